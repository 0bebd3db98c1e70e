"""The released heads' targets at full size with random weights, decoded with synthetic acceptance.

``peagle bench e2e --projection-shape gpt-oss-20b|qwen3-coder-30b-a3b --synthetic-acceptance
TABLE`` builds the target from its published config (:mod:`peagle.models.released_configs`) with
random bf16 weights generated on the device (never a checkpoint on disk), a P-EAGLE head (4 layers)
and an EAGLE-3 head (1 layer) at the released heads' shapes (attention/MLP widths ASSUMED, SPEC
§10), and runs the real decode loop (:class:`~peagle.decode.SpecDecoder`, CUDA graphs on a GPU)
over random-token prompts, every accept/reject decision drawn from the table's rates
(:mod:`peagle.decode.synthetic`): every kernel, KV write, graph and host step of a real step runs,
but the emitted tokens are not the model's text.

Grid: methods x K x concurrency x context, 256 new tokens per request, ``max(8, C)`` requests per
config; the goal configs (concurrency 1, context 1k) run first; the results file is rewritten after
every config. GPT-OSS experts are random bf16 (transformers' MXFP4 path fetches its kernels from
the Hub at load time: not offline); gpt-oss-120b does not fit one H200 in bf16 (:func:`fits`).

Per config, besides the end-to-end numbers (whose ``target_ms_per_step`` / ``drafter_ms_per_step``
are the engine's two phases and ``overhead_ms_per_step`` the host), ``breakdown`` times one steady
step's phases one by one (:func:`step_breakdown`): target pass, verify (``verify_chain`` + the
synthetic override), drafter (``fc`` + ``prepare_draft_inputs`` + drafter passes), host.

Random routers spread tokens over experts more evenly than trained ones: a verify pass of random
tokens touches more experts (reads more weight bytes) than a trained model's would. Every MoE row
says so (``"routing"``).

``--projection-shape gpt-oss-20b-tiny`` / ``qwen3-coder-30b-a3b-tiny``: the same architectures
shrunk (:func:`~peagle.models.released_configs.shrink`), the same code: the CPU tests.
``--dry-run``: the config list and estimated weights / KV memory per config, from ``meta``
tensors (no weights allocated).
"""

from __future__ import annotations

import gc
import math
import time

import torch

from peagle.models import released_configs as RC

SHAPES = ("gpt-oss-20b", "qwen3-coder-30b-a3b")
TINY_SUFFIX = "-tiny"
CONTEXTS = (1024, 8192)
CONCURRENCY = (1, 8, 64)
KS = (1, 3, 5, 7, 10)
NEW_TOKENS = 256
MIN_REQUESTS = 8
FLOOR_KS = (0, 7)  # the weight-streaming floor at concurrency 1, the first context
ROUTING_NOTE = (
    "random-weight router: tokens spread over experts more evenly than with a trained router, so "
    "an MoE pass touches (and reads) more experts than a trained model's would"
)
BLOCK_SIZE = 16
# Rows per step (SpecDecoder.max_num_batched_tokens): 64 prompts of 8k tokens in one prefill
# need ~25 GiB of MoE intermediates on top of the KV cache and ran out of memory on the H200 for
# gpt-oss-20b; 64k rows keeps every context-1k grid step as before (64 x 1k prompts at once).
PREFILL_TOKENS = 65536


def shape_choices() -> list[str]:
    return [*SHAPES, *(s + TINY_SUFFIX for s in SHAPES)]


def split_shape(shape: str) -> tuple[str, bool]:
    tiny = shape.endswith(TINY_SUFFIX)
    return (shape.removesuffix(TINY_SUFFIX), tiny)


def config_key(method: str, k: int, c: int, ctx: int) -> str:
    return f"{method},K={0 if method == 'none' else k},C={c},ctx={ctx}"


def plan(methods, ks, concurrencies, contexts) -> list[tuple[str, int, int, int]]:
    """``(method, k, C, context)`` in run order: the goal configs (concurrency 1, first context)
    first, then per context and concurrency ``none`` once and every K for each method."""
    out = []
    cs = sorted(concurrencies, key=lambda c: (c != 1, c))
    for ctx in contexts:
        for c in cs:
            if "none" in methods:
                out.append(("none", 0, c, ctx))
            for k in ks:
                out += [(m, k, c, ctx) for m in methods if m != "none"]
    return out


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def target_aux_layer_ids(num_layers: int) -> list[int]:
    from peagle.models.target import suggested_aux_layer_ids

    return suggested_aux_layer_ids(num_layers)


