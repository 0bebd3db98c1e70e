"""The vLLM adapter's chain verification against real vLLM (0.28 / 0.33; CPU, Triton interpreter).

vLLM's ``rejection_sample`` (its Triton kernels under ``TRITON_INTERPRET=1``) and the adapter's
replacement run on the same inputs from the same random state (global seed and per-request
generators re-seeded alike), so they consume the same uniforms and exponentials; their outputs
must be identical. Skipped without vLLM (see tests/vllm_env.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
from vllm_env import Spy, load_vllm, make_vllm_config, sampling_metadata, write_configs

import peagle
import peagle.vllm
from peagle.vllm import _settings as st
from peagle.vllm import sampler as adapter_sampler

v = load_vllm()
rs = v.rejection_sampler
PH = -1  # PLACEHOLDER_TOKEN_ID


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("vllm_models"))


@pytest.fixture(autouse=True)
def adapter(monkeypatch):
    monkeypatch.delenv(st.ENV_SWITCH, raising=False)
    st.forget_messages()
    assert peagle.vllm.enable()
    yield
    peagle.vllm.disable()


def vllm_rejection_sample(*args, **kwargs):
    """vLLM's own function (the adapter wraps it; ``__wrapped__`` is the original)."""
    return rs.rejection_sample.__wrapped__(*args, **kwargs)


def spec_inputs(drafts: list[list[int]], device="cpu"):
    """``draft_token_ids [T]``, ``num_draft_tokens``, ``cu_num_draft_tokens [B]`` (int32)."""
    flat = [x for d in drafts for x in d]
    n = [len(d) for d in drafts]
    cu = torch.tensor(n, dtype=torch.int32).cumsum(0).to(torch.int32)
    return torch.tensor(flat, dtype=torch.int32), n, cu


def run_both(drafts, target_logits, bonus, md_factory, draft_probs=None, seed=0):
    """(vLLM's output, the adapter's output) from the same random state."""
    ids, n, cu = spec_inputs(drafts)
    outs = []
    for fn in (vllm_rejection_sample, adapter_sampler.rejection_sample):
        torch.manual_seed(seed)
        md = md_factory()  # fresh generators, same seeds
        outs.append(fn(ids, n, max(n), cu, draft_probs, target_logits.clone(), bonus, md))
    return outs


# --------------------------------------------------------------------------------------------
# vLLM's greedy unit-test examples (tests/v1/sample/test_rejection_sampler.py), re-derived
# --------------------------------------------------------------------------------------------

GREEDY_EXAMPLES = [  # drafts, target argmax per draft, bonus, expected output
    ([[1, 2, 3]], [[1, 2, 3]], [4], [[1, 2, 3, 4]]),  # perfect match
    ([[1, 2, 3]], [[1, 5, 3]], [4], [[1, 5, PH, PH]]),  # early mismatch
    ([[1, 2], [3]], [[1, 2], [3]], [5, 4], [[1, 2, 5], [3, 4, PH]]),  # ragged batch
    ([[1]], [[1]], [2], [[1, 2]]),  # single draft
    ([[]], [[]], [5], [[5]]),  # no drafts: the bonus token only
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8, 6]], [6, 9], [[1, 2, 7, PH], [4, 8, PH, PH]]),
    ([[1]], [[2]], [3], [[2, PH]]),  # first mismatch
    ([[1, 2], [3, 4]], [[1, 5], [3, 4]], [6, 7], [[1, 5, PH], [3, 4, 7]]),
]


@pytest.mark.parametrize("drafts,argmax,bonus,expected", GREEDY_EXAMPLES)
def test_vllm_greedy_examples(drafts, argmax, bonus, expected):
    rows = [a for req in argmax for a in req]
    logits = torch.full((len(rows), 100), -100.0)
    logits[torch.arange(len(rows)), torch.tensor(rows, dtype=torch.long)] = 100.0
    bonus_t = torch.tensor(bonus, dtype=torch.int32).view(-1, 1)
    ref, ours = run_both(drafts, logits, bonus_t, lambda: sampling_metadata(v, None))
    exp = torch.tensor(expected, dtype=torch.int32)
    assert torch.equal(ref, exp) and torch.equal(ours, exp)


# --------------------------------------------------------------------------------------------
# Random batches: greedy, random, mixed; argmax and probabilistic drafts; seeded requests
# --------------------------------------------------------------------------------------------


