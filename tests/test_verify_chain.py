"""Tests of ``peagle::verify_chain`` (SPEC.md §6, EDGE_CASES.md A and G).

The op is compared with the independent pure-PyTorch reference (tests/reference/verify_chain.py)
fed the same random draws, which tests/reference/philox.py regenerates from the documented
Philox counter layout. Decisions the reference marks as within float rounding of flipping
(``margin``) are the only ones allowed to differ. Distribution tests check the emitted tokens
against the target distribution with a chi-square test.
"""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest
import torch
from conftest import capture_graph, poison_, requires_cuda
from reference import philox as rph
from reference.verify_chain import kept_mask, scores, target_probs, verify_chain_reference

from peagle.ops import VerifyOutput, verify_chain

MARGIN_TOL = 1e-4  # decisions closer than this to flipping may differ from the fp64 reference


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


class Case(dict):
    """Inputs of one verify_chain call (CPU tensors) plus layout facts."""

    @property
    def b(self) -> int:
        return self["cu_num_draft_tokens"].shape[0]

    @property
    def vocab(self) -> int:
        return self["target_logits"].shape[1]


def layout(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_num_draft_tokens`` and the logits row of every draft (global draft index -> row)."""
    b = len(counts)
    cu = torch.tensor(np.cumsum(counts) if b else [], dtype=torch.int32)
    req = torch.repeat_interleave(torch.arange(b), torch.tensor(counts, dtype=torch.long))
    draft_rows = torch.arange(int(sum(counts))) + req
    return cu, draft_rows


def make_case(
    counts: list[int],
    vocab: int,
    gen: torch.Generator,
    *,
    temps: list[float] | float = 0.0,
    dtype: torch.dtype = torch.float32,
    scale: float = 2.0,
    p_follow: float = 0.7,
    draft_probs: bool = False,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    seed0: int = 1000,
) -> Case:
    """Random logits; drafts follow the row's argmax (greedy) or a sample of the draft distribution
    with probability ``p_follow`` (so chains are accepted to various depths), else a random id."""
    b, t = len(counts), int(sum(counts))
    cu, draft_rows = layout(counts)
    logits = (torch.randn(t + b, vocab, generator=gen) * scale).to(dtype)
    if isinstance(temps, (int, float)):
        temps = [float(temps)] * b
    q = None
    if draft_probs:
        # Draft distribution: the target's softmax perturbed, with a few exact zeros.
        base = logits[draft_rows].float() + torch.randn(t, vocab, generator=gen)
        base[torch.rand(t, vocab, generator=gen) < 0.1] = -math.inf
        base[:, 0] = 0.0  # at least one finite entry per row
        q = torch.softmax(base, dim=1)
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(1).to(torch.int32) if t else None
    else:
        drafts = logits[draft_rows].float().argmax(dim=1).to(torch.int32)
    if t:
        rand_ids = torch.randint(0, vocab, (t,), generator=gen, dtype=torch.int32)
        follow = torch.rand(t, generator=gen) < p_follow
        drafts = torch.where(follow, drafts, rand_ids)
    else:
        drafts = torch.zeros(0, dtype=torch.int32)
    case = Case(
        target_logits=logits,
        draft_token_ids=drafts,
        cu_num_draft_tokens=cu,
        temperature=torch.tensor(temps, dtype=torch.float32),
        seeds=torch.arange(seed0, seed0 + b, dtype=torch.int64) * 7919,
        offsets=torch.arange(b, dtype=torch.int64) * 3 + 11,
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        draft_probs=q,
        uniforms=None,
        request_mask=None,
        bonus_token_ids=None,
        exponentials=None,
    )
    case.counts = list(counts)
    return case


def philox_draws(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's Philox draws: acceptance uniforms [T], recovered and bonus sampling uniforms [B]."""
    us, u_rec, u_bonus = [], [], []
    for r in range(case.b):
        s, o = int(case["seeds"][r]), int(case["offsets"][r])
        us.append(rph.acceptance_uniforms(s, o, case.counts[r]))
        u_rec.append(rph.sampling_uniform(s, o, rph.STREAM_RECOVERED))
        u_bonus.append(rph.sampling_uniform(s, o, rph.STREAM_BONUS))
    u = torch.from_numpy(np.concatenate(us)) if us else torch.zeros(0, dtype=torch.float64)
    f64 = lambda xs: torch.tensor(xs, dtype=torch.float64)
    return u, f64(u_rec), f64(u_bonus)


def run_op(case: Case, device: str, max_n: int | None = None, **overrides) -> VerifyOutput:
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    args.update(
        {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in overrides.items()}
    )
    if max_n is None:
        max_n = max(case.counts, default=0)
    b = case.b
    out = VerifyOutput(
        poison_(torch.empty(b, max_n + 1, dtype=torch.int32, device=device)),
        poison_(torch.empty(b, dtype=torch.int32, device=device)),
        poison_(torch.empty(b, max_n, dtype=torch.bool, device=device)),
    )
    res = verify_chain(
        args["target_logits"],
        args["draft_token_ids"],
        args["cu_num_draft_tokens"],
        args["temperature"],
        args["seeds"],
        args["offsets"],
        top_k=args["top_k"],
        top_p=args["top_p"],
        draft_probs=args["draft_probs"],
        uniforms=args["uniforms"],
        request_mask=args["request_mask"],
        bonus_token_ids=args["bonus_token_ids"],
        exponentials=args["exponentials"],
        out=out,
    )
    assert res is out
    return VerifyOutput(*(t.cpu() for t in out))


def reference(case: Case, max_n: int | None = None, uniforms: torch.Tensor | None = None):
    u, u_rec, u_bonus = philox_draws(case)
    if case["uniforms"] is not None:
        u = case["uniforms"]
    if uniforms is not None:
        u = uniforms
    if max_n is None:
        max_n = max(case.counts, default=0)
    return verify_chain_reference(
        case["target_logits"],
        case["draft_token_ids"],
        case["cu_num_draft_tokens"],
        case["temperature"],
        u,
        u_rec,
        u_bonus,
        top_k=case["top_k"],
        top_p=case["top_p"],
        draft_probs=case["draft_probs"],
        request_mask=case["request_mask"],
        max_num_draft_tokens=max_n,
        exponentials=case["exponentials"],
        bonus_token_ids=case["bonus_token_ids"],
    )


def check_invariants(got: VerifyOutput, case: Case) -> None:
    """Every element written; tokens in range; -1 exactly after the emitted tokens."""
    out, acc, app = got
    v = case.vocab
    mask = case["request_mask"]
    for r in range(case.b):
        real = mask is None or bool(mask[r])
        n = case.counts[r]
        a = int(acc[r])
        if not real:
            assert a == 0 and (out[r] == -1).all() and not app[r].any(), f"padding row {r}"
            continue
        assert 0 <= a <= n, f"row {r}: num_accepted {a} outside [0, {n}]"
        emitted = out[r, : a + 1]
        assert ((emitted >= 0) & (emitted < v)).all(), f"row {r}: token out of range {emitted}"
        assert (out[r, a + 1 :] == -1).all(), f"row {r}: tail not -1: {out[r]}"
        assert (app[r] == (torch.arange(app.shape[1]) < a)).all(), f"row {r}: accepted mask"
        d0 = int(case["cu_num_draft_tokens"][r - 1]) if r else 0
        assert (out[r, :a] == case["draft_token_ids"][d0 : d0 + a]).all(), f"row {r}: prefix"


def assert_matches(got: VerifyOutput, ref, case: Case, tol: float = MARGIN_TOL) -> None:
    check_invariants(got, case)
    differ = (got.output_token_ids != ref.output_token_ids).any(dim=1) | (
        got.num_accepted != ref.num_accepted
    )
    for r in torch.nonzero(differ).flatten().tolist():
        assert float(ref.margin[r]) < tol, (
            f"request {r} differs from the reference (margin {float(ref.margin[r]):.3g}): "
            f"got {got.output_token_ids[r].tolist()}, want {ref.output_token_ids[r].tolist()}"
        )


# ---------------------------------------------------------------------------------------------
# Philox
# ---------------------------------------------------------------------------------------------

# Random123 tests/kat_vectors, "philox4x32 10" lines: counter[4], key[2] -> output[4].
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_reference_philox_known_answers(ctr, key, want):
    got = tuple(int(w) for w in rph.philox4x32_10(ctr, key))
    assert got == want


def test_reference_philox_draw_ranges():
    u = rph.acceptance_uniforms(-5, 2**40 + 3, 4096)
    assert u.dtype == np.float64 and (u >= 0).all() and (u < 1).all()
    f = np.array([rph.sampling_uniform(2**63 - 1 - i, -1, rph.STREAM_BONUS) for i in range(2000)])
    assert (f >= 0).all() and (f < 1).all()
    assert abs(f.mean() - 0.5) < 0.03 and abs(u.mean() - 0.5) < 0.02
    # The two sampling streams and the acceptance stream are different draws.
    assert rph.sampling_uniform(7, 9, rph.STREAM_BONUS) != rph.sampling_uniform(
        7, 9, rph.STREAM_RECOVERED
    )
    assert rph.sampling_uniform(7, 9, rph.STREAM_ACCEPT) == rph.acceptance_uniforms(7, 9, 1)[0]


def test_philox_stream_layout_matches_op(device):
    """A request with 0 drafts emits the inverse-CDF draw of its bonus row with u from stream 2,
    index 0, words 0 and 1 -- on logits that are all equal, the token is floor(u * V)."""
    v = 4099
    b = 64
    case = make_case([0] * b, v, torch.Generator().manual_seed(3), temps=1.0)
    case["target_logits"].zero_()
    case["seeds"] = torch.tensor([(-1) ** i * (i * 2**33 + 17) for i in range(b)])
    case["offsets"] = torch.tensor([i * 2**32 + 5 * i for i in range(b)])
    got = run_op(case, device)
    for r in range(b):
        u = rph.sampling_uniform(int(case["seeds"][r]), int(case["offsets"][r]), rph.STREAM_BONUS)
        assert int(got.output_token_ids[r, 0]) == min(int(u * v), v - 1)


# ---------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 111, 32001])
def test_greedy_matches_reference(device, dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    counts = [3, 0, 1, 5, 2, 0, 4, 3]
    case = make_case(counts, vocab, gen, dtype=dtype, p_follow=0.85)
    got = run_op(case, device)
    ref = reference(case)
    assert_matches(got, ref, case, tol=0.0)
    assert (got.output_token_ids == ref.output_token_ids).all()
    if vocab > 1:  # the chains were accepted to different depths
        assert len(set(got.num_accepted.tolist())) > 1


def test_greedy_ties_take_first_index(device):
    v = 50
    counts = [2, 2]
    case = make_case(counts, v, torch.Generator().manual_seed(1))
    logits = torch.zeros(6, v)
    logits[:, 7] = 5.0
    logits[:, 3] = 5.0  # tie: the lower id (3) is the argmax
    logits[:, 30] = 5.0
    case["target_logits"] = logits
    case["draft_token_ids"] = torch.tensor([3, 7, 3, 3], dtype=torch.int32)
    got = run_op(case, device)
    assert got.output_token_ids.tolist() == [[3, 3, -1], [3, 3, 3]]
    assert got.num_accepted.tolist() == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_ties_inside_a_vector_take_first_index(device, dtype):
    """First-index argmax where the maximum repeats inside one 16-byte load and again later, with
    a NaN just before it, and where it is a signed zero (-0 then +0, +0 then -0): greedy
    corrections and a random row's first +inf, at a vocabulary the CUDA kernels split over CTAs
    (guards any rewrite of row_stats' running argmax, e.g. a per-load maximum first)."""
    v = 4100
    gen = torch.Generator().manual_seed(41)
    case = make_case([1, 1, 1, 1], v, gen, temps=[0.0, 0.0, 0.0, 0.8], dtype=dtype)
    logits = -(torch.rand(8, v, generator=gen) + 1.0)  # rows 2r: draft rows, 2r + 1: bonus rows
    logits[0, 1000] = float("nan")
    logits[0, [1001, 1003, 1006, 3001]] = 3.0
    logits[2, 2049], logits[2, 2050] = -0.0, 0.0
    logits[4, 2049], logits[4, 2050] = 0.0, -0.0
    logits[6, 1200] = float("nan")
    logits[6, [1201, 1202, 3500]] = math.inf
    case["target_logits"] = logits.to(dtype)
    case["draft_token_ids"] = torch.zeros(4, dtype=torch.int32)  # never the argmax: rejected
    got = run_op(case, device)
    assert got.output_token_ids.tolist() == [[1001, -1], [2049, -1], [2049, -1], [1201, -1]]
    assert got.num_accepted.tolist() == [0, 0, 0, 0]
    assert_matches(got, reference(case), case)


def test_greedy_is_never_scaled_and_ignores_top_k_top_p(device):
    """Greedy rows (temperature 0) with top-k=1 / top-p tiny: same as plain argmax (A1)."""
    gen = torch.Generator().manual_seed(2)
    counts = [4, 3, 2]
    case = make_case(counts, 111, gen, p_follow=0.9)
    plain = run_op(case, device)
    case["top_k"] = torch.tensor([1, 2, 3], dtype=torch.int32)
    case["top_p"] = torch.tensor([0.01, 0.5, 0.9], dtype=torch.float32)
    filtered = run_op(case, device)
    assert (plain.output_token_ids == filtered.output_token_ids).all()


# ---------------------------------------------------------------------------------------------
# random rows vs the reference
# ---------------------------------------------------------------------------------------------

RANDOM_VARIANTS = {
    "plain": {},
    "draft_probs": {"draft_probs": True},
    "top_k": {"top_k": [1, 5, 0, 40, 200, 3]},
    "top_p": {"top_p": [0.9, 0.5, 1.0, 0.05, 0.99, 0.7]},
    "top_k_top_p": {"top_k": [10, 50, 0, 3, 1000, 7], "top_p": [0.8, 0.95, 0.6, 1.0, 0.3, 0.9]},
    "draft_probs_top_k_top_p": {
        "draft_probs": True,
        "top_k": [20, 0, 5, 1, 64, 2],
        "top_p": [0.9, 0.7, 1.0, 0.99, 0.5, 0.8],
    },
}


@pytest.mark.parametrize("variant", list(RANDOM_VARIANTS))
@pytest.mark.parametrize("injected", [False, True], ids=["philox", "uniforms"])
def test_random_matches_reference(device, variant, injected):
    gen = torch.Generator().manual_seed(list(RANDOM_VARIANTS).index(variant) * 2 + injected)
    counts = [4, 0, 2, 7, 1, 3]
    case = make_case(
        counts,
        1000,
        gen,
        temps=[0.7, 1.0, 1.3, 0.5, 0.9, 2.0],
        scale=1.5,
        **RANDOM_VARIANTS[variant],
    )
    if injected:
        case["uniforms"] = torch.rand(sum(counts), generator=gen, dtype=torch.float64)
    got = run_op(case, device)
    ref = reference(case)
    assert_matches(got, ref, case)
    assert (got.output_token_ids == ref.output_token_ids).float().mean() > 0.9


@pytest.mark.parametrize("vocab", [1, 111, 32001])
@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "top_k_top_p"])
def test_random_vocab_sizes(device, vocab, filtered):
    gen = torch.Generator().manual_seed(vocab * 2 + filtered)
    counts = [3, 0, 5, 1]
    kw = {"top_k": [2, 0, 30, 1], "top_p": [0.9, 0.5, 1.0, 0.7]} if filtered else {}
    case = make_case(counts, vocab, gen, temps=[0.6, 1.0, 0.9, 1.5], draft_probs=vocab > 1, **kw)
    got = run_op(case, device)
    assert_matches(got, reference(case), case)
    if vocab == 1:  # p = q = 1 on the only token: every draft accepted
        assert got.num_accepted.tolist() == counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_low_precision_logits(device, dtype):
    gen = torch.Generator().manual_seed(17)
    counts = [3, 5, 0, 2]
    case = make_case(counts, 4097, gen, temps=0.8, dtype=dtype, top_k=[0, 100, 10, 4096])
    got = run_op(case, device)
    assert_matches(got, reference(case), case)