def build_target(name: str, device, dtype, tiny: bool = False, seed: int = 0):
    """A random-weight target of released shape ``name`` built directly on ``device`` in
    ``dtype`` (``grouped_mm`` experts: graph-capturable)."""
    from transformers import AutoModelForCausalLM

    from peagle.models import TargetRunner

    cfg = RC.target_config(name, tiny)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    return TargetRunner(model, target_aux_layer_ids(cfg.num_hidden_layers))


def head_dict(name: str, method: str, tiny: bool, num_target_layers: int) -> dict:
    head = RC.TARGETS[name]["head"]
    h, v, mask = head["h"], head["v"], head["mask"]
    if tiny:
        cfg = RC.config_fields(name, tiny=True)
        h, v = cfg["hidden_size"], cfg["vocab_size"]
        mask = v - 1
    aux = target_aux_layer_ids(num_target_layers)
    layers = 4 if method == "peagle" else 1
    d = RC.head_config(h, v, mask, num_layers=layers, aux_layer_ids=aux, tiny=tiny)
    if method != "peagle":
        d.pop("ptd_token_id")
    return d


def build_head(name: str, method: str, target, tiny: bool = False, seed: int = 1):
    """A random-weight head: P-EAGLE 4 layers (mask hidden, ``ptd_token_id``), EAGLE-3 1 layer."""
    from peagle.models import DrafterConfig, Eagle3Drafter

    d = head_dict(name, method, tiny, target.num_layers)
    torch.manual_seed(seed)
    with torch.device(target.device):
        drafter = Eagle3Drafter(DrafterConfig.from_dict(d), with_mask_hidden=method == "peagle")
        if drafter.mask_hidden is not None:
            torch.nn.init.normal_(drafter.mask_hidden, std=0.02)
    return drafter.to(target.dtype).eval()


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


# ---------------------------------------------------------------------------------------------
# Memory and the weight-streaming floor
# ---------------------------------------------------------------------------------------------


def _experts(target) -> list[torch.nn.Module]:
    return [e for layer in target.layers if (e := getattr(layer.mlp, "experts", None)) is not None]


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def weight_bytes(model: torch.nn.Module) -> int:
    return _nbytes(model.parameters())


def kv_bytes(per_token: int, concurrency: int, context: int, new_tokens: int, k: int) -> int:
    """KV bytes of ``concurrency`` requests at ``context + new_tokens`` tokens (+ the drafter's
    2K+1 tail), in whole blocks (what the engine allocates)."""
    blocks = math.ceil((context + new_tokens + 2 * k + 1) / BLOCK_SIZE)
    return concurrency * blocks * BLOCK_SIZE * per_token


def streamed_bytes(target, routed: list[torch.Tensor], num_tokens: int) -> dict:
    """Weight bytes a pass of ``num_tokens`` tokens must read: every non-expert parameter (the
    embedding table only for its ``num_tokens`` rows; the LM head whole) plus, per MoE layer,
    every expert its tokens route to (``routed[l]``: the layer's top-k indices)."""
    experts = _experts(target)
    emb = target.embed_tokens.weight
    expert_ids = {id(p) for e in experts for p in e.parameters()}
    dense = sum(p.numel() * p.element_size() for p in target.model.parameters()
                if id(p) not in expert_ids and p is not emb)  # fmt: skip
    dense += num_tokens * emb.shape[1] * emb.element_size()
    touched, expert_bytes = [], 0
    for e, idx in zip(experts, routed, strict=True):
        n_exp = int(getattr(e, "num_experts", 0) or e.gate_up_proj.shape[0])
        per = _nbytes(e.parameters()) / n_exp
        u = int(torch.unique(idx.reshape(-1)).numel())
        touched.append(u)
        expert_bytes += u * per
    return {"dense_bytes": int(dense), "expert_bytes": int(expert_bytes),
            "bytes": int(dense + expert_bytes), "experts_touched_per_layer": touched}  # fmt: skip


def record_routing(target, fn) -> list[torch.Tensor]:
    """Run ``fn()`` recording each MoE layer's top-k expert indices (the experts module's
    ``(hidden, top_k_index, top_k_weights)`` input)."""
    got: list[torch.Tensor] = []

    def hook(_mod, args, kwargs):
        idx = (
            args[1]
            if len(args) > 1
            else next(
                v for v in kwargs.values() if torch.is_tensor(v) and not v.is_floating_point()
            )
        )
        got.append(idx.detach())

    hs = [e.register_forward_pre_hook(hook, with_kwargs=True) for e in _experts(target)]
    try:
        fn()
    finally:
        for h in hs:
            h.remove()
    return got


