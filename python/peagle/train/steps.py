"""One training sequence's forward and backward (SPEC.md §8): P-EAGLE over sequence-partitioned
segments, and the autoregressive EAGLE-3 head with test-time training (TTT) over the same layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from peagle.models.drafter import Eagle3Drafter
from peagle.train.attention import MaskedAttention
from peagle.train.cod import Elements
from peagle.train.forward import masked_forward
from peagle.train.loss import kl_per_element, target_logprobs_on_draft_vocab
from peagle.train.mask import ElementMeta
from peagle.train.partition import partition_elements
from peagle.train.target_features import ShiftedSequence


@dataclass
class StepStats:
    """Sums over supervised elements, per depth (index = depth)."""

    kl: list[float] = field(default_factory=list)
    correct: list[int] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    num_supervised: int = 0
    num_elements: int = 0
    peak_segment_elements: int = 0

    def add(self, depths: torch.Tensor, kl: torch.Tensor, correct: torch.Tensor) -> None:
        if depths.numel() == 0:
            return
        k = int(depths.max()) + 1
        while len(self.kl) < k:
            self.kl.append(0.0)
            self.correct.append(0)
            self.count.append(0)
        d = depths.cpu()
        kl_sum = torch.zeros(k, dtype=torch.float64).index_add_(0, d, kl.detach().double().cpu())
        cor = torch.zeros(k, dtype=torch.long).index_add_(0, d, correct.long().cpu())
        cnt = torch.bincount(d, minlength=k)
        for i in range(k):
            self.kl[i] += float(kl_sum[i])
            self.correct[i] += int(cor[i])
            self.count[i] += int(cnt[i])

    def merge(self, other: StepStats) -> None:
        for i in range(len(other.kl)):
            if i >= len(self.kl):
                self.kl.append(0.0)
                self.correct.append(0)
                self.count.append(0)
            self.kl[i] += other.kl[i]
            self.correct[i] += other.correct[i]
            self.count[i] += other.count[i]
        self.num_supervised += other.num_supervised
        self.num_elements += other.num_elements
        self.peak_segment_elements = max(self.peak_segment_elements, other.peak_segment_elements)

    @property
    def mean_kl(self) -> float:
        return sum(self.kl) / max(1, sum(self.count))


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _supervised_loss(drafter, normed, seq, anchors, depths, rows, stats, norm):
    """Sum of KL over ``rows`` (supervised rows of this forward) divided by ``norm``."""
    a, d = anchors[rows], depths[rows]
    logits = drafter.compute_logits(normed[rows])
    tlogp = target_logprobs_on_draft_vocab(seq.target_logits[a + d], None)
    kl = kl_per_element(logits, tlogp)
    correct = logits.argmax(-1) == tlogp.argmax(-1)
    stats.add(d, kl, correct)
    return kl.sum() / norm


def peagle_sequence_step(
    drafter: Eagle3Drafter,
    seq: ShiftedSequence,
    elems: Elements,
    *,
    num_partitions: int = 1,
    attention: MaskedAttention | None = None,
    autocast_dtype: torch.dtype | None = None,
    loss_scale: float = 1.0,
    on_segment=None,
) -> StepStats:
    """Forward + backward of one P-EAGLE COD sample in ``num_partitions`` segments.

    Gradients accumulate into ``drafter``'s ``.grad``; each segment's loss is its summed KL over
    its own supervised elements divided by the global supervised count (times ``loss_scale``).
    ``on_segment(index, num_rows)`` is called after each segment's backward (tests measure memory).
    """
    cfg = drafter.config
    drafter.check_parallel_drafting()
    attention = attention or MaskedAttention()
    dev = seq.input_ids.device
    anchors, depths = elems.anchors.to(dev), elems.depths.to(dev)
    supervised = seq.loss_mask[anchors + depths]
    stats = StepStats(num_elements=len(elems))
    n_sup = int(supervised.sum())
    stats.num_supervised = n_sup
    if n_sup == 0:
        return stats
    scale = cfg.head_dim**-0.5
    for si, seg in enumerate(partition_elements(elems, seq.n, num_partitions)):
        idx = seg.indices.to(dev)
        a, d = anchors[idx], depths[idx]
        is0 = d == 0
        own = torch.zeros_like(is0)
        own[: seg.own.numel()] = True
        meta = ElementMeta(a, d, seq.doc_ids[a])
        with _autocast(dev, autocast_dtype):
            ids = torch.where(is0, seq.input_ids[a], cfg.mask_token_id)
            mask_vec = drafter.project_target_hidden(drafter.mask_hidden.reshape(1, -1))
            rows0 = is0.nonzero().flatten()
            h0 = drafter.project_target_hidden(seq.features[a[rows0]])
            hidden = mask_vec.expand(idx.numel(), -1).to(h0.dtype).index_put((rows0,), h0)
            prepared = attention.prepare_layers(meta, meta, cfg.layer_windows())

            def attend(i, q, k, v, prepared=prepared):
                return attention(prepared[i], q, k, v, scale)

            normed, _ = masked_forward(drafter, ids, hidden, seq.positions[a + d], attend)
            rows = (own & supervised[idx]).nonzero().flatten()
            loss = _supervised_loss(drafter, normed, seq, a, d, rows, stats, n_sup / loss_scale)
        loss.backward()
        stats.peak_segment_elements = max(stats.peak_segment_elements, idx.numel())
        if on_segment is not None:
            on_segment(si, idx.numel())
    return stats


def eagle3_sequence_step(
    drafter: Eagle3Drafter,
    seq: ShiftedSequence,
    elems: Elements,
    *,
    attention: MaskedAttention | None = None,
    autocast_dtype: torch.dtype | None = None,
    loss_scale: float = 1.0,
) -> StepStats:
    """Forward + backward of an autoregressive EAGLE-3 head over the same COD layout (TTT).

    Depth ``j`` runs as serial pass ``j``, exactly as serial drafting does at inference: element
    ``(a, j)`` takes the real token at reference position ``a + j`` (the accepted draft) and, for
    ``j >= 1``, the pre-norm output of ``(a, j-1)`` as its hidden input (no ``fc``); keys are all
    elements of passes ``<= j`` under the same mask rule. One backward over all passes.
    """
    cfg = drafter.config
    attention = attention or MaskedAttention()
    dev = seq.input_ids.device
    anchors, depths = elems.anchors.to(dev), elems.depths.to(dev)
    supervised = seq.loss_mask[anchors + depths]
    stats = StepStats(num_elements=len(elems))
    n_sup = int(supervised.sum())
    stats.num_supervised = n_sup
    if n_sup == 0:
        return stats
    scale = cfg.head_dim**-0.5
    num_layers = cfg.num_hidden_layers
    cache_k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    cache_v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    key_meta: list[ElementMeta] = []
    row_of = torch.full((seq.n,), -1, dtype=torch.long, device=dev)
    prev_prenorm = None
    total = None
    with _autocast(dev, autocast_dtype):
        for j in range(int(depths.max()) + 1):
            idx = (depths == j).nonzero().flatten()
            a = anchors[idx]
            d = depths[idx]
            if j == 0:
                hidden = drafter.project_target_hidden(seq.features[a])
            else:
                hidden = prev_prenorm[row_of[a]]
            q_meta = ElementMeta(a, d, seq.doc_ids[a])
            key_meta.append(q_meta)
            k_meta = ElementMeta(
                torch.cat([m.anchors for m in key_meta]),
                torch.cat([m.depths for m in key_meta]),
                torch.cat([m.doc_ids for m in key_meta]),
            )
            prepared = attention.prepare_layers(q_meta, k_meta, cfg.layer_windows())

            def attend(i, q, k, v, prepared=prepared):
                cache_k[i].append(k)
                cache_v[i].append(v)
                keys, values = torch.cat(cache_k[i]), torch.cat(cache_v[i])
                return attention(prepared[i], q, keys, values, scale)

            normed, prenorm = masked_forward(
                drafter, seq.input_ids[a + d], hidden, seq.positions[a + d], attend
            )
            rows = supervised[idx].nonzero().flatten()
            loss = _supervised_loss(drafter, normed, seq, a, d, rows, stats, n_sup / loss_scale)
            total = loss if total is None else total + loss
            prev_prenorm = prenorm
            row_of = torch.full((seq.n,), -1, dtype=torch.long, device=dev)
            row_of[a] = torch.arange(a.numel(), device=dev)
    total.backward()
    stats.peak_segment_elements = len(elems)
    return stats