def test_mixed_greedy_and_random_batch(device):
    """A1: temperatures [0, 0.7, ...] in one batch; no NaN, counts within [0, n]."""
    gen = torch.Generator().manual_seed(5)
    counts = [2, 2, 3, 0, 3, 1]
    temps = [0.0, 0.7, 0.0, 0.7, 1.0, 0.0]
    case = make_case(counts, 257, gen, temps=temps, top_k=[0, 5, 1, 0, 0, 3], top_p=[1.0] * 6)
    got = run_op(case, device)
    ref = reference(case)
    assert_matches(got, ref, case)
    for r in (0, 2, 5):  # greedy rows exactly
        assert (got.output_token_ids[r] == ref.output_token_ids[r]).all()


def test_injected_uniforms_decide_acceptance(device):
    """u = 0 accepts every draft with p(x) > 0; u just below 1 rejects a draft with p(x) < 1."""
    gen = torch.Generator().manual_seed(8)
    counts = [5, 5]
    case = make_case(counts, 64, gen, temps=1.0, scale=0.5, p_follow=0.0)
    case["uniforms"] = torch.zeros(10, dtype=torch.float64)
    got = run_op(case, device)
    assert got.num_accepted.tolist() == [5, 5]
    case["uniforms"] = torch.full((10,), 1.0 - 2.0**-53, dtype=torch.float64)
    got = run_op(case, device)
    assert got.num_accepted.tolist() == [0, 0]
    assert_matches(got, reference(case), case)


# ---------------------------------------------------------------------------------------------
# vLLM parity inputs: bonus_token_ids, exponentials (SPEC §6.4-6.6)
# ---------------------------------------------------------------------------------------------


def _exponentials(case: Case, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(case.b, case.vocab).exponential_(generator=gen)


@pytest.mark.parametrize("variant", ["plain", "draft_probs", "top_k_top_p", "draft_probs_top_k"])
def test_exponential_race_matches_reference(device, variant):
    gen = torch.Generator().manual_seed(300 + len(variant))
    counts = [4, 0, 2, 7, 1, 3, 5, 5]
    kw = {
        "plain": {},
        "draft_probs": {"draft_probs": True},
        "top_k_top_p": {"top_k": [5, 0, 40, 3, 0, 9, 1, 100], "top_p": [0.9, 0.8] * 4},
        "draft_probs_top_k": {"draft_probs": True, "top_k": [20, 0, 5, 1, 64, 2, 0, 7]},
    }[variant]
    case = make_case(
        counts, 1000, gen, temps=[0.7, 1.0, 1.3, 0.5, 0.9, 2.0, 0.8, 1.1], scale=1.5,
        p_follow=0.5, **kw,
    )  # fmt: skip
    case["exponentials"] = _exponentials(case, gen)
    got = run_op(case, device)
    ref = reference(case)
    assert_matches(got, ref, case)
    assert (got.output_token_ids == ref.output_token_ids).float().mean() > 0.9
    # The race, not the Philox draw, decided: the Philox-only reference differs somewhere.
    plain = dict(case)
    plain["exponentials"] = None
    plain = Case(plain)
    plain.counts = case.counts
    assert not torch.equal(reference(plain).output_token_ids, ref.output_token_ids)


def test_exponential_race_picks_residual_over_e(device):
    """Hand-checked race: p = [0.1, 0.3, 0.3, 0.3] (no draft_probs, draft 3 rejected with u ~ 1):
    residual = [0.1, 0.3, 0.3, 0]; with E = [0.05, 1, 1, 1e-9] the scores residual * (1/E) are
    [2, .3, .3, -] so id 0 wins (E of the removed draft is irrelevant); with E = [1, 0.5, 0.5, 1]
    ids 1 and 2 tie exactly (equal logits, equal E) -> the lower id (1)."""
    v = 4
    case = make_case([1], v, torch.Generator().manual_seed(31), temps=1.0)
    probs = torch.tensor([0.1, 0.3, 0.3, 0.3], dtype=torch.float64)
    case["target_logits"] = torch.log(probs).float().repeat(2, 1)
    case["draft_token_ids"] = torch.tensor([3], dtype=torch.int32)
    case["uniforms"] = torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)
    case["exponentials"] = torch.tensor([[0.05, 1.0, 1.0, 1e-9]])
    got = run_op(case, device)
    assert got.output_token_ids.tolist() == [[0, -1]]
    case["exponentials"] = torch.tensor([[1.0, 0.5, 0.5, 1.0]])
    got = run_op(case, device)
    assert got.output_token_ids.tolist() == [[1, -1]]


def test_exponential_race_empty_residual_falls_back_to_argmax(device):
    """q(x) = 0 rejects; with p == q the residual max(p - q, 0) is all zero: argmax of p."""
    v = 4
    case = make_case([1], v, torch.Generator().manual_seed(32), temps=1.0)
    case["target_logits"] = torch.tensor([[0.0, 1.0, -math.inf, 0.5], [0.0] * 4])
    case["draft_token_ids"] = torch.tensor([2], dtype=torch.int32)
    # q slightly above p everywhere, so max(p - q, 0) is exactly zero whatever the rounding of
    # p (the CUDA normaliser uses ex2.approx: p == q would leave 1-ULP positive residuals).
    case["draft_probs"] = torch.softmax(case["target_logits"][:1], dim=1) * 1.001
    case["uniforms"] = torch.tensor([0.0], dtype=torch.float64)
    case["exponentials"] = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    got = run_op(case, device)
    assert got.output_token_ids.tolist() == [[1, -1]] and got.num_accepted.tolist() == [0]


@pytest.mark.parametrize("temps", [0.0, 0.8, "mixed"])
def test_bonus_token_ids_replace_the_bonus(device, temps):
    """All-accepted requests (greedy and random) emit the given bonus id; the bonus rows are never
    read (filled with NaN here); 0-draft requests emit exactly the given id."""
    gen = torch.Generator().manual_seed(33)
    counts = [3, 0, 2, 4, 0, 1]
    t = [0.0, 0.8, 0.0, 1.2, 0.0, 0.5] if temps == "mixed" else temps
    case = make_case(
        counts, 500, gen, temps=t, p_follow=0.95, scale=8.0, top_k=[0, 10, 0, 50, 3, 0]
    )  # peaked rows: random requests accept their argmax drafts too
    case["bonus_token_ids"] = torch.tensor([11, 22, 33, 44, 55, 66], dtype=torch.int32)
    _, draft_rows = layout(counts)
    bonus_rows = sorted(set(range(case["target_logits"].shape[0])) - set(draft_rows.tolist()))
    ref = reference(case)  # computed on the intact logits
    case["target_logits"][bonus_rows] = float("nan")
    got = run_op(case, device)
    assert_matches(got, ref, case)
    for r, n in enumerate(counts):
        if int(got.num_accepted[r]) == n:
            assert int(got.output_token_ids[r, n]) == 11 * (r + 1)
    assert got.output_token_ids[1, 0] == 22 and got.output_token_ids[4, 0] == 55
    assert (got.num_accepted == torch.tensor(counts)).sum() >= 3


def _vllm_v016_style(case: Case, uniforms: torch.Tensor) -> torch.Tensor:
    """vLLM v0.16's probability-level rejection sampler, written here from its documented steps
    (not its code): fp32 logits / T, softmax; accept iff q > 0 and p / q >= u; recovered =
    argmax(residual * (1/E)) over the whole row (residual = p with the draft zeroed, or
    clamp(p - q, 0)); bonus = the given bonus id. Random requests only, no top-k/top-p."""
    logits = case["target_logits"].float()
    cu = case["cu_num_draft_tokens"].tolist()
    drafts = case["draft_token_ids"].long()
    e = case["exponentials"].float()
    q_all = case["draft_probs"]
    out = torch.full((case.b, max(case.counts) + 1), -1, dtype=torch.int32)
    for r in range(case.b):
        d0 = cu[r - 1] if r else 0
        n = case.counts[r]
        t = float(case["temperature"][r])
        for j in range(n):
            p = torch.softmax(logits[d0 + r + j] / t, dim=0)
            x = int(drafts[d0 + j])
            qx = 1.0 if q_all is None else float(q_all[d0 + j, x])
            if qx > 0 and float(p[x]) / qx >= float(uniforms[d0 + j]):
                out[r, j] = x
                continue
            if q_all is None:
                res = p.clone()
                res[x] = 0.0
            else:
                res = torch.clamp(p - q_all[d0 + j].float(), min=0.0)
            out[r, j] = int(torch.argmax(res * e[r].reciprocal()))
            break
        else:
            out[r, n] = int(case["bonus_token_ids"][r])
    return out


@pytest.mark.parametrize("draft_probs", [False, True], ids=["argmax_drafts", "draft_probs"])
def test_vllm_parity_with_injected_draws(device, draft_probs):
    """With uniforms, exponentials and bonus ids injected, the op reproduces a vLLM-style fp32
    pipeline row for row, except where the fp64 reference says a decision is within rounding."""
    gen = torch.Generator().manual_seed(34 + draft_probs)
    b = 96
    counts = [int(x) for x in torch.randint(0, 8, (b,), generator=gen)]
    case = make_case(
        counts, 3001, gen, temps=[float(x) for x in torch.rand(b, generator=gen) + 0.3],
        scale=2.0, p_follow=0.6, draft_probs=draft_probs,
    )  # fmt: skip
    case["uniforms"] = torch.rand(sum(counts), generator=gen, dtype=torch.float64)
    case["exponentials"] = _exponentials(case, gen)
    case["bonus_token_ids"] = torch.randint(0, 3001, (b,), generator=gen, dtype=torch.int32)
    got = run_op(case, device)
    want = _vllm_v016_style(case, case["uniforms"])
    ref = reference(case)
    differ = (got.output_token_ids != want).any(dim=1)
    for r in torch.nonzero(differ).flatten().tolist():
        assert float(ref.margin[r]) < MARGIN_TOL, (r, got.output_token_ids[r], want[r])
    assert int(differ.sum()) <= 1


# ---------------------------------------------------------------------------------------------
# seeds, zero-draft rows, padding, layout (A4, A9, D2/D5, G4, G6)
# ---------------------------------------------------------------------------------------------