def weight_floor(target, drafter, method, k: int, context: int, gbps: float) -> dict:
    """One steady step at concurrency 1 (run before the grid): the target pass (+ verify_chain)
    over K+1 rows timed (CUDA graph on a GPU), against the bytes it must stream over ``gbps``
    (the run's measured copy bandwidth, bytes read + written per second)."""
    from peagle.bench import projection as P

    k_eff = 0 if method == "none" else k
    shape = P.ProjectionShape(context=context)
    timing = P.time_passes(target, drafter, method, max(k, 1), 1, shape,
                           replays=20 if target.device.type == "cuda" else 2)  # fmt: skip
    t, num_blocks = P.uniform_step(target.device, target.vocab_size, 1, k_eff, context)
    kv = target.make_kv_cache(num_blocks, BLOCK_SIZE)
    from peagle.models.paged import AttentionMetadata

    meta = AttentionMetadata(t.positions, t.slot_mapping, t.query_start_loc, t.seq_lens,
                             t.block_table, t.max_query_len)  # fmt: skip
    with torch.inference_mode():
        routed = record_routing(
            target, lambda: target.forward(t.input_ids, meta, kv, t.logits_indices)
        )
    sb = streamed_bytes(target, routed, k_eff + 1)
    floor_ms = sb["bytes"] / (gbps * 1e9) * 1e3 if gbps > 0 else None
    return {
        "method": method, "k": k_eff, "concurrency": 1, "context": context,
        "tokens_in_pass": k_eff + 1, "t_target_and_verify_ms": timing["t_verify_ms"],
        "copy_gbps": round(gbps, 1), **sb,
        "floor_ms": None if floor_ms is None else round(floor_ms, 4),
        "floor_fraction": None if not floor_ms else round(floor_ms / timing["t_verify_ms"], 4),
        "routing": ROUTING_NOTE,
    }  # fmt: skip


def step_breakdown(target, drafter, method: str, k: int, c: int, context: int,
                   synthetic=None) -> dict:  # fmt: skip
    """One steady decode step of (method, K, C, context), its phases timed one by one (CUDA
    graphs on a GPU): ``target_pass_ms`` (target forward over the K+1 rows per request),
    ``verify_ms`` (``verify_chain`` on that step's logits shape, plus the synthetic override),
    ``drafter_ms`` (``fc`` + ``prepare_draft_inputs`` + the drafter pass(es) + argmax)."""
    from peagle import ops
    from peagle.bench import projection as P

    k_eff = 0 if method == "none" else k
    replays = 20 if target.device.type == "cuda" else 2
    shape = P.ProjectionShape(context=context)
    timing = P.time_passes(target, drafter, method, max(k, 1), c, shape, replays=replays)
    dev, b = target.device, c
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b * (k_eff + 1), target.vocab_size, device=dev, dtype=target.dtype)
    drafts = torch.randint(0, target.vocab_size, (b * k_eff,), generator=g, dtype=torch.int32)
    drafts = drafts.to(dev)
    cu = (torch.arange(1, b + 1, dtype=torch.int32) * k_eff).to(dev)
    zeros = torch.zeros(b, dtype=torch.int64, device=dev)
    temp = torch.zeros(b, device=dev)
    keys = torch.arange(b, dtype=torch.int64, device=dev)
    dpos = torch.arange(b * k_eff, dtype=torch.int64, device=dev) + context

    def verify():
        out = ops.verify_chain(logits, drafts, cu, temp, zeros, zeros, max_num_draft_tokens=k_eff)
        if synthetic is not None:
            synthetic.apply(logits, drafts, dpos, cu, keys, None, out.output_token_ids,
                            out.num_accepted)  # fmt: skip
        return out

    with torch.inference_mode():
        t_verify = P.time_fn(verify, dev, replays)
    return {"target_pass_ms": round(max(timing["t_verify_ms"] - t_verify, 0.0), 4),
            "verify_ms": round(t_verify, 4), "drafter_ms": round(timing["t_draft_ms"], 4),
            "target_and_verify_ms": timing["t_verify_ms"]}  # fmt: skip


def fits(name: str, memory_bytes: float = 139 * 2**30) -> tuple[bool, str]:
    """Whether target ``name`` fits one GPU of ``memory_bytes`` in bf16 (random weights), and
    why (not)."""
    from peagle.models.mxfp4 import count_parameters

    pc = count_parameters(RC.target_config(name))
    bf16 = pc.total * 2
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    if bf16 < 0.85 * memory_bytes:
        return True, f"{pc.total / 1e9:.2f} B parameters, {gib(bf16)} in bf16"
    mx = pc.bytes(torch.bfloat16, mxfp4_native=True)
    return False, (
        f"{pc.total / 1e9:.2f} B parameters: {gib(bf16)} in bf16 does not fit {gib(memory_bytes)}; "
        f"MXFP4 experts ({gib(mx)}) would, but transformers' MXFP4 path fetches its kernels from "
        "the Hub at load time (not possible offline) and peagle has not validated them in CUDA "
        "graphs"
    )


