"""Acceptance-rate tables for synthetic acceptance (:mod:`peagle.decode.synthetic`).

Each table gives, per method (``peagle``, ``eagle3``), the per-position *conditional* acceptance
rates ``r_1..r_n`` (draft i accepted given drafts 1..i-1 were; ``r_n`` is used beyond ``n``, so
any K works), with its source and the fixed rule that turned the published numbers into rates:

* ``paper``: the P-EAGLE paper's HumanEval acceptance lengths at K=7 (P-EAGLE 3.94, EAGLE-3 3.03)
  as ONE constant conditional rate per method, the ``r`` solving ``1 + r + ... + r^7 = AL``, used
  at every position.
* ``vllm-pr32628``: vLLM PR #32628's per-position acceptance on HumanEval at K=8 (the fraction of
  steps in which position i is accepted, ``a_i``) as ``r_1 = a_1``, ``r_i = a_i / a_(i-1)``, and
  ``r_8`` beyond K=8. This table has EAGLE-3 AHEAD of P-EAGLE (AL 3.04 vs 2.57).
* ``default-pair``: the packaged default pair's own measured per-position acceptance
  (``benchmarks/results/e2e-h200.json``, K=10, concurrency 1, greedy, held-out prompts), same
  conversion as ``vllm-pr32628``; ``r_10`` beyond K=10.

Rates describe trained heads on real text; the synthetic benchmark applies them to random-weight
targets, whose step cost (not outputs) is what is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle.decode.synthetic import SyntheticAcceptance


def constant_rate_for_acceptance_length(al: float, k: int = 7) -> float:
    """The ``r`` in [0, 1] with ``1 + r + ... + r^k = al`` (bisection; ``1 <= al <= k + 1``)."""
    if not 1.0 <= al <= k + 1:
        raise ValueError(f"acceptance length {al} is outside [1, {k + 1}] for K={k}")
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < al:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def conditional_from_unconditional(a: list[float]) -> list[float]:
    """``r_1 = a_1``, ``r_i = a_i / a_(i-1)`` (0 after a position never accepted)."""
    out, prev = [], 1.0
    for x in a:
        out.append(x / prev if prev > 0 else 0.0)
        prev = x
    return out


@dataclass(frozen=True)
class AcceptanceTable:
    name: str
    source: str
    rule: str
    rates: dict  # method -> conditional rates r_1..r_n
    published: dict  # method -> the published numbers the rates come from

    def synthetic(self, method: str, seed: int = 0) -> SyntheticAcceptance:
        if method not in self.rates:
            raise KeyError(f"table {self.name!r} has no rates for method {method!r}")
        return SyntheticAcceptance(self.rates[method], seed=seed, name=self.name,
                                   source=self.source, rule=self.rule)  # fmt: skip

    def to_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "rule": self.rule,
                "rates": {m: list(r) for m, r in self.rates.items()},
                "published": self.published}  # fmt: skip


PAPER_AL_K7 = {"peagle": 3.94, "eagle3": 3.03}
PR32628_A_K8 = {
    "peagle": [0.63, 0.38, 0.23, 0.14, 0.09, 0.05, 0.03, 0.02],
    "eagle3": [0.71, 0.49, 0.32, 0.21, 0.14, 0.09, 0.05, 0.03],
}
# benchmarks/results/e2e-h200.json, configs "peagle,K=10,C=1" / "eagle3,K=10,C=1" (the v3 pair,
# commit 2d699014, run 1): per_position_acceptance (accepted / drafted at each position, rounded
# to 4 digits).
DEFAULT_PAIR_A_K10 = {
    "peagle": [0.8254, 0.6136, 0.4675, 0.3675, 0.3214, 0.2694, 0.2172, 0.1496, 0.0708, 0.0218],
    "eagle3": [0.757, 0.6144, 0.524, 0.4421, 0.4016, 0.3405, 0.2826, 0.2455, 0.2236, 0.1929],
}

TABLES = {
    "paper": AcceptanceTable(
        name="paper",
        source="P-EAGLE paper, HumanEval, K=7: acceptance length P-EAGLE 3.94, EAGLE-3 3.03",
        rule="one constant conditional rate r per method solving 1 + r + ... + r^7 = AL, used at "
        "every position",
        rates={m: (constant_rate_for_acceptance_length(al, 7),) for m, al in PAPER_AL_K7.items()},
        published={"acceptance_length_k7": PAPER_AL_K7},
    ),
    "vllm-pr32628": AcceptanceTable(
        name="vllm-pr32628",
        source="vLLM PR #32628, HumanEval, K=8: per-position acceptance (fraction of steps in "
        "which position i is accepted); EAGLE-3 ahead here (AL 3.04 vs 2.57)",
        rule="r_1 = a_1, r_i = a_i / a_(i-1); r_8 beyond K=8",
        rates={m: tuple(conditional_from_unconditional(a)) for m, a in PR32628_A_K8.items()},
        published={"per_position_acceptance_k8": PR32628_A_K8},
    ),
    "default-pair": AcceptanceTable(
        name="default-pair",
        source="peagle's packaged default pair (recipe v3), measured: "
        "benchmarks/results/e2e-h200.json (H200, greedy, held-out prompts, K=10, concurrency 1, "
        "commit 2d699014)",
        rule="r_1 = a_1, r_i = a_i / a_(i-1) from per_position_acceptance; r_10 beyond K=10 "
        "(P-EAGLE's positions 8-10 lie past its trained depth 7)",
        rates={m: tuple(conditional_from_unconditional(a)) for m, a in DEFAULT_PAIR_A_K10.items()},
        published={"per_position_acceptance_k10": DEFAULT_PAIR_A_K10},
    ),
}


def get_table(name: str) -> AcceptanceTable:
    if name not in TABLES:
        raise KeyError(f"unknown acceptance table {name!r}; known: {', '.join(TABLES)}")
    return TABLES[name]
