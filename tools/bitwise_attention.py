"""Bitwise fingerprints of paged_attention's CUDA outputs, for kernel changes meant to keep the
bits: dump them with the old build and the new one on the same GPU, then compare
(`bash tools/h200.sh bits OLD_SRC` does all three).

    python3 tools/bitwise_attention.py dump OUT.json [--quick]
    python3 tools/bitwise_attention.py compare OLD.json NEW.json

Every case (decode, prefill, ragged, sliding-window, GQA 1-16, head_dim 64/128, page 8-32, the
cache layouts of tests/test_paged_attention.py) runs under each kernel variant
(``PEAGLE_ATTN_IMPL``: automatic, mma, wgmma, wgmma-n32, wgmma-m64, wgmma-m128), split count
(automatic, 1, 3, 16) and merge (kernel; cluster for the split counts that merge). Inputs come
from one seeded CPU generator per case, so both builds see the same bytes. A fingerprint is the
SHA-256 of the bf16 output's and the fp32 lse's bytes, or the error a call raised. ``compare``
lists the differing settings; a difference only where splits merge points at the merge, one at
every split count at the main kernel. Exit status 1 when any fingerprint differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass

import torch

IMPLS = ["auto", "mma", "wgmma", "wgmma-n32", "wgmma-m64", "wgmma-m128"]
SPLITS = [0, 1, 3, 16]


@dataclass(frozen=True)
class Case:
    name: str
    hq: int
    hkv: int
    d: int
    page: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    layout: str = "plain"
    window_left: int = -1


CASES = [
    Case("b1-32x8x128-kv1k", 32, 8, 128, 16, (14,), (1024,)),
    Case("b1-32x8x128-kv4k", 32, 8, 128, 16, (14,), (4096,)),
    Case("b1-32x8x128-kv16k", 32, 8, 128, 16, (14,), (16384,)),
    Case("b2-32x8x128-ragged", 32, 8, 128, 16, (14, 14), (4096, 3001)),
    Case("b8-32x8x128-ragged", 32, 8, 128, 16, (14,) * 8, tuple(700 + 397 * i for i in range(8))),
    Case("b64-32x8x128-kv1k", 32, 8, 128, 16, (14,) * 64, tuple(1024 - 7 * i for i in range(64))),
    Case("b1-64x8x64-kv1k", 64, 8, 64, 16, (14,), (1024,)),
    Case("b1-64x8x64-kv16k", 64, 8, 64, 16, (14,), (16384,)),
    Case("b8-64x8x64-ragged", 64, 8, 64, 16, (14,) * 8, tuple(500 + 511 * i for i in range(8))),
    Case("b64-64x8x64-kv1k", 64, 8, 64, 16, (14,) * 64, tuple(1024 - 5 * i for i in range(64))),
    Case("b4-mixed-rows", 32, 8, 128, 16, (14, 1, 9, 6), (150, 37, 9, 3)),
    Case("b3-gqa16-page8", 32, 2, 64, 8, (14, 14, 3), (300, 41, 3)),
    Case("b3-gqa1", 8, 8, 64, 16, (14, 7, 1), (200, 90, 17)),
    Case("b3-gqa4-d128-page8", 16, 4, 128, 8, (14, 5, 14), (333, 64, 15), "interleaved"),
    Case("b2-split2-page32", 32, 8, 128, 32, (14, 14), (777, 1500), "split2"),
    Case("b2-padded-64x8x64", 64, 8, 64, 16, (14, 14), (999, 260), "padded"),
    Case("b2-head-major", 32, 8, 128, 32, (14, 9), (1200, 77), "head_major"),
    Case("b2-head-major-64x8x64", 64, 8, 64, 16, (14, 14), (640, 2100), "head_major"),
    Case("prefill-q100", 32, 8, 128, 16, (100, 37), (300, 37)),
    Case("window-40", 64, 8, 64, 16, (14, 14), (900, 50), "plain", 40),
]
QUICK = {"b1-32x8x128-kv1k", "b8-64x8x64-ragged", "b64-64x8x64-kv1k", "b2-head-major"}


def make_inputs(c: Case, seed: int, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """Bf16 inputs of one case from a seeded CPU generator (identical in every build)."""
    g = torch.Generator().manual_seed(seed)
    per_req = [-(-kv // c.page) for kv in c.kv_lens]
    width = max(per_req) + 1
    nblk = sum(per_req) + 2
    perm = torch.randperm(nblk, generator=g)
    table = torch.full((len(c.q_lens), width), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(per_req):
        table[r, :n] = perm[at : at + n].to(torch.int32)
        at += n
    if c.layout == "split2":
        kv = torch.randn(2, nblk, c.page, c.hkv, c.d, generator=g)
        kc, vc = kv[0], kv[1]
    elif c.layout == "interleaved":
        kv = torch.randn(nblk, 2, c.page, c.hkv, c.d, generator=g)
        kc, vc = kv[:, 0], kv[:, 1]
    elif c.layout == "padded":
        kc = torch.randn(nblk, c.page, c.hkv, c.d + 8, generator=g)[..., : c.d]
        vc = torch.randn(nblk, c.page, c.hkv, c.d + 8, generator=g)[..., : c.d]
    elif c.layout == "head_major":
        kc = torch.randn(nblk, c.hkv, c.page, c.d, generator=g).permute(0, 2, 1, 3)
        vc = torch.randn(nblk, c.hkv, c.page, c.d, generator=g).permute(0, 2, 1, 3)
    else:
        kc = torch.randn(nblk, c.page, c.hkv, c.d, generator=g)
        vc = torch.randn(nblk, c.page, c.hkv, c.d, generator=g)
    q = torch.randn(sum(c.q_lens), c.hq, c.d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(c.q_lens).cumsum(0).tolist()], dtype=torch.int32)
    sl = torch.tensor(c.kv_lens, dtype=torch.int32)
    views = [strided_copy(x, device) for x in (q, kc, vc)]
    return (*views, table.to(device), qsl.to(device), sl.to(device))


def strided_copy(x: torch.Tensor, device: str) -> torch.Tensor:
    """A bf16 tensor on `device` with x's values, sizes and strides (the cache layouts' views)."""
    span = 1 + sum((s - 1) * st for s, st in zip(x.shape, x.stride(), strict=True))
    base = torch.zeros(span, dtype=torch.bfloat16, device=device)
    y = base.as_strided(x.shape, x.stride())
    y.copy_(x.to(torch.bfloat16))
    return y


# A CUDA error that leaves the context unusable (torch >= 2.8 raises it as AcceleratorError).
_STICKY = getattr(torch, "AcceleratorError", RuntimeError)


class Fault(Exception):
    """A launch left the CUDA context unusable; the message is the error's first line."""


