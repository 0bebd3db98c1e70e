"""Drive every CUDA kernel once on varied inputs, for compute-sanitizer (memcheck, racecheck).

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_ops.py [op ...]

Covers ragged batches, padding requests, odd (unaligned) hidden sizes, strided inputs, empty
batches; each case also checks the result against the CPU op so a silent wrong answer fails too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# memcheck only sees cudaMalloc bounds: bypass the caching allocator (before CUDA initialises).
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import peagle  # noqa: E402,F401
from peagle import ops  # noqa: E402


def prepare_draft_inputs_cases() -> None:
    from peagle.testing import make_batch

    g = torch.Generator().manual_seed(5)
    cases = [
        dict(num_reqs=0, k=3),
        dict(num_reqs=1, k=1),
        dict(num_reqs=5, k=7, hidden_size=7, dtype=torch.float16),
        dict(num_reqs=33, k=16, hidden_size=2880, dtype=torch.bfloat16, max_model_len=120),
        dict(num_reqs=9, k=4, shift=False, hidden_size=None),
        dict(num_reqs=300, k=7, hidden_size=4096, dtype=torch.bfloat16, max_prefill=300),
    ]
    for c in cases:
        kw = dict(c)
        batch = make_batch(g, kw.pop("num_reqs"), kw.pop("k"), **kw)
        gpu = ops.prepare_draft_inputs(*batch.positional("cuda"), **batch.kwargs("cuda"))
        cpu = ops.prepare_draft_inputs(*batch.positional(), **batch.kwargs())
        # The workspace form (outputs in three typed buffers) over the same batch.
        args, kwc = batch.positional("cuda"), batch.kwargs("cuda")
        s = kwc.pop("num_padding_slots_per_request")
        th, mh = kwc.pop("target_hidden_states", None), kwc.pop("mask_hidden", None)
        rows = ops.num_draft_rows(args[0].shape[0], args[2].shape[0] - 1, s, kwc["shift_input_ids"])
        ws = ops.DraftInputsWorkspace(
            args[2].shape[0] - 1, rows, num_padding_slots_per_request=s, device="cuda",
            hidden_size=None if th is None else th.shape[1],
            hidden_dtype=None if th is None else th.dtype, **kwc,
        )  # fmt: skip
        wsout = ws(*args, th, mh)
        for name in ("input_ids", "positions", "slot_mapping", "token_indices_to_sample"):
            assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), (c, name)
            assert torch.equal(getattr(wsout, name).cpu(), getattr(cpu, name)), (c, name)
    nxt = ops.prepare_next_token_ids(
        torch.randint(-2, 50, (40, 5), dtype=torch.int32, device="cuda"),
        torch.zeros(40, dtype=torch.bool, device="cuda"),
        torch.ones(40, dtype=torch.int32, device="cuda"),
        50,
    )
    torch.cuda.synchronize()
    assert nxt[0].shape == (40,)


def verify_chain_cases() -> None:
    from test_verify_chain import _shifted_rows, check_invariants, make_case, run_op

    g = torch.Generator().manual_seed(6)
    cases = [
        dict(counts=[0], vocab=1, temps=0.0),
        dict(counts=[3, 0, 7, 1], vocab=111, temps=[0.0, 1.0, 0.7, 0.0], dtype=torch.float16),
        dict(
            counts=[7] * 8,
            vocab=32001,
            temps=0.8,
            dtype=torch.bfloat16,
            top_k=[0, 5, 50, 0] * 2,
            top_p=[1.0, 0.9, 0.5, 0.3] * 2,
        ),  # fmt: skip
        dict(counts=[2, 5], vocab=4097, temps=1.0, draft_probs=True),
        dict(counts=[7] * 3, vocab=201088, temps=[0.0, 0.7, 1.2], dtype=torch.bfloat16),
        # vLLM parity inputs: given bonus ids (bonus rows never read), exponential race.
        dict(counts=[3, 0, 5, 2], vocab=1001, temps=[0.0, 0.9, 1.1, 0.6], exp_race=True,
             bonus_ids=True, top_k=[0, 7, 0, 30], top_p=[1.0, 0.8, 0.9, 1.0]),
        dict(counts=[4, 6], vocab=3001, temps=0.8, draft_probs=True, exp_race=True),
        # row_filter paths: candidates over many splits (B = 1), every element a candidate,
        # radix fallback (flat top-p overflows the candidate buffer; top_k > 256).
        dict(counts=[7], vocab=201088, temps=0.7, dtype=torch.bfloat16, top_k=[50],
             top_p=[0.9]),
        dict(counts=[2, 4, 1], vocab=1000, temps=0.8, top_k=[300, 600, 999]),
        dict(counts=[3, 5], vocab=32001, temps=1.0, scale=0.05, top_p=[0.9, 0.8]),
        dict(counts=[2, 2], vocab=32001, temps=0.9, top_k=[400, 2000], top_p=[0.95, 1.0]),
        # group scan (row_filter reads the groups reaching its bound) on unaligned fp32 rows;
        # rank_select on <= kRankMax candidates.
        dict(counts=[5, 0, 7, 2], vocab=32001, temps=0.9, scale=3.0, shift=3,
             dtype=torch.float32, top_k=[20, 0, 300, 5], top_p=[0.9, 0.5, 1.0, 0.8]),
        # group path (row_stats' group maxima, one row_filter CTA per row): 750 rows, 2 splits.
        dict(counts=[4] * 150, vocab=65537, temps=0.8, dtype=torch.bfloat16,
             top_k=[50, 0, 7] * 50, top_p=[0.9, 0.8, 1.0] * 50),
        # chunk sampling (no filter, no draft_probs): B = 1 at the bench shape, unaligned rows
        # over 8 splits (every chunk boundary moves), a tiny vocabulary (empty chunks), chunks
        # longer than one register round; then
        # the same cases through the tiled path.
        dict(counts=[7], vocab=201088, temps=0.7, dtype=torch.bfloat16, scale=4.0, tiled=False),
        dict(counts=[5, 0, 7, 2], vocab=32001, temps=0.9, scale=4.0, shift=3, tiled=False),
        dict(counts=[3, 1], vocab=7, temps=1.0, dtype=torch.float16, shift=1, tiled=False),
        # 560 rows: 2 splits, chunks of ~12.6K tokens (two register rounds of tiles).
        dict(counts=[7] * 70, vocab=201088, temps=0.8, dtype=torch.bfloat16, scale=4.0,
             tiled=False),
        dict(counts=[5, 0, 7, 2], vocab=32001, temps=0.9, scale=4.0, shift=3, tiled=True),
        dict(counts=[7], vocab=201088, temps=0.7, dtype=torch.bfloat16, tiled=True),
    ]  # fmt: skip
    for c in cases:
        kw = dict(c)
        exp_race, bonus_ids = kw.pop("exp_race", False), kw.pop("bonus_ids", False)
        shift, tiled = kw.pop("shift", 0), kw.pop("tiled", False)
        os.environ["PEAGLE_VERIFY_CHUNKS"] = "0" if tiled else "1"
        case = make_case(kw.pop("counts"), kw.pop("vocab"), g, **kw)
        case["target_logits"] = _shifted_rows(case["target_logits"].cuda(), shift)
        if exp_race:
            case["exponentials"] = torch.empty(case.b, case.vocab).exponential_(generator=g)
        if bonus_ids:
            case["bonus_token_ids"] = torch.randint(0, case.vocab, (case.b,), generator=g).int()
        gpu = run_op(case, "cuda")
        check_invariants(gpu, case)
        cpu = run_op(case, "cpu")
        same = (gpu.output_token_ids == cpu.output_token_ids).all(dim=1)
        assert int((~same).sum()) <= 1, (c, gpu.output_token_ids, cpu.output_token_ids)
    os.environ.pop("PEAGLE_VERIFY_CHUNKS")


def attention_cases() -> None:
    """write_kv_cache + paged_attention: padding/zero-length requests, garbage and -1 block-table
    columns, capacity overflow (keys masked on the device), windows, sinks, strided caches,
    split-KV (automatic and fixed), prefill tiles, GQA 1/4/8, head_dim 64/128, pages 8..128, every
    kernel variant (PEAGLE_SANITIZE_IMPLS, default all).
    Run with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that memcheck sees every allocation's bounds."""
    from reference.paged_attention import paged_attention_ref
    from test_paged_attention import make_problem

    g = torch.Generator().manual_seed(11)
    cases = [
        # q_lens, kv_lens, hq, hkv, d, block_size, dtype, make_problem kwargs, op kwargs
        (
            [14, 0, 3, 14],
            [700, 9, 0, 64],
            32,
            8,
            128,
            16,
            torch.bfloat16,
            {},
            {"max_query_len": 14},
        ),
        ([14, 1], [3000, 5], 64, 8, 64, 8, torch.float16, {"layout": "interleaved"}, {}),
        ([14, 14], [2100, 900], 8, 8, 64, 128, torch.bfloat16, {}, {"num_splits": 7}),
        (
            [70, 5],
            [70, 300],
            16,
            4,
            128,
            32,
            torch.float16,
            {"layout": "padded"},
            {"window_left": 40},
        ),
        ([4, 3], [66, 20], 8, 2, 64, 16, torch.bfloat16, {"max_blocks": 4}, {}),  # over capacity
        # split merge in clusters, two levels (B = 1 decode: 8-CTA clusters, last-arriver slices)
        ([14], [6000], 32, 8, 128, 16, torch.bfloat16, {}, {"max_query_len": 14}),
        ([14, 3], [5000, 40], 64, 8, 64, 16, torch.float16, {}, {"num_splits": 24}),
        # B = 1, 64/8 x 64, automatic splits, short table: the 64-row query tiles (wgmma)
        ([14], [6000], 64, 8, 64, 16, torch.bfloat16, {}, {"max_query_len": 14}),
        # head-major caches (slots D apart): the K/V byte-stride address math, both head layouts
        ([14, 9], [1200, 77], 32, 8, 128, 32, torch.bfloat16, {"layout": "head_major"}, {}),
        ([14, 14], [640, 2100], 64, 8, 64, 16, torch.float16, {"layout": "head_major"}, {}),
    ]
    # Every kernel variant (PEAGLE_ATTN_IMPL, read per launch): the default on all cases, the
    # others on the cases their paths handle differently (GQA 4/8, head_dim 128, splits).
    default_impls = "auto,mma,wgmma,wgmma-n32,wgmma-m64,wgmma-m128,mma-n32"
    impls = os.environ.get("PEAGLE_SANITIZE_IMPLS", default_impls).split(",")
    runs = [(impl, c) for impl in impls for c in (cases if impl == "auto" else cases[:2])]
    for impl, (q_lens, kv_lens, hq, hkv, d, bs, dtype, mk, kw) in runs:
        if impl == "auto":
            os.environ.pop("PEAGLE_ATTN_IMPL", None)
        else:
            os.environ["PEAGLE_ATTN_IMPL"] = impl
        pb = make_problem(g, q_lens, kv_lens, hq, hkv, d, bs, dtype, "cuda", t_pad=3, **mk)
        sinks = torch.randn(hq, generator=g).cuda()
        args = (pb.query, pb.key_cache, pb.value_cache, pb.block_table, pb.query_start_loc,
                pb.seq_lens)  # fmt: skip
        out, lse = ops.paged_attention(*args, sinks=sinks, return_lse=True, **kw)
        torch.cuda.synchronize()
        cap = pb.block_table.shape[1] * bs if "max_blocks" in mk else None
        ref, ref_lse = paged_attention_ref(
            *args, window_left=kw.get("window_left", -1), sinks=sinks, key_capacity=cap
        )
        err = (out.cpu().double() - ref).abs().max().item()
        assert err < 0.05, (impl, q_lens, kv_lens, err)
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse.cpu()), fin)
        assert (lse.cpu().double()[fin] - ref_lse[fin]).abs().max().item() < 1e-3
        # write_kv_cache into the same (strided) caches, -1 and out-of-range slots skipped.
        t = 40
        k = torch.randn(t, hkv, d, generator=g).to(dtype=dtype, device="cuda")
        slots = torch.randint(-1, pb.key_cache.shape[0] * bs, (t,), generator=g)
        slots[3] = pb.key_cache.shape[0] * bs + 5
        ops.write_kv_cache(k, k, pb.key_cache, pb.value_cache, slots.cuda())
        torch.cuda.synchronize()
    # Non-finite V in partly masked keys of an edge tile (the scrub and its rare path, which
    # reuses Q's shared-memory tile): rows that do not see them stay finite.
    for impl in impls:
        os.environ["PEAGLE_ATTN_IMPL"] = impl if impl != "auto" else ""
        for q_len, hq, hkv, d in [(8, 8, 2, 64), (8, 8, 2, 128), (14, 64, 8, 64)]:
            kv = 45
            pb = make_problem(g, [q_len], [kv], hq, hkv, d, 16, torch.float16, "cuda")
            for key in (kv - 3, kv - 2, kv - 1):
                blk = int(pb.block_table[0, key // 16])
                pb.value_cache[blk, key % 16] = float("nan")
            args = (pb.query, pb.key_cache, pb.value_cache, pb.block_table, pb.query_start_loc,
                    pb.seq_lens)  # fmt: skip
            for num_splits in (1, 3):
                out = ops.paged_attention(*args, num_splits=num_splits, max_query_len=q_len)
                torch.cuda.synchronize()
                assert torch.isfinite(out[: q_len - 3].float()).all(), (impl, q_len, d, num_splits)
                assert not torch.isfinite(out[q_len - 3 :].float()).all(-1).any()
    os.environ.pop("PEAGLE_ATTN_IMPL", None)
    # Both split merges on a split case: the merge kernel (default) and the cluster merge.
    os.environ["PEAGLE_ATTN_MERGE"] = "kernel"
    pb = make_problem(g, [14], [6000], 32, 8, 128, 16, torch.bfloat16, "cuda")
    args = (pb.query, pb.key_cache, pb.value_cache, pb.block_table, pb.query_start_loc,
            pb.seq_lens)  # fmt: skip
    out_k = ops.paged_attention(*args, max_query_len=14, num_splits=24)
    # Automatic splits at B = 1 over this short table: 32-key tiles, one CTA per SM.
    out_a = ops.paged_attention(*args, max_query_len=14)
    os.environ["PEAGLE_ATTN_MERGE"] = "cluster"  # the opt-in in-kernel merge
    out_c = ops.paged_attention(*args, max_query_len=14, num_splits=24)
    os.environ.pop("PEAGLE_ATTN_MERGE")
    torch.cuda.synchronize()
    assert (out_k.float() - out_c.float()).abs().max().item() < 0.02
    assert (out_k.float() - out_a.float()).abs().max().item() < 0.02


CASES = {
    "prepare_draft_inputs": prepare_draft_inputs_cases,
    "verify_chain": verify_chain_cases,
    "attention": attention_cases,
}


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    for name in names:
        CASES[name]()
        torch.cuda.synchronize()
        print(f"sanitize: {name} ok")


if __name__ == "__main__":
    main()
