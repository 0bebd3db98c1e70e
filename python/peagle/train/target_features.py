"""Online target features and the EAGLE shift (SPEC.md §2.1, §8.1).

The target (a transformers causal LM) runs over one token sequence ``x_0..x_{L-1}``; the 3
auxiliary features are the residual stream at the *input* of the configured layers
(``hidden_states[i]`` of transformers' ``output_hidden_states``), concatenated to ``[L, 3*H_t]``.
After the shift, training position ``t`` (``0 <= t < n = L-1``) carries input token ``x_{t+1}``,
features ``g_t``, RoPE position ``t+1``, and as label the target distribution at ``t+1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class ShiftedSequence:
    """One training sequence after the EAGLE shift (all on the training device).

    Attributes:
        input_ids: ``[n]`` int64 ``x_{t+1}``.
        features: ``[n, 3*H_t]`` target features ``g_t`` (target dtype).
        positions: ``[n]`` int64 ``t + 1``.
        target_logits: ``[n, V_d]`` target logits at ``t + 1`` restricted to the draft vocabulary.
        loss_mask: ``[n]`` bool label mask.
        doc_ids: ``[n]`` int64 document id of each position.
    """

    input_ids: torch.Tensor
    features: torch.Tensor
    positions: torch.Tensor
    target_logits: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor

    @property
    def n(self) -> int:
        return self.input_ids.numel()


@torch.no_grad()
def target_forward(
    model: torch.nn.Module, token_ids: torch.Tensor, aux_layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aux [L, 3*H_t], logits [L, V])`` of a transformers causal LM over ``token_ids [L]``."""
    out = model(input_ids=token_ids.view(1, -1), output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    aux = torch.cat([hs[i][0] for i in aux_layer_ids], dim=-1)
    return aux, out.logits[0]


MAX_BATCH_LOGITS = 2**28  # logits elements of one batched target forward (512 MiB in bf16)


@torch.no_grad()
def target_forward_batch(
    model: torch.nn.Module, sequences: Sequence[torch.Tensor], aux_layer_ids: Sequence[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`target_forward` of several sequences, one batched forward per group of equal
    length (a deep target's forward costs launches, not FLOPs, on a GPU: one per pack instead of
    one per sequence). Returns ``[(aux, logits)]`` in the order of ``sequences``."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(sequences)
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(sequences):
        by_len.setdefault(s.numel(), []).append(i)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 1
    for length, idx in by_len.items():
        # rows per forward: the logits of one forward stay under MAX_BATCH_LOGITS elements
        rows = max(1, MAX_BATCH_LOGITS // max(1, length * vocab))
        for s in range(0, len(idx), rows):
            part = idx[s : s + rows]
            x = torch.stack([sequences[i].reshape(-1) for i in part])
            res = model(input_ids=x, output_hidden_states=True, use_cache=False)
            aux = torch.cat([res.hidden_states[j] for j in aux_layer_ids], dim=-1)
            for row, i in enumerate(part):
                out[i] = (aux[row], res.logits[row])
    return out  # type: ignore[return-value]


def prompt_loss_mask(length: int, prompt_len: int, device=None) -> torch.Tensor:
    """``[length]`` per-token label mask that excludes the prompt: the label at token ``j`` (the
    target's distribution of token ``j + 1``) is supervised iff token ``j + 1`` is not a prompt
    token (``j + 1 >= prompt_len``). After the shift, position ``t`` (input token ``x_{t+1}``)
    is supervised iff the token it predicts, ``x_{t+2}``, was generated. ``prompt_len <= 1``
    supervises everything."""
    return torch.arange(1, length + 1, device=device) >= prompt_len


def shift_sequence(
    token_ids: torch.Tensor,
    aux: torch.Tensor,
    logits: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    draft_to_target: torch.Tensor | None = None,
) -> ShiftedSequence:
    """Apply the EAGLE shift to one target pass (``L >= 2`` tokens).

    Args:
        token_ids: ``[L]`` tokens; aux: ``[L, 3*H_t]``; logits: ``[L, V]``.
        loss_mask: ``[L]`` per-token mask ``l_t`` (default all True); position ``t`` gets
            ``l_{t+1}``.
        doc_ids: ``[L]`` document ids (default 0).
        draft_to_target: ``[V_d]`` target ids of the draft vocabulary (None = full vocabulary).
    """
    n = token_ids.numel() - 1
    if n < 1:
        raise ValueError(f"a training sequence needs >= 2 tokens, got {n + 1}")
    dev = token_ids.device
    lm = torch.ones(n + 1, dtype=torch.bool, device=dev) if loss_mask is None else loss_mask
    doc = torch.zeros(n + 1, dtype=torch.long, device=dev) if doc_ids is None else doc_ids
    lg = logits[1:]
    if draft_to_target is not None:
        lg = lg.index_select(-1, draft_to_target)
    return ShiftedSequence(
        input_ids=token_ids[1:].long(),
        features=aux[:-1],
        positions=torch.arange(1, n + 1, device=dev),
        target_logits=lg,
        loss_mask=lm[1:].bool(),
        doc_ids=doc[1:].long(),
    )


def pack_sequences(seqs: Sequence[ShiftedSequence]) -> ShiftedSequence:
    """Concatenate shifted sequences into one training sequence of separate documents.

    Sequence ``i`` becomes document ``i`` (``doc_ids``), so the mask rule never lets one attend to
    another and COD chains never cross from one into the next; each keeps its own RoPE positions
    and loss mask. One forward then carries several sequences: on a GPU the drafter passes of a
    small model cost launch time, not FLOPs, so packing multiplies tokens per second.
    """
    if not seqs:
        raise ValueError("pack_sequences needs at least one sequence")
    if len(seqs) == 1:
        return seqs[0]
    doc = [torch.full_like(s.doc_ids, i) for i, s in enumerate(seqs)]
    return ShiftedSequence(
        input_ids=torch.cat([s.input_ids for s in seqs]),
        features=torch.cat([s.features for s in seqs]),
        positions=torch.cat([s.positions for s in seqs]),
        target_logits=torch.cat([s.target_logits for s in seqs]),
        loss_mask=torch.cat([s.loss_mask for s in seqs]),
        doc_ids=torch.cat(doc),
    )
