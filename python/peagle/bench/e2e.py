"""End-to-end decode benchmark: P-EAGLE vs EAGLE-3 vs no speculation with the default pair.

For every config (method, K, concurrency C) the engine (:class:`~peagle.decode.SpecDecoder`,
CUDA graphs on a GPU) decodes ``num_prompts`` held-out prompts (:mod:`peagle.bench.prompts`,
never the training split) greedily, EOS ignored, ``max_new_tokens`` each, at most C at a time:

1. build the engine, capture the CUDA graphs of every batch size, run a short warm-up generate
   (outside timing);
2. time one full generate (wall clock, device synchronised before and after).

Recorded per config: ``tokens_per_s`` (output tokens / wall s), ``tpot_ms`` (per request: its
wall time / its output tokens, mean over requests; prefill included), ``acceptance_length``
(pooled: 1 + accepted drafts / verification steps that carried drafts), ``tokens_per_step`` (mean
over requests of emitted tokens / target steps), ``steps`` (engine steps), the GPU phase times
per step (CUDA events of the engine's target and drafter phases) and ``overhead_ms_per_step``
(wall per step minus those phases: host work), ``prefill_s`` / ``decode_tokens_per_s`` (wall of
the steps that admitted requests, and the tokens per second of the other steps), and a hash of
the output tokens (greedy outputs are the target's own in every method). ``none`` runs once per
C (K does not apply; ``k`` = 0).

Results are keyed per config and written after every config (atomic rename): a rerun skips
finished configs and merges. With ``--max-minutes`` the run stops before a config that would end
past the limit (estimated by the slowest config so far; at least one config runs per invocation)
and exits with status 75 ("run me again"); 0 when every config is done.
``--projection`` also times the passes of a ~1B random-weight target (:mod:`.projection`).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from peagle.errors import UserError, check_device

EXIT_MORE_WORK = 75
RELEASED_SHAPES = (
    "gpt-oss-20b",
    "qwen3-coder-30b-a3b",
    "gpt-oss-20b-tiny",
    "qwen3-coder-30b-a3b-tiny",
)  # peagle.bench.released.shape_choices()
TABLE_NAMES = ("paper", "vllm-pr32628", "default-pair")  # peagle.bench.acceptance_tables.TABLES
METHODS = ("peagle", "eagle3", "none")
DEFAULT_KS = (1, 3, 5, 7, 10)
DEFAULT_CONCURRENCY = (1, 16, 64)
SCHEMA = 1


def config_key(method: str, k: int, concurrency: int) -> str:
    return f"{method},K={0 if method == 'none' else k},C={concurrency}"


def plan(methods, ks, concurrencies) -> list[tuple[str, int, int]]:
    """Configs in run order: per concurrency, ``none`` once, then every K for each method."""
    out = []
    for c in concurrencies:
        if "none" in methods:
            out.append(("none", 0, c))
        for k in ks:
            out += [(m, k, c) for m in methods if m != "none"]
    return out


# ---------------------------------------------------------------------------------------------
# Results file
# ---------------------------------------------------------------------------------------------


class ResultsFile:
    """``{"gpu", "commit", "command", "torch", "settings", "configs": {key: row},
    "projection": {key: row}, ...}``, rewritten atomically after every config."""

    def __init__(self, path: str | Path, settings: dict, ignore: tuple[str, ...] = ()) -> None:
        """``ignore``: settings this run does not use (a run without ``--projection`` ignores
        ``projection_shape``); a file that differs only there is resumed with its own values."""
        self.path = Path(path)
        self.data = {"schema": SCHEMA, "settings": settings, "configs": {}, "projection": {}}
        if self.path.is_file():
            old = json.loads(self.path.read_text())
            old_settings = old.get("settings") or {}
            keys = sorted(set(old_settings) | set(settings))
            differ = [k for k in keys if k not in ignore and old_settings.get(k) != settings.get(k)]
            if differ:
                what = ", ".join(f"{k}: {old_settings.get(k)!r} there, {settings.get(k)!r} now"
                                 for k in differ)  # fmt: skip
                raise UserError(
                    f"bench e2e: {self.path}",
                    f"made with other settings ({what})",
                    "use another --out, or delete it to start over",
                )
            self.data.update(old)
        self.data.setdefault("projection", {})

    @property
    def configs(self) -> dict:
        return self.data["configs"]

    @property
    def projection(self) -> dict:
        return self.data["projection"]

    def write(self, extra: dict | None = None) -> None:
        from peagle.bench.timing import command_line, git_commit, gpu_name, write_json_atomic

        self.data.update(
            gpu=gpu_name(self.data["settings"].get("device")), commit=git_commit(),
            torch=torch.__version__,
            python=sys.version.split()[0], **(extra or {}),
        )  # fmt: skip
        cmds = self.data.setdefault("commands", [])
        cmd = command_line()
        if cmd not in cmds:
            cmds.append(cmd)
        self.data["command"] = cmds[0]
        write_json_atomic(self.path, self.data)


# ---------------------------------------------------------------------------------------------
# One config
# ---------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def outputs_digest(token_lists: list[list[int]]) -> str:
    return hashlib.sha1(json.dumps(token_lists).encode()).hexdigest()[:16]


def verify_ms(vocab_size: int, dtype: torch.dtype, k: int, b: int, device: torch.device) -> float:
    """ms of ``verify_chain`` alone at a step's shape (``b`` requests x ``k`` greedy drafts, logits
    in the target's dtype), CUDA graph of 20 calls, median of 50 replays: the verify share of
    ``target_ms_per_step`` (which brackets target forward + verification)."""
    from peagle import ops
    from peagle.bench.timing import bench_graph

    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(b * (k + 1), vocab_size, device=device, generator=g).to(dtype)
    rows = torch.arange(b * (k + 1), device=device)
    drafts = logits[rows[rows % (k + 1) != k]].float().argmax(-1).to(torch.int32)
    cu = torch.arange(1, b + 1, device=device, dtype=torch.int32) * k
    temp = torch.zeros(b, device=device)
    seeds = torch.arange(b, device=device, dtype=torch.int64)
    offsets = torch.zeros(b, device=device, dtype=torch.int64)
    top_k = torch.zeros(b, device=device, dtype=torch.int32)
    top_p = torch.ones(b, device=device)
    mask = torch.ones(b, device=device, dtype=torch.bool)
    fn = lambda i: ops.verify_chain(
        logits, drafts, cu, temp, seeds, offsets, top_k=top_k, top_p=top_p, request_mask=mask,
        max_num_draft_tokens=k,
    )  # fmt: skip
    return bench_graph(fn) / 1e3


def run_config(
    target, drafter, method: str, k: int, concurrency: int, prompts: list[list[int]],
    max_new_tokens: int, cuda_graphs: str = "auto", synthetic=None,
    max_num_batched_tokens: int | None = None,
) -> dict:  # fmt: skip
    """Measure one config (see the module docstring); returns its row. ``synthetic``: a
    :class:`~peagle.decode.synthetic.SyntheticAcceptance` (drawn decisions; benchmarks only);
    ``max_num_batched_tokens``: the engine's per-step row budget (prompts admitted in steps)."""
    from peagle.decode import SamplingParams, SpecDecoder

    device = target.device
    engine = SpecDecoder(
        target,
        None if method == "none" else drafter,
        method=method,
        num_speculative_tokens=max(k, 1),
        max_num_seqs=concurrency,
        max_model_len=max(len(p) for p in prompts) + max_new_tokens + 1,
        cuda_graphs=cuda_graphs,
        synthetic_acceptance=synthetic,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    if engine.graphs is not None:
        engine.graphs.capture_all()
    warm = SamplingParams(max_new_tokens=min(max_new_tokens, 2 * k + 4), ignore_eos=True)
    engine.generate(prompts[:concurrency], warm)
    _sync(device)

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    engine.num_steps = engine.num_graph_steps = 0
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    done, steps, prefill_s, prefill_steps = {}, 0, 0.0, 0
    while engine.has_unfinished():
        waiting, t1 = len(engine.waiting), time.perf_counter()
        for out in engine.step():
            done[out.request_id] = out
        if len(engine.waiting) < waiting:  # admitted requests prefilled in this step
            prefill_s += time.perf_counter() - t1
            prefill_steps += 1
        steps += 1
    _sync(device)
    wall = time.perf_counter() - t0
    outs = [done[i] for i in ids]
    graph_steps = engine.num_graph_steps
    del engine

    st = [o.stats for o in outs]
    tokens = sum(len(o.token_ids) for o in outs)
    spec_steps = sum(s.num_spec_steps for s in st)
    accepted = sum(s.num_accepted_tokens for s in st)
    width = max((len(s.drafted_per_position) for s in st), default=0)
    drafted_pos, accepted_pos = [0] * width, [0] * width
    for s in st:
        for j, (a, d) in enumerate(
            zip(s.accepted_per_position, s.drafted_per_position, strict=True)
        ):
            accepted_pos[j] += a
            drafted_pos[j] += d
    per_step = lambda attr: statistics.mean(getattr(s, attr) / s.num_steps for s in st) * 1e3
    target_ms, drafter_ms = per_step("target_time_s"), per_step("drafter_time_s")
    wall_ms = statistics.mean(s.wall_time_s / s.num_steps for s in st) * 1e3
    tpot = statistics.mean(s.wall_time_s / s.num_generated_tokens for s in st)
    per_pos = [round(a / d, 4) for a, d in zip(accepted_pos, drafted_pos, strict=True)]
    return {
        "method": method,
        "k": 0 if method == "none" else k,
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "max_new_tokens": max_new_tokens,
        "output_tokens": tokens,
        "wall_s": round(wall, 4),
        "tokens_per_s": round(tokens / wall, 2),
        "tpot_ms": round(tpot * 1e3, 4),
        "acceptance_length": round(1.0 + accepted / spec_steps, 4) if spec_steps else 1.0,
        "tokens_per_step": round(
            statistics.mean(s.num_generated_tokens / s.num_steps for s in st), 4
        ),
        "steps": steps,
        "graph_steps": graph_steps,  # replayed from a CUDA graph; the others ran eagerly
        "prefill_steps": prefill_steps,
        "prefill_s": round(prefill_s, 4),
        # one token per request from its prefill step; the rest from decode steps (exact when no
        # step mixes a prefill with decodes: all requests admitted at once, or one at a time)
        "decode_tokens_per_s": round((tokens - len(outs)) / max(wall - prefill_s, 1e-9), 2),
        "per_position_acceptance": per_pos,
        "target_ms_per_step": round(target_ms, 4),
        "drafter_ms_per_step": round(drafter_ms, 4),
        "verify_ms_per_step": (
            round(
                verify_ms(
                    target.vocab_size,
                    target.dtype,
                    0 if method == "none" else k,
                    concurrency,
                    device,
                ),
                4,
            )
            if device.type == "cuda"
            else None
        ),  # measured alone at the step's shape; part of target_ms_per_step
        "overhead_ms_per_step": round(max(wall_ms - target_ms - drafter_ms, 0.0), 4),
        "cuda_graphs": device.type == "cuda" and cuda_graphs != "off",
        # fused dense-layer paths (PEAGLE_FUSED_TARGET / PEAGLE_FUSED_DRAFTER, default on)
        "fused_layers": {
            "target": bool(getattr(target, "fused_layers", False)),
            "drafter": method != "none" and bool(getattr(drafter, "fused_layers", False)),
        },
        "max_num_batched_tokens": max_num_batched_tokens,
        "outputs_sha1": outputs_digest([o.token_ids for o in outs]),
    }


# ---------------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument(
        "--out",
        default="benchmarks/results/e2e-h200.json",
        help="results JSON, merged with and resumed from (default: %(default)s)",
    )
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument(
        "--synthetic-acceptance",
        default=None,
        choices=list(TABLE_NAMES),
        help="with a released --projection-shape: draw accept/reject decisions from this rate "
        "table (peagle.bench.acceptance_tables; outputs are not the model's text)",
    )
    ap.add_argument("--k", nargs="+", type=int, default=list(DEFAULT_KS), help="K values")
    ap.add_argument(
        "--concurrency",
        nargs="+",
        type=int,
        default=None,
        help="requests decoded together (the engine's max_num_seqs; default 1 16 64, released "
        "shapes 1 8 64)",
    )
    ap.add_argument(
        "--max-new-tokens", type=int, default=None, help="tokens per request (default 128, "
        "released shapes 256)",
    )  # fmt: skip
    ap.add_argument(
        "--num-prompts",
        type=int,
        default=64,
        help="held-out prompts (requests) per config; at least the largest concurrency",
    )
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="stop before a config that would end past this; exit 75 when work is left "
        "(0 = no limit)",
    )
    ap.add_argument(
        "--max-configs",
        type=int,
        default=0,
        help="measure at most this many configs in this run, then exit 75 if work is left "
        "(0 = all)",
    )
    ap.add_argument(
        "--projection",
        action="store_true",
        help="also time the verify / drafter passes of a ~1B random-weight target "
        "(docs/benchmarks.md); projected rows are labelled",
    )
    ap.add_argument("--projection-only", action="store_true", help="skip the measured configs")
    ap.add_argument(
        "--projection-shape",
        default="1b",
        choices=("1b", "tiny", *RELEASED_SHAPES),
        help="1b: Llama-3.2-1B shape (default); tiny: hidden 128 (CPU tests); gpt-oss-20b / "
        "qwen3-coder-30b-a3b: the released heads' targets at full size, random weights, decoded "
        "end to end with --synthetic-acceptance (peagle.bench.released; -tiny: the same shrunk)",
    )
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192],
                    help="released shapes: prompt tokens per request")  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=8,
                    help="released shapes: requests per config (at least 8 and C)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="synthetic acceptance's seed")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the configs, each one's expected acceptance length (the packaged pair's "
        "pair.json; released shapes: the rate table) and engine steps, run nothing (released "
        "shapes: and the estimated memory)",
    )
    ap.add_argument(
        "--assume-step-ms",
        type=float,
        default=None,
        help="--dry-run: minutes per config at this assumed ms per engine step",
    )
    ap.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")


