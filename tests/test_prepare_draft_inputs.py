"""prepare_draft_inputs / prepare_next_token_ids against the SPEC §3.7 vectors and the
pure-PyTorch reference (tests/reference/prepare_draft_inputs.py), on CPU and CUDA."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA, capture_graph, poison_, requires_cuda
from reference.prepare_draft_inputs import next_token_ids_ref, prepare_draft_inputs_ref

import peagle
from peagle import ops
from peagle.testing import make_batch

MASK = 999  # mask token id used by the golden examples (vLLM's test uses -2; ids here are valid)
ROW_FIELDS = ("input_ids", "positions", "is_rejected", "is_masked", "slot_mapping")
REQ_FIELDS = (
    "token_indices_to_sample",
    "query_start_loc",
    "seq_lens",
    "next_token_ids",
    "valid_sampled_tokens_count",
)


def run_op(batch, device, num_out_rows=None, poison=True):
    args = batch.positional(device)
    kw = batch.kwargs(device)
    b = args[2].shape[0] - 1
    s = kw["num_padding_slots_per_request"]
    rows = num_out_rows or ops.num_draft_rows(args[0].shape[0], b, s, kw["shift_input_ids"])
    th = kw.get("target_hidden_states")
    out = ops.empty_draft_inputs(
        b, rows, s, device, None if th is None else th.shape[1], None if th is None else th.dtype
    )
    if poison:
        for t in out:
            poison_(t)
    return ops.prepare_draft_inputs(*args, **kw, out=out)


def assert_matches_ref(got, ref, check_tail_untouched_from=None):
    for name in ROW_FIELDS + REQ_FIELDS:
        g = getattr(got, name).cpu()
        assert torch.equal(g, ref[name]), f"{name}:\n got {g.tolist()}\nwant {ref[name].tolist()}"
    if "hidden_states" in ref:
        h = got.hidden_states.cpu()
        d = ref["hidden_defined"]
        assert torch.equal(h[d], ref["hidden_states"][d]), "hidden rows differ"
        if check_tail_untouched_from is not None:  # EDGE D4: rows >= T_out are never written
            assert torch.isnan(h[check_tail_untouched_from:].float()).all()


def example1_inputs(shift=True, device="cpu", hidden=True):
    """SPEC §3.7 Example 1: K = S = 3, num_rejected = [1, 0], next = [100, 200]."""
    i32 = torch.int32
    g = torch.Generator().manual_seed(1)
    th = torch.randn(8, 6, generator=g) if hidden else None
    mh = torch.randn(6, generator=g) if hidden else None
    args = [
        torch.tensor([10, 11, 12, 13, 20, 21, 22, 23], dtype=i32),
        torch.tensor([5, 6, 7, 8, 10, 11, 12, 13]),
        torch.tensor([0, 4, 8], dtype=i32),
        torch.tensor([9, 14], dtype=i32),
        # valid counts [3, 4] -> num_rejected [1, 0]; next = last valid id.
        torch.tensor([[1, 2, 100, -1], [3, 4, 5, 200]], dtype=i32),
        torch.zeros(2, dtype=torch.bool),
        torch.zeros(2, dtype=i32),
        torch.tensor([3, 6], dtype=i32),
        torch.tensor([[3, 4], [7, 8]], dtype=i32),
    ]
    kw = dict(
        num_padding_slots_per_request=3,
        mask_token_id=MASK,
        block_size=16,
        max_model_len=10**6,
        vocab_size=1000,
        shift_input_ids=shift,
    )
    if hidden:
        kw.update(target_hidden_states=th.to(device), mask_hidden=mh.to(device))
    return [a.to(device) for a in args], kw, th, mh


def test_spec_example1_parallel_drafting(device):
    args, kw, th, mh = example1_inputs(device=device)
    out = ops.prepare_draft_inputs(*args, **kw)
    M = MASK
    assert out.input_ids.tolist() == [11, 12, 100, M, M, 0, 21, 22, 23, 200, M, M]
    assert out.positions.tolist() == [5, 6, 7, 8, 9, 0, 10, 11, 12, 13, 14, 15]
    assert out.is_rejected.nonzero().flatten().tolist() == [5]
    assert out.is_masked.nonzero().flatten().tolist() == [3, 4, 10, 11]
    assert out.token_indices_to_sample.tolist() == [2, 3, 4, 9, 10, 11]
    assert out.query_start_loc.tolist() == [0, 6, 12]
    assert out.seq_lens.tolist() == [11, 16]
    assert out.next_token_ids.tolist() == [100, 200]
    assert out.slot_mapping.tolist() == [53, 54, 55, 56, 57, -1, 122, 123, 124, 125, 126, 127]
    h = out.hidden_states.cpu()
    for o, src in [(0, 0), (1, 1), (2, 2), (6, 4), (7, 5), (8, 6), (9, 7)]:
        assert torch.equal(h[o], th[src])
    for o in (3, 4, 10, 11):
        assert torch.equal(h[o], mh)


def test_spec_example1_max_model_len(device):
    args, kw, _, _ = example1_inputs(device=device)
    kw["max_model_len"] = 15
    out = ops.prepare_draft_inputs(*args, **kw)
    assert out.slot_mapping.tolist() == [53, 54, 55, 56, 57, -1, 122, 123, 124, 125, 126, -1]


def test_spec_pard_shift_off(device):
    """SPEC §3.7 derived vector: Example 1 inputs, shift = 0, S = 3, N = 3."""
    args, kw, _, _ = example1_inputs(shift=False, device=device, hidden=False)
    out = ops.prepare_draft_inputs(*args, **kw)
    M = MASK
    assert out.input_ids.tolist() == [10, 11, 12, 100, M, M, 0, 20, 21, 22, 23, 200, M, M]
    assert out.positions.tolist() == [5, 6, 7, 8, 9, 10, 0, 10, 11, 12, 13, 14, 15, 16]
    assert out.is_rejected.nonzero().flatten().tolist() == [6]
    assert out.is_masked.nonzero().flatten().tolist() == [4, 5, 12, 13]
    assert out.token_indices_to_sample.tolist() == [3, 4, 5, 11, 12, 13]
    assert out.query_start_loc.tolist() == [0, 7, 14]


def test_spec_example2_serial_draft_model(device):
    """SPEC §3.7 Example 2: S = 1, shift = 0, num_rejected = [1, 0]."""
    i32 = torch.int32
    args = [
        torch.tensor([10, 11, 12, 20, 21], dtype=i32),
        torch.tensor([0, 1, 2, 0, 1]),
        torch.tensor([0, 3, 5], dtype=i32),
        torch.tensor([3, 2], dtype=i32),
        torch.tensor([[1, 100, -1], [200, -1, -1]], dtype=i32),  # valid [2, 1]
        torch.zeros(2, dtype=torch.bool),
        torch.zeros(2, dtype=i32),
        torch.tensor([2, 2], dtype=i32),  # drafts [2, 0] -> num_rejected [1, 0]
        torch.tensor([[0], [1]], dtype=i32),
    ]
    out = ops.prepare_draft_inputs(
        *[a.to(device) for a in args],
        num_padding_slots_per_request=1,
        mask_token_id=MASK,
        block_size=16,
        max_model_len=10**6,
        vocab_size=1000,
        shift_input_ids=False,
    )
    assert out.input_ids.tolist() == [10, 11, 100, 0, 20, 21, 200]
    assert out.positions.tolist() == [0, 1, 2, 0, 0, 1, 2]
    assert out.is_rejected.nonzero().flatten().tolist() == [3]
    assert not out.is_masked.any()
    assert out.token_indices_to_sample.tolist() == [2, 6]
    assert out.query_start_loc.tolist() == [0, 4, 7]
    assert out.seq_lens.tolist() == [4, 3]


def test_spec_all_rejected(device):
    """SPEC §3.7 derived: all K=3 drafts rejected, shift = 1."""
    i32 = torch.int32
    th = torch.randn(4, 8)
    mh = torch.randn(8)
    out = ops.prepare_draft_inputs(
        torch.tensor([10, 11, 12, 13], dtype=i32, device=device),
        torch.tensor([5, 6, 7, 8], device=device),
        torch.tensor([0, 4], dtype=i32, device=device),
        torch.tensor([9], dtype=i32, device=device),
        torch.tensor([[100, -1, -1, -1]], dtype=i32, device=device),
        torch.zeros(1, dtype=torch.bool, device=device),
        torch.zeros(1, dtype=i32, device=device),
        torch.tensor([3], dtype=i32, device=device),
        torch.tensor([[0]], dtype=i32, device=device),
        num_padding_slots_per_request=3,
        mask_token_id=MASK,
        block_size=16,
        max_model_len=10**6,
        vocab_size=1000,
        target_hidden_states=th.to(device),
        mask_hidden=mh.to(device),
    )
    assert out.input_ids.tolist() == [100, MASK, MASK, 0, 0, 0]
    assert out.positions.tolist() == [5, 6, 7, 0, 0, 0]
    assert out.is_rejected.tolist() == [False, False, False, True, True, True]
    assert out.is_masked.nonzero().flatten().tolist() == [1, 2]
    assert out.token_indices_to_sample.tolist() == [0, 1, 2]
    h = out.hidden_states.cpu()
    assert torch.equal(h[0], th[0]) and torch.equal(h[1], mh) and torch.equal(h[2], mh)
    assert torch.equal(h[3], th[3])  # the last mapped target row lands on the first rejected row


@pytest.mark.parametrize("shift", [True, False])
def test_spec_three_token_prefill(device, shift):
    """SPEC §3.7 / EDGE C9: prefill [7, 8, 9] at [0, 1, 2], next 50, K = 3."""
    i32 = torch.int32
    out = ops.prepare_draft_inputs(
        torch.tensor([7, 8, 9], dtype=i32, device=device),
        torch.tensor([0, 1, 2], device=device),
        torch.tensor([0, 3], dtype=i32, device=device),
        torch.tensor([3], dtype=i32, device=device),
        torch.tensor([[50, -1, -1, -1]], dtype=i32, device=device),
        torch.zeros(1, dtype=torch.bool, device=device),
        torch.zeros(1, dtype=i32, device=device),
        torch.tensor([0], dtype=i32, device=device),
        torch.tensor([[0]], dtype=i32, device=device),
        num_padding_slots_per_request=3,
        mask_token_id=MASK,
        block_size=16,
        max_model_len=10**6,
        vocab_size=1000,
        shift_input_ids=shift,
    )
    if shift:
        assert out.input_ids.tolist() == [8, 9, 50, MASK, MASK]
        assert out.positions.tolist() == [0, 1, 2, 3, 4]
        assert out.token_indices_to_sample.tolist() == [2, 3, 4]
    else:
        assert out.input_ids.tolist() == [7, 8, 9, 50, MASK, MASK]
        assert out.positions.tolist() == [0, 1, 2, 3, 4, 5]
        assert out.token_indices_to_sample.tolist() == [3, 4, 5]


@pytest.mark.parametrize("num_reqs", [0, 1, 3, 64])
@pytest.mark.parametrize("k", [1, 2, 7, 16])
@pytest.mark.parametrize("shift", [True, False])
def test_random_batches_match_reference(device, gen, num_reqs, k, shift):
    batch = make_batch(gen, num_reqs, k, shift=shift, hidden_size=24, max_model_len=150)
    t_in = batch.target_token_ids.shape[0]
    s = batch.scalars["num_padding_slots_per_request"]
    t_out = ops.num_draft_rows(t_in, num_reqs, s, shift)
    pad = 5  # CUDA-graph padding rows past the live count
    got = run_op(batch, device, num_out_rows=t_out + pad)
    ref = prepare_draft_inputs_ref(*batch.positional(), **batch.kwargs(), num_out_rows=t_out + pad)
    assert_matches_ref(got, ref, check_tail_untouched_from=t_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [1, 7, 1024, 2880])
def test_hidden_rows_dtypes_and_alignment(device, gen, dtype, hidden_size):
    """Odd hidden sizes give rows unaligned to 16 bytes; the copy must still be exact."""
    batch = make_batch(gen, 5, 3, hidden_size=hidden_size, dtype=dtype)
    got = run_op(batch, device)
    ref = prepare_draft_inputs_ref(*batch.positional(), **batch.kwargs())
    assert_matches_ref(got, ref)


def test_prefill_rows_longer_than_a_tile(device, gen):
    """EDGE F2: prefill rows around vLLM's 256-row tile, next to decodes."""
    batch = make_batch(gen, 6, 4, max_prefill=600, prefill_frac=0.6, padding_frac=0.0)
    got = run_op(batch, device)
    ref = prepare_draft_inputs_ref(*batch.positional(), **batch.kwargs())
    assert_matches_ref(got, ref)