def test_seeded_rows_independent_of_neighbours_and_order(device):
    """A9/G4: a seeded row's output depends only on its own inputs, seed and offset -- not on its
    batch position, its neighbours' logits or their draft counts (0-draft rows included)."""
    gen = torch.Generator().manual_seed(9)
    v = 300
    rows = []  # per request: (logits rows [n+1, V], drafts [n], temp, seed, offset)
    for n, t, s in [(3, 1.0, 42), (0, 1.0, 7), (3, 0.9, 99), (0, 0.0, 5), (2, 0.0, 1)]:
        rows.append(
            (
                torch.randn(n + 1, v, generator=gen),
                torch.randint(0, v, (n,), generator=gen, dtype=torch.int32),
                t,
                s,
                1234,
            )
        )

    def batch(order, extra=None):
        reqs = [rows[i] for i in order] + ([extra] if extra else [])
        counts = [r[1].shape[0] for r in reqs]
        case = make_case(counts, v, gen)
        case["target_logits"] = torch.cat([r[0] for r in reqs])
        case["draft_token_ids"] = torch.cat([r[1] for r in reqs])
        case["temperature"] = torch.tensor([r[2] for r in reqs], dtype=torch.float32)
        case["seeds"] = torch.tensor([r[3] for r in reqs])
        case["offsets"] = torch.tensor([r[4] for r in reqs])
        return case

    base = batch([0, 1, 2, 3, 4])
    got0 = run_op(base, device)
    assert_matches(got0, reference(base), base)
    perm = [3, 2, 4, 0, 1]
    extra = (
        torch.randn(6, v, generator=gen),
        torch.randint(0, v, (5,), generator=gen, dtype=torch.int32),
        1.0,
        3,
        3,
    )
    got1 = run_op(batch(perm, extra), device)
    w = got0.output_token_ids.shape[1]
    for new_pos, old_pos in enumerate(perm):
        assert (got1.output_token_ids[new_pos, :w] == got0.output_token_ids[old_pos]).all()
        assert (got1.output_token_ids[new_pos, w:] == -1).all()
        assert got1.num_accepted[new_pos] == got0.num_accepted[old_pos]
    # Zero-draft rows emit exactly their bonus token and nothing else.
    for r in (1, 3):
        assert got0.num_accepted[r] == 0 and (got0.output_token_ids[r, 1:] == -1).all()


def test_offsets_change_draws(device):
    """The caller advances offsets by 1 per step: a new offset gives new draws."""
    gen = torch.Generator().manual_seed(10)
    case = make_case([0] * 200, 1000, gen, temps=1.0, scale=0.1)
    a = run_op(case, device).output_token_ids[:, 0]
    case["offsets"] = case["offsets"] + 1
    b = run_op(case, device).output_token_ids[:, 0]
    assert (a != b).float().mean() > 0.9


def test_request_mask_rows_are_inert(device):
    """D2/D5: masked rows -> all -1, num_accepted 0, no accepted positions, whatever their
    (possibly stale, invalid) per-request values."""
    gen = torch.Generator().manual_seed(11)
    counts = [3, 3, 0, 3]
    case = make_case(counts, 100, gen, temps=[0.0, 0.8, 1.0, 0.0])
    case["request_mask"] = torch.tensor([True, False, False, True])
    case["temperature"][1] = float("nan")  # stale garbage in a padding row is never read
    case["top_k"] = torch.tensor([0, -5, 0, 0], dtype=torch.int32)
    got = run_op(case, device)
    ref = reference(case)
    assert_matches(got, ref, case)
    assert (got.output_token_ids[1:3] == -1).all() and (got.num_accepted[1:3] == 0).all()
    assert not got.accepted_per_position[1:3].any()


def test_padded_outputs_and_out_of_range_drafts(device):
    """A4/C5: the draft count is explicit; columns past the emitted tokens are -1 even when the
    output is wider than any request; out-of-range draft ids are rejected without being used as
    an index (q lookup included)."""
    gen = torch.Generator().manual_seed(12)
    counts = [3, 2, 2]
    case = make_case(counts, 4, gen, temps=[1.0, 0.0, 1.0], draft_probs=True)
    case["draft_token_ids"] = torch.tensor([1, 0, 1, -1, 2, 4, 2**30], dtype=torch.int32)
    got = run_op(case, device, max_n=5)
    check_invariants(got, case)
    ref = reference(case, max_n=5)
    assert_matches(got, ref, case)
    assert got.num_accepted[1] == 0  # greedy row: -1 is never the argmax
    assert got.num_accepted[2] == 0  # id 4 == V is rejected


