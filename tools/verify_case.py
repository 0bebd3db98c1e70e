"""One verify_chain case, called three times eagerly on CUDA: the workload for ncu
(``bash tools/h200.sh lines decide_sample python3 tools/verify_case.py 64``).

    python3 tools/verify_case.py B [--vocab 201088] [--temperature 0.7] [--k 7]
                                   [--top-k 50] [--top-p 0.9]

bf16 logits (randn x 3), random drafts, Philox seeds; K drafts per request.
"""

from __future__ import annotations

import argparse

import torch

from peagle import ops


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("batch", type=int)
    ap.add_argument("--vocab", type=int, default=201088)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--top-k", type=int, default=None, help="every request's top_k (default off)")
    ap.add_argument("--top-p", type=float, default=None, help="every request's top_p (default off)")
    args = ap.parse_args(argv)
    b, v, k = args.batch, args.vocab, args.k
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(b * (k + 1), v, device="cuda", generator=g) * 3.0).to(torch.bfloat16)
    drafts = torch.randint(0, v, (b * k,), device="cuda", dtype=torch.int32, generator=g)
    cu = torch.arange(1, b + 1, device="cuda", dtype=torch.int32) * k
    temps = torch.full((b,), args.temperature, device="cuda")
    seeds = torch.arange(b, device="cuda", dtype=torch.int64)
    offsets = torch.zeros(b, device="cuda", dtype=torch.int64)
    top_k = (
        None
        if args.top_k is None
        else torch.full((b,), args.top_k, device="cuda", dtype=torch.int32)
    )
    top_p = None if args.top_p is None else torch.full((b,), args.top_p, device="cuda")
    for _ in range(3):
        ops.verify_chain(
            logits,
            drafts,
            cu,
            temps,
            seeds,
            offsets,
            top_k=top_k,
            top_p=top_p,
            max_num_draft_tokens=k,
        )
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
