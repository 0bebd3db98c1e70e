"""Benchmark: peagle.prepare_draft_inputs (one launch) vs the multi-op vLLM-style path.

``peagle`` is the decode-loop form, :class:`peagle.ops.DraftInputsWorkspace` (16 arguments per
call); the 29-argument ``prepare_draft_inputs`` call is timed too (``extra.separate_outputs``:
same kernel, so the difference is per-call host cost).

For B in {1, 8, 64, 256}, K = 7, H in {2880, 4096}, bf16, uniform decode batches with random
accepted counts. Both implementations run on the same inputs in the same process; their
outputs are compared before timing. Reported per case and impl: µs per step eager and in a
CUDA graph (N steps captured back to back, replay / N), eager per call (``,eager``: an event pair
around every call, median) and eager back to back (``,eager-throughput``: N calls between one
event pair, / N: what a decode loop sees), GB/s on the hidden-state bytes
(T_in*H*2 read + T_out*H*2 written, PERF.md §3.2), % of the copy ceiling measured in the same
run, and the number of GPU kernels per step. A plain gather moving the same hidden rows
(``index_select``) is timed as a floor. Inputs rotate through enough sets to exceed the L2.

    peagle bench ops prepare_draft_inputs --out benchmarks/results/prep-h200.json
    python benchmarks/bench_prepare_draft_inputs.py --out benchmarks/results/prep-h200.json
"""

from __future__ import annotations

import argparse
import time

import torch

from peagle import ops
from peagle.bench.timing import (
    Results,
    bench_eager,
    bench_eager_throughput,
    bench_graph,
    copy_ceiling_gbps,
    l2_rotation_sets,
    print_table,
)
from peagle.testing import make_batch

FAMILY = "prep"
DESCRIPTION = __doc__.split("\n")[0]

K = 7
VOCAB = 201088
WS_KEYS = ("mask_token_id", "block_size", "max_model_len", "vocab_size", "padding_token_id",
           "shift_input_ids")  # fmt: skip


def count_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(
        1
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
    )


def build_sets(b, h, n_sets, seed):
    g = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        batch = make_batch(g, b, K, hidden_size=h, dtype=torch.bfloat16, vocab_size=VOCAB,
                           prefill_frac=0.0, padding_frac=0.0)  # fmt: skip
        args = batch.positional("cuda")
        kw = batch.kwargs("cuda")
        t_in = args[0].shape[0]
        rows = ops.num_draft_rows(t_in, b, K)
        out = ops.empty_draft_inputs(b, rows, K, "cuda", h, torch.bfloat16)
        ws = ops.DraftInputsWorkspace(b, rows, num_padding_slots_per_request=K, device="cuda",
                                      hidden_size=h, hidden_dtype=torch.bfloat16,
                                      **{k: kw[k] for k in WS_KEYS if k in kw})  # fmt: skip
        sets.append((args, kw, out, ws))
    return sets


def check_same(args, kw, out, peer, new_qsl, new_sl):
    assert torch.equal(out.input_ids, peer.ids)
    assert torch.equal(out.positions, peer.pos)
    assert torch.equal(out.is_rejected, peer.rej)
    assert torch.equal(out.is_masked, peer.msk)
    assert torch.equal(out.token_indices_to_sample, peer.sample)
    assert torch.equal(out.slot_mapping, peer.slots)
    assert torch.equal(out.query_start_loc, new_qsl)
    assert torch.equal(out.seq_lens, new_sl)
    defined = ~out.is_rejected
    assert torch.equal(out.hidden_states[defined], peer.hidden[defined])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--hidden-sizes", type=int, nargs="+", default=[2880, 4096])
    ap.add_argument("--out", type=str, default=None, help="write JSON results here")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    add_arguments(ap)
    run(ap.parse_args(argv))


