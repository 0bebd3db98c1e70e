"""Choice of attention kernel for the training mask: FlexAttention (GPU), SDPA dense/chunked."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle.train.mask import (
    ElementMeta,
    flex_attention_masked,
    flex_block_mask,
    sdpa_attention,
)

ATTENTION_KINDS = ("auto", "flex", "flex-eager", "dense", "chunked")
FLEX_MIN_HEAD_DIM = 16  # compiled FlexAttention (inductor) needs head_dim >= 16


@dataclass
class MaskedAttention:
    """``kind``: ``flex`` (compiled FlexAttention, block-sparse; the GPU default), ``flex-eager``
    (uncompiled, for tests), ``dense`` (SDPA with a ``[Q, K]`` bool mask), ``chunked`` (SDPA over
    query chunks of ``chunk_size`` rows; the CPU default), ``auto`` (flex on CUDA, else chunked;
    chunked also on CUDA when head_dim < 16, which compiled FlexAttention cannot lower).

    Raises:
        ValueError: unknown kind; ``flex`` with head_dim < 16.
    """

    kind: str = "auto"
    chunk_size: int = 1024
    window: int | None = None

    def resolved(self, device: torch.device) -> str:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind {self.kind!r} not in {ATTENTION_KINDS}")
        if self.kind == "auto":
            return "flex" if device.type == "cuda" else "chunked"
        return self.kind

    def prepare(self, q_meta: ElementMeta, k_meta: ElementMeta, window: int | None | str = "self"):
        """Per-forward state shared by the layers of one window (the block mask for flex);
        ``window`` overrides :attr:`window` (a drafter layer's own sliding window)."""
        window = self.window if window == "self" else window
        kind = self.resolved(q_meta.anchors.device)
        if kind.startswith("flex"):
            return kind, flex_block_mask(q_meta, k_meta, window)[0], q_meta, k_meta, window
        return kind, None, q_meta, k_meta, window

    def prepare_layers(
        self, q_meta: ElementMeta, k_meta: ElementMeta, windows: list[int | None]
    ) -> list:
        """:meth:`prepare` per drafter layer (``windows``: the layers' sliding windows, from
        :meth:`DrafterConfig.layer_windows`; :attr:`window` for a layer without one), once per
        distinct window."""
        windows = [self.window if w is None else w for w in windows]
        by_window = {w: self.prepare(q_meta, k_meta, window=w) for w in set(windows)}
        return [by_window[w] for w in windows]

    def __call__(self, prepared, q, k, v, scale: float) -> torch.Tensor:
        kind, block_mask, q_meta, k_meta, window = prepared
        if kind == "flex" and q.shape[-1] < FLEX_MIN_HEAD_DIM:
            if self.kind != "auto":
                raise ValueError(
                    f"attention kind 'flex' needs head_dim >= {FLEX_MIN_HEAD_DIM} (compiled "
                    f"FlexAttention), got {q.shape[-1]}; use 'chunked', 'dense' or 'flex-eager'"
                )
            kind = "chunked"
        if kind.startswith("flex"):
            # Under autocast q/k come out of RoPE in float32 (cos/sin follow the float32
            # embeddings) while v is the projection's bf16; FlexAttention is no autocast op and its
            # compiled backward refuses mixed dtypes (found reviewing the H200 recipe), so run it
            # in v's dtype, the dtype autocast gives SDPA.
            q, k = q.to(v.dtype), k.to(v.dtype)
            return flex_attention_masked(q, k, v, block_mask, scale=scale, compile=kind == "flex")
        chunk = self.chunk_size if kind == "chunked" else 0
        return sdpa_attention(q, k, v, q_meta, k_meta, scale=scale, window=window, chunk_size=chunk)
