"""The synthetic-acceptance rate tables (peagle.bench.acceptance_tables): sources and rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peagle.bench import acceptance_tables as A

ROOT = Path(__file__).resolve().parents[1]


def test_paper_table_reproduces_the_published_acceptance_lengths_at_k7():
    t = A.get_table("paper")
    for method, al in {"peagle": 3.94, "eagle3": 3.03}.items():
        (r,) = t.rates[method]
        assert sum(r**i for i in range(8)) == pytest.approx(al, abs=1e-9)
        syn = t.synthetic(method)
        assert syn.expected_acceptance_length(7) == pytest.approx(al, abs=1e-9)
        assert syn.rates_for(10) == [r] * 10  # one rate at every position: any K
    assert t.rates["peagle"][0] > t.rates["eagle3"][0]


def test_pr32628_table_converts_per_position_acceptance():
    t = A.get_table("vllm-pr32628")
    a = {"peagle": [0.63, 0.38, 0.23, 0.14, 0.09, 0.05, 0.03, 0.02],
         "eagle3": [0.71, 0.49, 0.32, 0.21, 0.14, 0.09, 0.05, 0.03]}  # fmt: skip
    for method, ai in a.items():
        r = t.rates[method]
        assert r[0] == ai[0]
        for i in range(1, 8):
            assert r[i] == pytest.approx(ai[i] / ai[i - 1])
        syn = t.synthetic(method)
        assert syn.rates_for(10)[8:] == [r[7], r[7]]  # r_8 beyond K=8
        assert syn.expected_acceptance_length(8) == pytest.approx(1 + sum(ai))
    # this table has EAGLE-3 ahead
    al = {m: t.synthetic(m).expected_acceptance_length(8) for m in a}
    assert al["eagle3"] == pytest.approx(3.04) and al["peagle"] == pytest.approx(2.57)


def test_default_pair_table_matches_the_committed_h200_results():
    res = json.loads((ROOT / "benchmarks/results/e2e-h200.json").read_text())
    t = A.get_table("default-pair")
    for method in ("peagle", "eagle3"):
        a = res["configs"][f"{method},K=10,C=1"]["per_position_acceptance"]
        assert list(A.DEFAULT_PAIR_A_K10[method]) == a
        assert list(t.rates[method]) == pytest.approx(A.conditional_from_unconditional(a))
        assert t.synthetic(method).expected_acceptance_length(10) == pytest.approx(1 + sum(a))
    assert "e2e-h200.json" in t.source


def test_tables_carry_name_source_and_rule():
    for name, t in A.TABLES.items():
        assert t.name == name and t.source and t.rule
        d = t.synthetic("peagle", seed=4).to_dict(3)
        assert d["synthetic_acceptance"] is True and d["table"] == name and d["seed"] == 4
        assert all(0.0 <= r <= 1.0 for rs in t.rates.values() for r in rs)
    with pytest.raises(KeyError):
        A.get_table("nope")
    with pytest.raises(ValueError):
        A.constant_rate_for_acceptance_length(9.0, 7)
