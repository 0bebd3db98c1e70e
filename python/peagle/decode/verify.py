"""The target runner step: the target pass over a step's rows, then ``verify_chain`` on the logits.

A request owns its ``k`` draft rows then its bonus row in the verified logits (a prefill owns only
its last row and samples one token); K/V of rows past the acceptance point is simply overwritten
by the next step (its rows start right after the last accepted token).

With synthetic acceptance (:mod:`~peagle.decode.synthetic`, a benchmarking switch, off by default)
``verify_chain`` still runs; only its accept/reject decisions are then replaced by seeded draws.
"""

from __future__ import annotations

from peagle import ops
from peagle.decode.inputs import StepTensors
from peagle.decode.synthetic import SyntheticAcceptance
from peagle.models.paged import AttentionMetadata
from peagle.models.target import TargetRunner


class TargetVerifier:
    """``(t, max_num_drafts) -> (output_token_ids [B, K+1], num_accepted [B], aux_hidden [T, 3H])``
    on the device: the target forward over ``t`` (writing its K/V into ``kv_cache``) and
    verification. Graph-capturable (no host sync)."""

    def __init__(
        self, target: TargetRunner, kv_cache, synthetic: SyntheticAcceptance | None = None
    ) -> None:
        self.target = target
        self.kv_cache = kv_cache
        self.synthetic = synthetic

    def __call__(self, t: StepTensors, max_num_drafts: int):
        meta = AttentionMetadata(
            t.positions, t.slot_mapping, t.query_start_loc, t.seq_lens, t.block_table,
            t.max_query_len,
        )  # fmt: skip
        logits, aux = self.target.forward(t.input_ids, meta, self.kv_cache, t.logits_indices)
        drafts = t.input_ids.index_select(0, t.draft_row_indices)
        out = ops.verify_chain(
            logits,
            drafts,
            t.cu_num_draft_tokens,
            t.temperature,
            t.seeds,
            t.offsets,
            top_k=t.top_k,
            top_p=t.top_p,
            request_mask=t.request_mask,
            max_num_draft_tokens=max_num_drafts,
        )
        tokens, accepted = out.output_token_ids, out.num_accepted
        if self.synthetic is not None:
            tokens, accepted = self.synthetic.apply(
                logits, drafts, t.positions.index_select(0, t.draft_row_indices),
                t.cu_num_draft_tokens, t.request_keys, t.request_mask, tokens, accepted,
            )  # fmt: skip
        return tokens, accepted, aux