def test_strided_inputs(device, gen):
    batch = make_batch(gen, 7, 3, hidden_size=40)
    args = batch.positional(device)
    kw = batch.kwargs(device)
    # Non-contiguous views of the same values.
    args[0] = torch.stack([args[0], args[0]], 1)[:, 0]
    args[4] = torch.cat([args[4], args[4]], 1)[:, : args[4].shape[1]]
    args[8] = torch.cat([args[8], args[8]], 1)[:, : args[8].shape[1]]
    th = kw["target_hidden_states"]
    kw["target_hidden_states"] = torch.cat([th, th], 1)[:, : th.shape[1]]
    got = ops.prepare_draft_inputs(*args, **kw)
    ref = prepare_draft_inputs_ref(*batch.positional(), **batch.kwargs())
    assert_matches_ref(got, ref)


def test_padding_requests_are_inert_and_never_read_block_table(device):
    """EDGE C1 / D2: 3 real requests padded to 4; the padding request's row is all -1."""
    g = torch.Generator().manual_seed(3)
    batch = make_batch(g, 3, 3, padding_frac=0.0, prefill_frac=0.0)
    b = batch
    b.query_start_loc = torch.cat([b.query_start_loc, b.query_start_loc[-1:]])
    b.seq_lens = torch.cat([b.seq_lens, torch.zeros(1, dtype=torch.int32)])
    b.sampled_token_ids = torch.cat(
        [b.sampled_token_ids, torch.full((1, 4), -1, dtype=torch.int32)]
    )
    b.discard_request_mask = torch.cat([b.discard_request_mask, torch.zeros(1, dtype=torch.bool)])
    b.backup_next_token_ids = torch.cat(
        [b.backup_next_token_ids, torch.full((1,), -1, dtype=torch.int32)]
    )
    b.cu_num_draft_tokens = torch.cat([b.cu_num_draft_tokens, b.cu_num_draft_tokens[-1:]])
    b.block_table = torch.cat([b.block_table, torch.full_like(b.block_table[:1], -1)])
    got = run_op(b, device)
    ref = prepare_draft_inputs_ref(*b.positional(), **b.kwargs())
    assert_matches_ref(got, ref)
    assert got.seq_lens[3].item() == 0
    n = 2
    pad_rows = slice(int(b.query_start_loc[3]) + 3 * n, int(b.query_start_loc[3]) + 4 * n)
    assert (got.slot_mapping[pad_rows] == -1).all()
    assert (got.positions[pad_rows] == 0).all()
    assert got.valid_sampled_tokens_count[3].item() == 0


