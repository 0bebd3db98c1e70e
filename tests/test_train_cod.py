"""COD sampling (SPEC.md §8.4): chains keep their predecessors, counts follow the formula."""

from __future__ import annotations

import math

import pytest
import torch

from peagle.train.cod import cod_count, cod_sample


def _by_depth(el):
    out = {}
    for a, d in zip(el.anchors.tolist(), el.depths.tolist(), strict=True):
        out.setdefault(d, []).append(a)
    return out


@pytest.mark.parametrize(
    "n,k,r,r_min",
    [
        (1, 4, 0.7, 0.2),
        (2, 3, 0.7, 0.0),
        (37, 6, 0.7, 0.2),
        (64, 10, 0.5, 0.0),
        (50, 5, 1.0, 0.0),
        (40, 8, 0.8, 0.3),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cod_chains_and_counts(n, k, r, r_min, seed):
    gen = torch.Generator().manual_seed(seed)
    lm = torch.rand(n, generator=gen) > 0.2
    doc = torch.cumsum((torch.rand(n, generator=gen) > 0.9).long(), 0)
    el = cod_sample(n, k, r, r_min, loss_mask=lm, doc_ids=doc, generator=gen)
    by = _by_depth(el)
    assert sorted(by[0]) == list(range(n))  # depth 0 keeps every position
    n_valid = int(lm.sum())
    elems = set(zip(el.anchors.tolist(), el.depths.tolist(), strict=True))
    assert len(elems) == len(el)  # no duplicates
    for d in range(1, k):
        kept = by.get(d, [])
        for a in kept:
            p = a + d
            assert (a, d - 1) in elems, f"depth-{d} element at anchor {a} lost its predecessor"
            assert p < n and bool(lm[p]), "kept a position with loss mask 0 or out of range"
            assert doc[p] == doc[p - 1], "kept a cross-document successor"
            assert a >= 0
        # count = min(floor(n_valid * max(r^d, r_min)), #candidates)
        prev = {a + d - 1 for a in by.get(d - 1, [])}
        cands = [p for p in range(1, n) if (p - 1) in prev and bool(lm[p]) and doc[p] == doc[p - 1]]
        want = min(math.floor(n_valid * max(r**d, r_min)), len(cands))
        assert len(kept) == want, (d, len(kept), want)
    assert el.anchors.dtype == torch.long and el.depths.dtype == torch.long
    # depth-major, ascending anchors within a depth
    assert torch.all(el.depths[1:] >= el.depths[:-1])


def test_cod_full_retention_keeps_every_chain():
    el = cod_sample(10, 4, 1.0, 0.0)
    by = _by_depth(el)
    for d in range(4):
        assert by[d] == list(range(10 - d))


def test_cod_count_formula():
    assert cod_count(6, 1, 0.7, 0.0) == 4
    assert cod_count(6, 2, 0.7, 0.0) == 2
    assert cod_count(100, 5, 0.7, 0.2) == 20  # floor: 0.7^5 = 0.168 < 0.2
    assert cod_count(0, 1, 0.7, 0.2) == 0


def test_cod_is_seeded_and_random():
    a = cod_sample(50, 4, 0.6, 0.0, generator=torch.Generator().manual_seed(5))
    b = cod_sample(50, 4, 0.6, 0.0, generator=torch.Generator().manual_seed(5))
    c = cod_sample(50, 4, 0.6, 0.0, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.anchors, b.anchors)
    assert not torch.equal(a.anchors, c.anchors)


def test_cod_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_depths"):
        cod_sample(5, 0, 0.7, 0.2)
    with pytest.raises(ValueError, match="ratios"):
        cod_sample(5, 2, 1.5, 0.2)
    with pytest.raises(ValueError, match="loss_mask"):
        cod_sample(5, 2, 0.7, 0.2, loss_mask=torch.ones(4, dtype=torch.bool))
