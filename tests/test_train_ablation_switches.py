"""The training switches recipe v3's ablation compares (issue 19): a cap on chain starts per
sequence (``max_anchors``), prompt tokens excluded from the loss, ``norm_before_residual``, a
frozen ``lm_head``; and the batched target forward that serves packed sequences. Each switch must
change what it claims to, and nothing when off."""

from __future__ import annotations

import json

import pytest
import torch
from train_cli_helpers import make_tiny_train_target
from train_helpers import tiny_drafter, tiny_sequence, tiny_target

from peagle.cli import main as peagle_main
from peagle.train.attention import MaskedAttention
from peagle.train.cod import cod_sample
from peagle.train.steps import peagle_sequence_step
from peagle.train.target_features import (
    prompt_loss_mask,
    target_forward,
    target_forward_batch,
)


def _doc_ids(lengths):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


@pytest.mark.parametrize("cap", [0, 1, 3, 10])
def test_max_anchors_caps_chain_starts_per_document(cap):
    lengths = [40, 25, 60]
    n, doc = sum(lengths), _doc_ids(lengths)
    gen = torch.Generator().manual_seed(0)
    el = cod_sample(n, 8, 0.9, 0.3, doc_ids=doc, generator=gen, max_anchors=cap)
    d0 = el.depths == 0
    assert int(d0.sum()) == n  # depth 0 keeps every position
    deep = ~d0
    for i in range(len(lengths)):
        starts = el.anchors[deep & (doc[el.anchors] == i)].unique()
        assert starts.numel() <= cap
    if cap == 0:
        assert not bool(deep.any())
    # every deeper element keeps its chain predecessor
    have = set(zip(el.anchors.tolist(), el.depths.tolist(), strict=True))
    for a, d in have:
        assert d == 0 or (a, d - 1) in have


def test_max_anchors_moves_the_loss_to_depth_0_and_none_is_the_old_sampler():
    n = 300
    free = cod_sample(n, 10, 0.7, 0.2, generator=torch.Generator().manual_seed(5))
    same = cod_sample(n, 10, 0.7, 0.2, generator=torch.Generator().manual_seed(5), max_anchors=None)
    assert torch.equal(free.anchors, same.anchors) and torch.equal(free.depths, same.depths)
    capped = cod_sample(n, 10, 0.7, 0.2, generator=torch.Generator().manual_seed(5), max_anchors=8)
    share = [float((e.depths == 0).sum()) / len(e) for e in (free, capped)]
    assert share[0] < 0.35 and share[1] > 0.9, share  # ~27 % uncapped at K=10
    assert capped.anchors[capped.depths > 0].unique().numel() <= 8


def test_prompt_loss_mask_supervises_only_predictions_of_generated_tokens():
    m = prompt_loss_mask(10, 4)
    # label at token j predicts token j+1: supervised iff j+1 >= 4
    assert m.tolist() == [False, False, False, True, True, True, True, True, True, True]
    assert bool(prompt_loss_mask(5, 0).all()) and bool(prompt_loss_mask(5, 1).all())


def test_prompt_exclusion_zeroes_the_prompt_positions_loss_weight():
    """With the prompt mask, the gradient does not depend on the target distributions at
    positions that predict prompt tokens (their loss weight is 0), and does without it."""
    target = tiny_target(3)
    drafter = tiny_drafter(target, parallel=True, layers=2)
    length, prompt = 30, 12
    lm = prompt_loss_mask(length, prompt)
    seq = tiny_sequence(target, drafter, length, seed=4, loss_mask=lm)
    assert seq.loss_mask.tolist() == [t + 2 >= prompt for t in range(seq.n)]
    elems = cod_sample(
        seq.n, 4, 0.8, 0.3, loss_mask=seq.loss_mask, generator=torch.Generator().manual_seed(1)
    )
    sup = seq.loss_mask[elems.anchors + elems.depths]
    assert not bool(sup[(elems.anchors + elems.depths + 2) < prompt].any())

    def grads(s):
        drafter.zero_grad()
        peagle_sequence_step(drafter, s, elems, attention=MaskedAttention("dense"))
        return {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}

    base = grads(seq)
    # scramble the labels of the prompt positions: nothing changes
    noisy = tiny_sequence(target, drafter, length, seed=4, loss_mask=lm)
    rows = torch.arange(seq.n) + 2 < prompt
    noisy.target_logits[rows] = torch.randn_like(noisy.target_logits[rows]) * 5
    for k, g in grads(noisy).items():
        torch.testing.assert_close(g, base[k], rtol=0, atol=0, msg=k)
    # without the mask the same scramble changes the gradient
    full = tiny_sequence(target, drafter, length, seed=4)
    full_noisy = tiny_sequence(target, drafter, length, seed=4)
    full_noisy.target_logits[rows] = noisy.target_logits[rows]
    g0, g1 = grads(full), grads(full_noisy)
    assert any(not torch.equal(g0[k], g1[k]) for k in g0)