def test_rejected_rows_write_no_kv(device):
    """EDGE C3: request A accepted 1 of 4 drafts, B all 4; A's 3 rejected rows get slot -1 and
    sit after every real row of A."""
    i32 = torch.int32
    k = 4
    ids = torch.arange(10, dtype=i32)
    out = ops.prepare_draft_inputs(
        ids.to(device),
        torch.cat([torch.arange(20, 25), torch.arange(30, 35)]).to(device),
        torch.tensor([0, 5, 10], dtype=i32, device=device),
        torch.tensor([25, 35], dtype=i32, device=device),
        torch.tensor([[1, 2, -1, -1, -1], [1, 2, 3, 4, 5]], dtype=i32, device=device),
        torch.zeros(2, dtype=torch.bool, device=device),
        torch.zeros(2, dtype=i32, device=device),
        torch.tensor([4, 8], dtype=i32, device=device),
        torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=i32, device=device),
        num_padding_slots_per_request=k,
        mask_token_id=MASK,
        block_size=16,
        max_model_len=10**6,
        vocab_size=1000,
    )
    a_rows = slice(0, 5 + k - 1)
    rej = out.is_rejected[a_rows].cpu()
    assert rej.tolist() == [False] * 5 + [True] * 3
    assert (out.slot_mapping[a_rows].cpu()[rej] == -1).all()
    assert not out.is_rejected[8:].any()
    slots = out.slot_mapping.cpu()
    written = slots[slots >= 0]
    assert written.unique().numel() == written.numel()  # EDGE C7: every slot written once