def random_case(seed, b, k, vocab, mode, with_q, scale=4.0, all_k=False):
    """Ragged drafts (0..K per request) with every acceptance pattern likely to occur.

    Target logits are peaked (``scale``); greedy requests accept a random prefix of argmax drafts
    then mismatch; random requests draft from the target itself or from noise, so both
    accepted and rejected positions occur. Sometimes a draft is -1 (vLLM's padded draft).
    """
    g = torch.Generator().manual_seed(seed)
    n = [int(torch.randint(0, k + 1, (1,), generator=g)) for _ in range(b)]
    n = [k] * b if all_k else n
    n[0] = k
    t = sum(n)
    logits = torch.randn(t, vocab, generator=g) * scale
    if mode == "greedy":
        temperature = None
    elif mode == "random":
        temperature = torch.rand(b, generator=g) + 0.5
    else:
        temperature = torch.where(torch.arange(b) % 2 == 0, 0.0, torch.rand(b, generator=g) + 0.5)
    greedy = [temperature is None or float(temperature[r]) == 0 for r in range(b)]
    q = torch.softmax(torch.randn(t, vocab, generator=g) * 2, -1) if with_q else None
    drafts, row = [], 0
    for r in range(b):
        keep = int(torch.randint(0, n[r] + 1, (1,), generator=g))
        d = []
        for j in range(n[r]):
            if greedy[r]:
                x = int(logits[row].argmax())
                if j >= keep:
                    x = (x + 1 + int(torch.randint(0, vocab - 1, (1,), generator=g))) % vocab
            elif with_q:
                x = int(torch.multinomial(q[row], 1, generator=g))
            elif torch.rand(1, generator=g) < 0.7:
                x = int(torch.multinomial(torch.softmax(logits[row], -1), 1, generator=g))
            else:
                x = int(torch.randint(0, vocab, (1,), generator=g))
            if torch.rand(1, generator=g) < 0.05:
                x = -1
            d.append(x)
            row += 1
        drafts.append(d)
    bonus = torch.randint(0, vocab, (b, 1), generator=g, dtype=torch.int32)
    seeded = [r for r in range(b) if torch.rand(1, generator=g) < 0.5]
    return drafts, logits, bonus, temperature, seeded, q


def processed_logits(logits, temperature, n):
    """What vLLM hands rejection_sample: fp32 logits / temperature (greedy rows unscaled)."""
    if temperature is None:
        return logits
    t = torch.repeat_interleave(torch.where(temperature == 0, 1.0, temperature), torch.tensor(n))
    return logits / t[:, None]


CASES = [  # seed, B, K, V, mode, probabilistic drafts
    (1, 3, 3, 64, "greedy", False),
    (2, 5, 4, 257, "greedy", False),
    (3, 4, 3, 100, "random", False),
    (4, 6, 5, 1000, "random", False),
    (5, 5, 2, 333, "mixed", False),
    (6, 4, 4, 128, "random", True),
    (7, 6, 3, 500, "mixed", True),
    (8, 3, 7, 8193, "random", False),  # one full 8192-wide tile + a 1-token tail (GHSA guard)
]


@pytest.mark.parametrize("seed,b,k,vocab,mode,with_q", CASES)
def test_rejection_sample_matches_vllm(seed, b, k, vocab, mode, with_q):
    drafts, logits, bonus, temperature, seeded, q = random_case(seed, b, k, vocab, mode, with_q)
    target = processed_logits(logits, temperature, [len(d) for d in drafts])

    def md():
        gens = {r: torch.Generator().manual_seed(1000 + r) for r in seeded}
        return sampling_metadata(v, temperature, gens)

    ref, ours = run_both(drafts, target, bonus, md, draft_probs=q, seed=seed)
    assert torch.equal(ours, ref), (drafts, ours, ref)
    # Not vacuous: some requests stop early, some keep every draft and emit the bonus.
    emitted = (ref != PH).sum(1)
    n = torch.tensor([len(d) for d in drafts])
    assert ((emitted < n + 1) & (n > 0)).any() or mode == "greedy" and b < 4