def test_batched_target_forward_equals_per_sequence_forwards():
    target = tiny_target(2)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 50, (n,), generator=gen) for n in (9, 12, 9, 5, 12)]
    ids = [1, 2, 3]
    for s, (aux, logits) in zip(seqs, target_forward_batch(target, seqs, ids), strict=True):
        ref_aux, ref_logits = target_forward(target, s, ids)
        torch.testing.assert_close(aux, ref_aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("switches")
    target, _, tok = make_tiny_train_target(root)
    # pretokenised "regenerated" sequences with a prompt length field
    gen = torch.Generator().manual_seed(0)
    data = root / "regen.jsonl"
    with open(data, "w") as f:
        for _ in range(6):
            ids = torch.randint(2, len(tok), (36,), generator=gen).tolist()
            f.write(json.dumps({"input_ids": ids, "prompt_len": 12}) + "\n")
    return root, target, data


def _train(target, data, out, *extra):
    return peagle_main(
        [
            "train", "--target", str(target), "--data", str(data), "--jsonl-field", "input_ids",
            "--output", str(out), "--device", "cpu", "--seq-len", "40", "--no-progress",
            "--log-every", "1", "--num-layers", "2", "--warmup-steps", "1", "--steps", "3",
            "-k", "3", "--lr", "1e-2", *extra,
        ]
    )  # fmt: skip


def _state(out):
    return torch.load(out / "train_state.pt", weights_only=False)


def test_cli_switches_reach_the_training_run(tiny):
    root, target, data = tiny
    out = root / "all"
    assert (
        _train(
            target, data, out, "--max-anchors", "2", "--prompt-len-field", "prompt_len",
            "--norm-before-residual", "--freeze-lm-head",
        )
        == 0
    )  # fmt: skip
    st = _state(out)
    tc = st["train_config"]
    assert tc["max_anchors"] == 2 and tc["prompt_len_field"] == "prompt_len"
    assert tc["freeze_lm_head"] and tc["norm_before_residual"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["norm_before_residual"] is True
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    # 1 sequence per step, at most 2 chains: depth 0 carries most elements
    for rec in log:
        n = rec["elements_per_depth"]
        assert n[0] >= 12 and sum(n[1:]) <= 2 * 2, n
        assert abs(sum(rec["loss_share_per_depth"]) - 1) < 1e-6
    # the prompt's labels are not supervised: 36 tokens -> 35 positions, 12-token prompt
    # excludes positions t with t + 2 < 12 (10 of them)
    assert log[0]["elements_per_depth"][0] == 35 - 10


def test_frozen_lm_head_stays_the_targets_rows_and_the_rest_trains(tiny):
    from transformers import AutoModelForCausalLM

    from peagle.train.init import drafter_config_for_target, init_drafter

    root, target, data = tiny
    t = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    head = t.get_output_embeddings().weight.detach()
    cfg = drafter_config_for_target(t.config, num_layers=2, mask_token_id=1)
    init = init_drafter(cfg, t, parallel=True, seed=0).state_dict()
    assert torch.equal(init["lm_head.weight"], head)  # the initial lm_head is the target's
    for flag, out in (("--freeze-lm-head", root / "frozen"), (None, root / "trained")):
        assert _train(target, data, out, *([flag] if flag else [])) == 0
        m = _state(out)["model"]
        assert torch.equal(m["lm_head.weight"], head) == (flag is not None), flag
        assert not torch.equal(m["fc.weight"], init["fc.weight"])  # the rest trains
        assert not torch.equal(
            m["midlayer.mlp.down_proj.weight"], init["midlayer.mlp.down_proj.weight"]
        )
    # a resume must keep the setting (the optimizer holds no lm_head state when frozen)
    assert _train(target, data, root / "frozen", "--steps", "4") == 2


def test_norm_before_residual_changes_the_forward():
    target = tiny_target(1)
    a = tiny_drafter(target, parallel=True, layers=2)
    b = tiny_drafter(target, parallel=True, layers=2)
    b.config.norm_before_residual = True
    for layer in b.decoder_layers():
        layer.norm_before_residual = True
    ids = torch.randint(0, 50, (7,))
    hidden = torch.randn(7, a.config.hidden_size, dtype=torch.float64) * 3
    pos = torch.arange(7)

    def causal(i, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
            v.repeat_interleave(2, 1).transpose(0, 1), is_causal=True,
        ).transpose(0, 1)  # fmt: skip

    out_a = a(ids, hidden, positions=pos, attend=causal)[0]
    out_b = b(ids, hidden, positions=pos, attend=causal)[0]
    assert not torch.allclose(out_a, out_b)