def _load_pair(device, dtype, methods) -> dict:
    """``{method: (target, drafter)}``: ONE target shared by every method (the engine points its
    feature layers at each drafter's own ids), the drafters loaded as ``load_model_pair`` does."""
    from peagle import default_models
    from peagle.models import Eagle3Drafter, load_model_pair

    if not default_models.available():
        raise UserError("bench e2e", "this build has no packaged default model pair")
    # The peagle drafter's feature layers: the 4-layer default target has no valid default
    # auxiliary layers of its own ("none" never reads them).
    target, peagle = load_model_pair(
        str(default_models.target_dir()),
        str(default_models.drafter_dir("peagle")),
        device=device,
        dtype=dtype,
    )
    pairs = {}
    for m in methods:
        if m == "none":
            pairs[m] = (target, None)
        elif m == "peagle":
            pairs[m] = (target, peagle)
        else:
            drafter = Eagle3Drafter.from_pretrained(
                str(default_models.drafter_dir(m)),
                dtype=dtype,
                device=device,
                shared_embed_tokens=target.embed_tokens.weight.detach(),
                shared_lm_head=target.lm_head.weight.detach(),
            )
            drafter.check_target(target.hidden_size, target.vocab_size)
            pairs[m] = (target, drafter)
    return pairs


def _prompts(num: int) -> tuple[list[list[int]], dict]:
    """``num`` held-out prompts of the packaged pair (token ids) and what they are: a v3 pair
    (``pair.json`` ``eval_prompts``) ships the evaluation split's prompts its recipe measured
    (the first ``num``); a v1/v2 pair (``corpus.held_out_modules``) rebuilds them from those
    stdlib modules of the running interpreter."""
    from peagle import default_models

    info = default_models.info()
    corpus = info.get("corpus", {})
    if info.get("eval_prompts", {}).get("file"):
        rows = default_models.eval_prompts()
        if num > len(rows):
            raise UserError(
                "bench e2e",
                f"--num-prompts {num}: the packaged pair ships {len(rows)} held-out evaluation "
                f"prompts ({info['eval_prompts']['file']})",
            )
        meta = {
            "source": info["eval_prompts"]["file"],
            "split": info["eval_prompts"].get("split", "evaluation"),
            "held_out_distributions": corpus.get("evaluation", {}).get("distribution_list", []),
            "prompt_tokens": info["eval_prompts"].get("prompt_tokens"),
            "pair_python_version": info.get("python_version"),
        }
        return [list(r["token_ids"]) for r in rows[:num]], meta
    if "held_out_modules" not in corpus:
        raise UserError(
            "bench e2e",
            "the packaged pair's pair.json names no held-out prompts (neither eval_prompts nor "
            "corpus.held_out_modules)",
        )
    from transformers import AutoTokenizer

    from peagle.bench.prompts import held_out_prompts

    tok = AutoTokenizer.from_pretrained(str(default_models.target_dir()))
    ev = info.get("eval", {})
    prompts = held_out_prompts(
        tok, num, corpus["held_out_modules"], prompt_tokens=96,
        new_tokens=int(ev.get("max_new_tokens", 96)),
    )  # fmt: skip
    meta = {"held_out_modules": corpus["held_out_modules"], "prompt_tokens": 96,
            "pair_python_version": info.get("python_version")}  # fmt: skip
    return [p["token_ids"] for p in prompts], meta


