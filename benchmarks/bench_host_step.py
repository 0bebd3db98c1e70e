"""Host time per decode step of ``SpecDecoder`` outside the model passes (any device; CPU numbers
are CPU-host numbers, not H200 numbers).

For every (method, cuda_graphs mode, concurrency) the default pair decodes ``--requests`` random
prompts greedily (EOS ignored) and every ``step()`` is split into:

* ``model``: time inside the target verifier + the proposer (the forwards; on the graph path
  their emulated replays),
* ``overhead`` = step wall - model: batch building, input staging, graph buffer loads, host syncs,
  output handling, block bookkeeping (what ``peagle bench e2e`` calls ``overhead_ms_per_step``),
* ``build``: ``InputBuilder.build`` alone (before the staging change it does not include the graph
  path's static-buffer loads; after it does).

Medians over the decode steps after a warm-up generate (prefill steps excluded: only steps where
every running request was already prefilled count). Run it against the installed ``peagle``::

    python benchmarks/bench_host_step.py --methods none peagle eagle3 --graphs off emulate
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time

import torch


def _wrap(obj, name, acc):
    fn = getattr(obj, name)

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[0] += time.perf_counter() - t0

    setattr(obj, name, timed)


def measure(pair, method, graphs, concurrency, k, requests, new_tokens, seed=0):
    from peagle.decode import SamplingParams, SpecDecoder

    target, drafter = pair
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, 1000) for _ in range(rng.randrange(8, 40))] for _ in range(requests)
    ]
    eng = SpecDecoder(
        target, None if method == "none" else drafter, method=method,
        num_speculative_tokens=k, max_num_seqs=concurrency, cuda_graphs=graphs,
        max_model_len=64 + new_tokens,
    )  # fmt: skip
    if eng.graphs is not None:
        eng.graphs.capture_all()
    eng.generate(prompts[:concurrency], SamplingParams(max_new_tokens=8, ignore_eos=True))
    model, build = [0.0], [0.0]
    _wrap(eng, "verifier", model)
    if eng.proposer is not None:
        _wrap(eng.proposer, "propose", model)
    if eng.graphs is not None:
        _wrap(eng.graphs, "target_fn", model)
        if eng.graphs.draft_fn is not None:
            _wrap(eng.graphs, "draft_fn", model)
    _wrap(eng.inputs, "build", build)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    over, builds, tokens = [], [], []
    while eng.has_unfinished():
        decode = bool(eng.running) and all(r.prefilled for r in eng.running) and not eng.waiting
        model[0] = build[0] = 0.0
        t0 = time.perf_counter()
        for out in eng.step():
            tokens.append(out.token_ids)
        wall = time.perf_counter() - t0
        if decode:
            over.append(wall - model[0])
            builds.append(build[0])
    return {
        "method": method, "graphs": graphs, "concurrency": concurrency, "k": k,
        "decode_steps": len(over),
        "overhead_us": round(statistics.median(over) * 1e6, 1),
        "build_us": round(statistics.median(builds) * 1e6, 1),
        "tokens_sha1": hashlib.sha1(json.dumps(sorted(tokens)).encode()).hexdigest()[:12],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=["none", "peagle", "eagle3"])
    ap.add_argument("--graphs", nargs="+", default=["off", "emulate"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from peagle.bench import e2e

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    pairs = e2e._load_pair(args.device, dtype, args.methods)
    for c in args.concurrency:
        for m in args.methods:
            for g in args.graphs:
                row = measure(pairs[m], m, g, c, args.k, max(args.requests, c), args.new_tokens)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
