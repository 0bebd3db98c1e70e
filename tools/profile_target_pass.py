"""Where the time of a released-shape target pass goes (issue 20, goal 2), on the H200.

    python3 tools/profile_target_pass.py --shape gpt-oss-20b --tokens 1 8 --out p.json [--compile]

For each pass size (tokens = K+1 rows of one request at ``--context``): the pass as the benchmark
runs it (one CUDA graph, median of replays), its weight-streaming floor (the bytes of every
non-expert weight plus each expert its tokens route to, over the copy bandwidth measured in the
same run), and a torch.profiler trace of the same pass run eagerly (the kernels a graph replays
are the ones the eager pass launches), attributed to the model part that launched them: each
kernel is mapped, through its launch's correlation id, to the innermost annotated module (norm,
attention projections, RoPE, paged attention, router, experts, the rest of the MoE block, LM
head, embedding) whose host-side range contains the launch. ``graph_ms - kernel_sum_ms`` is the
time the graph spends between kernels. ``--compile`` also times the pass under ``torch.compile``
(inductor fuses the elementwise chains), captured in the same kind of graph: what fusion buys.

Random routers spread tokens over more experts than trained ones: the routed-expert counts are
recorded next to the floor.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time

import torch

# Annotation names: the model part a kernel is attributed to.
PARTS = ("embed", "norm", "attn_proj", "rope", "attention", "router", "experts", "moe_other",
         "lm_head")  # fmt: skip
_KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH = re.compile(r"(cudaLaunch|cuLaunch|cudaMemcpy|cudaMemset|cuMemcpy|cuMemset)")


def attribute_kernels(trace: dict) -> list[dict]:
    """``[{"name", "dur_us", "part"}]`` for every GPU kernel / memcpy / memset of a chrome trace
    (torch.profiler ``export_chrome_trace``): its launch (runtime event of the same correlation
    id) is matched to the innermost ``user_annotation`` on the launching thread whose range
    contains it; ``part`` is that annotation's name, or ``"unannotated"``."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    launches = {}
    ann = collections.defaultdict(list)
    for e in ev:
        cat = e.get("cat", "")
        if cat in ("cuda_runtime", "cuda_driver") and _LAUNCH.search(e.get("name", "")):
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = e
        elif cat == "user_annotation" and e.get("name") in PARTS:
            ann[e["tid"]].append(e)
    out = []
    for e in ev:
        if e.get("cat") not in _KERNEL_CATS:
            continue
        part = "unannotated"
        rt = launches.get(e.get("args", {}).get("correlation"))
        if rt is not None:
            best = None
            for a in ann.get(rt["tid"], ()):
                if a["ts"] <= rt["ts"] <= a["ts"] + a["dur"] and (
                    best is None or a["dur"] < best["dur"]
                ):
                    best = a
            if best is not None:
                part = best["name"]
        out.append({"name": e.get("name", "?"), "dur_us": float(e.get("dur", 0.0)), "part": part})
    return out


def summarize(kernels: list[dict], passes: int) -> dict:
    """Per part and per kernel name: count and total µs per pass (``passes`` profiled)."""
    by_part = collections.defaultdict(lambda: [0, 0.0])
    by_name = collections.defaultdict(lambda: [0, 0.0, ""])
    for k in kernels:
        p = by_part[k["part"]]
        p[0] += 1
        p[1] += k["dur_us"]
        n = by_name[k["name"][:120]]
        n[0] += 1
        n[1] += k["dur_us"]
        n[2] = k["part"]
    total = sum(v[1] for v in by_part.values()) / passes
    parts = {
        name: {"kernels": round(c / passes, 1), "us": round(t / passes, 2),
               "share": round(t / passes / total, 4) if total else 0.0}
        for name, (c, t) in sorted(by_part.items(), key=lambda kv: -kv[1][1])
    }  # fmt: skip
    top = [
        {"kernel": name, "part": part, "launches": round(c / passes, 1), "us": round(t / passes, 2)}
        for name, (c, t, part) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
    ]  # fmt: skip
    n = sum(v[0] for v in by_part.values()) / passes
    return {"kernels_per_pass": round(n, 1), "kernel_sum_ms": round(total / 1e3, 4),
            "parts": parts, "top_kernels": top}  # fmt: skip