# ---------------------------------------------------------------------------------------------
# Dry run
# ---------------------------------------------------------------------------------------------


def dry_run(name: str, tiny: bool, configs, new_tokens: int, rates_al=None, step_ms=None) -> dict:
    """Per config: weights (target + head), KV bytes, steps and (given ``step_ms``) minutes;
    computed on ``meta`` (no memory)."""
    from transformers import AutoModelForCausalLM

    from peagle.models import DrafterConfig, Eagle3Drafter, TargetRunner

    cfg = RC.target_config(name, tiny)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        target = TargetRunner(model, target_aux_layer_ids(cfg.num_hidden_layers))
        heads = {m: Eagle3Drafter(DrafterConfig.from_dict(head_dict(name, m, tiny,
                                                                    cfg.num_hidden_layers)),
                                  with_mask_hidden=m == "peagle").to(torch.bfloat16)
                 for m in ("peagle", "eagle3")}  # fmt: skip
    w_target = weight_bytes(model)
    rows = []
    for m, k, c, ctx in configs:
        head = heads.get(m)
        per_tok = target.kv_bytes_per_token() + (head.kv_bytes_per_token() if head else 0)
        n_req = max(MIN_REQUESTS, c)
        al = 1.0 if m == "none" or rates_al is None else rates_al(m, k)
        steps = math.ceil(n_req / c) * (1 + math.ceil((new_tokens - 1) / al))
        row = {"key": config_key(m, k, c, ctx), "requests": n_req,
               "weights_gib": round((w_target + (weight_bytes(head) if head else 0)) / 2**30, 2),
               "kv_gib": round(kv_bytes(per_tok, c, ctx, new_tokens, k) / 2**30, 3),
               "expected_al": round(al, 3), "steps": steps,
               "prefill_tokens": min(c, n_req) * ctx}  # fmt: skip
        if step_ms is not None:
            row["minutes_at_step_ms"] = round(steps * step_ms / 6e4, 2)
        rows.append(row)
    return {"target": name, "tiny": tiny, "target_weights_gib": round(w_target / 2**30, 2),
            "head_weights_gib": {m: round(weight_bytes(h) / 2**30, 3) for m, h in heads.items()},
            "configs": rows}  # fmt: skip


def print_dry_run(plan_: dict, fit: tuple[bool, str] | None = None) -> None:
    print(f"{plan_['target']}{' (tiny)' if plan_['tiny'] else ''}: target weights "
          f"{plan_['target_weights_gib']} GiB, heads {plan_['head_weights_gib']} GiB")  # fmt: skip
    if fit is not None:
        print(("fits one 139 GiB GPU: " if fit[0] else "does NOT fit one 139 GiB GPU: ") + fit[1])
    cols = ["key", "requests", "weights_gib", "kv_gib", "expected_al", "steps",
            "prefill_tokens", "minutes_at_step_ms"]  # fmt: skip
    cols = [c for c in cols if c in plan_["configs"][0]]
    print(" ".join(f"{c:>14s}" if c != "key" else f"{c:26s}" for c in cols))
    for r in plan_["configs"]:
        print(" ".join(f"{r[c]!s:>14s}" if c != "key" else f"{r[c]:26s}" for c in cols))
    print("prefill_tokens: one step prefills every admitted prompt at once (no chunked prefill)")
    total = sum(r.get("minutes_at_step_ms", 0) for r in plan_["configs"])
    if total:
        print(f"total at the assumed step time: {total:.1f} min (+ model build and graph capture)")


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def _memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"allocated_gib": round(torch.cuda.memory_allocated(device) / 2**30, 3),
            "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)}  # fmt: skip


