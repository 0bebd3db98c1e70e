"""prepare_draft_inputs_workspace (DraftInputsWorkspace): the 16-argument form of the draft step.

It must compute exactly what the 29-argument op computes (compared against the pure-PyTorch
reference and against that op on the same random batches), keep its outputs in disjoint,
aligned slices of three typed buffers, and refuse a config/workspace that does not fit the call.
"""

from __future__ import annotations

import pytest
import torch
from conftest import capture_graph, poison_, requires_cuda
from reference.prepare_draft_inputs import prepare_draft_inputs_ref
from test_prepare_draft_inputs import REQ_FIELDS, ROW_FIELDS, assert_matches_ref, example1_inputs

from peagle import ops
from peagle.testing import make_batch

LAYOUT = torch.ops.peagle.prepare_draft_inputs_workspace_layout


def make_workspace(batch, device, num_out_rows=None) -> ops.DraftInputsWorkspace:
    args, kw = batch.positional(device), batch.kwargs(device)
    b = args[2].shape[0] - 1
    s = kw["num_padding_slots_per_request"]
    rows = num_out_rows or ops.num_draft_rows(args[0].shape[0], b, s, kw["shift_input_ids"])
    th = kw.get("target_hidden_states")
    return ops.DraftInputsWorkspace(
        b,
        rows,
        num_padding_slots_per_request=s,
        mask_token_id=kw["mask_token_id"],
        block_size=kw["block_size"],
        max_model_len=kw["max_model_len"],
        vocab_size=kw["vocab_size"],
        padding_token_id=kw.get("padding_token_id", 0),
        shift_input_ids=kw["shift_input_ids"],
        device=device,
        hidden_size=None if th is None else th.shape[1],
        hidden_dtype=None if th is None else th.dtype,
    )


def ref_of(batch, num_out_rows=None) -> dict:
    return prepare_draft_inputs_ref(
        *batch.positional(), **batch.kwargs(), num_out_rows=num_out_rows
    )


def poison_workspace(ws: ops.DraftInputsWorkspace) -> None:
    for t in (ws.workspace_i64, ws.workspace_i32, ws.workspace_bool, *ws.out):
        poison_(t)


def run_workspace(batch, device, num_out_rows=None):
    ws = make_workspace(batch, device, num_out_rows)
    poison_workspace(ws)
    args, kw = batch.positional(device), batch.kwargs(device)
    return ws(*args, kw.get("target_hidden_states"), kw.get("mask_hidden"))