def test_outputs_overwritten_not_accumulated(device):
    """G6: calling twice into the same buffers gives the same result; a different call in between
    leaves nothing behind."""
    gen = torch.Generator().manual_seed(13)
    case_a = make_case([3, 1, 2], 50, gen, temps=[0.0, 1.0, 0.5])
    case_b = make_case([0, 3, 3], 50, gen, temps=[1.0, 0.0, 0.0])
    dev = lambda c: {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    out = VerifyOutput(
        torch.full((3, 4), 77, dtype=torch.int32, device=device),
        torch.full((3,), 77, dtype=torch.int32, device=device),
        torch.ones(3, 3, dtype=torch.bool, device=device),
    )
    results = []
    for c in (case_a, case_b, case_a, case_a):
        a = dev(c)
        verify_chain(
            a["target_logits"], a["draft_token_ids"], a["cu_num_draft_tokens"], a["temperature"],
            a["seeds"], a["offsets"], out=out,
        )  # fmt: skip
        results.append(tuple(t.cpu().clone() for t in out))
    for x, y in zip(results[0], results[2], strict=True):
        assert torch.equal(x, y)
    for x, y in zip(results[2], results[3], strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(results[0][0], results[1][0])


def test_empty_batch_and_no_drafts(device):
    gen = torch.Generator().manual_seed(14)
    case = make_case([], 10, gen)
    got = run_op(case, device)
    assert got.output_token_ids.shape == (0, 1) and got.num_accepted.shape == (0,)
    case = make_case([0, 0, 0], 10, gen, temps=[0.0, 1.0, 0.3])
    got = run_op(case, device)
    assert_matches(got, reference(case), case)
    assert got.output_token_ids.shape == (3, 1) and (got.num_accepted == 0).all()
    assert got.output_token_ids[0, 0] == case["target_logits"][0].argmax()


def test_wrapper_allocates_outputs(device):
    gen = torch.Generator().manual_seed(15)
    case = make_case([2, 4, 1], 33, gen, temps=0.0)
    a = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    res = verify_chain(
        a["target_logits"], a["draft_token_ids"], a["cu_num_draft_tokens"], a["temperature"],
        a["seeds"], a["offsets"], return_accepted_per_position=True,
    )  # fmt: skip
    assert res.output_token_ids.shape == (3, 5) and res.accepted_per_position.shape == (3, 4)
    ref = reference(case)
    assert (res.output_token_ids.cpu() == ref.output_token_ids).all()
    res = verify_chain(
        a["target_logits"], a["draft_token_ids"], a["cu_num_draft_tokens"], a["temperature"],
        a["seeds"], a["offsets"], max_num_draft_tokens=7,
    )  # fmt: skip
    assert res.output_token_ids.shape == (3, 8) and res.accepted_per_position is None


# ---------------------------------------------------------------------------------------------
# special distributions (A2, A10, G1, G2)
# ---------------------------------------------------------------------------------------------


def test_neg_inf_logits(device):
    """A2: -inf logits have probability exactly 0; a row with one finite logit is one-hot (greedy
    and random), and no NaN or out-of-range id appears."""
    v = 97
    counts = [2, 2, 2]
    case = make_case(counts, v, torch.Generator().manual_seed(16), temps=[0.0, 1.0, 0.7])
    logits = torch.randn(9, v, generator=torch.Generator().manual_seed(1))
    logits[:, ::3] = -math.inf  # many masked tokens everywhere
    for row in (0, 3, 6):  # each request's first draft row has a single finite logit, at id 10
        logits[row] = -math.inf
        logits[row, 10] = 3.0
    case["target_logits"] = logits
    case["draft_token_ids"] = torch.tensor([10, 3, 10, 3, 6, 10], dtype=torch.int32)
    for u in (0.0, 0.5, 1.0 - 2.0**-53):
        case["uniforms"] = torch.full((6,), u, dtype=torch.float64)
        got = run_op(case, device)
        assert_matches(got, reference(case), case)
        assert got.output_token_ids[0, 0] == 10  # greedy one-hot row accepts draft 10
        assert got.output_token_ids[1, 0] == 10  # random one-hot row: p(10) = 1 -> accepted
        assert got.output_token_ids[2, 0] == 10  # random one-hot row rejects 6, recovers 10
        assert got.num_accepted[2] == 0
    # Sampled tokens never land on -inf logits.
    case["uniforms"] = None
    case["draft_token_ids"] = torch.tensor([10, 3, 10, 3, 10, 9], dtype=torch.int32)
    for offset in range(20):
        case["offsets"] = torch.full((3,), offset, dtype=torch.int64)
        got = run_op(case, device)
        for r in (1, 2):
            a = int(got.num_accepted[r])
            tok = int(got.output_token_ids[r, a])
            row = 3 * r + a
            assert torch.isfinite(logits[row, tok]), f"request {r} sampled a -inf token {tok}"


def test_all_neg_inf_row_stays_in_range(device):
    v = 20
    case = make_case([1, 1], v, torch.Generator().manual_seed(18), temps=[0.0, 1.0])
    case["target_logits"] = torch.full((4, v), -math.inf)
    got = run_op(case, device)
    assert_matches(got, reference(case), case)
    assert got.output_token_ids[:, 0].tolist() == [0, 0]  # first index when nothing is finite


def test_zero_draft_probability_rejects(device):
    """G1: q(x) = 0 with p(x) = 0.5 is rejected (even with u = 0); a recovered token is emitted."""
    v = 4
    case = make_case([1], v, torch.Generator().manual_seed(19), temps=1.0)
    case["target_logits"] = torch.tensor([[0.0, 0.0, -math.inf, -math.inf], [0.0, 1.0, 2.0, 3.0]])
    case["draft_token_ids"] = torch.tensor([1], dtype=torch.int32)
    case["draft_probs"] = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    case["uniforms"] = torch.tensor([0.0], dtype=torch.float64)
    got = run_op(case, device)
    # Residual max(p - q, 0) = [0, 0.5, 0, 0]: the recovered token is 1.
    assert got.output_token_ids.tolist() == [[1, -1]] and got.num_accepted.tolist() == [0]


@pytest.mark.parametrize("u", [0.0, 0.5, 1.0 - 2.0**-53, 1.0])
def test_p_equal_q_always_accepted(device, u):
    """G2: p == q accepts for every u in [0, 1] (accept iff u <= p/q = 1). Dyadic distributions so
    that p is exact in every arithmetic."""
    v = 16
    counts = [2, 3]
    case = make_case(counts, v, torch.Generator().manual_seed(20), temps=1.0)
    logits = torch.full((7, v), -math.inf)
    logits[0:3, :4] = 0.0  # request 0 (rows 0-2): p = 1/4 on ids 0..3
    logits[3:7, 8:16] = 0.0  # request 1 (rows 3-6): p = 1/8 on ids 8..15
    case["target_logits"] = logits
    case["draft_token_ids"] = torch.tensor([1, 3, 8, 15, 9], dtype=torch.int32)
    q = torch.zeros(5, v)
    q[:2, :4] = 0.25
    q[2:, 8:16] = 0.125
    case["draft_probs"] = q
    case["uniforms"] = torch.full((5,), u, dtype=torch.float64)
    got = run_op(case, device)
    assert got.num_accepted.tolist() == [2, 3]
    assert got.output_token_ids[0, :2].tolist() == [1, 3]


@pytest.mark.parametrize("vocab", [32000])
def test_one_hot_p_and_q(device, vocab):
    """A10: p and q one-hot on the same id always accept; on different ids always reject and emit
    the target's hot id; huge top_k changes nothing; u = 0 or 1 changes neither outcome."""
    counts = [1, 1, 1]
    case = make_case(counts, vocab, torch.Generator().manual_seed(21), temps=[1.0, 1.0, 0.5])
    logits = torch.full((6, vocab), -math.inf)
    logits[:, 1] = 0.0
    case["target_logits"] = logits.to(torch.bfloat16)
    case["draft_token_ids"] = torch.tensor([1, 2, 1], dtype=torch.int32)
    q = torch.zeros(3, vocab)
    q[0, 1] = q[1, 2] = q[2, 1] = 1.0
    case["draft_probs"] = q
    case["top_k"] = torch.tensor([2**30, 2**30, 0], dtype=torch.int32)
    case["top_p"] = torch.tensor([1.0, 1.0, 1.0])
    for u in (0.0, 0.999, 1.0):
        case["uniforms"] = torch.full((3,), u, dtype=torch.float64)
        got = run_op(case, device)
        assert got.output_token_ids.tolist() == [[1, 1], [1, -1], [1, 1]]
        assert got.num_accepted.tolist() == [1, 0, 1]
    case["draft_probs"] = None  # argmax drafting: same outcomes
    case["uniforms"] = None
    got = run_op(case, device)
    assert got.output_token_ids.tolist() == [[1, 1], [1, -1], [1, 1]]


# ---------------------------------------------------------------------------------------------
# NaN and +inf logits (SPEC §6.7): greedy NaN = -inf, all-NaN -> 0, +inf rows one-hot at the
# first +inf index
# ---------------------------------------------------------------------------------------------


def _nan_free_argmax(row: torch.Tensor) -> int:
    """Independent greedy rule: first-index argmax with NaN read as -inf (0 if nothing > -inf)."""
    r = torch.nan_to_num(row.double(), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    if not (r > -math.inf).any():
        return 0
    return int(torch.nonzero(r == r.max())[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_nan_logits_are_minus_inf(device, dtype):
    """NaN logits never win the greedy argmax (a NaN placed where the maximum would be); drafts
    equal to the NaN-free argmax are accepted, others get that argmax as the correction."""
    v, counts = 61, [3, 3, 2, 4]
    gen = torch.Generator().manual_seed(31)
    case = make_case(counts, v, gen, temps=0.0, dtype=dtype, p_follow=0.8)
    logits = case["target_logits"].float()
    nan = torch.rand(logits.shape, generator=gen) < 0.25
    nan[torch.arange(logits.shape[0]), logits.argmax(dim=1)] = True  # the true max becomes NaN
    logits[nan] = float("nan")
    case["target_logits"] = logits.to(dtype)
    _, rows = layout(counts)
    case["draft_token_ids"] = torch.tensor(
        [_nan_free_argmax(case["target_logits"][r]) for r in rows.tolist()], dtype=torch.int32
    )
    case["draft_token_ids"][[2, 7]] = 0  # two mismatches (ids 0 are never the argmax here)
    got = run_op(case, device)
    assert_matches(got, reference(case), case)
    assert got.num_accepted.tolist() == [2, 3, 1, 4]
    for r, row in ((0, 2), (2, 9)):  # corrections: the NaN-free argmax of the rejected row
        a = int(got.num_accepted[r])
        assert int(got.output_token_ids[r, a]) == _nan_free_argmax(case["target_logits"][row])
    bonus = int(got.output_token_ids[3, 4])  # request 3 all accepted: bonus row 4 + 3 + 4 + 3
    assert bonus == _nan_free_argmax(case["target_logits"][15])


def test_greedy_all_nan_row_yields_token_0(device):
    """A row whose logits are all NaN (or NaN and -inf) has greedy argmax 0: draft 0 on it is
    accepted, another draft is corrected to 0; a random request on such rows emits 0 too."""
    v = 33
    case = make_case([2, 2, 1], v, torch.Generator().manual_seed(32), temps=[0.0, 0.0, 0.9])
    logits = case["target_logits"]
    logits[0:3] = float("nan")  # request 0: both draft rows and the bonus row all NaN
    logits[3] = float("nan")  # request 1: first draft row all NaN ...
    logits[3, ::2] = -math.inf  # ... and -inf
    logits[6:8] = float("nan")  # request 2 (random): all NaN
    case["target_logits"] = logits
    case["draft_token_ids"] = torch.tensor([0, 0, 7, 1, 4], dtype=torch.int32)
    got = run_op(case, device)
    assert got.output_token_ids.tolist() == [[0, 0, 0], [0, -1, -1], [0, -1, -1]]
    assert got.num_accepted.tolist() == [2, 0, 0]
    assert_matches(got, reference(case), case)


def test_greedy_several_posinf_emit_first(device):
    v = 50
    case = make_case([2, 1], v, torch.Generator().manual_seed(33), temps=0.0)
    logits = case["target_logits"]
    logits[:, [41, 7, 23]] = math.inf
    logits[:, 3] = float("nan")
    case["target_logits"] = logits
    case["draft_token_ids"] = torch.tensor([7, 23, 41], dtype=torch.int32)
    got = run_op(case, device)
    assert got.output_token_ids.tolist() == [[7, 7, -1], [7, -1, -1]]
    assert got.num_accepted.tolist() == [1, 0]


@pytest.mark.parametrize("filt", ["none", "top_k", "top_p"])
@pytest.mark.parametrize("with_q", [False, True])
def test_random_several_posinf_emit_first(device, filt, with_q):
    """Decision (SPEC §6.7): a random row whose maximum score is +inf is one-hot at its FIRST +inf
    index f (not split evenly over the +inf ids, the tempered limit): a draft f is accepted for
    every uniform, any other draft (another +inf id included) is rejected and f is emitted, and a
    bonus row with several +inf emits f. Same with q, top-k and top-p, every Philox draw."""
    v, f = 64, 9
    counts = [2, 2, 1, 0]
    gen = torch.Generator().manual_seed(34)
    case = make_case(counts, v, gen, temps=[0.7, 1.0, 1.3, 0.5], draft_probs=with_q)
    logits = case["target_logits"]
    logits[:, [f, 30, 52]] = math.inf  # every row: three +inf ids, the first is f
    logits[:, 2] = float("nan")
    logits[:, 5] = -math.inf
    case["target_logits"] = logits
    # r0: f then f (both accepted, bonus f); r1: 30 (another +inf id) rejected -> f; r2: random id
    case["draft_token_ids"] = torch.tensor([f, f, 30, f, 17], dtype=torch.int32)
    if with_q:
        q = torch.softmax(torch.randn(5, v, generator=gen), dim=1)
        case["draft_probs"] = q
    if filt == "top_k":
        case["top_k"] = torch.tensor([2, 5, 1, 3], dtype=torch.int32)
    elif filt == "top_p":
        case["top_p"] = torch.tensor([0.5, 0.9, 0.2, 0.99])
    want_out = [[f, f, f], [f, -1, -1], [f, -1, -1], [f, -1, -1]]
    want_acc = [2, 0, 0, 0]
    for u in (0.0, 0.5, 1.0 - 2.0**-53):
        # q(f) in (0, 1) so u <= 1/q(f) always holds: accepted for every u
        case["uniforms"] = torch.full((5,), u, dtype=torch.float64)
        got = run_op(case, device)
        assert got.output_token_ids.tolist() == want_out, u
        assert got.num_accepted.tolist() == want_acc, u
        assert_matches(got, reference(case), case)
    case["uniforms"] = None
    for offset in range(8):  # Philox draws
        case["offsets"] = torch.full((4,), offset, dtype=torch.int64)
        got = run_op(case, device)
        assert got.output_token_ids.tolist() == want_out, offset
        assert got.num_accepted.tolist() == want_acc, offset


def test_random_single_posinf_is_one_hot(device):
    """One +inf logit: the draft on it is accepted (p = 1, as a one-hot row), so the chain goes on
    to the next draft row; a draft elsewhere is rejected and the +inf id emitted."""
    v = 40
    case = make_case([3, 1], v, torch.Generator().manual_seed(35), temps=1.0)
    logits = case["target_logits"]
    logits[0, 11] = math.inf
    logits[1, 12] = math.inf
    logits[4, 13] = math.inf  # request 1's draft row
    case["target_logits"] = logits
    third = int(torch.argmax(logits[2]))
    case["draft_token_ids"] = torch.tensor([11, 12, third, 20], dtype=torch.int32)
    case["uniforms"] = torch.tensor([0.999, 0.999, 0.0, 0.3], dtype=torch.float64)
    got = run_op(case, device)
    assert got.output_token_ids[0, :3].tolist() == [11, 12, third]
    assert got.num_accepted.tolist() == [3, 0]
    assert got.output_token_ids[1].tolist() == [13, -1, -1, -1]
    assert_matches(got, reference(case), case)


# ---------------------------------------------------------------------------------------------
# top-k / top-p
# ---------------------------------------------------------------------------------------------


def _vllm_style_keep(s: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """vLLM's rule (apply_top_k_top_p): ascending sort; top-k masks below the k-th largest;
    top-p masks the prefix whose cumulative probability is <= 1 - p, keeping the last."""
    asc, idx = torch.sort(s)
    v = s.shape[0]
    if 0 < k < v:
        asc = asc.masked_fill(asc < asc[v - k], -math.inf)
    if p < 1.0:
        probs = torch.softmax(asc, dim=0)
        mask = torch.cumsum(probs, 0) <= 1 - p
        mask[-1] = False
        asc = asc.masked_fill(mask, -math.inf)
    keep = torch.zeros(v, dtype=torch.bool)
    keep[idx] = asc > -math.inf
    return keep


def test_reference_kept_set_matches_vllm_rule_on_distinct_scores():
    gen = torch.Generator().manual_seed(22)
    for trial in range(200):
        v = int(torch.randint(2, 300, (1,), generator=gen))
        s = (torch.randn(v, generator=gen, dtype=torch.float64) * 3).unique()
        s = s[torch.randperm(s.shape[0], generator=gen)]
        k = int(torch.randint(0, s.shape[0] + 2, (1,), generator=gen))
        p = float(torch.rand(1, generator=gen)) if trial % 4 else 1.0
        assert torch.equal(kept_mask(s, k, p), _vllm_style_keep(s, k, p)), (trial, k, p)


def test_top_k_keeps_ties_at_threshold(device):
    v = 40
    case = make_case([0] * 400, v, torch.Generator().manual_seed(23), temps=1.0)
    logits = torch.full((400, v), -5.0)
    logits[:, [4, 9, 17]] = 2.0  # three-way tie for the largest score
    logits[:, 30] = 1.0
    case["target_logits"] = logits
    case["top_k"] = torch.full((400,), 2, dtype=torch.int32)
    got = run_op(case, device).output_token_ids[:, 0]
    assert set(got.tolist()) == {4, 9, 17}  # the tie at the 2nd largest keeps all three


def test_top_p_smallest_set(device):
    """p = [0.5, 0.25, 0.125, 0.125]: top_p 0.45 keeps {0}; 0.55 and 0.7 keep {0, 1}; 0.8 keeps all
    four (the last two are tied: equal scores are kept or cut together)."""
    v = 4
    b = 3000
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125])).repeat(b, 1)
    case = make_case([0] * b, v, torch.Generator().manual_seed(24), temps=1.0)
    case["target_logits"] = logits
    for p, want in ((0.45, {0}), (0.55, {0, 1}), (0.7, {0, 1}), (0.8, {0, 1, 2, 3})):
        case["top_p"] = torch.full((b,), p)
        got = set(run_op(case, device).output_token_ids[:, 0].tolist())
        assert got == want, (p, got)


# ---------------------------------------------------------------------------------------------
# distribution tests (chi-square of the emitted tokens vs the target)
# ---------------------------------------------------------------------------------------------


def _chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    counts = torch.bincount(tokens.long(), minlength=probs.shape[0]).double()
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts[~support]}"
    expected = probs[support] * n
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def _distribution_check(
    device, trials, vocab, k, *, draft_probs, top_k=0, top_p=1.0, temp=0.8, seed=0
):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(k + 1, vocab, generator=gen) * 1.2
    base[:, -1] = -math.inf  # one masked token
    case = make_case([k] * trials, 1, gen, temps=temp)  # layout only; the rest is replaced
    case["target_logits"] = base.repeat(trials, 1)
    case["seeds"] = torch.full((trials,), 20240601 + seed, dtype=torch.int64)
    case["offsets"] = torch.arange(trials, dtype=torch.int64)
    if top_k:
        case["top_k"] = torch.full((trials,), top_k, dtype=torch.int32)
    if top_p < 1.0:
        case["top_p"] = torch.full((trials,), top_p)
    p = []
    for j in range(k + 1):
        s = scores(base[j], temp)
        p.append(target_probs(s, kept_mask(s, top_k, top_p)))
    if draft_probs:
        q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=1)
        q[:, 1] = 0.0  # a token the draft never proposes
        q = q / q.sum(1, keepdim=True)
        drafts = torch.stack(
            [torch.multinomial(q[j], trials, True, generator=gen) for j in range(k)]
        )
        case["draft_token_ids"] = drafts.T.reshape(-1).to(torch.int32)
        case["draft_probs"] = q.repeat(trials, 1)
    else:  # argmax drafting from some other model: fixed drafts per position
        q = None
        # The target's second most likely token (its most likely if the support is 1 token).
        second = [int((pj > 0).sum() > 1) for pj in p[:k]]
        drafts = torch.tensor(
            [int(torch.argsort(p[j], descending=True)[second[j]]) for j in range(k)]
        )
        case["draft_token_ids"] = drafts.repeat(trials).to(torch.int32)
    got = run_op(case, device)
    out, acc = got.output_token_ids, got.num_accepted
    pvals = [_chi2_pvalue(out[:, 0], p[0])]
    sel = acc >= 1
    assert sel.sum() > 1000
    pvals.append(_chi2_pvalue(out[sel, 1], p[1]))
    sel = acc == k
    if sel.sum() > 1000:
        pvals.append(_chi2_pvalue(out[sel, k], p[k]))
    for pv in pvals:
        assert pv > 1e-4, f"emitted distribution differs from the target: p-values {pvals}"
    # Power check: the same statistic rejects a slightly wrong distribution on the same support.
    support = (p[0] > 0).double()
    wrong = 0.85 * p[0] + 0.15 * support / support.sum()
    assert _chi2_pvalue(out[:, 0], wrong) < 1e-6


@pytest.mark.parametrize("draft_probs", [False, True], ids=["argmax_drafts", "draft_probs"])
def test_emitted_distribution_matches_target(draft_probs):
    _distribution_check("cpu", 100_000, 6, 2, draft_probs=draft_probs)


def test_emitted_distribution_top_k_top_p():
    _distribution_check("cpu", 100_000, 9, 2, draft_probs=True, top_k=5, top_p=0.85, seed=1)
    _distribution_check("cpu", 100_000, 9, 2, draft_probs=False, top_k=4, top_p=0.9, seed=2)


@pytest.mark.slow
@pytest.mark.parametrize("draft_probs", [False, True], ids=["argmax_drafts", "draft_probs"])
@pytest.mark.parametrize("top", [(0, 1.0), (20, 0.9)])
def test_emitted_distribution_slow(device, draft_probs, top):
    _distribution_check(
        device, 300_000, 30, 4, draft_probs=draft_probs, top_k=top[0], top_p=top[1], seed=3
    )


# ---------------------------------------------------------------------------------------------
# sizes and strides
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [151936, 201088])
def test_large_vocab(device, vocab):
    gen = torch.Generator().manual_seed(vocab)
    counts = [2, 1, 0]
    case = make_case(
        counts, vocab, gen, temps=[0.0, 0.7, 1.0], dtype=torch.bfloat16, top_k=[0, 0, 50],
        top_p=[1.0, 0.9, 1.0],
    )  # fmt: skip
    got = run_op(case, device)
    assert_matches(got, reference(case), case)


