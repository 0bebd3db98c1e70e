"""Held-out acceptance lengths of a drafter with peagle's decode loop (greedy)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def acceptance_lengths(
    target_dir: Path,
    drafter_dir: Path,
    method: str,
    prompts: list[str],
    ks: list[int],
    max_new_tokens: int,
    device: torch.device,
    max_num_seqs: int = 16,
    done: dict | None = None,
    should_stop=None,
    on_result=None,
    prompt_ids: list[list[int]] | None = None,
    per_prompt: bool = False,
) -> dict | None:
    """``{K: {"acceptance_length", "per_position_acceptance", "tokens"}}`` over all prompts.

    Acceptance length = 1 + accepted drafts / verification steps that carried drafts, pooled over
    the prompts (greedy, EOS ignored so every prompt generates ``max_new_tokens`` tokens).

    Resumable by K: ``done`` holds results already measured (skipped), ``on_result(k, res)`` is
    called after each K, and ``should_stop()`` is asked after each K; ``None`` is returned when it
    said stop with Ks left (at least one K is measured per call).

    ``prompt_ids`` (v3): the prompts as token ids, used instead of tokenizing ``prompts``.
    ``per_prompt``: each result also holds ``"per_prompt": [[spec steps, accepted drafts], ...]``
    in prompt order (the ablation's paired noise estimate).
    """
    from transformers import AutoTokenizer

    from peagle.decode import SamplingParams, SpecDecoder
    from peagle.models import load_model_pair

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target, drafter = load_model_pair(str(target_dir), str(drafter_dir), device=device, dtype=dtype)
    if prompt_ids is not None:
        ids = [list(p) for p in prompt_ids]
    else:
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    results = dict(done or {})
    measured = 0
    for k in ks:
        if k in results:
            continue
        if measured and should_stop is not None and should_stop():
            return None
        measured += 1
        engine = SpecDecoder(
            target,
            drafter,
            method=method,
            num_speculative_tokens=k,
            max_num_seqs=max_num_seqs,
            max_model_len=max(len(i) for i in ids) + max_new_tokens + 1,
            cuda_graphs="off",
        )
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
        outs = engine.generate(ids, params)
        steps = sum(o.stats.num_spec_steps for o in outs)
        acc = sum(o.stats.num_accepted_tokens for o in outs)
        width = max(len(o.stats.drafted_per_position) for o in outs)
        drafted = [0] * width
        accepted = [0] * width
        for o in outs:
            for j, (a, d) in enumerate(
                zip(o.stats.accepted_per_position, o.stats.drafted_per_position, strict=True)
            ):
                accepted[j] += a
                drafted[j] += d
        results[k] = {
            "acceptance_length": 1.0 + acc / max(1, steps),
            "per_position_acceptance": [
                a / max(1, d) for a, d in zip(accepted, drafted, strict=True)
            ],
            "spec_steps": steps,
            "tokens": sum(len(o.token_ids) for o in outs),
        }
        if per_prompt:
            results[k]["per_prompt"] = [
                [o.stats.num_spec_steps, o.stats.num_accepted_tokens] for o in outs
            ]
        if on_result is not None:
            on_result(k, results[k])
    return {k: results[k] for k in ks}


def load_prompts(path: Path) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]