@pytest.mark.parametrize("num_reqs", [0, 1, 3, 64])
@pytest.mark.parametrize("k", [1, 2, 7, 16])
@pytest.mark.parametrize("shift", [True, False])
def test_random_batches_match_reference(device, gen, num_reqs, k, shift):
    for _ in range(3):
        batch = make_batch(gen, num_reqs, k, shift=shift, hidden_size=24, max_model_len=150)
        t_out = ops.num_draft_rows(batch.target_token_ids.shape[0], num_reqs, k, shift)
        got = run_workspace(batch, device, num_out_rows=t_out + 5)
        assert_matches_ref(got, ref_of(batch, t_out + 5), check_tail_untouched_from=t_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_same_as_separate_outputs_op_with_padded_rows(device, gen, dtype):
    """Bit-identical to the 29-argument op, including the inert tail of a padded capacity."""
    from test_prepare_draft_inputs import run_op

    for num_reqs in (1, 5, 33):
        batch = make_batch(gen, num_reqs, 7, hidden_size=2880, dtype=dtype)
        rows = ops.num_draft_rows(batch.target_token_ids.shape[0], num_reqs, 7) + 13
        got = run_workspace(batch, device, num_out_rows=rows)
        want = run_op(batch, device, num_out_rows=rows)
        for name in ROW_FIELDS + REQ_FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        torch.testing.assert_close(
            got.hidden_states, want.hidden_states, rtol=0, atol=0, equal_nan=True
        )


def test_repeated_calls_overwrite_the_same_views(device, gen):
    def decode_batch():  # T_in = B*(K+1) for every batch, so one capacity fits all
        return make_batch(gen, 4, 3, hidden_size=16, prefill_frac=0.0, padding_frac=0.0)

    ws = make_workspace(decode_batch(), device)
    ptr = ws.workspace_i32.data_ptr()
    for _ in range(3):
        batch = decode_batch()
        kw = batch.kwargs(device)
        got = ws(*batch.positional(device), kw["target_hidden_states"], kw["mask_hidden"])
        assert got is ws.out and ws.workspace_i32.data_ptr() == ptr
        assert_matches_ref(got, ref_of(batch))


@pytest.mark.parametrize("num_reqs,k,rows", [(0, 1, 0), (1, 1, 2), (3, 7, 50), (257, 16, 9999)])
def test_layout_is_aligned_disjoint_and_covers_every_output(num_reqs, k, rows):
    lay = LAYOUT(num_reqs, k, rows)
    b = num_reqs
    buffers = {  # buffer -> (element size, numel, [(output, offset, numel)])
        "workspace_i64": (8, lay[2], [("positions", lay[0], rows), ("slot_mapping", lay[1], rows)]),
        "workspace_i32": (4, lay[9], [("input_ids", lay[3], rows),
                                      ("token_indices_to_sample", lay[4], b * k),
                                      ("query_start_loc", lay[5], b + 1), ("seq_lens", lay[6], b),
                                      ("next_token_ids", lay[7], b),
                                      ("valid_sampled_tokens_count", lay[8], b)]),
        "workspace_bool": (1, lay[12], [("is_rejected", lay[10], rows),
                                        ("is_masked", lay[11], rows)]),
    }  # fmt: skip
    ws = ops.DraftInputsWorkspace(
        num_reqs, rows, num_padding_slots_per_request=k, mask_token_id=1, block_size=16,
        max_model_len=100, vocab_size=10, device="cpu",
    )  # fmt: skip
    for buf, (esize, numel, outs) in buffers.items():
        base = getattr(ws, buf)
        assert base.numel() == numel and base.element_size() == esize
        spans = sorted((off, n) for _, off, n in outs)
        for (a, na), (c, _) in zip(spans, spans[1:], strict=False):
            assert a + na <= c, buf  # disjoint
        assert spans[-1][0] + spans[-1][1] <= numel
        for name, off, n in outs:
            assert off * esize % 16 == 0, name
            t = getattr(ws.out, name)  # the wrapper's views are exactly these slices
            assert t.numel() == n and t.dtype == base.dtype, name
            if n:
                assert t.data_ptr() - base.data_ptr() == off * esize, name


def example_workspace(**over):
    args, kw, _, _ = example1_inputs()
    params = dict(num_padding_slots_per_request=3, mask_token_id=kw["mask_token_id"],
                  block_size=16, max_model_len=10**6, vocab_size=1000, device="cpu",
                  hidden_size=6, hidden_dtype=torch.float32)  # fmt: skip
    b = params.pop("num_reqs", 2)
    rows = over.pop("num_out_rows", 12)
    params.update(over)
    return args, kw, ops.DraftInputsWorkspace(over.pop("num_reqs", b), rows, **params)


def test_example1_matches_separate_outputs_op():
    args, kw, ws = example_workspace()
    got = ws(*args, kw["target_hidden_states"], kw["mask_hidden"])
    want = ops.prepare_draft_inputs(*args, **kw)
    for name in ROW_FIELDS + REQ_FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    defined = ~want.is_rejected  # hidden rows of rejected rows are unspecified (SPEC §4)
    assert torch.equal(got.hidden_states[defined], want.hidden_states[defined])


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda ws: setattr(ws, "config", ws.config.int()), "config must be a contiguous CPU"),
        (lambda ws: setattr(ws, "config", ws.config[:5]), "config must be a contiguous CPU"),
        (lambda ws: ws.config.__setitem__(3, 2), "shift_input_ids.*must be 0 or 1"),
        (lambda ws: ws.config.__setitem__(8, 3), "laid out for B=3 requests but .* B=2"),
        (lambda ws: ws.config.__setitem__(1, 5000), "mask_token_id 5000 is outside"),
        (lambda ws: ws.config.__setitem__(7, 11), "at least T_in \\+ B\\*N = 8 \\+ 2\\*2 = 12"),
        (lambda ws: setattr(ws, "workspace_i32", ws.workspace_i32[:10]),
         "workspace_i32 needs \\d+ elements for B=2, S=3, 12 rows, got 10"),
        (lambda ws: setattr(ws, "workspace_i64", torch.empty(99, dtype=torch.int64)[1:]),
         "workspace_i64 must be 16-byte aligned"),
        (lambda ws: setattr(ws, "workspace_bool", ws.workspace_bool.view(torch.uint8)),
         "workspace_bool must have dtype Bool"),
        (lambda ws: setattr(ws, "workspace_i64", ws.workspace_i64.view(-1, 2)),
         "workspace_i64 must be 1-D"),
    ],
)  # fmt: skip
def test_bad_config_or_workspace(mutate, match):
    args, kw, ws = example_workspace()
    mutate(ws)
    with pytest.raises(RuntimeError, match=match):
        ws(*args, kw["target_hidden_states"], kw["mask_hidden"])