def fingerprint(args: tuple[torch.Tensor, ...], c: Case, splits: int) -> str:
    from peagle import ops

    q = args[0]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    try:
        ops.paged_attention(*args, max_query_len=max(c.q_lens), window_left=c.window_left,
                            num_splits=splits, return_lse=True, out=out, lse=lse)  # fmt: skip
        torch.cuda.synchronize()
    except _STICKY as e:  # the context is lost (e.g. an illegal address): no later case can run
        raise Fault(str(e).splitlines()[0][:120]) from e
    except Exception as e:  # noqa: BLE001 (an unsupported variant is a fingerprint too)
        return "error: " + str(e).splitlines()[0][:120]
    h = hashlib.sha256(out.view(torch.int16).cpu().numpy().tobytes())
    h.update(lse.cpu().numpy().tobytes())
    return h.hexdigest()[:24]


def dump(path: str, quick: bool) -> int:
    """Fingerprints every setting into `path`; 2 when a launch faulted: the fingerprints so far
    and that setting (``fault: ...``) are written, and the setting is printed."""
    rows, fault = {}, None
    try:
        for i, c in enumerate(CASES):
            if quick and c.name not in QUICK:
                continue
            args = make_inputs(c, seed=1000 + i)
            for impl in IMPLS:
                for splits in SPLITS:
                    for merge in ("kernel", "cluster") if splits != 1 else ("kernel",):
                        key = f"{c.name}|{impl}|s{splits}|{merge}"
                        os.environ["PEAGLE_ATTN_IMPL"] = impl
                        os.environ["PEAGLE_ATTN_MERGE"] = merge
                        try:
                            rows[key] = fingerprint(args, c, splits)
                        except Fault as e:
                            rows[key], fault = f"fault: {e}", key
                            raise
    except Fault:
        pass
    finally:
        os.environ.pop("PEAGLE_ATTN_IMPL", None)
        os.environ.pop("PEAGLE_ATTN_MERGE", None)
    errors = sum(v.startswith("error") for v in rows.values())
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    with open(path, "w") as f:
        json.dump({"gpu": gpu, "rows": rows}, f, indent=1)
    print(f"{len(rows)} fingerprints ({errors} errors) -> {path}")
    if fault is not None:
        print(f"FAULT {fault}: {rows[fault]} (the CUDA context is lost; later settings not run)")
        return 2
    return 0


def compare(old_path: str, new_path: str) -> int:
    old = json.load(open(old_path))["rows"]
    new = json.load(open(new_path))["rows"]
    keys = sorted(set(old) | set(new))
    diff = [k for k in keys if old.get(k) != new.get(k)]
    for k in diff:
        print(f"DIFF {k}: {old.get(k)} -> {new.get(k)}")
    merged = [k for k in diff if "|s1|" not in k]
    print(f"{len(keys)} settings, {len(diff)} differ ({len(diff) - len(merged)} without a merge)")
    return 1 if diff else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--quick", action="store_true", help="4 cases only")
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    a = ap.parse_args(argv)
    if a.cmd == "compare":
        return compare(a.old, a.new)
    return dump(a.out, a.quick)


if __name__ == "__main__":
    sys.exit(main())