class _Annotator:
    """Forward hooks that wrap modules in ``record_function(part)`` ranges, plus wrappers of the
    runner's RoPE and paged-attention calls."""

    def __init__(self, runner) -> None:
        import peagle.models.target as T

        self._T, self._runner, self._hooks, self._stack = T, runner, [], []
        roles = [(runner.embed_tokens, "embed"), (runner.norm, "norm"), (runner.lm_head, "lm_head")]
        for layer in runner.layers:
            roles += [(layer.input_layernorm, "norm"), (layer.post_attention_layernorm, "norm")]
            a = layer.self_attn
            roles += [
                (getattr(a, n), "attn_proj") for n in ("q_proj", "k_proj", "v_proj", "o_proj")
            ]
            roles += [(getattr(a, n), "norm") for n in ("q_norm", "k_norm") if hasattr(a, n)]
            roles.append((layer.mlp, "moe_other"))
            for n in ("router", "gate"):
                if isinstance(getattr(layer.mlp, n, None), torch.nn.Module):
                    roles.append((getattr(layer.mlp, n), "router"))
            if getattr(layer.mlp, "experts", None) is not None:
                roles.append((layer.mlp.experts, "experts"))
        for mod, part in roles:
            self._hooks.append(mod.register_forward_pre_hook(self._enter(part)))
            self._hooks.append(mod.register_forward_hook(self._exit))
        self._orig_attn, self._orig_rope = (
            T.paged_attention_forward,
            runner.__dict__.get("apply_rope"),
        )
        T.paged_attention_forward = self._wrap(self._orig_attn, "attention")
        runner.apply_rope = self._wrap(runner.apply_rope, "rope")

    def _enter(self, part):
        def hook(_m, _a):
            rf = torch.profiler.record_function(part)
            rf.__enter__()
            self._stack.append(rf)

        return hook

    def _exit(self, _m, _a, _o):
        self._stack.pop().__exit__(None, None, None)

    def _wrap(self, fn, part):
        def wrapped(*a, **kw):
            with torch.profiler.record_function(part):
                return fn(*a, **kw)

        return wrapped

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._T.paged_attention_forward = self._orig_attn
        if self._orig_rope is None:
            del self._runner.apply_rope
        else:
            self._runner.apply_rope = self._orig_rope


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def profile_eager(fn, runner, passes: int = 3) -> dict:
    """Kernels of ``passes`` eager calls of ``fn`` attributed to ``runner``'s parts
    (:func:`summarize`); on the CPU the trace has no kernels (a smoke run)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync(runner.device)
    acts = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if runner.device.type == "cuda" else []
    )
    ann = _Annotator(runner)
    try:
        with profile(activities=acts) as prof:
            for _ in range(passes):
                fn()
            _sync(runner.device)
    finally:
        ann.remove()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return summarize(attribute_kernels(trace), passes)


def pass_inputs(target, dev: torch.device, n: int, context: int) -> tuple:
    """``(input_ids, meta, kv, logits_indices)`` of one request's steady pass of ``n`` rows."""
    from peagle.bench import projection as P
    from peagle.bench import released as R
    from peagle.models.paged import AttentionMetadata

    t, num_blocks = P.uniform_step(dev, target.vocab_size, 1, n - 1, context)
    kv = target.make_kv_cache(num_blocks, R.BLOCK_SIZE)
    meta = AttentionMetadata(t.positions, t.slot_mapping, t.query_start_loc, t.seq_lens,
                             t.block_table, t.max_query_len)  # fmt: skip
    return t.input_ids, meta, kv, t.logits_indices


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="gpt-oss-20b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="rows in the pass (K+1)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile's pass")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the -tiny shapes")
    ap.add_argument("--out", default="profile-target-pass.json")
    args = ap.parse_args(argv)

    from peagle.bench import projection as P
    from peagle.bench import released as R
    from peagle.bench.timing import copy_ceiling_gbps, git_commit

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    name, tiny = R.split_shape(args.shape)
    t0 = time.perf_counter()
    target = R.build_target(name, dev, torch.bfloat16 if cuda else torch.float32, tiny=tiny)
    gbps = copy_ceiling_gbps() if cuda else 1.0  # the CPU smoke run has no meaningful floor
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu"
    res = {"gpu": gpu, "commit": git_commit(), "shape": args.shape,
           "context": args.context, "copy_gbps": round(gbps, 1), "torch": torch.__version__,
           "command": "python3 tools/profile_target_pass.py " + " ".join(argv or sys.argv[1:]),
           "build_s": round(time.perf_counter() - t0, 2), "routing": R.ROUTING_NOTE,
           "passes": {}}  # fmt: skip

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    for n in args.tokens:
        inputs = pass_inputs(target, dev, n, args.context)

        def fn(inputs=inputs):
            return target.forward(*inputs)

        with torch.inference_mode():
            routed = R.record_routing(target, fn)
            sb = R.streamed_bytes(target, routed, n)
            graph_ms = P.time_fn(fn, dev, args.replays)
            prof = profile_eager(fn, target)
        floor_ms = sb["bytes"] / (gbps * 1e9) * 1e3 if cuda else float("nan")
        row = {"tokens": n, "graph_ms": round(graph_ms, 4), "floor_ms": round(floor_ms, 4),
               "x_floor": round(graph_ms / floor_ms, 2),
               "gap_ms": round(graph_ms - prof["kernel_sum_ms"], 4),
               "expert_floor_ms": round(sb["expert_bytes"] / (gbps * 1e9) * 1e3, 4),
               "dense_floor_ms": round(sb["dense_bytes"] / (gbps * 1e9) * 1e3, 4),
               **sb, **prof}  # fmt: skip
        res["passes"][str(n)] = row
        save()
        print(f"tokens {n}: graph {graph_ms:.3f} ms, floor {floor_ms:.3f} ms "
              f"({graph_ms / floor_ms:.2f}x), {prof['kernels_per_pass']} kernels summing "
              f"{prof['kernel_sum_ms']:.3f} ms", flush=True)  # fmt: skip
        for part, v in prof["parts"].items():
            print(f"  {part:12s} {v['kernels']:7.1f} kernels {v['us']:9.1f} us  {v['share']:.1%}")
        for k in prof["top_kernels"][:12]:
            print(f"    {k['us']:8.1f} us  x{k['launches']:6.1f}  [{k['part']}] {k['kernel'][:90]}")
    if args.compile:
        from torch import _dynamo

        _dynamo.config.cache_size_limit = 64
        for n in args.tokens:
            inputs = pass_inputs(target, dev, n, args.context)
            compiled = torch.compile(target.forward.__wrapped__, dynamic=False)

            def cfn(compiled=compiled, inputs=inputs):
                return compiled(target, *inputs)

            row = res["passes"][str(n)]
            try:
                tc = time.perf_counter()
                with torch.inference_mode():
                    cfn()
                    cfn()
                    _sync(dev)
                    row["compile_s"] = round(time.perf_counter() - tc, 1)
                    ms = P.time_fn(cfn, dev, args.replays)
                row["compiled_graph_ms"] = round(ms, 4)
                row["compiled_x_floor"] = round(ms / row["floor_ms"], 2)
                print(f"tokens {n}: torch.compile + graph {ms:.3f} ms ({ms / row['floor_ms']:.2f}x "
                      f"floor; compile {row['compile_s']} s)", flush=True)  # fmt: skip
            except Exception as e:  # noqa: BLE001 -- recorded, not fatal: the eager profile stands
                row["compile_error"] = f"{type(e).__name__}: {str(e)[:400]}"
                print(f"tokens {n}: torch.compile failed: {row['compile_error']}", flush=True)
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
