"""Synthetic acceptance (peagle.decode.synthetic): drawn accept/reject decisions, every kernel run.

The decisions are checked directly on ``SyntheticAcceptance.apply`` (many draws, fast) and through
the decode loop with the tiny clear-margin models: all rates 0 emits exactly one token per step
(the target's own greedy token, so the outputs are the greedy reference), all rates 1 emits K+1,
a seed fixes the run, and without the switch nothing changes.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_decode import PROMPTS, engine, hf_greedy
from tiny_models import VOCAB, make_target

from peagle.decode import SamplingParams
from peagle.decode.synthetic import SyntheticAcceptance, uniforms
from peagle.models import TargetRunner

N = 20


@pytest.fixture(scope="module")
def llama():
    model, g = make_target("llama")
    return model, g, TargetRunner(model)


@pytest.fixture(scope="module")
def refs(llama):
    return [hf_greedy(llama[0], p, N) for p in PROMPTS]


def _chain_counts(rates, k, b=64, steps=400, seed=3):
    """Attempts and acceptances per position of ``apply`` over ``steps`` steps of ``b`` requests
    that each advance by their emitted tokens (like the decode loop)."""
    syn = SyntheticAcceptance(rates, seed=seed)
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 1000, (b,), generator=gen)
    keys = torch.arange(b, dtype=torch.int64) * 7 + 100
    cu = torch.arange(1, b + 1, dtype=torch.int32) * k
    tried, accepted = [0] * k, [0] * k
    for _ in range(steps):
        logits = torch.randn(b * (k + 1), VOCAB, generator=gen)
        drafts = torch.randint(0, VOCAB, (b * k,), generator=gen, dtype=torch.int32)
        dpos = (pos[:, None] + 1 + torch.arange(k)[None, :]).reshape(-1)
        out0 = torch.full((b, k + 1), -1, dtype=torch.int32)
        acc0 = torch.zeros(b, dtype=torch.int32)
        out, acc = syn.apply(logits, drafts, dpos, cu, keys, None, out0, acc0)
        for a in acc.tolist():
            for j in range(min(a + 1, k)):
                tried[j] += 1
                accepted[j] += int(j < a)
        # the emitted row: accepted drafts, then the target's argmax at row a
        rows = logits.view(b, k + 1, VOCAB).argmax(-1)
        for i, a in enumerate(acc.tolist()):
            assert out[i, :a].tolist() == drafts.view(b, k)[i, :a].tolist()
            assert int(out[i, a]) == int(rows[i, a])
            assert (out[i, a + 1 :] == -1).all()
        pos = pos + acc.to(torch.int64) + 1
    return tried, accepted


def test_synthetic_conditional_rates_converge():
    rates = [0.9, 0.6, 0.35, 0.8, 0.5]
    tried, accepted = _chain_counts(rates, k=5)
    for r, n, a in zip(rates, tried, accepted, strict=True):
        assert n > 300
        sigma = math.sqrt(r * (1 - r) / n)
        assert abs(a / n - r) < 4.5 * sigma + 1e-9, (r, a / n, n)


def test_synthetic_uniforms_are_uniform_and_keyed():
    keys = torch.arange(200_000, dtype=torch.int64) % 997
    pos = torch.arange(200_000, dtype=torch.int64) // 997
    u = uniforms(5, keys, pos)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    hist = torch.histc(u, bins=20, min=0.0, max=1.0) / u.numel()
    assert (hist - 0.05).abs().max() < 0.003
    assert torch.equal(u, uniforms(5, keys, pos))
    assert not torch.equal(u, uniforms(6, keys, pos))
    # one draw per (key, position): neighbouring keys are not correlated
    a, b = uniforms(5, keys[:-1], pos[:-1]), uniforms(5, keys[:-1] + 1, pos[:-1])
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.01


def test_synthetic_rates_validated_and_extended():
    syn = SyntheticAcceptance([0.5, 0.25])
    assert syn.rates_for(4) == [0.5, 0.25, 0.25, 0.25]
    assert syn.expected_acceptance_length(2) == pytest.approx(1 + 0.5 + 0.125)
    with pytest.raises(ValueError):
        SyntheticAcceptance([1.2])
    with pytest.raises(ValueError):
        SyntheticAcceptance([])


@pytest.mark.parametrize("method,k", [("peagle", 3), ("eagle3", 2)])
def test_synthetic_all_rates_zero_emit_one_token_per_step(llama, refs, method, k):
    model, g, runner = llama
    eng = engine(runner, model, g, method, k, synthetic_acceptance=SyntheticAcceptance([0.0]))
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=N))
    for out, ref in zip(outs, refs, strict=True):
        assert out.stats.num_steps == N  # one token per step, prefill included
        assert out.stats.num_accepted_tokens == 0 and out.stats.num_draft_tokens > 0
        assert out.token_ids == ref  # every emitted token is the target's own greedy token


@pytest.mark.parametrize("method,k,graphs", [("peagle", 3, "off"), ("peagle", 4, "emulate"),
                                             ("eagle3", 2, "off")])  # fmt: skip
def test_synthetic_all_rates_one_emit_k_plus_one(llama, method, k, graphs):
    model, g, runner = llama
    n = 1 + 4 * (k + 1)
    eng = engine(runner, model, g, method, k, synthetic_acceptance=SyntheticAcceptance([1.0]),
                 cuda_graphs=graphs, max_num_seqs=4)  # fmt: skip
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=n))
    for out in outs:
        st = out.stats
        assert st.num_steps == 5 and st.num_spec_steps == 4  # prefill, then 4 x (K drafts + bonus)
        assert st.acceptance_length == k + 1
        assert st.per_position_acceptance == [1.0] * k
        assert len(out.token_ids) == n


def test_synthetic_deterministic_for_a_seed(llama):
    """Same seed, same run, whatever the requests' own (random) sampling seeds; eager and the
    graph layout draw the same decisions (keyed on request id and position, not batch slot)."""
    model, g, runner = llama
    syn = lambda s: SyntheticAcceptance([0.8, 0.5, 0.3], seed=s)
    params = SamplingParams(max_new_tokens=N)

    def run(seed, **kw):
        eng = engine(runner, model, g, "peagle", 3, synthetic_acceptance=syn(seed), **kw)
        outs = eng.generate(PROMPTS, params)
        return [o.token_ids for o in outs], [o.stats.accepted_per_position for o in outs]

    a = run(1)
    assert run(1) == a
    assert run(1, cuda_graphs="emulate", max_num_seqs=4) == a
    assert run(2)[1] != a[1]


def test_synthetic_rates_converge_in_decode_loop(llama):
    model, g, runner = llama
    rates = [0.7, 0.5, 0.3]
    eng = engine(runner, model, g, "peagle", 3, max_num_seqs=8,
                 synthetic_acceptance=SyntheticAcceptance(rates, seed=11))  # fmt: skip
    prompts = [PROMPTS[i % 4] for i in range(8)]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=200, ignore_eos=True))
    acc = [sum(o.stats.accepted_per_position[j] for o in outs) for j in range(3)]
    tried = [sum(o.stats.num_spec_steps for o in outs)] + acc[:2]
    for r, a, n in zip(rates, acc, tried, strict=True):
        assert abs(a / n - r) < 4.5 * math.sqrt(r * (1 - r) / n) + 0.02, (r, a / n, n)


def test_synthetic_stats_carry_the_flag_and_default_is_off(llama, refs):
    model, g, runner = llama
    on = engine(runner, model, g, "peagle", 2, synthetic_acceptance=SyntheticAcceptance([0.5]))
    out = on.generate(PROMPTS[:1], SamplingParams(max_new_tokens=5))[0]
    assert out.stats.synthetic_acceptance and out.stats.to_dict()["synthetic_acceptance"] is True
    off = engine(runner, model, g, "peagle", 2)
    assert off.synthetic is None and off.verifier.synthetic is None
    outs = off.generate(PROMPTS, SamplingParams(max_new_tokens=N))
    assert [o.token_ids for o in outs] == refs
    assert all("synthetic_acceptance" not in o.stats.to_dict() for o in outs)
    assert SyntheticAcceptance([0.5], name="t").to_dict(3)["rates_used"] == [0.5] * 3
