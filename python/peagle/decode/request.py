"""Requests of the decode loop: sampling parameters, per-request state, outputs and statistics."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    Attributes:
        temperature: 0 = greedy (first-index argmax); > 0 samples from ``softmax(logits / T)``.
        top_k: keep the k most likely tokens (0 = off); top_p: nucleus mass (1.0 = off).
        seed: per-request seed (None: a random one); a seeded request's output does not depend
            on its batch neighbours.
        max_new_tokens: at most this many generated tokens.
        stop_token_ids: extra stop tokens (the stop token itself is emitted, nothing after it).
        ignore_eos: do not stop at the engine's EOS ids.
        num_speculative_tokens: this request's K (default: the engine's K; never above it).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}"
            )


@dataclass
class RequestStats:
    """Speculation and timing statistics of one request.

    ``num_spec_steps`` counts verification steps that carried at least one draft;
    ``accepted_per_position[j]`` / ``drafted_per_position[j]`` is the acceptance rate of draft
    position j. Accepted counts only drafts that were emitted: a stop token inside an accepted
    block ends the count there (EDGE_CASES X9). Times are seconds; drafter/target times are the
    wall (or CUDA-event) time of the batched phases this request took part in.
    """

    num_steps: int = 0
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    target_time_s: float = 0.0
    drafter_time_s: float = 0.0
    wall_time_s: float = 0.0
    num_generated_tokens: int = 0
    synthetic_acceptance: bool = False  # decisions drawn (peagle.decode.synthetic): not the text

    def record_step(self, num_drafts: int, num_accepted: int) -> None:
        self.num_steps += 1
        if num_drafts == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        while len(self.drafted_per_position) < num_drafts:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for j in range(num_drafts):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += int(j < num_accepted)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per speculative step: mean accepted drafts + 1 (1.0 without)."""
        if self.num_spec_steps == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_spec_steps

    @property
    def per_position_acceptance(self) -> list[float]:
        pairs = zip(self.accepted_per_position, self.drafted_per_position, strict=True)
        return [a / d for a, d in pairs]

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = {
            "num_generated_tokens": self.num_generated_tokens,
            "acceptance_length": self.acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "num_steps": self.num_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "drafter_time_s": self.drafter_time_s,
            "target_time_s": self.target_time_s,
            "wall_time_s": self.wall_time_s,
            "tokens_per_second": self.tokens_per_second,
        }
        if self.synthetic_acceptance:
            d["synthetic_acceptance"] = True
        return d


@dataclass
class RequestOutput:
    """A finished request: ``token_ids`` are the generated tokens (stop token included)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS / stop id) or "length" (max_new_tokens / max_model_len)
    stats: RequestStats


@dataclass
class Request:
    """Live state of a request inside the engine (not part of the public API)."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    num_spec_tokens: int
    seed: int
    stop_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    reserved_blocks: int = 0
    prefilled: bool = False
    # Drafts proposed for the next step live on the device: row ``draft_row`` of the engine's
    # last draft tensor (None: no drafts available).
    draft_row: int | None = None
    rng_offset: int = 0
    finish_reason: str | None = None
    start_time: float = 0.0
    stats: RequestStats = field(default_factory=RequestStats)

    @staticmethod
    def new_seed() -> int:
        return secrets.randbits(63)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def commit(self, row: list[int], num_drafts: int, accepted: int, max_model_len: int) -> bool:
        """Append the step's emitted tokens (``row[: accepted + 1]`` of the verification output),
        applying the stop conditions (EOS / stop ids, ``max_new_tokens``, ``max_model_len``;
        nothing after a stop is emitted); returns whether the request finished."""
        assert 0 <= accepted <= num_drafts, (self.request_id, accepted, num_drafts)
        # Drafts past the budget (the scheduler drafts K regardless, EDGE_CASES E2) are verified
        # but never emitted; the statistics count only the drafts that could have been.
        budget = min(
            self.params.max_new_tokens - len(self.output_token_ids),
            max_model_len - self.num_tokens,
        )
        useful = min(num_drafts, max(budget - 1, 0))
        self.rng_offset += 1
        self.prefilled = True
        emitted = 0
        for tok in row[: accepted + 1]:
            self.output_token_ids.append(tok)
            emitted += 1
            if tok in self.stop_ids:
                self.finish_reason = "stop"
            elif (
                len(self.output_token_ids) >= self.params.max_new_tokens
                or self.num_tokens >= max_model_len
            ):
                self.finish_reason = "length"
            if self.finish_reason is not None:
                break
        # Statistics count emitted tokens only (EDGE_CASES X9): a stop inside the accepted
        # block drops the accepted drafts after it (and the bonus token).
        self.stats.record_step(useful, min(accepted, emitted, useful))
        return self.finish_reason is not None

    def output(self) -> RequestOutput:
        self.stats.num_generated_tokens = len(self.output_token_ids)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason or "length",
            stats=self.stats,
        )
