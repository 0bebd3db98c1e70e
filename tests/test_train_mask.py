"""The training attention mask (SPEC.md §8.3) against a brute-force construction, and the
attention kernels (dense, chunked, FlexAttention) against a float64 softmax reference."""

from __future__ import annotations

import pytest
import torch

from peagle.train.cod import cod_sample
from peagle.train.mask import (
    ElementMeta,
    dense_mask,
    flex_attention_masked,
    flex_block_mask,
    sdpa_attention,
)


def brute_mask(anchors, depths, docs, window=None):
    """Literal rule, element by element (the window from the reference positions a + d)."""
    e = len(anchors)
    m = torch.zeros(e, e, dtype=torch.bool)
    for i in range(e):
        for j in range(e):
            if docs[i] != docs[j]:
                continue
            ctx = depths[j] == 0 and anchors[j] <= anchors[i]
            chain = anchors[j] == anchors[i] and depths[j] <= depths[i]
            near = window is None or (anchors[i] + depths[i]) - (anchors[j] + depths[j]) < window
            m[i, j] = (ctx or chain) and near
    return m


def meta(anchors, depths, docs=None):
    a = torch.tensor(anchors)
    return ElementMeta(
        a, torch.tensor(depths), torch.zeros_like(a) if docs is None else torch.tensor(docs)
    )


def test_spec_reference_example():
    # n=6, COD rounds [0,1,3,4], [0,3], [0]
    anchors = [0, 1, 2, 3, 4, 5, 0, 1, 3, 4, 0, 3, 0]
    depths = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3]
    m = meta(anchors, depths)
    ref = [a + d for a, d in zip(anchors, depths, strict=True)]
    assert ref == [0, 1, 2, 3, 4, 5, 1, 2, 4, 5, 2, 5, 3]
    got = dense_mask(m, m)
    assert torch.equal(got, brute_mask(anchors, depths, [0] * 13))
    # A few entries spelled out: (3,1) sees depth-0 anchors 0..3 and itself, not (1,1) or (4,0).
    row = got[8]
    assert row[:4].all() and not row[4:6].any()
    assert row[8] and not row[6] and not row[7] and not row[9]
    # (0,3) sees (0,0), (0,1), (0,2), itself; nothing else.
    assert got[12].nonzero().flatten().tolist() == [0, 6, 10, 12]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [None, 3])
def test_random_cod_layout_matches_brute_force(seed, window):
    gen = torch.Generator().manual_seed(seed)
    n = 23
    docs = torch.cumsum((torch.rand(n, generator=gen) > 0.8).long(), 0)
    el = cod_sample(n, 5, 0.7, 0.1, doc_ids=docs, generator=gen)
    perm = torch.randperm(len(el), generator=gen)  # order must not matter
    a, d = el.anchors[perm], el.depths[perm]
    m = ElementMeta(a, d, docs[a])
    want = brute_mask(a.tolist(), d.tolist(), docs[a].tolist(), window)
    assert torch.equal(dense_mask(m, m, window), want)
    # rectangular use (queries = a subset), as in EAGLE-3 test-time training
    q = m.index(torch.arange(0, len(el), 3))
    assert torch.equal(dense_mask(q, m, window), want[::3])


def _reference_attention(q, k, v, mask, scale):
    """float64 softmax attention with GQA by repetition."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).double()
    v = v.repeat_interleave(rep, dim=1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def _random_case(seed, n=19, k_depths=4, hq=4, hkv=2, dim=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    el = cod_sample(n, k_depths, 0.7, 0.2, generator=gen)
    m = ElementMeta(el.anchors, el.depths, torch.zeros_like(el.anchors))
    e = len(el)
    q = torch.randn(e, hq, dim, generator=gen, dtype=dtype)
    k = torch.randn(e, hkv, dim, generator=gen, dtype=dtype)
    v = torch.randn(e, hkv, dim, generator=gen, dtype=dtype)
    return m, q, k, v


@pytest.mark.parametrize("chunk", [0, 1, 7, 1000])
def test_sdpa_dense_and_chunked_match_reference(chunk):
    m, q, k, v = _random_case(0)
    out = sdpa_attention(q, k, v, m, m, scale=0.3, chunk_size=chunk)
    ref = _reference_attention(q, k, v, dense_mask(m, m), 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_flex_block_mask_matches_dense_rule():
    m, q, k, v = _random_case(1, n=150)  # > 128 elements: several blocks, padding
    bm, qn, kn = flex_block_mask(m, m)
    assert qn % 128 == 0 and kn % 128 == 0 and qn >= len(m)
    dense = bm.to_dense()  # [1, 1, Qblocks, Kblocks]: which blocks are computed at all
    want = dense_mask(m, m)
    # every allowed pair lies in a computed block
    qi, ki = want.nonzero().unbind(1)
    assert dense[0, 0, qi // 128, ki // 128].all()
    out = flex_attention_masked(q.float(), k.float(), v.float(), bm, scale=0.3, compile=False)
    ref = _reference_attention(q, k, v, want, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
