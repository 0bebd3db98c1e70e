"""One paged_attention case, called three times eagerly on CUDA: the workload for ncu
(``bash tools/h200.sh lines paged_attention_kernel python3 tools/attention_case.py 64 64 64 4096``).

    python3 tools/attention_case.py B HQ D KV [--hkv 8] [--q-len 14] [--page 16]

bf16 inputs (randn), shuffled pages; PEAGLE_ATTN_IMPL / PEAGLE_ATTN_MERGE apply as usual.
"""

from __future__ import annotations

import argparse

import torch

from peagle import ops


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("batch", type=int)
    ap.add_argument("num_q_heads", type=int)
    ap.add_argument("head_dim", type=int)
    ap.add_argument("kv", type=int, help="keys per request (seq_lens)")
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--q-len", type=int, default=14)
    ap.add_argument("--page", type=int, default=16)
    args = ap.parse_args(argv)
    b, hq, hkv, d, kv, q_len, page = (
        args.batch, args.num_q_heads, args.hkv, args.head_dim, args.kv, args.q_len, args.page
    )  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(0)
    per_req = -(-kv // page)
    nblk = b * per_req
    kc = torch.randn(nblk, page, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    vc = torch.randn(nblk, page, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    bt = torch.randperm(nblk, device="cuda", generator=g).to(torch.int32).view(b, per_req)
    q = torch.randn(b * q_len, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32) * q_len
    sl = torch.full((b,), kv, device="cuda", dtype=torch.int32)
    for _ in range(3):
        ops.paged_attention(q, kc, vc, bt, qsl, sl, max_query_len=q_len)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
