"""Input builders shared by the tests and the benchmarks (shipped, like ``flashinfer.testing``).

* :func:`make_batch` / :class:`DraftStepBatch`: random draft-step batches for
  ``prepare_draft_inputs`` (tests, ``peagle bench ops prepare_draft_inputs``, tools).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftStepBatch:
    """Inputs of one draft step (CPU tensors); kwargs() gives the op's keyword arguments."""

    target_token_ids: torch.Tensor
    target_positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    sampled_token_ids: torch.Tensor
    discard_request_mask: torch.Tensor
    backup_next_token_ids: torch.Tensor
    cu_num_draft_tokens: torch.Tensor
    block_table: torch.Tensor
    target_hidden_states: torch.Tensor | None
    mask_hidden: torch.Tensor | None
    scalars: dict = field(default_factory=dict)

    def positional(self, device="cpu"):
        return [
            t.to(device)
            for t in (
                self.target_token_ids,
                self.target_positions,
                self.query_start_loc,
                self.seq_lens,
                self.sampled_token_ids,
                self.discard_request_mask,
                self.backup_next_token_ids,
                self.cu_num_draft_tokens,
                self.block_table,
            )
        ]

    def kwargs(self, device="cpu"):
        kw = dict(self.scalars)
        if self.target_hidden_states is not None:
            kw["target_hidden_states"] = self.target_hidden_states.to(device)
            kw["mask_hidden"] = self.mask_hidden.to(device)
        return kw


def make_batch(
    gen: torch.Generator,
    num_reqs: int,
    k: int,
    *,
    shift: bool = True,
    hidden_size: int | None = 64,
    dtype: torch.dtype = torch.float32,
    vocab_size: int = 1000,
    block_size: int = 16,
    max_prefill: int = 40,
    prefill_frac: float = 0.25,
    padding_frac: float = 0.1,
    max_model_len: int | None = None,
    spare_blocks: int = 2,
    num_slots: int | None = None,
) -> DraftStepBatch:
    """A ragged mix of decode requests (K drafts, 0..K rejected), prefills / chunked prefills
    (some discarded with a backup token) and CUDA-graph padding requests (qlen 0 or seq_len 0,
    block-table row of -1)."""

    def randint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    def rand():
        return float(torch.rand(1, generator=gen))

    s = k if num_slots is None else num_slots
    n_new = s - int(shift)
    qlens, drafts, valid, discard, seq, p0s, padding = [], [], [], [], [], [], []
    for _ in range(num_reqs):
        u = rand()
        if u < padding_frac:
            # Padding request: either no rows, or rows with seq_len 0.
            qlen = 0 if rand() < 0.5 else k + 1
            qlens.append(qlen)
            drafts.append(0 if qlen == 0 else k)
            valid.append(0)
            discard.append(False)
            seq.append(0)
            p0s.append(0)
            padding.append(True)
            continue
        if u < padding_frac + prefill_frac:
            qlen = randint(1, max_prefill)
            nd, nval, disc = 0, 1, rand() < 0.3
        else:
            qlen = k + 1
            nd = k
            nval = randint(1, k + 1)  # 1 + accepted drafts
            disc = False
        p0 = randint(0, 200)
        qlens.append(qlen)
        drafts.append(nd)
        valid.append(nval)
        discard.append(disc)
        seq.append(p0 + qlen)
        p0s.append(p0)
        padding.append(False)

    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    t_in = qsl[-1]
    target_ids = torch.randint(0, vocab_size, (t_in,), generator=gen, dtype=torch.int32)
    positions = torch.zeros(t_in, dtype=torch.int64)
    for r in range(num_reqs):
        positions[qsl[r] : qsl[r + 1]] = torch.arange(p0s[r], p0s[r] + qlens[r])
    sampled = torch.full((num_reqs, k + 1), -1, dtype=torch.int32)
    for r in range(num_reqs):
        nval = valid[r]
        sampled[r, :nval] = torch.randint(0, vocab_size, (nval,), generator=gen, dtype=torch.int32)
        # Garbage beyond the valid columns: placeholders and other invalid ids (EDGE C5).
        for c in range(nval, k + 1):
            sampled[r, c] = [-1, -1, -2, vocab_size, vocab_size + 7][randint(0, 4)]
    backup = torch.randint(0, vocab_size, (num_reqs,), generator=gen, dtype=torch.int32)
    cu = torch.tensor(drafts, dtype=torch.int32).cumsum(0).to(torch.int32)
    max_pos = max([p + q + n_new for p, q in zip(p0s, qlens, strict=True)], default=1)
    width = (max_pos + block_size - 1) // block_size + spare_blocks
    num_blocks = max(num_reqs * width, 1)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = perm[: num_reqs * width].reshape(num_reqs, width).clone()
    for r in range(num_reqs):
        if padding[r]:
            block_table[r] = -1
        else:  # columns the request never uses hold garbage
            used = (p0s[r] + qlens[r] + n_new + block_size - 1) // block_size
            block_table[r, used:] = -7
    if max_model_len is None:
        max_model_len = 10**6
    th = mh = None
    if hidden_size is not None and shift:
        th = torch.randn(t_in, hidden_size, generator=gen).to(dtype)
        mh = torch.randn(hidden_size, generator=gen).to(dtype)
    return DraftStepBatch(
        target_token_ids=target_ids,
        target_positions=positions,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        sampled_token_ids=sampled,
        discard_request_mask=torch.tensor(discard, dtype=torch.bool),
        backup_next_token_ids=backup,
        cu_num_draft_tokens=cu,
        block_table=block_table,
        target_hidden_states=th,
        mask_hidden=mh,
        scalars=dict(
            num_padding_slots_per_request=s,
            mask_token_id=vocab_size - 1,
            block_size=block_size,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            shift_input_ids=shift,
        ),
    )
