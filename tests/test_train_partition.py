"""Sequence partitioning (SPEC.md §8.5, paper Algorithm 1): bucket rule, segment completeness,
exact gradients against an independent single pass in float64, falling peak memory."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from train_helpers import MASK_ID, tiny_drafter, tiny_sequence, tiny_target

from peagle.train.attention import MaskedAttention
from peagle.train.cod import Elements, cod_sample
from peagle.train.forward import masked_forward
from peagle.train.mask import ElementMeta, dense_mask
from peagle.train.partition import boundaries, element_buckets, partition_elements
from peagle.train.steps import eagle3_sequence_step, peagle_sequence_step


@pytest.fixture
def fp64_rmsnorm(monkeypatch):
    """transformers' LlamaRMSNorm normalises in float32 even for float64 inputs; exact-gradient
    tests need it in float64 (the partitioned backward sums partial gradients in another order)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def forward(self, x):
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)


def brute_buckets(anchors, depths, n, p):
    """Algorithm 1 literally: A^0/A^1 by position, depth g >= 2 inherits A^{g-1}[pos - 1]."""
    b = [s * n // p for s in range(p + 1)]

    def by_pos(pos):
        return max(s for s in range(p) if b[s] <= pos)

    table = {}
    order = sorted(range(len(anchors)), key=lambda i: depths[i])
    for i in order:
        a, d = anchors[i], depths[i]
        pos = a + d
        table[(d, pos)] = by_pos(pos) if d <= 1 else table[(d - 1, pos - 1)]
    return [table[(depths[i], anchors[i] + depths[i])] for i in range(len(anchors))]


@pytest.mark.parametrize("n,p", [(1, 1), (6, 1), (6, 4), (17, 3), (17, 17), (10, 25), (40, 7)])
def test_buckets_and_segments(n, p):
    el = cod_sample(n, 5, 0.8, 0.2, generator=torch.Generator().manual_seed(n + p))
    a, d = el.anchors.tolist(), el.depths.tolist()
    assert element_buckets(el, n, p).tolist() == brute_buckets(a, d, n, p)
    segs = partition_elements(el, n, p)
    own = torch.cat([s.own for s in segs])
    assert sorted(own.tolist()) == list(range(len(el)))  # every element owned exactly once
    full = ElementMeta(el.anchors, el.depths, torch.zeros_like(el.anchors))
    allowed = dense_mask(full, full)
    b = boundaries(n, p)
    for s in segs:
        idx = s.indices
        assert (el.depths[s.context] == 0).all()
        assert not set(s.own.tolist()) & set(s.context.tolist())
        # completeness: every key an owned query may attend is inside the segment
        keys = allowed[s.own].any(0).nonzero().flatten()
        assert set(keys.tolist()) <= set(idx.tolist())
        # causal completion: all depth-0 positions below the segment's upper boundary
        seg_b = int(element_buckets(Elements(el.anchors[s.own[:1]], el.depths[s.own[:1]]), n, p))
        d0 = (el.depths == 0) & (el.anchors < b[seg_b + 1])
        assert set(d0.nonzero().flatten().tolist()) <= set(idx.tolist())


def _reference_loss(drafter, seq, el):
    """Independent single pass: whole COD sample, brute-force float64 softmax attention."""
    cfg = drafter.config
    a, d = el.anchors, el.depths
    m = ElementMeta(a, d, seq.doc_ids[a])
    allowed = dense_mask(m, m)
    mask_vec = drafter.fc(drafter.mask_hidden.reshape(1, -1))
    hidden = torch.where((d == 0)[:, None], drafter.fc(seq.features[a]), mask_vec)
    ids = torch.where(d == 0, seq.input_ids[a], MASK_ID)
    scale = cfg.head_dim**-0.5

    def attend(i, q, k, v):
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, 1)
        v = v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        s = s.masked_fill(~allowed, float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    normed, _ = masked_forward(drafter, ids, hidden, seq.positions[a + d], attend)
    logq = torch.log_softmax(drafter.lm_head(normed), -1)
    logp = torch.log_softmax(seq.target_logits[a + d], -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    sup = seq.loss_mask[a + d]
    return kl[sup].sum() / sup.sum()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("seed,length", [(0, 30), (1, 41)])
def test_partitioned_gradients_equal_single_pass_fp64(seed, length, fp64_rmsnorm):
    target = tiny_target(seed)
    drafter = tiny_drafter(target, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    lm = torch.rand(length, generator=gen) > 0.15
    doc = torch.cumsum((torch.rand(length, generator=gen) > 0.93).long(), 0)
    seq = tiny_sequence(target, drafter, length, seed, loss_mask=lm, doc_ids=doc)
    el = cod_sample(seq.n, 6, 0.7, 0.2, loss_mask=seq.loss_mask, doc_ids=seq.doc_ids, generator=gen)

    drafter.zero_grad()
    ref_loss = _reference_loss(drafter, seq, el)
    ref_loss.backward()
    ref = _grads(drafter)
    assert ref["mask_hidden"].abs().max() > 0 and ref["embed_tokens.weight"].abs().max() > 0
    n = seq.n
    for p in (1, 2, 3, 5, n, n + 7):
        for kind in ("dense", "chunked"):
            drafter.zero_grad()
            st = peagle_sequence_step(
                drafter, seq, el, num_partitions=p, attention=MaskedAttention(kind, chunk_size=5)
            )
            assert st.mean_kl == pytest.approx(ref_loss.item(), rel=1e-10)
            got = _grads(drafter)
            assert got.keys() == ref.keys()
            for name in ref:
                torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12,
                                           msg=f"S={p} {kind} {name}")  # fmt: skip


def test_partitioned_gradients_with_draft_vocab(fp64_rmsnorm):
    target = tiny_target(3)
    draft_ids = torch.tensor([0, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47])
    drafter = tiny_drafter(target, draft_ids=draft_ids)
    seq = tiny_sequence(target, drafter, 25)
    assert seq.target_logits.shape[1] == draft_ids.numel()
    el = cod_sample(seq.n, 4, 0.8, 0.2, generator=torch.Generator().manual_seed(0))
    drafter.zero_grad()
    _reference_loss(drafter, seq, el).backward()
    ref = _grads(drafter)
    drafter.zero_grad()
    peagle_sequence_step(drafter, seq, el, num_partitions=4, attention=MaskedAttention("dense"))
    for name, g in _grads(drafter).items():
        torch.testing.assert_close(g, ref[name], rtol=1e-9, atol=1e-12)


def _saved_bytes_per_segment(drafter, seq, el, p):
    """Bytes of distinct tensors autograd saves for backward, per segment (activation memory)."""
    per_seg, seen, cur = [], set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            cur[0] += key[1]
        return t

    def on_segment(i, rows):
        per_seg.append(cur[0])
        cur[0] = 0
        seen.clear()

    drafter.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        peagle_sequence_step(drafter, seq, el, num_partitions=p,
                             attention=MaskedAttention("dense"), on_segment=on_segment)  # fmt: skip
    return per_seg


def test_peak_memory_per_segment_falls_with_partitions():
    target = tiny_target(0)
    drafter = tiny_drafter(target, dtype=torch.float32)
    params = sum(p.numel() * p.element_size() for p in drafter.parameters())
    seq = tiny_sequence(target, drafter, 257, dtype=torch.float32)
    el = cod_sample(seq.n, 8, 0.8, 0.2, generator=torch.Generator().manual_seed(0))
    peaks = []
    for p in (1, 2, 4, 8):
        per_seg = _saved_bytes_per_segment(drafter, seq, el, p)
        assert len(per_seg) == p
        peaks.append(max(per_seg) - params)  # activations beyond the (saved) weights
    assert all(b < a for a, b in zip(peaks, peaks[1:], strict=False)), peaks
    assert peaks[-1] < 0.6 * peaks[0], peaks


def test_eagle3_gradients_match_independent_ttt(fp64_rmsnorm):
    """EAGLE-3 TTT: pass j uses real tokens and the previous pass's pre-norm output."""
    target = tiny_target(4)
    drafter = tiny_drafter(target, parallel=False, layers=1)
    seq = tiny_sequence(target, drafter, 20)
    el = cod_sample(seq.n, 4, 0.8, 0.2, generator=torch.Generator().manual_seed(1))
    scale = drafter.config.head_dim**-0.5

    # independent reference: grow one joint element list pass by pass, recompute everything.
    drafter.zero_grad()
    total, prev_prenorm, prev_a = 0.0, None, None
    ks, metas = [[]], []
    for j in range(int(el.depths.max()) + 1):
        a = el.anchors[el.depths == j]
        d = torch.full_like(a, j)
        if j == 0:
            hidden = drafter.fc(seq.features[a])
        else:
            hidden = torch.stack([prev_prenorm[(prev_a == x).nonzero()[0, 0]] for x in a.tolist()])
        metas.append(ElementMeta(a, d, torch.zeros_like(a)))
        km = ElementMeta(
            *[torch.cat([getattr(m, f) for m in metas]) for f in ("anchors", "depths", "doc_ids")]
        )
        allowed = dense_mask(metas[-1], km)
        cache = {}

        def attend(i, q, k, v, allowed=allowed, cache=cache, j=j):
            prev_k = [c[i][0] for c in ks[:j]]
            prev_v = [c[i][1] for c in ks[:j]]
            cache[i] = (k, v)
            kk = torch.cat([*prev_k, k]).repeat_interleave(2, 1)
            vv = torch.cat([*prev_v, v]).repeat_interleave(2, 1)
            s = torch.einsum("qhd,khd->hqk", q, kk) * scale
            return torch.einsum(
                "hqk,khd->qhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), vv
            )

        normed, prenorm = masked_forward(
            drafter, seq.input_ids[a + d], hidden, seq.positions[a + d], attend
        )
        ks.insert(j, cache)
        logq = torch.log_softmax(drafter.lm_head(normed), -1)
        logp = torch.log_softmax(seq.target_logits[a + d], -1)
        total = total + (logp.exp() * (logp - logq)).sum()
        prev_prenorm, prev_a = prenorm, a
    (total / len(el)).backward()
    ref = _grads(drafter)
    drafter.zero_grad()
    eagle3_sequence_step(drafter, seq, el, attention=MaskedAttention("dense"))
    got = _grads(drafter)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)


@requires_cuda
@pytest.mark.parametrize("partitions", [1, 3])
def test_flex_attention_gradients_match_dense_on_cuda(partitions):
    """The compiled FlexAttention path (the CUDA default) against dense SDPA, float32 (head_dim
    16: the smallest compiled FlexAttention lowers)."""
    target = tiny_target(5, head_dim=16)
    drafter = tiny_drafter(target, dtype=torch.float32).cuda()
    seq = tiny_sequence(target, drafter.cpu(), 300, dtype=torch.float32)
    drafter.cuda()
    seq = type(seq)(**{k: v.cuda() for k, v in vars(seq).items()})
    el = cod_sample(seq.n, 6, 0.7, 0.2, generator=torch.Generator().manual_seed(0))
    out = {}
    for kind in ("dense", "flex"):
        drafter.zero_grad()
        st = peagle_sequence_step(
            drafter, seq, el, num_partitions=partitions, attention=MaskedAttention(kind)
        )
        out[kind] = (st.mean_kl, _grads(drafter))
    assert out["flex"][0] == pytest.approx(out["dense"][0], rel=1e-4)
    for name, g in out["dense"][1].items():
        torch.testing.assert_close(out["flex"][1][name], g, rtol=2e-3, atol=2e-5, msg=name)


def test_flex_refuses_head_dim_below_16_and_auto_falls_back():
    """Compiled FlexAttention cannot lower head_dim < 16 (found on the H200): explicit ``flex``
    says so before compiling; ``auto`` takes the chunked SDPA path instead."""
    target = tiny_target(5)  # head_dim 8
    drafter = tiny_drafter(target, dtype=torch.float32)
    seq = tiny_sequence(target, drafter, 40, dtype=torch.float32)
    el = cod_sample(seq.n, 3, 0.7, 0.2, generator=torch.Generator().manual_seed(0))
    att = MaskedAttention("flex")
    q = torch.randn(1, 4, 5, 8)
    prepared = ("flex", None, None, None, None)
    with pytest.raises(ValueError, match="head_dim >= 16"):
        att(prepared, q, q, q, 1.0)
    auto = peagle_sequence_step(drafter, seq, el, attention=MaskedAttention("auto"))
    dense = peagle_sequence_step(drafter, seq, el, attention=MaskedAttention("dense"))
    assert auto.mean_kl == pytest.approx(dense.mean_kl, rel=1e-5)