def test_rejection_sample_covers_every_accept_count():
    """Across the random cases, every accepted count 0..K occurs for K = 4 (greedy and random)."""
    seen = {"greedy": set(), "random": set()}
    for seed in range(20, 24):
        for mode in seen:
            drafts, logits, bonus, temperature, seeded, _ = random_case(
                seed, 8, 4, 64, mode, False, scale=8.0, all_k=True
            )
            target = processed_logits(logits, temperature, [len(d) for d in drafts])
            md = lambda: sampling_metadata(v, temperature)  # noqa: E731, B023
            ref, ours = run_both(drafts, target, bonus, md, seed=seed)
            assert torch.equal(ours, ref)
            for r, d in enumerate(drafts):
                if len(d) == 4:
                    seen[mode].add(int((ref[r] != PH).sum()) - 1)
    assert seen["greedy"] == set(range(5)) and seen["random"] == set(range(5)), seen


def test_seeded_request_is_independent_of_batch():
    """vLLM's determinism rule: a seeded request's tokens depend on its seed only."""
    drafts, logits, bonus, temperature, _, _ = random_case(31, 4, 3, 97, "random", False)
    target = processed_logits(logits, temperature, [len(d) for d in drafts])
    outs = []
    for seed in (1, 2):
        gens = {0: torch.Generator().manual_seed(77)}
        ids, n, cu = spec_inputs(drafts)
        torch.manual_seed(seed)
        md = sampling_metadata(v, temperature, gens)
        outs.append(adapter_sampler.rejection_sample(ids, n, max(n), cu, None, target, bonus, md))
    assert torch.equal(outs[0][0], outs[1][0])


def test_all_zero_residual_is_a_documented_difference():
    """Draft rejected because q(x) = 0 with p = q: the residual max(p - q, 0) is all zero; vLLM's
    kernel then returns token 0, peagle the first argmax of p (SPEC §6.4). One finite logit
    makes p exactly one-hot in both, so no rounding is involved."""
    vocab = 50
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, 9] = 0.0
    q = torch.zeros(1, vocab)
    q[0, 9] = 1.0
    ids, n, cu = spec_inputs([[3]])  # q(3) = 0: rejected by both
    bonus = torch.tensor([[1]], dtype=torch.int32)
    out = []
    for fn in (vllm_rejection_sample, adapter_sampler.rejection_sample):
        torch.manual_seed(0)
        out.append(fn(ids, n, 1, cu, q, logits.clone(), bonus, sampling_metadata(v, torch.ones(1))))
    assert out[0].tolist() == [[0, PH]] and out[1].tolist() == [[9, PH]]


# --------------------------------------------------------------------------------------------
# A patched RejectionSampler (full forward, vLLM's own bonus sampler) == an unpatched one
# --------------------------------------------------------------------------------------------


def build_sampler(dirs, monkeypatch, *, active: bool, **cfg):
    monkeypatch.setenv(st.ENV_SWITCH, "1" if active else "0")
    vc = make_vllm_config(v, dirs, **cfg)
    s = rs.RejectionSampler(v.Sampler(), vc.speculative_config, torch.device("cpu"))
    monkeypatch.delenv(st.ENV_SWITCH)
    assert s._peagle_active == active
    return s


def spec_decode_metadata(drafts):
    md = v.SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    n = [len(d) for d in drafts]
    target_rows, bonus_rows, row = [], [], 0
    for nr in n:
        target_rows += list(range(row, row + nr))
        bonus_rows.append(row + nr)
        row += nr + 1
    md.target_logits_indices = torch.tensor(target_rows, dtype=torch.int32)
    md.bonus_logits_indices = torch.tensor(bonus_rows, dtype=torch.int32)
    return md


@pytest.mark.parametrize("seed,mode,top", [(41, "mixed", False), (42, "random", True),
                                           (43, "greedy", False)])  # fmt: skip