def run(args, res, device: torch.device, budget, run_config) -> bool:
    """Run the grid of ``args`` into ``res`` (an e2e ``ResultsFile``) with ``run_config`` (e2e's:
    one config through the decode loop); False when the budget stopped it early."""
    from peagle.bench.acceptance_tables import get_table
    from peagle.bench.timing import copy_ceiling_gbps, git_commit

    name, tiny = split_shape(args.projection_shape)
    table = get_table(args.synthetic_acceptance)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    methods = args.methods
    configs = plan(methods, args.k, args.concurrency, args.contexts)
    todo = [c for c in configs if config_key(*c) not in res.configs]
    # K=0: no speculation; K=7: the target pass of a drafting method (the same for both)
    drafting = [m for m in methods if m != "none"]
    floors = ([("none", 0)] if "none" in methods else []) + [(m, 7) for m in drafting[:1]]
    floor_todo = [f for f in floors if f"{f[0]},K={f[1]}" not in res.data.get("floor", {})]
    res.data["synthetic_acceptance"] = {"enabled": True, **table.to_dict()}
    res.data["routing"] = ROUTING_NOTE
    res.data["released_shape"] = {
        "target": name, "tiny": tiny, "config": RC.config_fields(name, tiny),
        "experts": "random bf16 (transformers' MXFP4 path fetches kernels from the Hub: offline "
        "not possible)" if RC.TARGETS[name]["model_type"] == "gpt_oss" else "random bf16",
        "heads": {m: head_dict(name, m, tiny, RC.config_fields(name, tiny)["num_hidden_layers"])
                  for m in ("peagle", "eagle3")},
        "head_widths": "ASSUMED (SPEC §10): 32/8 heads x 64, intermediate 3H",
    }  # fmt: skip
    if not todo and not floor_todo:
        return True
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.monotonic()
    target = build_target(name, device, dtype, tiny)
    heads = {m: build_head(name, m, target, tiny) for m in methods if m != "none"}
    build_s = time.monotonic() - t0
    res.data["memory"] = {"target_weights_gib": round(weight_bytes(target.model) / 2**30, 3),
                          "head_weights_gib": {m: round(weight_bytes(h) / 2**30, 3)
                                               for m, h in heads.items()},
                          "build_s": round(build_s, 2), **_memory(device)}  # fmt: skip
    res.write()
    if floor_todo:  # first: a few seconds, and part of the goal configs
        gbps = copy_ceiling_gbps() if device.type == "cuda" else 0.0
        fl = res.data.setdefault("floor", {})
        for m, k in floor_todo:
            fl[f"{m},K={k}"] = weight_floor(target, heads.get(m), m, k, args.contexts[0], gbps)
            res.write()
    graphs = "off" if args.no_cuda_graphs else "auto"
    for i, (m, k, c, ctx) in enumerate(todo):
        if budget.expired():
            res.write()
            print(f"stopping: {len(todo) - i} configs left; run the same command again", flush=True)
            return False
        t1 = time.monotonic()
        n_req = max(args.num_requests, MIN_REQUESTS, c)
        prompts = random_prompts(n_req, ctx, target.vocab_size, seed=ctx)
        drafter = heads.get(m)
        syn = None if m == "none" else table.synthetic(m, seed=args.seed)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        row = run_config(target, drafter, m, k, c, prompts, args.max_new_tokens, graphs,
                         synthetic=syn, max_num_batched_tokens=PREFILL_TOKENS)  # fmt: skip
        per_tok = target.kv_bytes_per_token() + (drafter.kv_bytes_per_token() if drafter else 0)
        kv_gib = round(kv_bytes(per_tok, c, ctx, args.max_new_tokens, k) / 2**30, 3)
        mem = {"kv_gib": kv_gib, **_memory(device)}  # the e2e run's, before the breakdown's
        if "peak_gib" in mem:  # activations, logits, graph pools, allocator slack
            w = weight_bytes(target.model) + (weight_bytes(drafter) if drafter else 0)
            mem["workspace_gib"] = round(mem["peak_gib"] - w / 2**30 - kv_gib, 3)
        gc.collect()  # free the e2e engine (a reference cycle) before the breakdown's KV cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
        bd = step_breakdown(target, drafter, m, k, c, ctx, syn)
        bd["host_ms"] = row["overhead_ms_per_step"]  # the e2e run's wall minus its GPU phases
        row.update(
            breakdown=bd,
            context=ctx, commit=git_commit(), synthetic_acceptance=syn is not None,
            acceptance_table=table.name,
            rates=None if syn is None else syn.rates_for(max(k, 1)),
            expected_acceptance_length=1.0 if syn is None else round(
                syn.expected_acceptance_length(k), 4),
            routing=ROUTING_NOTE,
            memory=mem,
            outputs_are_model_text=False,
        )  # fmt: skip
        res.configs[config_key(m, k, c, ctx)] = row
        res.write()
        budget.record(time.monotonic() - t1)
        print(f"{config_key(m, k, c, ctx):28s} {row['tokens_per_s']:10.1f} tok/s  TPOT "
              f"{row['tpot_ms']:8.3f} ms  AL {row['acceptance_length']:.3f}  "
              f"({time.monotonic() - t1:.1f} s)", flush=True)  # fmt: skip
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return True