@pytest.mark.parametrize("temps", [0.0, 0.9], ids=["greedy", "random"])
def test_non_contiguous_logits(device, temps):
    gen = torch.Generator().manual_seed(25)
    counts = [3, 0, 2, 4]
    case = make_case(counts, 301, gen, temps=temps, draft_probs=True)
    wide = torch.randn(case["target_logits"].shape[0], 512, generator=gen)
    wide[:, 7 : 7 + 301] = case["target_logits"]
    strided = wide[:, 7 : 7 + 301]
    assert strided.stride(0) == 512
    qwide = torch.zeros(case["draft_probs"].shape[0], 400)
    qwide[:, :301] = case["draft_probs"]
    ref_out = run_op(case, device)
    got = run_op(case, device, target_logits=strided, draft_probs=qwide[:, :301])
    for x, y in zip(ref_out, got, strict=True):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------


def _bad_args(device):
    gen = torch.Generator().manual_seed(26)
    case = make_case([2, 1], 10, gen, temps=[0.0, 1.0], draft_probs=True)
    case["uniforms"] = torch.rand(3, generator=gen, dtype=torch.float64)
    case["top_k"] = torch.tensor([0, 3], dtype=torch.int32)
    case["top_p"] = torch.tensor([1.0, 0.9])
    case["request_mask"] = torch.tensor([True, True])
    case["bonus_token_ids"] = torch.tensor([3, 7], dtype=torch.int32)
    case["exponentials"] = torch.empty(2, 10).exponential_(generator=gen)
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    args["output_token_ids"] = torch.empty(2, 3, dtype=torch.int32, device=device)
    args["num_accepted"] = torch.empty(2, dtype=torch.int32, device=device)
    args["accepted_per_position"] = torch.empty(2, 2, dtype=torch.bool, device=device)
    return args


def _call_raw(a):
    torch.ops.peagle.verify_chain.default(
        a["target_logits"], a["draft_token_ids"], a["cu_num_draft_tokens"], a["temperature"],
        a["seeds"], a["offsets"], a["output_token_ids"], a["num_accepted"], a["top_k"],
        a["top_p"], a["draft_probs"], a["uniforms"], a["request_mask"],
        a["accepted_per_position"], a["bonus_token_ids"], a["exponentials"],
    )  # fmt: skip


def test_bad_args_baseline_is_valid(device):
    _call_raw(_bad_args(device))


BAD_TYPES = {
    "target_logits": (lambda a: a["target_logits"].to(torch.float64), "target_logits"),
    "draft_token_ids": (lambda a: a["draft_token_ids"].long(), "draft_token_ids"),
    "cu_num_draft_tokens": (lambda a: a["cu_num_draft_tokens"].long(), "cu_num_draft_tokens"),
    "temperature": (lambda a: a["temperature"].double(), "temperature"),
    "seeds": (lambda a: a["seeds"].int(), "seeds"),
    "offsets": (lambda a: a["offsets"].float(), "offsets"),
    "top_k": (lambda a: a["top_k"].long(), "top_k"),
    "top_p": (lambda a: a["top_p"].half(), "top_p"),
    "draft_probs": (lambda a: a["draft_probs"].half(), "draft_probs"),
    "uniforms": (lambda a: a["uniforms"].float(), "uniforms"),
    "request_mask": (lambda a: a["request_mask"].int(), "request_mask"),
    "output_token_ids": (lambda a: a["output_token_ids"].long(), "output_token_ids"),
    "num_accepted": (lambda a: a["num_accepted"].long(), "num_accepted"),
    "accepted_per_position": (lambda a: a["accepted_per_position"].int(), "accepted_per_position"),
    "bonus_token_ids": (lambda a: a["bonus_token_ids"].long(), "bonus_token_ids"),
    "exponentials": (lambda a: a["exponentials"].double(), "exponentials"),
}

BAD_SHAPES = {
    "rows_not_T_plus_B": ("target_logits", lambda a: a["target_logits"][:-1], "T \\+ B"),
    "logits_1d": ("target_logits", lambda a: a["target_logits"][0], "target_logits"),
    "logits_col_stride": (
        "target_logits",
        lambda a: a["target_logits"].repeat_interleave(2, dim=1)[:, ::2],
        "unit stride",
    ),
    "drafts_2d": ("draft_token_ids", lambda a: a["draft_token_ids"][None], "draft_token_ids"),
    "temperature": ("temperature", lambda a: a["temperature"][:1], "temperature"),
    "seeds": ("seeds", lambda a: a["seeds"][:1], "seeds"),
    "offsets": ("offsets", lambda a: a["offsets"].repeat(2), "offsets"),
    "top_k": ("top_k", lambda a: a["top_k"][:1], "top_k"),
    "top_p": ("top_p", lambda a: a["top_p"][None], "top_p"),
    "draft_probs_rows": ("draft_probs", lambda a: a["draft_probs"][:2], "draft_probs"),
    "draft_probs_vocab": ("draft_probs", lambda a: a["draft_probs"][:, :5], "draft_probs"),
    "uniforms": ("uniforms", lambda a: a["uniforms"][:2], "uniforms"),
    "request_mask": ("request_mask", lambda a: a["request_mask"][:1], "request_mask"),
    "out_rows": ("output_token_ids", lambda a: a["output_token_ids"][:1], "output_token_ids"),
    "out_cols": ("output_token_ids", lambda a: a["output_token_ids"][:, :0], "output_token_ids"),
    "out_strided": (
        "output_token_ids",
        lambda a: torch.empty(3, 2, dtype=torch.int32, device=a["seeds"].device).T,
        "contiguous",
    ),
    "num_accepted": ("num_accepted", lambda a: a["num_accepted"][:1], "num_accepted"),
    "app_cols": (
        "accepted_per_position",
        lambda a: a["accepted_per_position"][:, :1],
        "accepted_per_position",
    ),
    "bonus_token_ids": (
        "bonus_token_ids",
        lambda a: a["bonus_token_ids"][:, None],
        "bonus_token_ids",
    ),
    "exponentials_rows": ("exponentials", lambda a: a["exponentials"][:1], "exponentials"),
    "exponentials_vocab": ("exponentials", lambda a: a["exponentials"][:, :9], "exponentials"),
    "exponentials_col_stride": (
        "exponentials",
        lambda a: a["exponentials"].repeat_interleave(2, dim=1)[:, ::2],
        "unit stride",
    ),
}


@pytest.mark.parametrize("name", list(BAD_TYPES))
def test_bad_dtype(device, name):
    a = _bad_args(device)
    fn, msg = BAD_TYPES[name]
    a[name] = fn(a)
    with pytest.raises(RuntimeError, match=msg):
        _call_raw(a)


@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_bad_shape(device, case):
    a = _bad_args(device)
    name, fn, msg = BAD_SHAPES[case]
    a[name] = fn(a)
    with pytest.raises(RuntimeError, match=msg):
        _call_raw(a)