def test_positions_beyond_max_model_len(device, gen):
    """EDGE C6: rows at positions >= max_model_len get slot -1; the table is not read for them
    (the unused columns hold garbage, so a read would produce a wrong slot)."""
    batch = make_batch(gen, 8, 4, max_model_len=60, prefill_frac=0.0, padding_frac=0.0)
    got = run_op(batch, device)
    ref = prepare_draft_inputs_ref(*batch.positional(), **batch.kwargs())
    assert_matches_ref(got, ref)
    pos = got.positions.cpu()
    assert (got.slot_mapping.cpu()[pos >= 60] == -1).all()


def test_overwrites_outputs_on_repeat(device, gen):
    batch = make_batch(gen, 9, 3)
    first = run_op(batch, device)
    second = ops.prepare_draft_inputs(*batch.positional(device), **batch.kwargs(device), out=first)
    ref = prepare_draft_inputs_ref(*batch.positional(), **batch.kwargs())
    assert_matches_ref(second, ref)


def test_prepare_next_token_ids(device, gen):
    """Stage A alone; placeholders and other invalid ids are skipped (EDGE C5)."""
    batch = make_batch(gen, 40, 5)
    nxt, valid = ops.prepare_next_token_ids(
        batch.sampled_token_ids.to(device),
        batch.discard_request_mask.to(device),
        batch.backup_next_token_ids.to(device),
        1000,
    )
    ref_n, ref_v = next_token_ids_ref(
        batch.sampled_token_ids, batch.discard_request_mask, batch.backup_next_token_ids, 1000
    )
    assert torch.equal(nxt.cpu(), ref_n) and torch.equal(valid.cpu(), ref_v)
    row = torch.tensor([[5, -1, -2, -1]], dtype=torch.int32, device=device)
    n1, v1 = ops.prepare_next_token_ids(
        row,
        torch.zeros(1, dtype=torch.bool, device=device),
        torch.tensor([7], dtype=torch.int32, device=device),
        1000,
    )
    assert n1.tolist() == [5] and v1.tolist() == [1]


