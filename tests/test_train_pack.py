"""Packing several sequences into one training forward (``peagle train --pack``).

Packed sequences are separate documents: the gradient of a packed forward must equal the sum of
the sequences' own gradients (each normalised by the packed supervised count), in float64, for
both heads; any attention or COD chain crossing a document boundary would break the equality.
"""

from __future__ import annotations

import pytest
import torch
from train_helpers import tiny_drafter, tiny_sequence, tiny_target

from peagle.train.attention import MaskedAttention
from peagle.train.cod import Elements, cod_sample
from peagle.train.steps import eagle3_sequence_step, peagle_sequence_step
from peagle.train.target_features import pack_sequences


def _grads(drafter, step, seq, elems, loss_scale):
    drafter.zero_grad()
    st = step(drafter, seq, elems, attention=MaskedAttention("dense"), loss_scale=loss_scale)
    return st, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
def test_packed_gradient_equals_sum_of_per_sequence_gradients(parallel):
    target = tiny_target(3)
    drafter = tiny_drafter(target, parallel=parallel, layers=2)
    step = peagle_sequence_step if parallel else eagle3_sequence_step
    lengths = (37, 64, 23)  # ragged
    seqs = [tiny_sequence(target, drafter, n, seed=i) for i, n in enumerate(lengths)]
    elems = [
        cod_sample(s.n, 4, 0.7, 0.2, generator=torch.Generator().manual_seed(10 + i))
        for i, s in enumerate(seqs)
    ]
    packed = pack_sequences(seqs)
    assert packed.n == sum(s.n for s in seqs)
    assert packed.doc_ids.tolist() == sum(([i] * s.n for i, s in enumerate(seqs)), [])
    # the same elements, offset into the packed sequence, depth-major then ascending anchor
    offsets = torch.tensor([0, *torch.tensor([s.n for s in seqs]).cumsum(0)[:-1].tolist()])
    a = torch.cat([e.anchors + o for e, o in zip(elems, offsets, strict=True)])
    d = torch.cat([e.depths for e in elems])
    order = torch.argsort(d * packed.n + a)
    packed_elems = Elements(a[order], d[order])

    st, g_packed = _grads(drafter, step, packed, packed_elems, 1.0)
    total = st.num_supervised
    g_sum = {}
    for s, e in zip(seqs, elems, strict=True):
        n_sup = int(s.loss_mask[e.anchors + e.depths].sum())
        _, g = _grads(drafter, step, s, e, n_sup / total)
        for n, v in g.items():
            g_sum[n] = g_sum.get(n, 0) + v
    assert g_packed.keys() == g_sum.keys()
    for n, v in g_packed.items():
        torch.testing.assert_close(v, g_sum[n], rtol=1e-9, atol=1e-12, msg=n)


def test_cod_chains_never_cross_packed_documents():
    target = tiny_target(3)
    drafter = tiny_drafter(target, parallel=True, layers=1)
    seqs = [tiny_sequence(target, drafter, n, seed=i) for i, n in enumerate((5, 9, 2, 30))]
    packed = pack_sequences(seqs)
    el = cod_sample(packed.n, 8, 1.0, 1.0, doc_ids=packed.doc_ids)  # r = 1: every chain kept
    ref = el.anchors + el.depths
    assert torch.equal(packed.doc_ids[el.anchors], packed.doc_ids[ref])
    # a document of n positions holds n - d chains of depth d (r = 1)
    for d in range(1, 8):
        assert int((el.depths == d).sum()) == sum(max(0, s.n - d) for s in seqs)


def test_pack_of_one_is_the_sequence():
    target = tiny_target(3)
    drafter = tiny_drafter(target, parallel=True, layers=1)
    s = tiny_sequence(target, drafter, 12)
    assert pack_sequences([s]) is s
    with pytest.raises(ValueError):
        pack_sequences([])