def test_patched_sampler_matches_vllm(dirs, monkeypatch, seed, mode, top):
    drafts, logits, _, temperature, seeded, _ = random_case(seed, 5, 3, 300, mode, False)
    b = len(drafts)
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(sum(len(d) for d in drafts) + b, 300, generator=g) * 3
    md_spec = spec_decode_metadata(drafts)
    full[md_spec.target_logits_indices.long()] = logits
    if top:  # vLLM's Triton top-k/top-p asks the platform for its SM count: use its torch path
        from vllm.v1.sample.ops import topk_topp_sampler

        monkeypatch.setattr(topk_topp_sampler, "HAS_TRITON", False)
    top_k = torch.tensor([300, 5, 50, 300, 7][:b], dtype=torch.int32) if top else None
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.99, 1.0][:b]) if top else None
    outs, calls = [], []
    for active in (True, False):
        s = build_sampler(dirs, monkeypatch, active=active, k=3)
        gens = {r: torch.Generator().manual_seed(500 + r) for r in seeded}
        md = sampling_metadata(v, temperature, gens, top_k=top_k, top_p=top_p)
        with monkeypatch.context() as m:
            spies = {"verify_chain": Spy(peagle.ops.verify_chain)}
            m.setattr(peagle.ops, "verify_chain", spies["verify_chain"])
            for name in v.verify_launchers:  # 0.28-0.29's Triton kernels / 0.30+'s dispatchers
                spies[name] = Spy(getattr(rs, name))
                m.setattr(rs, name, spies[name])
            torch.manual_seed(seed)
            outs.append(s(spec_decode_metadata(drafts), None, full.clone(), md).sampled_token_ids)
        calls.append({k: sp.calls for k, sp in spies.items()})
    assert torch.equal(outs[0], outs[1]), outs
    assert calls[0]["verify_chain"] == 1 and sum(calls[0].values()) == 1
    assert calls[1]["verify_chain"] == 0 and sum(calls[1].values()) >= 1


def test_sampler_activation_and_fallbacks(dirs, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="vllm.peagle"):
        build_sampler(dirs, monkeypatch, active=True, k=3)
        build_sampler(dirs, monkeypatch, active=True, k=3)
    active = [r.getMessage() for r in caplog.records if "adapter active" in r.getMessage()]
    assert len(active) == 1 and "verify_chain" in active[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.peagle"):
        for _ in range(2):  # synthetic acceptance: vLLM's code, one warning
            vc = make_vllm_config(v, dirs, k=3, rejection_sample_method="synthetic",
                                  synthetic_acceptance_rates=[0.9, 0.5, 0.2])  # fmt: skip
            s = rs.RejectionSampler(v.Sampler(), vc.speculative_config, torch.device("cpu"))
            assert not s._peagle_active
        s = rs.RejectionSampler(v.Sampler(use_fp64_gumbel=True), make_vllm_config(
            v, dirs, k=3).speculative_config, torch.device("cpu"))  # fmt: skip
        assert not s._peagle_active
        vc = make_vllm_config(v, dirs, k=3, parallel=False)  # not P-EAGLE: quietly vLLM's
        assert not rs.RejectionSampler(v.Sampler(), vc.speculative_config)._peagle_active
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 2, warns
    assert "synthetic" in warns[0] and "use_fp64_gumbel" in warns[1]


def test_other_methods_fall_through_to_vllm(monkeypatch):
    """Inside an active sampler's forward, the stand-in runs verify_chain only for the standard
    method: synthetic acceptance and (0.33) FLy calls reach vLLM's own function and give its
    result; a standard call with every newer argument at its default runs verify_chain."""
    import inspect

    import peagle.vllm._patch as patch

    drafts, logits, bonus, temperature, _, _ = random_case(51, 3, 3, 64, "greedy", False)
    ids, n, cu = spec_inputs(drafts)
    md = sampling_metadata(v, temperature)
    params = inspect.signature(rs.rejection_sample.__wrapped__).parameters
    cases = [{}, dict(synthetic_mode=True,
                      synthetic_conditional_rates=torch.tensor([0.9, 0.5, 0.2]))]  # fmt: skip
    if "fly_window_size" in params:  # 0.33's lossy FLy verification
        cases.append(dict(fly_window_size=2, fly_entropy_threshold=0.3))
    calls = []
    for extra in cases:
        with monkeypatch.context() as m:
            spy = Spy(adapter_sampler.rejection_sample)
            m.setattr(adapter_sampler, "rejection_sample", spy)
            token = adapter_sampler.sampler_active().set(True)
            try:
                torch.manual_seed(0)
                ours = rs.rejection_sample(ids, n, max(n), cu, None, logits.clone(), bonus, md,
                                           **extra)  # fmt: skip
            finally:
                adapter_sampler.sampler_active().reset(token)
        torch.manual_seed(0)
        ref = vllm_rejection_sample(ids, n, max(n), cu, None, logits.clone(), bonus, md, **extra)
        assert torch.equal(ours, ref), extra
        calls.append(spy.calls)
    assert calls[0] == 1 and all(c == 0 for c in calls[1:]), calls
    assert len(calls) == (3 if "fly_window_size" in params else 2)
    assert patch._is_stand_in(rs.rejection_sample)