# ---- bad inputs -------------------------------------------------------------------------------


def _ex1(device="cpu"):
    args, kw, _, _ = example1_inputs(device=device)
    return args, kw


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a, k: a.__setitem__(0, a[0].long()), "target_token_ids must have dtype Int"),
        (lambda a, k: a.__setitem__(1, a[1][:-1]), "target_positions must have shape"),
        (lambda a, k: a.__setitem__(4, a[4][:1]), "sampled_token_ids"),
        (lambda a, k: a.__setitem__(8, a[8][:1]), "block_table must have B=2 rows"),
        (lambda a, k: k.__setitem__("mask_token_id", 1000), "mask_token_id 1000 is outside"),
        (lambda a, k: k.__setitem__("block_size", 0), "block_size must be positive"),
        (lambda a, k: k.pop("mask_hidden"), "must be given together"),
        (lambda a, k: k.__setitem__("mask_hidden", k["mask_hidden"][:3]), "mask_hidden must hold"),
        (
            lambda a, k: k.__setitem__("mask_hidden", k["mask_hidden"].double()),
            "mask_hidden must have dtype",
        ),
    ],
)
def test_bad_shapes_and_dtypes(mutate, match):
    args, kw = _ex1()
    mutate(args, kw)
    with pytest.raises(RuntimeError, match=match):
        ops.prepare_draft_inputs(*args, **kw)


def test_output_too_small_is_an_error():
    """EDGE C4: buffers must count the rejected tail: T_in + B*N rows."""
    args, kw = _ex1()
    with pytest.raises(RuntimeError, match="at least T_in \\+ B\\*N = 8 \\+ 2\\*2 = 12 rows"):
        ops.prepare_draft_inputs(*args, **kw, num_out_rows=11)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a[2].copy_(torch.tensor([0, 5, 4])), "non-decreasing"),
        (lambda a: a[7].copy_(torch.tensor([3, 2])), "cu_num_draft_tokens must be"),
        (lambda a: a[4][0].fill_(-1), "backup_next_token_ids"),  # valid 0 and backup 0 ok...
        (lambda a: a[8].fill_(-1), "needs block_table"),
        (lambda a: (a[4][1].fill_(-1), a[6].fill_(5)), "rejected rows"),
    ],
)
def test_bad_values_raise_on_cpu(mutate, match):
    args, kw = _ex1()
    if match == "backup_next_token_ids":
        args[6].fill_(-1)  # backup is used (no valid sample) but is a placeholder (EDGE C5)
    mutate(args)
    with pytest.raises(RuntimeError, match=match):
        ops.prepare_draft_inputs(*args, **kw)


