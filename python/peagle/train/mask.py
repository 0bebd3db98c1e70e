"""The P-EAGLE training attention rule (SPEC.md §8.3) in dense, chunked and FlexAttention form.

Query element ``(a_q, d_q)`` may attend key ``(a_k, d_k)`` iff both lie in the same document, the
query is not padding, and either

* ``d_k == 0 and a_k <= a_q`` (real context up to its own anchor), or
* ``a_k == a_q and d_k <= d_q`` (earlier or equal depths of its own chain),

and, with a sliding window, ``(a_q + d_q) - (a_k + d_k) < window``: the window is measured from the
query's *reference position* ``a_q + d_q``, the position the row has at inference, where the paged
attention shows a row at position ``p`` the keys at positions ``> p - window``
(``window_left = window - 1``) -- the inference rule, and speculators' (which measures context keys
from ``a_q + d_q`` as well; it does not window the chain, which differs only for depths >= window).

Every real query may attend itself, so no real row is fully masked. Padding (FlexAttention blocks
are padded to a multiple of 128) is a query document id of -1 and a key document id of -2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUERY_PAD_DOC = -1
KEY_PAD_DOC = -2


@dataclass
class ElementMeta:
    """Per-element ``anchors``, ``depths``, ``doc_ids`` (``[E]`` int64, one device)."""

    anchors: torch.Tensor
    depths: torch.Tensor
    doc_ids: torch.Tensor

    def __len__(self) -> int:
        return self.anchors.numel()

    def to(self, device) -> ElementMeta:
        return ElementMeta(self.anchors.to(device), self.depths.to(device), self.doc_ids.to(device))

    def index(self, idx: torch.Tensor) -> ElementMeta:
        return ElementMeta(self.anchors[idx], self.depths[idx], self.doc_ids[idx])


def mask_rule(aq, dq, docq, ak, dk, dock, window: int | None = None):
    """The rule on broadcastable tensors (also used as a FlexAttention ``mask_mod`` body)."""
    context = (dk == 0) & (ak <= aq)
    chain = (ak == aq) & (dk <= dq)
    visible = context | chain
    if window is not None:
        visible = visible & ((aq + dq) - (ak + dk) < window)
    return (docq == dock) & (docq != QUERY_PAD_DOC) & visible


def dense_mask(q: ElementMeta, k: ElementMeta, window: int | None = None) -> torch.Tensor:
    """``[Q, K]`` bool mask, True = may attend."""
    return mask_rule(
        q.anchors[:, None],
        q.depths[:, None],
        q.doc_ids[:, None],
        k.anchors[None, :],
        k.depths[None, :],
        k.doc_ids[None, :],
        window,
    )


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_meta: ElementMeta,
    k_meta: ElementMeta,
    *,
    scale: float,
    window: int | None = None,
    chunk_size: int = 0,
) -> torch.Tensor:
    """Masked attention with ``scaled_dot_product_attention``.

    Args:
        query: ``[Q, Hq, D]``; key, value: ``[K, Hkv, D]`` (``Hq`` a multiple of ``Hkv``).
        chunk_size: > 0 processes queries in chunks of this many rows, so the mask and the score
            matrix never exceed ``chunk_size x K`` (the CPU "chunked" fallback).

    Returns:
        ``[Q, Hq, D]``.
    """
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    gqa = query.shape[1] != key.shape[1]
    n = query.shape[0]
    step = chunk_size if chunk_size > 0 else max(n, 1)
    outs = []
    for s in range(0, n, step):
        e = min(n, s + step)
        q = query[s:e].transpose(0, 1).unsqueeze(0)
        m = dense_mask(q_meta.index(slice(s, e)), k_meta, window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs) if len(outs) != 1 else outs[0]


FLEX_BLOCK = 128


def _pad(t: torch.Tensor, n: int, value: int) -> torch.Tensor:
    return F.pad(t, (0, n - t.numel()), value=value)


def flex_block_mask(q: ElementMeta, k: ElementMeta, window: int | None = None):
    """A FlexAttention ``BlockMask`` for the rule, with Q and K padded to multiples of 128.

    Returns ``(block_mask, q_len_padded, k_len_padded)``.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    qn = -(-len(q) // FLEX_BLOCK) * FLEX_BLOCK
    kn = -(-len(k) // FLEX_BLOCK) * FLEX_BLOCK
    aq, dq = _pad(q.anchors, qn, 0), _pad(q.depths, qn, 0)
    docq = _pad(q.doc_ids, qn, QUERY_PAD_DOC)
    ak, dk = _pad(k.anchors, kn, 0), _pad(k.depths, kn, 0)
    dock = _pad(k.doc_ids, kn, KEY_PAD_DOC)

    def mask_mod(b, h, qi, ki):
        return mask_rule(aq[qi], dq[qi], docq[qi], ak[ki], dk[ki], dock[ki], window)

    bm = create_block_mask(mask_mod, None, None, qn, kn, device=q.anchors.device)
    return bm, qn, kn


_compiled_flex = None


def flex_attention_masked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask,
    *,
    scale: float,
    compile: bool = True,
) -> torch.Tensor:
    """FlexAttention with a block mask from :func:`flex_block_mask`; pads and un-pads rows.

    Shapes as :func:`sdpa_attention`. ``compile=False`` runs the eager (reference) kernel.
    """
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    fn = flex_attention
    if compile:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    qn, kn = block_mask.shape[-2], block_mask.shape[-1]
    nq, nk = query.shape[0], key.shape[0]
    q = F.pad(query, (0, 0, 0, 0, 0, qn - nq)).transpose(0, 1).unsqueeze(0)
    k = F.pad(key, (0, 0, 0, 0, 0, kn - nk)).transpose(0, 1).unsqueeze(0)
    v = F.pad(value, (0, 0, 0, 0, 0, kn - nk)).transpose(0, 1).unsqueeze(0)
    o = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return o[0].transpose(0, 1)[:nq]
