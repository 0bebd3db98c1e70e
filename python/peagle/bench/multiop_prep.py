"""The peer of prepare_draft_inputs: our own reimplementation of vLLM's multi-op draft step.

vLLM v0.16 (PR #32887, ``vllm/v1/spec_decode/{eagle,utils}.py``) builds the P-EAGLE drafter
batch with a sequence of small kernels; this module repeats that *sequence* with code written
here (no vLLM code is copied or imported):

  1. Stage A  — one Triton program per request: next token + valid count
  2. Stage B  — one Triton program per request: rejected count / last valid row
  3. Stage C  — one Triton copy-and-expand kernel over (request, row tile): ids, positions,
                rejected / masked flags, sample indices, hidden_state_mapping
  4. hidden scatter   — ``hidden[hidden_state_mapping] = target_hidden`` (index_copy_)
  5. mask broadcast   — ``torch.where(is_masked[:, None], mask_vector, hidden, out=hidden)``
  6. slot mapping     — request index per row (searchsorted), block-table gather, arithmetic,
                        masked_fill for rejected rows and positions >= max_model_len
  7. metadata         — ``query_start_loc + N * arange``, ``seq_lens + N``

Differences from vLLM: none intended in the outputs (checked against peagle before timing);
the kernel count is reported by the benchmark. Like vLLM it has no padding-request rule, so
benchmarks use batches of real requests only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stage_a(sampled_ptr, stride, cols, discard_ptr, backup_ptr, vocab, next_ptr, valid_ptr,
             BLOCK: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ids = tl.load(sampled_ptr + r * stride + c, mask=c < cols, other=-1)
    ok = (ids >= 0) & (ids < vocab) & (c < cols)
    count = tl.sum(ok.to(tl.int32), axis=0)
    last_col = tl.max(tl.where(ok, c, -1), axis=0)
    last = tl.sum(tl.where(c == last_col, ids, 0), axis=0)
    backup = tl.load(backup_ptr + r)
    discard = tl.load(discard_ptr + r)
    nxt = tl.where(discard | (count == 0), backup, last)
    count = tl.where(discard, 0, count)
    tl.store(next_ptr + r, nxt)
    tl.store(valid_ptr + r, count)


@triton.jit
def _stage_b(cu_ptr, valid_ptr, qsl_ptr, query_end_ptr):
    r = tl.program_id(0)
    cu = tl.load(cu_ptr + r)
    prev = tl.load(cu_ptr + r - 1, mask=r > 0, other=0)
    n_draft = cu - prev
    valid = tl.load(valid_ptr + r)
    nrej = tl.where(n_draft > 0, n_draft + 1 - valid, 0)
    tl.store(query_end_ptr + r, tl.load(qsl_ptr + r + 1) - 1 - nrej)


@triton.jit
def _stage_c(ids_ptr, pos_ptr, next_ptr, qsl_ptr, qend_ptr, out_ids_ptr, out_pos_ptr,
             out_rej_ptr, out_mask_ptr, out_sample_ptr, out_map_ptr, t_in, pad_id, mask_id,
             S: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    tile = tl.program_id(1)
    n_new = S - SHIFT
    qs = tl.load(qsl_ptr + r)
    qn = tl.load(qsl_ptr + r + 1)
    qend = tl.load(qend_ptr + r)
    nv = qend - qs + 1 - SHIFT
    rows = qn - qs + n_new
    out0 = qs + r * n_new
    p0 = tl.load(pos_ptr + qs)
    j = tile * BLOCK + tl.arange(0, BLOCK)
    live = j < rows
    src = tl.minimum(qs + SHIFT + j, t_in - 1)
    tok = tl.load(ids_ptr + src, mask=live & (j < nv), other=0)
    nxt = tl.load(next_ptr + r)
    tok = tl.where(j == nv, nxt, tok)
    tok = tl.where((j > nv) & (j < nv + S), mask_id, tok)
    rej = j >= nv + S
    tok = tl.where(rej, pad_id, tok)
    tl.store(out_ids_ptr + out0 + j, tok, mask=live)
    tl.store(out_pos_ptr + out0 + j, tl.where(rej, 0, p0 + j), mask=live)
    tl.store(out_rej_ptr + out0 + j, rej, mask=live)
    tl.store(out_mask_ptr + out0 + j, (j > nv) & (j < nv + S), mask=live)
    is_sample = live & (j >= nv) & (j < nv + S)
    tl.store(out_sample_ptr + r * S + (j - nv), out0 + j, mask=is_sample)
    if SHIFT:
        tl.store(out_map_ptr + qs + j, out0 + j, mask=j < qn - qs)


class MultiOpPrep:
    """Persistent buffers + the 7-stage sequence above; ``__call__`` fills ``self.out``."""

    def __init__(self, t_in, num_reqs, num_slots, hidden_size, dtype, device, max_query_len):
        self.s = num_slots
        self.n_new = num_slots - 1
        t_out = t_in + num_reqs * self.n_new
        kw = {"device": device}
        self.next = torch.empty(num_reqs, dtype=torch.int32, **kw)
        self.valid = torch.empty(num_reqs, dtype=torch.int32, **kw)
        self.qend = torch.empty(num_reqs, dtype=torch.int32, **kw)
        self.ids = torch.empty(t_out, dtype=torch.int32, **kw)
        self.pos = torch.empty(t_out, dtype=torch.int64, **kw)
        self.rej = torch.empty(t_out, dtype=torch.bool, **kw)
        self.msk = torch.empty(t_out, dtype=torch.bool, **kw)
        self.sample = torch.empty(num_reqs * num_slots, dtype=torch.int32, **kw)
        self.map = torch.empty(t_in, dtype=torch.int64, **kw)
        self.map32 = torch.empty(t_in, dtype=torch.int32, **kw)
        self.hidden = torch.empty(t_out, hidden_size, dtype=dtype, **kw)
        self.slots = torch.empty(t_out, dtype=torch.int64, **kw)
        self.rows = torch.arange(t_out, dtype=torch.int64, **kw)
        self.ar = torch.arange(num_reqs + 1, dtype=torch.int32, **kw)
        self.max_rows = max_query_len + self.n_new
        self.block = min(256, triton.next_power_of_2(self.max_rows))

    def __call__(self, tt, tp, qsl, sl, sampled, discard, backup, cu, bt, th, mh, *, block_size,
                 max_model_len, vocab_size, mask_token_id, padding_token_id=0):  # fmt: skip
        b = qsl.shape[0] - 1
        t_in = tt.shape[0]
        cols = sampled.shape[1]
        _stage_a[(b,)](sampled, sampled.stride(0), cols, discard, backup, vocab_size, self.next,
                       self.valid, BLOCK=triton.next_power_of_2(cols))  # fmt: skip
        _stage_b[(b,)](cu, self.valid, qsl, self.qend)
        grid = (b, triton.cdiv(self.max_rows, self.block))
        _stage_c[grid](tt, tp, self.next, qsl, self.qend, self.ids, self.pos, self.rej, self.msk,
                       self.sample, self.map32, t_in, padding_token_id, mask_token_id, S=self.s,
                       SHIFT=1, BLOCK=self.block)  # fmt: skip
        # Hidden scatter, then the mask broadcast (mask wins).
        self.map.copy_(self.map32)
        self.hidden.index_copy_(0, self.map, th)
        torch.where(self.msk.unsqueeze(1), mh.view(1, -1), self.hidden, out=self.hidden)
        # Slot mapping.
        new_qsl = qsl + self.n_new * self.ar
        req = torch.searchsorted(new_qsl[1:], self.rows, right=True).clamp_(max=b - 1)
        pc = self.pos.clamp(max=max_model_len - 1)
        block_ids = bt[req, pc // block_size].to(torch.int64)
        torch.add(block_ids * block_size, pc % block_size, out=self.slots)
        self.slots.masked_fill_(self.rej | (self.pos >= max_model_len), -1)
        new_sl = sl + self.n_new
        return new_qsl, new_sl
