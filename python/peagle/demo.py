"""`peagle demo`: one P-EAGLE step through every op on small sample inputs, explained.

A batch of two requests (K = 3) goes through the pieces of one speculative step:
verification of the previous drafts from target logits (``verify_chain``), the drafter batch
with its mask slots (``prepare_draft_inputs``), the drafter's KV write (``write_kv_cache``)
and its attention over the paged cache (``paged_attention``).
"""

from __future__ import annotations

import argparse

import torch

from peagle import ops


def _show(name: str, value) -> None:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    print(f"  {name:<26} {value}")


def run_demo(device: str = "cpu", seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    i32 = torch.int32
    vocab, k, hidden, mask_id = 64, 3, 8, 63
    print(f"peagle demo on {device}: B=2 requests, K={k} drafts each, vocab {vocab}\n")

    # 1. Verification of the previous step's drafts, straight from target logits.
    drafts = torch.tensor([5, 9, 2, 7, 7, 1], dtype=i32)
    logits = torch.randn(8, vocab, generator=g)
    # Make the target agree with request 0's first two drafts and with all of request 1's.
    for row, tok in [(0, 5), (1, 9), (4, 7), (5, 7), (6, 1)]:
        logits[row, tok] += 20.0
    cu = torch.tensor([3, 6], dtype=i32)
    ver = ops.verify_chain(
        logits.to(device),
        drafts.to(device),
        cu.to(device),
        temperature=torch.zeros(2, device=device),
        seeds=torch.tensor([1, 2], device=device),
        offsets=torch.zeros(2, dtype=torch.int64, device=device),
    )
    print("verify_chain (greedy): request r owns n_r draft rows + 1 bonus row of logits")
    _show("draft_token_ids", drafts.view(2, k))
    _show("output_token_ids", ver.output_token_ids)
    _show("num_accepted", ver.num_accepted)

    # 2. The drafter batch: copied rows, NTP row, K-1 mask rows, rejected tail.
    qsl = torch.tensor([0, 4, 8], dtype=i32)
    positions = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23])
    target_ids = torch.tensor([4, 5, 9, 2, 6, 7, 7, 1], dtype=i32)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=i32)
    prep = ops.prepare_draft_inputs(
        target_ids.to(device),
        positions.to(device),
        qsl.to(device),
        torch.tensor([14, 24], dtype=i32, device=device),
        ver.output_token_ids,
        torch.zeros(2, dtype=torch.bool, device=device),
        torch.zeros(2, dtype=i32, device=device),
        cu.to(device),
        block_table.to(device),
        num_padding_slots_per_request=k,
        mask_token_id=mask_id,
        block_size=16,
        max_model_len=4096,
        vocab_size=vocab,
        target_hidden_states=torch.randn(8, hidden, generator=g).to(device),
        mask_hidden=torch.randn(hidden, generator=g).to(device),
    )
    print(f"\nprepare_draft_inputs (mask token {mask_id}, one op for the whole draft step)")
    for name in ("input_ids", "positions", "is_masked", "is_rejected", "slot_mapping",
                 "token_indices_to_sample", "query_start_loc", "seq_lens"):  # fmt: skip
        _show(name, getattr(prep, name))

    # 3. The drafter's attention over its paged KV cache.
    t = prep.input_ids.shape[0]
    hq, hkv, d, bs = 4, 2, 16, 16

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

    k_cache, v_cache = randn(4, bs, hkv, d), randn(4, bs, hkv, d)
    ops.write_kv_cache(randn(t, hkv, d), randn(t, hkv, d), k_cache, v_cache, prep.slot_mapping)
    out, lse = ops.paged_attention(
        randn(t, hq, d),
        k_cache,
        v_cache,
        block_table.to(device),
        prep.query_start_loc,
        prep.seq_lens,
        return_lse=True,
    )
    print(f"\nwrite_kv_cache + paged_attention: {t} drafter rows, {hq} query / {hkv} KV heads")
    _show("out shape", tuple(out.shape))
    _show("lse[:, 0] (rounded)", [round(x, 2) for x in lse[:, 0].float().tolist()])
    print("\nrejected rows write no KV (slot -1) and sit after every real row of their request.")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="peagle demo", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    run_demo(args.device, args.seed)


if __name__ == "__main__":
    main()
