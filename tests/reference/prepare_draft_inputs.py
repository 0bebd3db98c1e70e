"""Pure-PyTorch reference of the P-EAGLE draft-batch step, written from SPEC.md §3-4.

Deliberately naive (Python loops over requests, one stage after another, like vLLM's sequence of
kernels and torch ops) so that it shares no code with the C++/CUDA implementation.
"""

from __future__ import annotations

import torch

PADDING_SLOT_ID = -1


def next_token_ids_ref(sampled, discard, backup, vocab_size):
    """Stage A (SPEC §3.2)."""
    b = sampled.shape[0]
    next_ids = torch.empty(b, dtype=torch.int32)
    valid = torch.empty(b, dtype=torch.int32)
    for r in range(b):
        if bool(discard[r]):
            next_ids[r], valid[r] = int(backup[r]), 0
            continue
        ids = [int(x) for x in sampled[r]]
        ok = [x for x in ids if 0 <= x < vocab_size]
        valid[r] = len(ok)
        next_ids[r] = ok[-1] if ok else int(backup[r])
    return next_ids, valid


def prepare_draft_inputs_ref(
    target_token_ids,
    target_positions,
    query_start_loc,
    seq_lens,
    sampled_token_ids,
    discard_request_mask,
    backup_next_token_ids,
    cu_num_draft_tokens,
    block_table,
    *,
    num_padding_slots_per_request,
    mask_token_id,
    block_size,
    max_model_len,
    vocab_size,
    target_hidden_states=None,
    mask_hidden=None,
    padding_token_id=0,
    shift_input_ids=True,
    num_out_rows=None,
):
    """Returns a dict of expected outputs plus ``hidden_defined`` (rows whose hidden is specified).

    Inputs are CPU tensors. Padding requests (qlen 0 or seq_len 0) follow SPEC §3.8.
    """
    tt = target_token_ids.tolist()
    tp = target_positions.tolist()
    qsl = query_start_loc.tolist()
    sl = seq_lens.tolist()
    cu = cu_num_draft_tokens.tolist()
    b = len(qsl) - 1
    s = num_padding_slots_per_request
    shift = int(shift_input_ids)
    n = s - shift
    t_in = len(tt)
    t_out = t_in + b * n if num_out_rows is None else num_out_rows

    # Stage A.
    next_ids, valid = next_token_ids_ref(
        sampled_token_ids, discard_request_mask, backup_next_token_ids, vocab_size
    )
    # Inert defaults for every row (padded tail).
    input_ids = [0] * t_out
    positions = [0] * t_out
    is_rejected = [False] * t_out
    is_masked = [False] * t_out
    slots = [PADDING_SLOT_ID] * t_out
    sample = [0] * (b * s)
    hidden_src = {}  # drafter row -> ("target", i) | ("mask",)
    new_seq = []
    for r in range(b):
        qs, qn = qsl[r], qsl[r + 1]
        qlen = qn - qs
        out0 = qs + r * n
        padding = qlen == 0 or sl[r] == 0
        if padding:
            next_ids[r], valid[r] = 0, 0
            for j in range(qlen + n):
                is_rejected[out0 + j] = True
            for k in range(s):
                sample[r * s + k] = min(max(out0, 0), t_out - 1)
            new_seq.append(sl[r])
            continue
        # Stage B.
        n_draft = cu[r] - (cu[r - 1] if r > 0 else 0)
        nrej = n_draft + 1 - int(valid[r]) if n_draft > 0 else 0
        query_end = qn - 1 - nrej
        # Stage C.
        nv = query_end - qs + (0 if shift else 1)
        p0 = tp[qs]
        rows = nv + s + nrej
        assert rows == qlen + n
        for j in range(rows):
            o = out0 + j
            if j < nv:
                tok = tt[min(qs + shift + j, t_in - 1)]
            elif j == nv:
                tok = int(next_ids[r])
            elif j < nv + s:
                tok = mask_token_id
            else:
                tok = padding_token_id
            rej = j >= nv + s
            input_ids[o] = tok
            positions[o] = 0 if rej else p0 + j
            is_rejected[o] = rej
            is_masked[o] = nv < j < nv + s
            if nv <= j < nv + s:
                sample[r * s + (j - nv)] = o
        # hidden_state_mapping, then the mask broadcast (mask wins).
        if shift:
            for j in range(qlen):
                hidden_src[out0 + j] = ("target", qs + j)
        for j in range(rows):
            if is_masked[out0 + j]:
                hidden_src[out0 + j] = ("mask",)
        new_seq.append(sl[r] + n)
    # Stage D: slot mapping.
    for r in range(b):
        qs, qn = qsl[r], qsl[r + 1]
        if qn - qs == 0 or sl[r] == 0:
            continue
        for j in range(qn - qs + n):
            o = qs + r * n + j
            pos = positions[o]
            if is_rejected[o] or pos >= max_model_len:
                continue
            pc = min(pos, max_model_len - 1)
            slots[o] = int(block_table[r, pc // block_size]) * block_size + pc % block_size
    # Stage E.
    new_qsl = [qsl[r] + n * r for r in range(b + 1)]

    out = {
        "input_ids": torch.tensor(input_ids, dtype=torch.int32),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "is_rejected": torch.tensor(is_rejected, dtype=torch.bool),
        "is_masked": torch.tensor(is_masked, dtype=torch.bool),
        "token_indices_to_sample": torch.tensor(sample, dtype=torch.int32),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "query_start_loc": torch.tensor(new_qsl, dtype=torch.int32),
        "seq_lens": torch.tensor(new_seq, dtype=torch.int32),
        "next_token_ids": next_ids,
        "valid_sampled_tokens_count": valid,
    }
    if target_hidden_states is not None:
        h = target_hidden_states.shape[1]
        hidden = torch.zeros(t_out, h, dtype=target_hidden_states.dtype)
        defined = torch.zeros(t_out, dtype=torch.bool)
        for o, src in hidden_src.items():
            hidden[o] = mask_hidden.reshape(h) if src[0] == "mask" else target_hidden_states[src[1]]
            defined[o] = True
        out["hidden_states"] = hidden
        out["hidden_defined"] = defined
    return out