def run(args_cli: argparse.Namespace) -> None:
    from peagle.bench.multiop_prep import MultiOpPrep  # Triton: imported only when measuring

    ceiling = copy_ceiling_gbps()
    res = Results(copy_ceiling_gbps=ceiling, extra={"k": K, "dtype": "bfloat16", "cold_l2": True})
    print(f"copy ceiling: {ceiling:.0f} GB/s")
    for h in args_cli.hidden_sizes:
        for b in args_cli.batch_sizes:
            t_in = b * (K + 1)
            t_out = t_in + b * (K - 1)
            hidden_bytes = (t_in + t_out) * h * 2
            n_sets = l2_rotation_sets(hidden_bytes, factor=3, max_sets=16)
            sets = build_sets(b, h, n_sets, seed=b * 7 + h)
            peers = [MultiOpPrep(t_in, b, K, h, torch.bfloat16, "cuda", K + 1) for _ in sets]
            scal = dict(block_size=16, max_model_len=10**6, vocab_size=VOCAB,
                        mask_token_id=VOCAB - 1)  # fmt: skip

            def run_peagle(i, sets=sets):
                a, kw, _, ws = sets[i % len(sets)]
                ws(*a, kw["target_hidden_states"], kw["mask_hidden"])

            def run_separate(i, sets=sets):
                a, kw, out, _ = sets[i % len(sets)]
                ops.prepare_draft_inputs(*a, **kw, out=out)

            def run_peer(i, sets=sets, peers=peers, scal=scal):
                a, kw, _, _ = sets[i % len(sets)]
                return peers[i % len(sets)](*a, kw["target_hidden_states"], kw["mask_hidden"],
                                            **scal)  # fmt: skip

            gather_idx = [
                torch.randint(0, t_in, (t_out,), device="cuda", dtype=torch.int64) for _ in sets
            ]
            gather_out = [torch.empty(t_out, h, dtype=torch.bfloat16, device="cuda") for _ in sets]

            def run_gather(i, sets=sets, idx=gather_idx, go=gather_out):
                j = i % len(sets)
                torch.index_select(sets[j][1]["target_hidden_states"], 0, idx[j], out=go[j])

            # Correct first: same outputs on every set.
            for i in range(len(sets)):
                run_peagle(i)
                run_separate(i)
                new_qsl, new_sl = run_peer(i)
                a, kw, out, ws = sets[i]
                check_same(a, kw, ws.out, peers[i], new_qsl, new_sl)
                check_same(a, kw, out, peers[i], new_qsl, new_sl)
            torch.cuda.synchronize()

            # Host cost of one call (wrapper, dispatcher, checks, launch), GPU not waited on.

            a0, kw0, out0, ws0 = sets[0]
            raw = torch.ops.peagle.prepare_draft_inputs.default
            full = [*a0, kw0["target_hidden_states"], kw0["mask_hidden"], K, VOCAB - 1, 0, True,
                    16, 10**6, VOCAB, *out0]  # fmt: skip
            raw_ws = torch.ops.peagle.prepare_draft_inputs_workspace.default
            full_ws = [*a0, kw0["target_hidden_states"], kw0["mask_hidden"], ws0.config,
                       ws0.workspace_i64, ws0.workspace_i32, ws0.workspace_bool,
                       ws0.out.hidden_states]  # fmt: skip
            calls = {
                "workspace": lambda f=run_peagle: f(0),
                "workspace_raw_op": lambda raw=raw_ws, full=full_ws: raw(*full),
                "separate_outputs": lambda f=run_separate: f(0),
                "separate_outputs_raw_op": lambda raw=raw, full=full: raw(*full),
            }
            for label, call in calls.items():
                for _ in range(50):
                    call()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(500):
                    call()
                host_us = (time.perf_counter() - t0) / 500 * 1e6
                torch.cuda.synchronize()
                res.extra.setdefault("host_us_per_call", {})[f"B={b},H={h},{label}"] = round(
                    host_us, 2
                )

            case = f"B={b},K={K},H={h}"
            for impl, fn in (("peagle", run_peagle), ("vllm-multiop", run_peer),
                             ("gather-floor", run_gather)):  # fmt: skip
                t_graph = bench_graph(fn, calls_per_graph=20, replays=50)
                t_eager = bench_eager(fn, iters=200)
                t_tput = bench_eager_throughput(fn, calls=200, repeats=5)
                kernels = count_kernels(lambda fn=fn: fn(0))
                gbps = hidden_bytes / (t_graph * 1e-6) / 1e9
                res.add(case + ",graph", impl, t_graph, gbps,
                        pct_of_ceiling=round(100 * gbps / ceiling, 1), kernels=kernels)  # fmt: skip
                res.add(case + ",eager", impl, t_eager, hidden_bytes / (t_eager * 1e-6) / 1e9,
                        kernels=kernels)  # fmt: skip
                res.add(case + ",eager-throughput", impl, t_tput,
                        hidden_bytes / (t_tput * 1e-6) / 1e9, kernels=kernels)  # fmt: skip
            sep = res.extra.setdefault("separate_outputs", {})  # the 29-argument call, same run
            sep[case + ",eager"] = round(bench_eager(run_separate, iters=200), 3)
            sep[case + ",eager-throughput"] = round(
                bench_eager_throughput(run_separate, calls=200, repeats=5), 3
            )
            del sets, peers
            torch.cuda.empty_cache()

    # Ratios vs the peer, same run.
    by = {(r["case"], r["impl"]): r["median_us"] for r in res.rows}
    for r in res.rows:
        peer = by.get((r["case"], "vllm-multiop"))
        if peer:
            r["speedup_vs_vllm_multiop"] = round(peer / r["median_us"], 2)
    print_table(res.rows, ["case", "impl", "median_us", "gbps", "pct_of_ceiling", "kernels",
                           "speedup_vs_vllm_multiop"])  # fmt: skip
    if args_cli.out:
        res.write(args_cli.out)
        print(f"wrote {args_cli.out}")


if __name__ == "__main__":
    main()