class Budget:
    """Stops a run before a config that would end past ``limit_s`` (the slowest config so far is
    the estimate) or after ``max_configs`` configs; never before the first config of a run, so
    every invocation makes progress."""

    def __init__(self, limit_s: float, max_configs: int = 0) -> None:
        self.start = time.monotonic()
        self.limit_s = limit_s
        self.max_configs = max_configs
        self.ran = 0
        self.slowest = 0.0

    def expired(self) -> bool:
        if self.ran == 0:
            return False
        if self.max_configs and self.ran >= self.max_configs:
            return True
        return time.monotonic() - self.start + self.slowest > self.limit_s

    def record(self, seconds: float) -> None:
        self.ran += 1
        self.slowest = max(self.slowest, seconds)


def run(args: argparse.Namespace) -> int:
    from peagle.bench.timing import git_commit

    budget = Budget(args.max_minutes * 60 if args.max_minutes > 0 else float("inf"),
                    args.max_configs)  # fmt: skip
    if args.projection_shape in RELEASED_SHAPES:
        return run_released(args, budget)
    args.concurrency = args.concurrency or list(DEFAULT_CONCURRENCY)
    args.max_new_tokens = args.max_new_tokens or 128
    if any(k < 1 for k in args.k) or any(c < 1 for c in args.concurrency):
        raise UserError("bench e2e", "--k and --concurrency values must be >= 1")
    if args.dry_run:
        print_pair_dry_run(pair_dry_run(args))
        return 0
    device = torch.device(check_device("--device", args.device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    num_prompts = max(args.num_prompts, max(args.concurrency))
    settings = {
        "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "max_new_tokens": args.max_new_tokens, "num_prompts": num_prompts, "greedy": True,
        "ignore_eos": True, "cuda_graphs": not args.no_cuda_graphs,
        "projection_shape": args.projection_shape,
    }  # fmt: skip
    projecting = bool(args.projection or args.projection_only)
    res = ResultsFile(args.out, settings, ignore=() if projecting else ("projection_shape",))
    configs = plan(args.methods, args.k, args.concurrency)
    todo = [] if args.projection_only else configs
    todo = [c for c in todo if config_key(*c) not in res.configs]
    proj_todo = configs if (args.projection or args.projection_only) else []
    proj_todo = [c for c in proj_todo if config_key(*c) not in res.projection]

    if todo:
        pairs = _load_pair(device, dtype, sorted({m for m, _, _ in todo}))
        prompts, meta = _prompts(num_prompts)
        res.data["prompts"] = meta
        graphs = "off" if args.no_cuda_graphs else "auto"
        for i, (method, k, c) in enumerate(todo):
            if budget.expired():
                res.write()
                left = len(todo) - i + len(proj_todo)
                print(f"stopping: {left} configs left; run the same command again", flush=True)
                return EXIT_MORE_WORK
            t0 = time.monotonic()
            target, drafter = pairs[method]
            row = run_config(target, drafter, method, k, c, prompts, args.max_new_tokens, graphs)
            row["commit"] = git_commit()
            res.configs[config_key(method, k, c)] = row
            res.write()
            budget.record(time.monotonic() - t0)
            print(f"{config_key(method, k, c):22s} {row['tokens_per_s']:10.1f} tok/s  "
                  f"TPOT {row['tpot_ms']:8.3f} ms  AL {row['acceptance_length']:.3f}  "
                  f"steps {row['steps']}  ({time.monotonic() - t0:.1f} s)", flush=True)  # fmt: skip
            gc.collect()  # the engine and its CUDA graphs reference each other
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del pairs
    if proj_todo and not run_projection(args, res, proj_todo, device, budget):
        return EXIT_MORE_WORK
    res.write()
    check_greedy_match(res.configs)
    if not getattr(args, "no_summary", False):  # `peagle tune --run` prints its own tables
        from peagle.bench.tune import print_tables

        print_tables(res.data)
    print(f"wrote {res.path}")
    return 0


def pair_dry_run(args: argparse.Namespace) -> dict:
    """The packaged pair's grid without running it: per config the expected acceptance length
    (``pair.json``'s, measured on the recipe's evaluation prompts; 1 for none) and the engine
    steps it implies (``ceil(prompts / C)`` waves of one prefill step + ``ceil((tokens - 1) /
    AL)`` decode steps), and with ``--assume-step-ms`` the minutes."""
    from peagle import default_models

    if not default_models.available():
        raise UserError("bench e2e", "this build has no packaged default model pair")
    info = default_models.info()
    al_table = info.get("acceptance_length", {})
    num_prompts = max(args.num_prompts, max(args.concurrency))
    rows = []
    for method, k, c in plan(args.methods, args.k, args.concurrency):
        al = 1.0 if method == "none" else al_table.get(method, {}).get(str(k))
        if al is None:
            raise UserError("bench e2e", f"--dry-run: pair.json has no acceptance length for "
                            f"{method} at K={k}")  # fmt: skip
        steps = math.ceil(num_prompts / c) * (1 + math.ceil((args.max_new_tokens - 1) / al))
        row = {"key": config_key(method, k, c), "requests": num_prompts,
               "expected_al": round(float(al), 3), "steps": steps}  # fmt: skip
        if args.assume_step_ms is not None:
            row["minutes_at_step_ms"] = round(steps * args.assume_step_ms / 6e4, 2)
        rows.append(row)
    return {"recipe": info.get("recipe", "?"), "num_prompts": num_prompts,
            "max_new_tokens": args.max_new_tokens, "configs": rows}  # fmt: skip


def print_pair_dry_run(plan_: dict) -> None:
    print(f"packaged pair (recipe {plan_['recipe']}): {len(plan_['configs'])} configs, "
          f"{plan_['num_prompts']} prompts x {plan_['max_new_tokens']} tokens each; expected AL "
          "from pair.json")  # fmt: skip
    cols = [c for c in ("key", "requests", "expected_al", "steps", "minutes_at_step_ms")
            if c in plan_["configs"][0]]  # fmt: skip
    print(" ".join(f"{c:>18s}" if c != "key" else f"{c:22s}" for c in cols))
    for r in plan_["configs"]:
        print(" ".join(f"{r[c]!s:>18s}" if c != "key" else f"{r[c]:22s}" for c in cols))
    total = sum(r.get("minutes_at_step_ms", 0) for r in plan_["configs"])
    if total:
        print(f"total at the assumed step time: {total:.1f} min (+ engine build and CUDA-graph "
              "capture per config)")  # fmt: skip


def run_released(args: argparse.Namespace, budget: Budget) -> int:
    """``--projection-shape gpt-oss-20b|qwen3-coder-30b-a3b[-tiny]`` (:mod:`.released`)."""
    from peagle.bench import released as R
    from peagle.bench.acceptance_tables import get_table

    args.concurrency = args.concurrency or list(R.CONCURRENCY)
    args.max_new_tokens = args.max_new_tokens or R.NEW_TOKENS
    if any(k < 1 for k in args.k) or any(c < 1 for c in args.concurrency):
        raise UserError("bench e2e", "--k and --concurrency values must be >= 1")
    if args.synthetic_acceptance is None:
        raise UserError("bench e2e", f"--projection-shape {args.projection_shape} has random "
                        "weights: give --synthetic-acceptance TABLE")  # fmt: skip
    name, tiny = R.split_shape(args.projection_shape)
    configs = R.plan(args.methods, args.k, args.concurrency, args.contexts)
    if args.dry_run:
        table = get_table(args.synthetic_acceptance)
        al = lambda m, k: table.synthetic(m).expected_acceptance_length(k)  # noqa: E731
        p = R.dry_run(name, tiny, configs, args.max_new_tokens, al, args.assume_step_ms)
        R.print_dry_run(p, None if tiny else R.fits(name))
        return 0
    device = torch.device(check_device("--device", args.device))
    if not tiny:  # refuse up front what would run out of memory after minutes of building
        if device.type != "cuda":
            raise UserError(
                "bench e2e",
                f"--projection-shape {name} is full size: it runs on a CUDA GPU",
                f"on the CPU use {name}{R.TINY_SUFFIX} or --dry-run",
            )
        ok, why = R.fits(name, torch.cuda.get_device_properties(device).total_memory)
        if not ok:
            raise UserError("bench e2e", f"--projection-shape {name}: {why}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    settings = {
        "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "max_new_tokens": args.max_new_tokens, "greedy": True, "ignore_eos": True,
        "cuda_graphs": not args.no_cuda_graphs, "projection_shape": args.projection_shape,
        "synthetic_acceptance": args.synthetic_acceptance, "seed": args.seed,
        "num_requests": max(args.num_requests, R.MIN_REQUESTS),
    }  # fmt: skip
    res = ResultsFile(args.out, settings)
    done = R.run(args, res, device, budget, run_config)
    res.write()
    print(f"wrote {res.path}")
    return 0 if done else EXIT_MORE_WORK


def run_projection(args, res: ResultsFile, todo, device, budget: Budget) -> bool:
    """Time the projection configs in ``todo``; False when stopped by the budget."""
    from peagle.bench import projection as P

    shape = P.ProjectionShape() if args.projection_shape == "1b" else P.TINY_SHAPE
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res.data["projection_shape"] = {**shape.to_dict(), "description": shape.describe()}
    target, drafters = None, {}
    for i, (method, k, c) in enumerate(todo):
        if budget.expired():
            res.write()
            print(f"stopping: {len(todo) - i} projection configs left; run the same command "
                  "again", flush=True)  # fmt: skip
            return False
        t0 = time.monotonic()
        if target is None:
            target = P.build_target(shape, device, dtype)
        if method != "none" and method not in drafters:
            drafters[method] = P.build_drafter(shape, method, target)
        row = P.time_passes(target, drafters.get(method), method, k, c, shape,
                            replays=20 if device.type == "cuda" else 3)  # fmt: skip
        row.update(method=method, k=0 if method == "none" else k, concurrency=c,
                   projection=True)  # fmt: skip
        res.projection[config_key(method, k, c)] = row
        res.write()
        budget.record(time.monotonic() - t0)
        print(f"projection {config_key(method, k, c):22s} verify {row['t_verify_ms']:.3f} ms  "
              f"draft {row['t_draft_ms']:.3f} ms", flush=True)  # fmt: skip
    return True


def check_greedy_match(configs: dict) -> bool:
    """Print whether every config produced the same greedy tokens; returns True if so."""
    digests = {r["outputs_sha1"] for r in configs.values()}
    if len(digests) <= 1:
        print(f"greedy outputs identical across {len(configs)} configs")
        return True
    print(f"note: greedy outputs differ across configs ({len(digests)} distinct); in bf16 on a "
          "GPU different batch shapes can flip near-tied argmaxes", file=sys.stderr)  # fmt: skip
    return False
