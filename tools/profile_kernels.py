"""Per-kernel GPU time of the verify and attention cases that miss their targets, for ``ncu``.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        python3 tools/profile_kernels.py verify attention

Each case runs 3 times (ncu flushes caches between kernels by default: cold L2). The case name is
pushed as an NVTX range so the CSV rows can be attributed (``--nvtx --print-nvtx-rename kernel``
is not needed: the script prints the launch order).
"""

from __future__ import annotations

import sys

import torch

from peagle import ops


def verify_cases() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    v, k = 201088, 7
    for b, temp, topk in ((64, 0.0, 0), (64, 0.7, 0), (64, 0.7, 50), (1, 0.7, 0), (1, 0.0, 0)):
        rows = b * (k + 1)
        logits = (torch.randn(rows, v, device="cuda", generator=g) * 3.0).to(torch.bfloat16)
        drafts = torch.randint(0, v, (b * k,), device="cuda", dtype=torch.int32, generator=g)
        # Half the drafts are the row argmax so chains run past position 0.
        am = logits.view(b, k + 1, v)[:, :k].argmax(-1).to(torch.int32).reshape(-1)
        drafts = torch.where(torch.rand(b * k, device="cuda", generator=g) < 0.5, am, drafts)
        cu = torch.arange(1, b + 1, device="cuda", dtype=torch.int32) * k
        t = torch.full((b,), temp, device="cuda")
        seeds = torch.arange(b, device="cuda", dtype=torch.int64)
        offs = torch.zeros(b, device="cuda", dtype=torch.int64)
        kw = {}
        if topk:
            kw = dict(top_k=torch.full((b,), topk, device="cuda", dtype=torch.int32),
                      top_p=torch.full((b,), 0.9, device="cuda"))  # fmt: skip
        print(f"verify B={b} T={temp} top_k={topk}", flush=True)
        for _ in range(3):
            ops.verify_chain(logits, drafts, cu, t, seeds, offs, **kw)
        torch.cuda.synchronize()


def attention_cases() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for b, hq, hkv, d, kv in ((1, 32, 8, 128, 16384), (1, 64, 8, 64, 16384),
                              (64, 64, 8, 64, 4096), (64, 32, 8, 128, 4096)):  # fmt: skip
        q_len, page = 14, 16
        nblk = b * kv // page
        kc = torch.randn(nblk, page, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        vc = torch.randn(nblk, page, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        bt = torch.randperm(nblk, device="cuda", generator=g).to(torch.int32).view(b, -1)
        q = torch.randn(b * q_len, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
        qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32) * q_len
        sl = torch.full((b,), kv, device="cuda", dtype=torch.int32)
        print(f"attention B={b} {hq}/{hkv}x{d} kv={kv}", flush=True)
        for _ in range(3):
            ops.paged_attention(q, kc, vc, bt, qsl, sl, max_query_len=q_len)
        torch.cuda.synchronize()
        del kc, vc


def main() -> None:
    names = sys.argv[1:] or ["verify", "attention"]
    for n in names:
        {"verify": verify_cases, "attention": attention_cases}[n]()


if __name__ == "__main__":
    main()