BAD_VALUES = {
    "cu_decreasing": ("cu_num_draft_tokens", [2, 1], "non-decreasing"),
    "cu_negative": ("cu_num_draft_tokens", [-1, 3], "non-decreasing"),
    "cu_not_ending_at_T": ("cu_num_draft_tokens", [1, 2], "end at T"),
    "too_many_drafts": ("cu_num_draft_tokens", [0, 3], "max_n"),
    "temperature_negative": ("temperature", [0.0, -0.5], "temperature"),
    "temperature_nan": ("temperature", [float("nan"), 1.0], "temperature"),
    "temperature_inf": ("temperature", [0.0, float("inf")], "temperature"),
    "top_k_negative": ("top_k", [0, -1], "top_k"),
    "top_p_zero": ("top_p", [1.0, 0.0], "top_p"),
    "top_p_above_one": ("top_p", [1.5, 0.9], "top_p"),
    "bonus_id_negative": ("bonus_token_ids", [0, -1], "bonus_token_ids"),
    "bonus_id_too_large": ("bonus_token_ids", [10, 2], "bonus_token_ids"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_cpu(case):
    a = _bad_args("cpu")
    name, values, msg = BAD_VALUES[case]
    a[name] = torch.tensor(values, dtype=a[name].dtype)
    with pytest.raises(RuntimeError, match=msg):
        _call_raw(a)


@requires_cuda
def test_wrong_device():
    a = _bad_args("cuda")
    for name in (
        "draft_token_ids", "temperature", "seeds", "uniforms", "output_token_ids",
        "bonus_token_ids", "exponentials",
    ):  # fmt: skip
        b = dict(a)
        b[name] = b[name].cpu()
        with pytest.raises(RuntimeError, match=name):
            _call_raw(b)


# ---------------------------------------------------------------------------------------------
# torch integration
# ---------------------------------------------------------------------------------------------


def test_opcheck(device):
    a = _bad_args(device)
    args = (
        a["target_logits"], a["draft_token_ids"], a["cu_num_draft_tokens"], a["temperature"],
        a["seeds"], a["offsets"], a["output_token_ids"], a["num_accepted"], a["top_k"],
        a["top_p"], a["draft_probs"], a["uniforms"], a["request_mask"],
        a["accepted_per_position"], a["bonus_token_ids"], a["exponentials"],
    )  # fmt: skip
    torch.library.opcheck(torch.ops.peagle.verify_chain.default, args)


def test_torch_compile_fullgraph(device):
    gen = torch.Generator().manual_seed(27)
    case = make_case([2, 3, 1], 64, gen, temps=[0.0, 0.8, 1.0])
    a = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}

    def step(logits, drafts, cu, temp, seeds, offsets):
        res = verify_chain(logits * 1.0, drafts, cu, temp, seeds, offsets, max_num_draft_tokens=3)
        return res.output_token_ids, res.num_accepted + 0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    args = (
        a["target_logits"], a["draft_token_ids"], a["cu_num_draft_tokens"], a["temperature"],
        a["seeds"], a["offsets"],
    )  # fmt: skip
    want = step(*args)
    got = compiled(*args)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


# ---------------------------------------------------------------------------------------------
# CUDA: agreement with the CPU op, graphs, determinism
# ---------------------------------------------------------------------------------------------


def _agreement(case: Case) -> tuple[VerifyOutput, VerifyOutput]:
    return run_op(case, "cpu"), run_op(case, "cuda")


@requires_cuda
@pytest.mark.parametrize("vocab", [111, 4097, 32001, 151936, 201088])
@pytest.mark.parametrize(
    "variant",
    [
        "greedy", "plain", "draft_probs", "top_k", "top_p", "top_k_top_p", "greedy_bonus_ids",
        "exp_race_bonus_ids", "exp_race_draft_probs_top_k",
    ],
)  # fmt: skip
def test_cuda_matches_cpu(vocab, variant):
    gen = torch.Generator().manual_seed(vocab + len(variant))
    b = 64 if vocab > 40000 else 256
    counts = [int(x) for x in torch.randint(0, 8, (b,), generator=gen)]
    kw = {}
    if variant.startswith("greedy"):
        kw["temps"] = 0.0
    else:
        kw["temps"] = [float(x) for x in torch.rand(b, generator=gen) * 1.5 + 0.2]
    if "draft_probs" in variant:
        kw["draft_probs"] = True
    if "top_k" in variant:
        kw["top_k"] = [int(x) for x in torch.randint(0, 300, (b,), generator=gen)]
    if "top_p" in variant:
        kw["top_p"] = [float(x) for x in torch.rand(b, generator=gen) * 0.9 + 0.1]
    case = make_case(counts, vocab, gen, dtype=torch.bfloat16, scale=2.5, **kw)
    if "bonus_ids" in variant:
        case["bonus_token_ids"] = torch.randint(0, vocab, (b,), generator=gen, dtype=torch.int32)
    if "exp_race" in variant:
        case["exponentials"] = _exponentials(case, gen)
    cpu, cuda = _agreement(case)
    check_invariants(cuda, case)
    same = (cpu.output_token_ids == cuda.output_token_ids).all(dim=1) & (
        cpu.num_accepted == cuda.num_accepted
    )
    if variant.startswith("greedy"):
        assert same.all()
    else:
        # SPEC §0.1: rows may differ only where float rounding flips a comparison (<= 0.1%); with
        # b <= 256 rows that means none in practice, so allow at most one.
        assert int((~same).sum()) <= max(1, int(0.001 * b)), torch.nonzero(~same).flatten()


@requires_cuda
def test_cuda_graph_capture_and_replay():
    gen = torch.Generator().manual_seed(28)
    b, k, v = 8, 7, 32001
    cases = [
        make_case([k] * b, v, gen, temps=[0.0, 0.7] * 4, top_k=[0, 50] * 4, top_p=[1.0, 0.9] * 4)
        for _ in range(3)
    ]
    static = {
        key: (val.cuda().clone() if isinstance(val, torch.Tensor) else val)
        for key, val in cases[0].items()
    }
    out = VerifyOutput(
        torch.empty(b, k + 1, dtype=torch.int32, device="cuda"),
        torch.empty(b, dtype=torch.int32, device="cuda"),
        torch.empty(b, k, dtype=torch.bool, device="cuda"),
    )

    def call():
        verify_chain(
            static["target_logits"], static["draft_token_ids"], static["cu_num_draft_tokens"],
            static["temperature"], static["seeds"], static["offsets"], top_k=static["top_k"],
            top_p=static["top_p"], out=out,
        )  # fmt: skip

    graph = capture_graph(call)
    for c in cases + [cases[0]]:
        for key, val in c.items():
            if isinstance(val, torch.Tensor):
                static[key].copy_(val)
        poison_(out.output_token_ids)
        poison_(out.num_accepted)
        graph.replay()
        torch.cuda.synchronize()
        want = run_op(c, "cpu")
        assert torch.equal(out.output_token_ids.cpu(), want.output_token_ids)
        assert torch.equal(out.num_accepted.cpu(), want.num_accepted)
        assert torch.equal(out.accepted_per_position.cpu(), want.accepted_per_position)


@requires_cuda
@pytest.mark.parametrize("vocab", [111, 4097, 32000, 128256, 151936])
def test_cuda_deterministic(vocab):
    """A5: the same inputs 50 times give bit-identical outputs."""
    gen = torch.Generator().manual_seed(vocab)
    b = 16
    counts = [7] * b
    case = make_case(
        counts, vocab, gen, dtype=torch.bfloat16, temps=[0.0, 0.6, 1.0, 1.4] * 4,
        top_k=[0, 0, 40, 0] * 4, top_p=[1.0, 1.0, 0.9, 0.95] * 4, scale=1.0,
    )  # fmt: skip
    first = run_op(case, "cuda")
    for _ in range(49):
        again = run_op(case, "cuda")
        for x, y in zip(first, again, strict=True):
            assert torch.equal(x, y)
    case["draft_probs"] = torch.softmax(torch.randn(sum(counts), vocab, generator=gen), dim=1)
    first = run_op(case, "cuda")
    for _ in range(10):
        again = run_op(case, "cuda")
        for x, y in zip(first, again, strict=True):
            assert torch.equal(x, y)


def _same_rows(a: VerifyOutput, b: VerifyOutput) -> torch.Tensor:
    same_tokens = (a.output_token_ids == b.output_token_ids).all(dim=1)
    return same_tokens & (a.num_accepted == b.num_accepted)


# row_filter's three ways to the kept-set threshold (verify_chain_filter.cuh): candidates above
# a bound (top-k: split maxima; top-p: m - D), every element a candidate (bound -inf and
# V <= 4096), and radix passes over the whole row (candidates overflow 4096: flat top-p,
# top_k > 256 on a large vocabulary).
FILTER_PATHS = {
    "top_k_candidates": dict(vocab=32001, scale=3.0, top_k=(1, 256), top_p=None),
    "top_p_candidates": dict(vocab=32001, scale=4.0, top_k=None, top_p=(0.5, 0.95)),
    "top_k_top_p_candidates": dict(vocab=151936, scale=3.0, top_k=(1, 100), top_p=(0.3, 0.99)),
    "all_candidates": dict(vocab=1000, scale=2.0, top_k=(257, 999), top_p=(0.6, 1.0)),
    "fallback_flat_top_p": dict(vocab=32001, scale=0.05, top_k=None, top_p=(0.8, 0.95)),
    "fallback_large_top_k": dict(vocab=32001, scale=2.0, top_k=(300, 3000), top_p=(0.7, 1.0)),
}


@requires_cuda
@pytest.mark.parametrize("path", list(FILTER_PATHS))
def test_cuda_filter_paths_match_cpu(path):
    cfg = FILTER_PATHS[path]
    gen = torch.Generator().manual_seed(len(path))
    b = 24
    counts = [int(x) for x in torch.randint(0, 8, (b,), generator=gen)]
    kw = {}
    if cfg["top_k"] is not None:
        lo, hi = cfg["top_k"]
        kw["top_k"] = [int(x) for x in torch.randint(lo, hi + 1, (b,), generator=gen)]
    if cfg["top_p"] is not None:
        lo, hi = cfg["top_p"]
        kw["top_p"] = [float(x) for x in torch.rand(b, generator=gen) * (hi - lo) + lo]
    temps = [float(x) for x in torch.rand(b, generator=gen) + 0.5]
    case = make_case(
        counts, cfg["vocab"], gen, temps=temps, dtype=torch.bfloat16, scale=cfg["scale"], **kw
    )
    cpu, cuda = _agreement(case)
    check_invariants(cuda, case)
    assert int((~_same_rows(cpu, cuda)).sum()) <= 1
    again = run_op(case, "cuda")
    for x, y in zip(cuda, again, strict=True):
        assert torch.equal(x, y)


@requires_cuda
def test_cuda_many_requests_loop_over_the_grid():
    """B = 70000 requests and ~140000 rows: past the 65535 grid-y limit every kernel loops."""
    gen = torch.Generator().manual_seed(42)
    b = 70000
    counts = [int(x) for x in torch.randint(0, 3, (b,), generator=gen)]
    temps = [0.0 if x < 0.4 else 0.9 for x in torch.rand(b, generator=gen).tolist()]
    top_k = [int(x) for x in torch.randint(0, 6, (b,), generator=gen)]
    case = make_case(counts, 7, gen, temps=temps, top_k=top_k, scale=1.5)
    case["request_mask"] = torch.rand(b, generator=gen) < 0.95
    cpu, cuda = _agreement(case)
    check_invariants(cuda, case)
    same = _same_rows(cpu, cuda)
    greedy = torch.tensor(temps) == 0.0
    assert same[greedy].all()
    assert int((~same).sum()) <= int(0.001 * b)


@requires_cuda
@pytest.mark.parametrize("parity", [False, True], ids=["philox", "vllm_inputs"])
def test_cuda_graph_replay_is_bit_identical_to_eager(parity):
    """Counters zeroed in-kernel and the programmatic launches inside a graph: every replay
    equals the eager call on the same inputs, bit for bit (filtered rows, recovered and bonus
    tokens, and with parity inputs the exponential race and given bonus ids)."""
    gen = torch.Generator().manual_seed(43 + parity)
    b, k, v = 16, 7, 32001
    kw = {"temps": [0.0, 0.7, 1.0, 1.3] * 4, "top_k": [0, 50, 0, 5] * 4}
    kw["top_p"] = [1.0, 0.9, 0.8, 1.0] * 4
    cases = [make_case([k] * b, v, gen, dtype=torch.bfloat16, p_follow=0.9, **kw) for _ in range(3)]
    for c in cases:
        if parity:
            c["exponentials"] = _exponentials(c, gen)
            c["bonus_token_ids"] = torch.randint(0, v, (b,), generator=gen, dtype=torch.int32)
            c["uniforms"] = torch.rand(b * k, generator=gen, dtype=torch.float64)
    static = {
        key: (val.cuda().clone() if isinstance(val, torch.Tensor) else val)
        for key, val in cases[0].items()
    }
    out = VerifyOutput(
        torch.empty(b, k + 1, dtype=torch.int32, device="cuda"),
        torch.empty(b, dtype=torch.int32, device="cuda"),
        torch.empty(b, k, dtype=torch.bool, device="cuda"),
    )

    def call():
        verify_chain(
            static["target_logits"], static["draft_token_ids"], static["cu_num_draft_tokens"],
            static["temperature"], static["seeds"], static["offsets"], top_k=static["top_k"],
            top_p=static["top_p"], uniforms=static["uniforms"],
            bonus_token_ids=static["bonus_token_ids"], exponentials=static["exponentials"],
            out=out,
        )  # fmt: skip

    # Two calls per replay: the second must not see the first's counters.
    graph = capture_graph(lambda: (call(), call()))
    for c in cases + cases[::-1]:
        want = run_op(c, "cuda")
        for key, val in c.items():
            if isinstance(val, torch.Tensor):
                static[key].copy_(val)
        poison_(out.output_token_ids)
        poison_(out.num_accepted)
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(out, want, strict=True):
            assert torch.equal(x.cpu(), y)
        check_invariants(VerifyOutput(*(t.cpu() for t in out)), c)


_PDL_SNIPPET = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_verify_chain import make_case, run_op
gen = torch.Generator().manual_seed(44)
case = make_case([7, 0, 3, 5], 32001, gen, temps=[0.0, 0.8, 1.1, 0.6], dtype=torch.bfloat16,
                 top_k=[0, 40, 0, 3], top_p=[1.0, 0.9, 0.8, 1.0])
got = run_op(case, "cuda")
torch.save(tuple(t.clone() for t in got), {path!r})
"""


@requires_cuda
def test_cuda_plain_launches_match_programmatic(tmp_path):
    """PEAGLE_DISABLE_PDL=1 (plain launches, read once per process, hence a subprocess) gives the
    same bits as the programmatic dependent launches."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    out = {}
    for flag in ("0", "1"):
        path = str(tmp_path / f"pdl{flag}.pt")
        env = dict(os.environ, PEAGLE_DISABLE_PDL=flag)
        code = _PDL_SNIPPET.format(tests=tests, path=path)
        subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
        out[flag] = torch.load(path)
    for x, y in zip(out["0"], out["1"], strict=True):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# CUDA: the one-kernel (fused) path, PEAGLE_VERIFY_FUSED=1 (read at every call). It must give the
# unfused path's bits exactly (same code on the same inputs, only the scheduling differs), leave
# its persistent counters zeroed (repeated calls, graph replays) and fall back to the unfused
# path where it does not apply (top-k / top-p).
# ---------------------------------------------------------------------------------------------


def _fused_and_unfused(case: Case, monkeypatch, max_n: int | None = None):
    monkeypatch.delenv("PEAGLE_VERIFY_FUSED", raising=False)
    plain = run_op(case, "cuda", max_n=max_n)
    monkeypatch.setenv("PEAGLE_VERIFY_FUSED", "1")
    fused = run_op(case, "cuda", max_n=max_n)
    monkeypatch.delenv("PEAGLE_VERIFY_FUSED", raising=False)
    return plain, fused


def _assert_same(a: VerifyOutput, b: VerifyOutput) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x, y)


FUSED_CASES = {
    # name: (counts, vocab, temps, extra)
    "b1_random": ([7], 201088, [0.7], {}),
    "b1_greedy": ([7], 201088, [0.0], {}),
    "b64_random": ([7] * 64, 201088, 0.7, {}),
    "b64_mixed": ([7] * 64, 151936, [0.0, 0.7, 1.2, 0.4] * 16, {}),
    "k1": ([1] * 16, 32001, 0.9, {}),
    "ragged": (
        [0, 3, 7, 1, 0, 5, 2, 7, 4],
        4097,
        [0.8, 0.0, 1.1, 0.6, 0.0, 0.9, 1.5, 0.7, 0.3],
        {},
    ),
    "odd_vocab": ([3, 5, 2, 6], 111, 1.0, {}),
    "tiny_vocab": ([2, 0, 3], 5, [0.5, 1.0, 0.0], {}),
    "draft_probs": ([7] * 8, 32001, 0.8, {"draft_probs": True}),
    "exponentials": ([7] * 8, 32001, 0.8, {"exp_race": True}),
    "bonus_ids": ([7] * 8, 32001, [0.0, 0.8] * 4, {"bonus_ids": True}),
    "request_mask": ([7, 3, 0, 7, 5, 7], 32001, 0.8, {"mask": True}),
    "many_requests": ([int(i % 4) for i in range(3000)], 37, 0.9, {}),
}


@requires_cuda
@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_cuda_fused_matches_unfused(name, monkeypatch):
    counts, vocab, temps, extra = FUSED_CASES[name]
    gen = torch.Generator().manual_seed(len(name) * 31 + vocab)
    case = make_case(
        counts, vocab, gen, temps=temps, dtype=torch.bfloat16, scale=3.0, p_follow=0.8,
        draft_probs=extra.get("draft_probs", False),
    )  # fmt: skip
    b = case.b
    if extra.get("exp_race"):
        case["exponentials"] = _exponentials(case, gen)
    if extra.get("bonus_ids"):
        case["bonus_token_ids"] = torch.randint(0, vocab, (b,), generator=gen, dtype=torch.int32)
    if extra.get("mask"):
        case["request_mask"] = torch.tensor([True, False, True, True, False, True])
    plain, fused = _fused_and_unfused(case, monkeypatch)
    check_invariants(fused, case)
    _assert_same(plain, fused)
    # Repeated calls reuse the counters: still the same bits.
    monkeypatch.setenv("PEAGLE_VERIFY_FUSED", "1")
    for _ in range(3):
        _assert_same(run_op(case, "cuda"), fused)
    # A smaller max_num_draft_tokens clamps the chains (rows past it are skipped items).
    if max(counts) > 2:
        plain2, fused2 = _fused_and_unfused(case, monkeypatch, max_n=2)
        _assert_same(plain2, fused2)