def test_hidden_part_must_match_the_workspace():
    args, kw, ws = example_workspace(hidden_size=None, hidden_dtype=None)
    with pytest.raises(RuntimeError, match="must be given together"):
        ws(*args, kw["target_hidden_states"], kw["mask_hidden"])


def test_opcheck():
    args, kw, ws = example_workspace()
    full = [*args, kw["target_hidden_states"], kw["mask_hidden"], ws.config, ws.workspace_i64,
            ws.workspace_i32, ws.workspace_bool, ws.out.hidden_states]  # fmt: skip
    torch.library.opcheck(torch.ops.peagle.prepare_draft_inputs_workspace.default, full)


def test_torch_compile_fullgraph():
    # Hidden rows that are neither scattered nor masked keep whatever the buffer held (SPEC §4:
    # unspecified, never compared). Comparing them made this test flaky: torch.empty memory can
    # hold NaN, and NaN != NaN. The buffer is poisoned (NaN) so that comparing them always fails.
    args, kw, ws = example_workspace()
    poison_workspace(ws)

    def step(*a):
        out = ws(*a, kw["target_hidden_states"], kw["mask_hidden"])
        return out.input_ids + 1, out.slot_mapping.clone(), out.hidden_states.clone()

    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    for e, c in zip(eager[:2], compiled[:2], strict=True):
        assert torch.equal(e, c)
    defined = ~ws.out.is_rejected
    assert 0 < int(defined.sum()) < defined.numel()
    assert torch.equal(eager[2][defined], compiled[2][defined])


@requires_cuda
def test_cuda_graph_replay_matches_eager(gen):
    """Capture once; replay with new contents (accepted counts, positions, block tables)."""
    k, b, h, width = 7, 24, 512, 40

    def decode_batch():
        return make_batch(gen, b, k, hidden_size=h, dtype=torch.bfloat16, prefill_frac=0.0,
                          padding_frac=0.0)  # fmt: skip

    def block_table(batch):  # fixed width: columns a request never uses hold garbage
        bt = torch.full((b, width), -7, dtype=torch.int32)
        bt[:, : batch.block_table.shape[1]] = batch.block_table
        return bt

    batch = decode_batch()
    static = batch.positional("cuda")
    static[8] = block_table(batch).cuda()
    kw = batch.kwargs("cuda")
    ws = make_workspace(batch, "cuda")
    graph = capture_graph(lambda: ws(*static, kw["target_hidden_states"], kw["mask_hidden"]))
    for _ in range(4):
        new = decode_batch()
        src = new.positional("cpu")
        src[8] = block_table(new)
        for dst, s in zip(static, src, strict=True):
            dst.copy_(s)
        kw["target_hidden_states"].copy_(new.target_hidden_states)
        kw["mask_hidden"].copy_(new.mask_hidden)
        poison_workspace(ws)
        graph.replay()
        torch.cuda.synchronize()
        new.block_table = src[8]
        assert_matches_ref(ws.out, ref_of(new))