def _poke_needed_columns(batch, gen):
    """Set one needed block-table column of every third real decode request to a negative id
    (-1, or another negative value); returns {request: (column, block id it held)}."""
    bs = batch.scalars["block_size"]
    qsl, seq = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    poked = {}
    for r in range(len(seq)):
        qlen = qsl[r + 1] - qsl[r]
        if qlen == 0 or seq[r] == 0 or r % 3:
            continue
        p0 = int(batch.target_positions[qsl[r]])
        cols = list(range(p0 // bs, (p0 + qlen - 1) // bs + 1))
        c = cols[int(torch.randint(0, len(cols), (1,), generator=gen))]
        poked[r] = (c, int(batch.block_table[r, c]))
        batch.block_table[r, c] = -1 if len(poked) % 2 else -(2**31)
    assert poked
    return poked


def test_block_table_minus1_in_needed_columns_cpu_raises(gen):
    """SPEC §3.5: a negative block id in a column a written row needs is a value error on CPU,
    naming block_table, the request and the column; -1 in columns no row needs is fine."""
    args, kw = _ex1()
    args[8][1, 0] = -1  # request 1 (positions 10..15, block size 16) needs column 0
    with pytest.raises(RuntimeError, match=r"request 1 position 10 needs block_table\[1, 0\]"):
        ops.prepare_draft_inputs(*args, **kw)
    args, kw = _ex1()
    args[8][:, 1] = -1  # column 1 is never needed: no error, same slots as with valid ids
    got = ops.prepare_draft_inputs(*args, **kw)
    assert got.slot_mapping.tolist() == [53, 54, 55, 56, 57, -1, 122, 123, 124, 125, 126, 127]
    batch = make_batch(gen, 12, 4, padding_frac=0.0, prefill_frac=0.2)
    _poke_needed_columns(batch, gen)
    with pytest.raises(RuntimeError, match=r"needs block_table\[\d+, \d+\].*negative block id"):
        run_op(batch, "cpu")


@requires_cuda
def test_block_table_minus1_in_needed_columns_cuda_gives_padding_slot(gen):
    """SPEC §3.5: the CUDA kernel cannot raise without a host sync; a row whose needed block-table
    entry is negative gets slot PADDING_SLOT_ID (-1: write_kv_cache skips it) and every other
    output equals the reference computed from the valid table."""
    batch = make_batch(gen, 24, 4, padding_frac=0.1, prefill_frac=0.2)
    ref = prepare_draft_inputs_ref(*batch.positional(), **batch.kwargs())
    poked = _poke_needed_columns(batch, gen)
    bs = batch.scalars["block_size"]
    n = batch.scalars["num_padding_slots_per_request"] - 1
    qsl = batch.query_start_loc.tolist()
    want = ref["slot_mapping"].clone()
    for r, (c, _) in poked.items():
        rows = slice(qsl[r] + r * n, qsl[r + 1] + (r + 1) * n)
        hit = (ref["positions"][rows] // bs == c) & (ref["slot_mapping"][rows] >= 0)
        want[rows][hit] = -1
        assert hit.any()
    got = run_op(batch, "cuda")
    assert torch.equal(got.slot_mapping.cpu(), want)
    ref["slot_mapping"] = want
    assert_matches_ref(got, ref)


def test_mismatched_devices():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    args, kw = _ex1()
    args[3] = args[3].cuda()
    with pytest.raises(RuntimeError, match="seq_lens is on cuda"):
        ops.prepare_draft_inputs(*args, **kw)


# ---- torch.library / torch.compile ------------------------------------------------------------


def test_opcheck():
    args, kw, _, _ = example1_inputs()
    out = ops.empty_draft_inputs(2, 12, 3, "cpu", 6, torch.float32)
    full = [
        *args,
        kw["target_hidden_states"],
        kw["mask_hidden"],
        3,
        MASK,
        0,
        True,
        16,
        10**6,
        1000,
        *out,
    ]
    torch.library.opcheck(torch.ops.peagle.prepare_draft_inputs.default, full)
    sampled, discard, backup = args[4], args[5], args[6]
    torch.library.opcheck(
        torch.ops.peagle.prepare_next_token_ids.default,
        [sampled, discard, backup, 1000, out.next_token_ids, out.valid_sampled_tokens_count],
    )


def test_torch_compile_fullgraph():
    args, kw, _, _ = example1_inputs()

    def step(*a):
        out = ops.prepare_draft_inputs(*a, **kw)
        return out.input_ids + 1, out.slot_mapping

    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


# ---- CUDA only ---------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("num_reqs", [0, 1, 3, 64, 512])
@pytest.mark.parametrize("k", [1, 2, 7, 16])
@pytest.mark.parametrize("hidden_size", [1024, 2880, 4096, 7168])
def test_cuda_matches_cpu(num_reqs, k, hidden_size):
    g = torch.Generator().manual_seed(num_reqs * 131 + k * 7 + hidden_size)
    for shift in (True, False):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            if dtype != torch.bfloat16 and hidden_size not in (1024, 2880):
                continue
            batch = make_batch(
                g,
                num_reqs,
                k,
                shift=shift,
                hidden_size=hidden_size,
                dtype=dtype,
                max_model_len=180,
                max_prefill=300,
            )
            cpu = run_op(batch, "cpu")
            gpu = run_op(batch, "cuda")
            for name in ROW_FIELDS + REQ_FIELDS:
                assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
            if cpu.hidden_states is not None:  # same rows written, the rest left poisoned
                torch.testing.assert_close(
                    gpu.hidden_states.cpu(), cpu.hidden_states, rtol=0, atol=0, equal_nan=True
                )


@requires_cuda
def test_cuda_graph_replay_with_new_contents():
    """Capture once with padded buffers; replay with different accepted counts and with fewer
    live requests (the rest padding), matching eager each time (EDGE D1)."""
    k, b_max, h = 7, 16, 256
    g = torch.Generator().manual_seed(11)
    # Static input buffers sized for a uniform decode batch of b_max requests.
    t_in = b_max * (k + 1)
    rows = ops.num_draft_rows(t_in, b_max, k)
    template = make_batch(
        g,
        b_max,
        k,
        hidden_size=h,
        dtype=torch.bfloat16,
        prefill_frac=0.0,
        padding_frac=0.0,
        spare_blocks=50,
    )
    static_args = [a.cuda() for a in template.positional()]
    static_kw = template.kwargs("cuda")
    out = ops.empty_draft_inputs(b_max, rows, k, "cuda", h, torch.bfloat16)
    graph = capture_graph(lambda: ops.prepare_draft_inputs(*static_args, **static_kw, out=out))

    for trial in range(6):
        live = b_max if trial < 3 else int(torch.randint(1, b_max, (1,), generator=g))
        new = make_batch(
            g, live, k, hidden_size=h, dtype=torch.bfloat16, prefill_frac=0.0, padding_frac=0.0
        )
        # Pad to b_max requests: padding requests own qlen 0 and seq_len 0.
        pad = b_max - live
        tin_live = new.target_token_ids.shape[0]
        fill = t_in - tin_live

        def padded(t, value, n=pad):
            return torch.cat([t, torch.full((n, *t.shape[1:]), value, dtype=t.dtype)])

        src = [
            padded(new.target_token_ids, 0, fill),
            padded(new.target_positions, 0, fill),
            torch.cat([new.query_start_loc, torch.full((pad,), tin_live, dtype=torch.int32)]),
            padded(new.seq_lens, 0),
            padded(new.sampled_token_ids, -1),
            padded(new.discard_request_mask, False),
            padded(new.backup_next_token_ids, 0),
            padded(new.cu_num_draft_tokens, int(new.cu_num_draft_tokens[-1])),
            None,
        ]
        bt = torch.full_like(template.block_table, -1)
        w = min(bt.shape[1], new.block_table.shape[1])
        bt[:live, :w] = new.block_table[:, :w]
        src[8] = bt
        for dst, s in zip(static_args, src, strict=True):
            dst.copy_(s)
        static_kw["target_hidden_states"].copy_(padded(new.target_hidden_states, 0.0, fill))
        static_kw["mask_hidden"].copy_(new.mask_hidden)
        graph.replay()
        eager = ops.prepare_draft_inputs(*static_args, **static_kw)
        torch.cuda.synchronize()
        for name in ROW_FIELDS + REQ_FIELDS:
            assert torch.equal(getattr(out, name), getattr(eager, name)), (trial, name)
        real = eager.is_masked | ~eager.is_rejected
        real[int(eager.query_start_loc[-1]) :] = False
        assert torch.equal(out.hidden_states[real], eager.hidden_states[real])


def test_public_names():
    assert peagle.PADDING_SLOT_ID == -1 and peagle.PLACEHOLDER_TOKEN_ID == -1