@requires_cuda
def test_cuda_fused_edge_rows(monkeypatch):
    """+inf rows, all -inf rows, NaN rows and a one-hot row through the fused path."""
    gen = torch.Generator().manual_seed(77)
    v = 4097
    case = make_case([3, 3, 3, 3, 2], v, gen, temps=[0.7, 0.0, 1.0, 0.9, 0.6], scale=2.0)
    lg = case["target_logits"]
    lg[0, 17] = math.inf
    lg[0, 900] = math.inf
    lg[3, :] = -math.inf
    lg[7, :] = float("nan")
    lg[10, :] = -math.inf
    lg[10, 5] = 1.0
    lg[15] = math.inf  # a whole +inf bonus row
    plain, fused = _fused_and_unfused(case, monkeypatch)
    check_invariants(fused, case)
    _assert_same(plain, fused)
    assert_matches(fused, reference(case), case)


@requires_cuda
@pytest.mark.parametrize(
    "top", [(1, 1.0), (4097, 1.0), (0, 1.0), (50, 0.9), (0, 1e-6), (0, 0.5)],
    ids=["top_k_1", "top_k_ge_v", "off", "top_k_top_p", "tiny_top_p", "top_p"],
)  # fmt: skip
def test_cuda_fused_falls_back_with_filters(top, monkeypatch):
    """With top_k / top_p tensors the plan keeps the unfused path: same bits either way."""
    gen = torch.Generator().manual_seed(78)
    b, v = 12, 4097
    case = make_case(
        [7] * b, v, gen, temps=0.8, dtype=torch.bfloat16, top_k=[top[0]] * b, top_p=[top[1]] * b
    )
    plain, fused = _fused_and_unfused(case, monkeypatch)
    _assert_same(plain, fused)
    assert_matches(fused, reference(case), case)


@requires_cuda
@pytest.mark.parametrize("b", [1, 64])
def test_cuda_fused_graph_replay(b, monkeypatch):
    """Counters reset by the last CTAs: graph replays (two calls per replay) equal eager calls,
    and eager calls after the replays still do."""
    monkeypatch.setenv("PEAGLE_VERIFY_FUSED", "1")
    gen = torch.Generator().manual_seed(79 + b)
    k, v = 7, 201088 if b == 1 else 32001
    temps = [0.0, 0.7, 1.0, 1.3] * (b // 4) if b >= 4 else [0.7]
    cases = [make_case([k] * b, v, gen, dtype=torch.bfloat16, temps=temps) for _ in range(3)]
    static = {
        key: (val.cuda().clone() if isinstance(val, torch.Tensor) else val)
        for key, val in cases[0].items()
    }
    out = VerifyOutput(
        torch.empty(b, k + 1, dtype=torch.int32, device="cuda"),
        torch.empty(b, dtype=torch.int32, device="cuda"),
        torch.empty(b, k, dtype=torch.bool, device="cuda"),
    )

    def call():
        verify_chain(
            static["target_logits"], static["draft_token_ids"], static["cu_num_draft_tokens"],
            static["temperature"], static["seeds"], static["offsets"], out=out,
        )  # fmt: skip

    call()  # the counters exist before capture
    torch.cuda.synchronize()
    graph = capture_graph(lambda: (call(), call()))
    for c in cases + cases[::-1]:
        monkeypatch.delenv("PEAGLE_VERIFY_FUSED", raising=False)
        want = run_op(c, "cuda")
        monkeypatch.setenv("PEAGLE_VERIFY_FUSED", "1")
        for key, val in c.items():
            if isinstance(val, torch.Tensor):
                static[key].copy_(val)
        poison_(out.output_token_ids)
        poison_(out.num_accepted)
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(out, want, strict=True):
            assert torch.equal(x.cpu(), y)
        _assert_same(run_op(c, "cuda"), want)


# ---------------------------------------------------------------------------------------------
# CUDA: top-k candidates collected in row_stats, PEAGLE_VERIFY_TOPK_IN_STATS=1 (read at every
# call). row_filter thresholds rows with top_k <= 64 from them without reading the row again
# where they prove the threshold, else takes the default path: the kept set and its integer mass
# are exact either way, so the outputs must be the default path's bits.
# ---------------------------------------------------------------------------------------------


def _topk_in_stats_both(case: Case, monkeypatch):
    monkeypatch.delenv("PEAGLE_VERIFY_TOPK_IN_STATS", raising=False)
    plain = run_op(case, "cuda")
    monkeypatch.setenv("PEAGLE_VERIFY_TOPK_IN_STATS", "1")
    cands = run_op(case, "cuda")
    monkeypatch.delenv("PEAGLE_VERIFY_TOPK_IN_STATS", raising=False)
    return plain, cands


@requires_cuda
@pytest.mark.parametrize("top_p", [0.5, 0.9, 1.0])
@pytest.mark.parametrize("top_k", [1, 50, 64, 1000])
@pytest.mark.parametrize("ties", ["none", "quantised", "tied_top"])
@pytest.mark.parametrize("vocab", [4097, 201088])
def test_cuda_topk_in_stats_matches_default(top_k, top_p, ties, vocab, monkeypatch):
    gen = torch.Generator().manual_seed(top_k * 7 + int(top_p * 10) + vocab + len(ties))
    counts = [0, 3, 7, 1, 5, 2, 7, 4]
    b = len(counts)
    case = make_case(
        counts, vocab, gen, temps=[0.7, 0.0, 1.1, 0.6, 0.9, 1.5, 0.7, 0.3],
        dtype=torch.bfloat16, scale=3.0, p_follow=0.8,
        top_k=[top_k, top_k, 0, top_k, top_k, 2, top_k, top_k], top_p=[top_p] * b,
    )  # fmt: skip
    lg = case["target_logits"]
    if ties == "quantised":
        lg.copy_((lg * 2).round() / 2)
    elif ties == "tied_top":
        lg[:, 3::11] = lg.max()
        lg[:, ::7] = -math.inf
        lg[:, 64:80] = lg.max() + 1  # a tied block of maxima in one thread's vectors
    plain, cands = _topk_in_stats_both(case, monkeypatch)
    check_invariants(cands, case)
    _assert_same(plain, cands)


@requires_cuda
@pytest.mark.parametrize("b", [1, 64])
def test_cuda_topk_in_stats_bench_shape(b, monkeypatch):
    """The issue's shape (K=7, V=201088, T=0.7, top_k=50, top_p=0.9), float32 and bf16 logits."""
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(b)
        case = make_case(
            [7] * b, 201088, gen, temps=0.7, dtype=dtype, scale=3.0, p_follow=0.8,
            top_k=[50] * b, top_p=[0.9] * b,
        )  # fmt: skip
        plain, cands = _topk_in_stats_both(case, monkeypatch)
        _assert_same(plain, cands)
        assert_matches(cands, reference(case), case)


# ---------------------------------------------------------------------------------------------
# CUDA: row_filter ranks candidate sets of up to kRankMax keys (rank_select) and selects larger
# ones by radix digits; PEAGLE_VERIFY_RADIX_SELECT=1 (read at every call) forces the digits. Both
# find the same kept set and integer kept mass, so the outputs must be the same bits.
# ---------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize(
    "top_k,top_p",
    [(1, None), (50, None), (256, None), (50, 0.9), (7, 0.5), (None, 0.9), (200, 1e-6)],
)
@pytest.mark.parametrize("ties", ["none", "quantised", "tied_top"])
@pytest.mark.parametrize("vocab", [1000, 32001, 201088])
def test_cuda_rank_select_matches_radix(top_k, top_p, ties, vocab, monkeypatch):
    gen = torch.Generator().manual_seed(vocab + len(ties) + (top_k or 0))
    counts = [0, 3, 7, 1, 5, 2, 7, 4]
    kw = {}
    if top_k is not None:
        kw["top_k"] = [top_k, top_k, 0, top_k, top_k, 2, top_k, top_k]
    if top_p is not None:
        kw["top_p"] = [top_p, 1.0, top_p, top_p, top_p, 0.95, top_p, top_p]
    case = make_case(
        counts, vocab, gen, temps=[0.7, 0.0, 1.1, 0.6, 0.9, 1.5, 0.7, 0.3],
        dtype=torch.bfloat16, scale=3.0, p_follow=0.8, **kw,
    )  # fmt: skip
    lg = case["target_logits"]
    if ties == "quantised":
        lg.copy_((lg * 2).round() / 2)
    elif ties == "tied_top":
        lg[:, 3::11] = lg.max()
        lg[:, ::7] = -math.inf
        lg[:, 64:80] = lg.max() + 1
    monkeypatch.delenv("PEAGLE_VERIFY_RADIX_SELECT", raising=False)
    ranked = run_op(case, "cuda")
    monkeypatch.setenv("PEAGLE_VERIFY_RADIX_SELECT", "1")
    radix = run_op(case, "cuda")
    monkeypatch.delenv("PEAGLE_VERIFY_RADIX_SELECT", raising=False)
    check_invariants(ranked, case)
    _assert_same(ranked, radix)


# ---------------------------------------------------------------------------------------------
# chunk sampling (the default without top-k/top-p, draft_probs and exponentials) vs the tiled
# path (PEAGLE_VERIFY_CHUNKS=0); SPEC §0.1: draws may differ only where rounding moves them
# ---------------------------------------------------------------------------------------------


def _shifted_rows(logits: torch.Tensor, shift: int) -> torch.Tensor:
    """The same values in rows starting `shift` elements into a wider buffer: every row's first
    16-byte boundary (the kernels' unaligned head) moves."""
    if shift == 0:
        return logits
    shape = (logits.shape[0], logits.shape[1] + shift + 5)
    wide = torch.full(shape, float("nan"), dtype=logits.dtype, device=logits.device)
    wide[:, shift : shift + logits.shape[1]] = logits
    return wide[:, shift : shift + logits.shape[1]]


def _chunked_and_tiled(case: Case, monkeypatch) -> tuple[VerifyOutput, VerifyOutput]:
    monkeypatch.setenv("PEAGLE_VERIFY_CHUNKS", "0")
    tiled = run_op(case, "cuda")
    monkeypatch.setenv("PEAGLE_VERIFY_CHUNKS", "1")
    return run_op(case, "cuda"), tiled


