"""End-to-end greedy check and speed of the decode loop on a real model pair.

Runs the same prompts greedily without speculation and with each speculative method, then reports
per method: the token match rate against no speculation (bf16 batch shapes change rounding, so
outputs may diverge at near-ties), every first divergence with the target's logit gap between the
two tokens (relative to the largest logit; a real bug shows up as a large gap), the acceptance
length, per-position acceptance and output tokens/s. Prints one JSON document (``--out`` also
writes it).

    python benchmarks/e2e_greedy_match.py --model /models/Llama-3.1-8B-Instruct \\
        --draft-model /models/llama3-8b-p-eagle --prompts-file prompts.txt -k 5 \\
        --max-new-tokens 256 --out benchmarks/results/e2e-greedy-h200.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer

from peagle.commands.generate import encode_prompt, eos_ids, parse_prompt_lines
from peagle.decode import SamplingParams, SpecDecoder
from peagle.models import load_model_pair


def divergences(model, prompts, outs, refs, tie):
    found, match, total = [], 0, 0
    for i, (p, out, ref) in enumerate(zip(prompts, outs, refs, strict=True)):
        n = min(len(out), len(ref))
        j = next((t for t in range(n) if out[t] != ref[t]), n)
        match += j
        total += len(ref)
        if j < n:
            with torch.no_grad():
                x = torch.tensor([p + ref[:j]], device=model.device)
                logits = model(x).logits[0, -1].float()
            gap = abs(float(logits[ref[j]] - logits[out[j]]))
            rel = gap / float(logits.abs().max())
            found.append({"prompt": i, "position": j, "gap": gap, "relative_gap": rel,
                          "near_tie": rel <= tie})  # fmt: skip
    return match / max(total, 1), found


def run_method(target, drafter, method, args, token_ids, eos):
    eng = SpecDecoder(
        target,
        None if method == "none" else drafter,
        method=method,
        num_speculative_tokens=args.k,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max(len(t) for t in token_ids) + args.max_new_tokens,
        eos_token_ids=eos,
        cuda_graphs="off" if args.no_cuda_graphs else "auto",
    )
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    eng.generate(token_ids[:1], SamplingParams(max_new_tokens=8))  # warm-up, graph capture
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = eng.generate(token_ids, params)
    wall = time.perf_counter() - t0
    gen = sum(len(o.token_ids) for o in outs)
    steps = sum(o.stats.num_spec_steps for o in outs)
    acc = sum(o.stats.num_accepted_tokens for o in outs)
    k = max((len(o.stats.drafted_per_position) for o in outs), default=0)
    per_pos = []
    for j in range(k):
        d = sum(
            o.stats.drafted_per_position[j] for o in outs if j < len(o.stats.drafted_per_position)
        )
        a = sum(
            o.stats.accepted_per_position[j] for o in outs if j < len(o.stats.accepted_per_position)
        )
        per_pos.append(a / d if d else 0.0)
    summary = {
        "method": method,
        "k": 0 if method == "none" else args.k,
        "generated_tokens": gen,
        "wall_s": wall,
        "tokens_per_second": gen / wall,
        "acceptance_length": 1.0 + acc / steps if steps else 1.0,
        "per_position_acceptance": per_pos,
        "drafter_time_s": sum(o.stats.drafter_time_s for o in outs) / len(outs),
        "target_time_s": sum(o.stats.target_time_s for o in outs) / len(outs),
        "cuda_graph_sizes": sorted(eng.graphs.graphs) if eng.graphs is not None else [],
    }
    del eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [o.token_ids for o in outs], summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", required=True)
    ap.add_argument("--prompt", action="append", default=[])
    ap.add_argument("--prompts-file")
    ap.add_argument("--methods", default="peagle,eagle3", help="comma-separated spec methods")
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=1, help="concurrency (vLLM bench: 1)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chat-template", default="auto")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--tie", type=float, default=0.02, help="near-tie: gap <= tie * max|logit|")
    ap.add_argument("--out")
    args = ap.parse_args()

    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += parse_prompt_lines(f, args.prompts_file)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(args.model)
    target, drafter = load_model_pair(
        args.model, args.draft_model, device=device, dtype=getattr(torch, args.dtype)
    )
    token_ids = [encode_prompt(tok, p, args.chat_template) for p in prompts]
    eos = eos_ids(tok, target)
    base, base_summary = run_method(target, drafter, "none", args, token_ids, eos)
    report = {"model": args.model, "draft_model": args.draft_model, "num_prompts": len(prompts),
              "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
              "methods": [base_summary]}  # fmt: skip
    for method in [m for m in args.methods.split(",") if m]:
        outs, summary = run_method(target, drafter, method, args, token_ids, eos)
        rate, divs = divergences(target.model, token_ids, outs, base, args.tie)
        summary["match_rate"] = rate
        summary["divergences"] = divs
        summary["all_divergences_near_ties"] = all(d["near_tie"] for d in divs)
        summary["speedup_vs_none"] = (
            summary["tokens_per_second"] / base_summary["tokens_per_second"]
        )
        report["methods"].append(summary)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