@requires_cuda
@pytest.mark.parametrize(
    "vocab,b,reps",
    [(201088, 1, 48), (201088, 64, 3), (201088, 160, 2), (151936, 8, 12), (32001, 256, 2),
     (4097, 3, 40), (111, 16, 20), (7, 5, 30)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shift", [0, 3])
def test_cuda_chunk_sampling_matches_tiled(vocab, b, reps, dtype, shift, monkeypatch):
    # Chunk sizes: B=1 ~500 tokens (one 2048-token tile), B=64 ~8.4K (5 tiles: one register
    # round), B=160 ~12.6K (7 tiles: two rounds).
    gen = torch.Generator().manual_seed(vocab + b + shift + int(dtype.itemsize))
    counts = [int(x) for x in torch.randint(0, 8, (b,), generator=gen)]
    temps = [float(x) for x in torch.rand(b, generator=gen) * 1.5 + 0.2]
    temps[0] = 0.0 if b > 4 else temps[0]  # a greedy request among random ones
    # Peaked rows and drafts that mostly follow the argmax: rejected drafts often hold most of
    # their chunk's mass (the excluded chunk is recomputed without them).
    case = make_case(counts, vocab, gen, temps=temps, dtype=dtype, scale=4.0, p_follow=0.9)
    # On the device: run_op's .to("cuda") of a CPU view would make it contiguous again.
    case["target_logits"] = _shifted_rows(case["target_logits"].cuda(), shift)
    sampled = differ = 0
    for rep in range(reps):
        case["offsets"] = torch.arange(b, dtype=torch.int64) * 5 + 1000 * rep
        chunked, tiled = _chunked_and_tiled(case, monkeypatch)
        check_invariants(chunked, case)
        assert torch.equal(chunked.num_accepted, tiled.num_accepted)  # the decisions are shared
        same = (chunked.output_token_ids == tiled.output_token_ids).all(dim=1)
        sampled += sum(1 for t in temps if t > 0)
        differ += int((~same).sum())
    assert sampled > 0
    assert differ <= max(1, int(0.001 * sampled)), (differ, sampled)


@requires_cuda
@pytest.mark.parametrize("vocab,b", [(201088, 64), (32001, 8), (4097, 3)])
@pytest.mark.parametrize("splits", ["1", "5", "8"])
def test_cuda_stats_splits_override(vocab, b, splits, monkeypatch):
    """PEAGLE_VERIFY_STATS_SPLITS (a sweep knob) changes how a row's statistics are split and
    hence chunk sampling's chunks: greedy requests keep their bits, decisions agree, and sampled
    tokens agree except where rounding moves a draw across a chunk boundary (as between chunk
    and tiled sampling)."""
    gen = torch.Generator().manual_seed(vocab + b + int(splits))
    counts = [int(x) for x in torch.randint(0, 8, (b,), generator=gen)]
    temps = [float(x) for x in torch.rand(b, generator=gen) * 1.5 + 0.2]
    temps[0] = 0.0
    case = make_case(counts, vocab, gen, temps=temps, dtype=torch.bfloat16, scale=4.0, p_follow=0.9)
    monkeypatch.setenv("PEAGLE_VERIFY_CHUNKS", "1")
    sampled = differ = 0
    for rep in range(3):
        case["offsets"] = torch.arange(b, dtype=torch.int64) * 5 + 1000 * rep
        monkeypatch.delenv("PEAGLE_VERIFY_STATS_SPLITS", raising=False)
        base = run_op(case, "cuda")
        monkeypatch.setenv("PEAGLE_VERIFY_STATS_SPLITS", splits)
        got = run_op(case, "cuda")
        check_invariants(got, case)
        assert torch.equal(got.num_accepted, base.num_accepted)
        assert torch.equal(got.output_token_ids[0], base.output_token_ids[0])  # greedy
        same = (got.output_token_ids == base.output_token_ids).all(dim=1)
        sampled += sum(1 for t in temps if t > 0)
        differ += int((~same).sum())
    assert differ <= max(1, int(0.001 * sampled)), (differ, sampled)


def _run_peak_extra(case):
    """run_op on CUDA and the peak CUDA memory it requested above what was requested before it.

    Requested bytes, not the caching allocator's allocated bytes: a request served by a cached
    block too small to split is counted as the whole block, so two workspaces ~0.6 MB apart
    could both count as the same cached 14 MB block when an earlier test in the worker left one
    (test_cuda_kept_sampling_matches_tiled saw equal peaks under pytest-xdist). Garbage is
    collected first and the collector held off meanwhile: a tensor of an earlier test freed during
    the call would otherwise leave the peak at the level before the call."""
    gc.collect()
    gc.disable()
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_stats()["requested_bytes.all.current"]
        torch.cuda.reset_peak_memory_stats()
        out = run_op(case, "cuda")
        torch.cuda.synchronize()
        return out, torch.cuda.memory_stats()["requested_bytes.all.peak"] - base
    finally:
        gc.enable()


# row_filter reads only the groups of kGroupVecs vectors whose maximum (row_stats' group_max)
# reaches the candidate bound; PEAGLE_VERIFY_FILTER_STREAM=1 (read at every call) reads every
# filtered row whole. Same candidates, so the same bits: ragged B, odd vocabularies, every logits
# dtype, unaligned rows, NaN / inf among the logits, ties, B > the grid's rows per split.
@requires_cuda
@pytest.mark.parametrize(
    "vocab,b,groups",
    [(201088, 64, True), (151936, 64, True), (65537, 200, True), (201088, 1, False),
     (151936, 8, False), (1000, 5, False)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shift", [0, 3])
@pytest.mark.parametrize("top", ["top_k", "top_p", "both"])
def test_cuda_filter_groups_match_stream(vocab, b, groups, dtype, shift, top, monkeypatch):
    gen = torch.Generator().manual_seed(vocab + b + shift + int(dtype.itemsize) + len(top))
    counts = [int(x) for x in torch.randint(0, 8, (b,), generator=gen)]
    temps = [float(x) for x in torch.rand(b, generator=gen) * 1.5 + 0.2]
    temps[0] = 0.0 if b > 4 else temps[0]
    kw = {}
    if top in ("top_k", "both"):
        kw["top_k"] = [int(x) for x in torch.randint(1, 300, (b,), generator=gen)]
    if top in ("top_p", "both"):
        kw["top_p"] = [float(x) for x in torch.rand(b, generator=gen) * 0.9 + 0.05]
    case = make_case(counts, vocab, gen, temps=temps, dtype=dtype, scale=3.0, p_follow=0.8, **kw)
    lg = case["target_logits"]
    lg[:, 5::97] = float("nan")  # never candidates, never group maxima
    lg[:, 11::389] = -math.inf
    lg[0, vocab // 2 : vocab // 2 + 9] = lg[0].nan_to_num(nan=-math.inf).max() + 0.5  # tied top
    if vocab > 1300:  # top scores 128 / 256 / 512 elements apart: two in one thread's group
        for d in (0, 128, 256, 512):
            lg[1::2, 700 + d] = lg.nan_to_num(nan=-math.inf).max() + 0.25
    if shift:  # quantised: ties, many groups with several candidates
        lg.copy_((lg * 2).round() / 2)
    case["target_logits"] = _shifted_rows(lg.cuda(), shift)
    peaks = []
    outs = []
    for stream in (True, False):
        if stream:
            monkeypatch.setenv("PEAGLE_VERIFY_FILTER_STREAM", "1")
        else:
            monkeypatch.delenv("PEAGLE_VERIFY_FILTER_STREAM", raising=False)
        run_op(case, "cuda")  # allocations of the first call settle
        out, peak = _run_peak_extra(case)
        outs.append(out)
        peaks.append(peak)
    check_invariants(outs[1], case)
    _assert_same(outs[1], outs[0])
    # The group path's workspace holds the group maxima (verify_chain_heuristics.h decides).
    assert (peaks[1] > peaks[0]) == groups, peaks


@requires_cuda
@pytest.mark.slow
@pytest.mark.parametrize("shift", [0, 1])
def test_cuda_chunk_sampling_distribution(shift):
    """Emitted first tokens follow the target with the support spread over every chunk, the
    draft (rejected half the time) dominating its chunk, and rows whose unaligned head varies
    (odd vocabulary, bf16): chi-square, with a power check."""
    vocab, trials, temp = 4099, 100_000, 1.0
    gen = torch.Generator().manual_seed(99 + shift)
    row = torch.full((vocab,), -math.inf)
    support = torch.linspace(0, vocab - 1, 48).round().long()
    row[support] = torch.randn(48, generator=gen) * 0.5
    x = int(support[24]) + 1  # the draft, next to a support token of small mass
    row[x] = 3.5
    row[x + 2] = -1.0
    logits = torch.stack([row, torch.randn(vocab, generator=gen)]).to(torch.bfloat16)
    case = make_case([1] * trials, 1, gen, temps=temp)  # layout only; the rest is replaced
    big = logits.cuda().repeat(trials, 1)
    case["target_logits"] = _shifted_rows(big, shift) if shift else big
    case["draft_token_ids"] = torch.full((trials,), x, dtype=torch.int32)
    case["seeds"] = torch.full((trials,), 4242 + shift, dtype=torch.int64)
    case["offsets"] = torch.arange(trials, dtype=torch.int64)
    got = run_op(case, "cuda")
    s = scores(logits[0].float(), temp)
    p = target_probs(s, kept_mask(s, 0, 1.0))
    assert 0.3 < float(p[x]) < 0.8 and float((got.num_accepted == 0).float().mean()) > 0.2
    assert _chi2_pvalue(got.output_token_ids[:, 0], p) > 1e-4
    wrong = 0.9 * p + 0.1 * (p > 0).double() / float((p > 0).sum())
    assert _chi2_pvalue(got.output_token_ids[:, 0], wrong) < 1e-6


# Kept sampling (group path, argmax drafts): decide_sample draws from row_filter's kept lists;
# PEAGLE_VERIFY_KEPT_SAMPLING=0 reads the sampled rows (tiled path). The decisions are shared and
# a draw may differ only where rounding moves it across a token boundary (SPEC §0.1).
@requires_cuda
@pytest.mark.parametrize("vocab,b,reps", [(201088, 64, 4), (65537, 200, 2), (40961, 600, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shift", [0, 3])
def test_cuda_kept_sampling_matches_tiled(vocab, b, reps, dtype, shift, monkeypatch):
    gen = torch.Generator().manual_seed(vocab + b + shift + int(dtype.itemsize))
    counts = [int(x) for x in torch.randint(0, 8, (b,), generator=gen)]
    temps = [float(x) for x in torch.rand(b, generator=gen) * 1.5 + 0.2]
    temps[0] = 0.0
    top_k = [int(x) for x in torch.randint(1, 300, (b,), generator=gen)]  # > 256: no list
    top_p = [float(x) for x in torch.rand(b, generator=gen) * 0.9 + 0.1]
    top_p[1] = 1.0
    case = make_case(
        counts, vocab, gen, temps=temps, dtype=dtype, scale=4.0, p_follow=0.9, top_k=top_k,
        top_p=top_p,
    )  # fmt: skip
    lg = case["target_logits"]
    lg[:, 5::97] = float("nan")
    lg[2, vocab // 3 : vocab // 3 + 40] = lg[2].nan_to_num(nan=-math.inf).max() + 1.0  # tied top
    case["target_logits"] = _shifted_rows(lg.cuda(), shift)
    sampled = differ = 0
    peaks = []
    for rep in range(reps):
        case["offsets"] = torch.arange(b, dtype=torch.int64) * 5 + 1000 * rep
        outs = []
        for kept in ("1", "0"):
            monkeypatch.setenv("PEAGLE_VERIFY_KEPT_SAMPLING", kept)
            run_op(case, "cuda")
            out, peak = _run_peak_extra(case)
            outs.append(out)
            peaks.append(peak)
        monkeypatch.delenv("PEAGLE_VERIFY_KEPT_SAMPLING", raising=False)
        kept_out, tiled = outs
        check_invariants(kept_out, case)
        assert torch.equal(kept_out.num_accepted, tiled.num_accepted)
        same = (kept_out.output_token_ids == tiled.output_token_ids).all(dim=1)
        sampled += sum(1 for t in temps if t > 0)
        differ += int((~same).sum())
    assert differ <= max(1, int(0.001 * sampled)), (differ, sampled)
    assert peaks[0] > peaks[1], peaks  # the kept lists were allocated: the group path ran


@requires_cuda
@pytest.mark.slow
def test_cuda_kept_sampling_distribution():
    """Kept sampling's emitted first tokens follow the top-k/top-p target, with the draft (rejected
    about half the time) among the kept tokens and the support spread over many groups and
    splits: chi-square, with a power check."""
    vocab, trials, temp, top_k, top_p = 40961, 20_000, 1.0, 20, 0.95
    gen = torch.Generator().manual_seed(7)
    row = torch.randn(vocab, generator=gen) - 12.0
    support = torch.linspace(3, vocab - 4, 48).round().long()
    row[support] = torch.randn(48, generator=gen) * 0.5
    x = int(support[24])
    row[x] = 3.0
    logits = torch.stack([row, torch.randn(vocab, generator=gen)]).to(torch.bfloat16)
    case = make_case([1] * trials, 1, gen, temps=temp)  # layout only; the rest is replaced
    case["target_logits"] = logits.cuda().repeat(trials, 1)
    case["draft_token_ids"] = torch.full((trials,), x, dtype=torch.int32)
    case["seeds"] = torch.full((trials,), 4343, dtype=torch.int64)
    case["offsets"] = torch.arange(trials, dtype=torch.int64)
    case["top_k"] = torch.full((trials,), top_k, dtype=torch.int32)
    case["top_p"] = torch.full((trials,), top_p)
    got = run_op(case, "cuda")
    s = scores(logits[0].float(), temp)
    p = target_probs(s, kept_mask(s, top_k, top_p))
    assert 0.2 < float(p[x]) < 0.8 and float((got.num_accepted == 0).float().mean()) > 0.2
    assert _chi2_pvalue(got.output_token_ids[:, 0], p) > 1e-4
    wrong = 0.9 * p + 0.1 * (p > 0).double() / float((p > 0).sum())
    assert _chi2_pvalue(got.output_token_ids[:, 0], wrong) < 1e-6


@requires_cuda
def test_cuda_fused_chunk_sampling_resets_counters_on_empty_rows(monkeypatch):
    """Fused path + chunk sampling: a sampled row without mass (all -inf, NaN or +inf; no drafts,
    so the bonus row is sampled at once) must still reset the request's counters, or the next
    launch's sampling item reads a stale decision."""
    monkeypatch.setenv("PEAGLE_VERIFY_CHUNKS", "1")
    gen = torch.Generator().manual_seed(81)
    v, counts = 4097, [0, 2, 0, 0, 3]
    temps = [0.8, 0.9, 1.1, 0.7, 1.0]
    empty = make_case(counts, v, gen, temps=temps, dtype=torch.bfloat16)
    empty["target_logits"][0] = -math.inf
    empty["target_logits"][4] = float("nan")
    empty["target_logits"][5] = math.inf
    normal = make_case(counts, v, gen, temps=temps, dtype=torch.bfloat16, scale=0.5)
    monkeypatch.setenv("PEAGLE_VERIFY_FUSED", "0")
    want = [run_op(c, "cuda") for c in (empty, normal)]
    monkeypatch.setenv("PEAGLE_VERIFY_FUSED", "1")
    for _ in range(5):
        for c, w in zip((empty, normal), want, strict=True):
            got = run_op(c, "cuda")
            check_invariants(got, c)
            _assert_same(w, got)


@requires_cuda
@pytest.mark.parametrize("b,vocab", [(1, 201088), (8, 32001), (40, 4097)])
def test_cuda_sample_ctas_same_bits(b, vocab, monkeypatch):
    """The tiled decide_sample's residency (2 CTAs per SM below 32 requests, 3 from 32;
    PEAGLE_VERIFY_SAMPLE_CTAS forces it) changes how many CTAs share a request's tiles, never the
    tile masses or the draw: the same bits either way."""
    gen = torch.Generator().manual_seed(96 + b)
    counts = [int(x) for x in torch.randint(1, 8, (b,), generator=gen)]
    temps = [float(x) for x in torch.rand(b, generator=gen) * 1.5 + 0.2]
    temps[-1] = 0.0 if b > 1 else temps[-1]  # a greedy request among random ones
    case = make_case(counts, vocab, gen, temps=temps, dtype=torch.bfloat16, scale=3.0)
    monkeypatch.setenv("PEAGLE_VERIFY_CHUNKS", "0")  # the tiled path at every B
    outs = []
    for ctas in ("2", "3"):
        monkeypatch.setenv("PEAGLE_VERIFY_SAMPLE_CTAS", ctas)
        outs.append(run_op(case, "cuda"))
    check_invariants(outs[0], case)
    _assert_same(outs[0], outs[1])
