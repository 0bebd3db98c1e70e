"""Benchmark: peagle.paged_attention vs torch SDPA and FlexAttention on P-EAGLE decode batches.

Cases: B in {1, 8, 64}, 14 query rows per request (2K, K = 7), heads 64/8 x 64 and 32/8 x 128,
kv_len in {1k, 4k, 16k}, bf16. peagle reads a paged cache (page 16, pages shuffled); the torch
baselines read the same K/V gathered into contiguous [B, Hkv, kv, D] tensors:

* ``sdpa``: ``F.scaled_dot_product_attention`` with ``causal_lower_right`` (bottom-right causal)
  and ``enable_gqa``;
* ``sdpa-packed-gqa``: the GQA group folded into the query axis ([B, Hkv, G*14, D]) with an
  explicit boolean bottom-right mask (one K/V read per KV head, like peagle);
* ``flex``: compiled FlexAttention with a bottom-right causal block mask and ``enable_gqa``;
* ``flashinfer-<backend>`` (when FlashInfer imports; ``--no-flashinfer`` skips it): FlashInfer
  over the same paged cache through every backend of :mod:`peagle.bench.flashinfer_peers`
  (prefill wrapper fa2 / fa3, decode wrapper with ``q_len_per_req``, XQA, ``BatchAttention``),
  planned outside the timed region; a backend that fails is recorded under ``flashinfer`` in
  the results file (``errors``: case -> impl -> error), not timed.

``--impls`` also times peagle's other kernel variants (``PEAGLE_ATTN_IMPL``: ``mma``, ``wgmma``,
``mma-n32``, ``wgmma-n32``; rows ``peagle[<impl>]``; ``peagle`` is the default choice).

Outputs are compared with peagle's before timing (``BAD`` marks a max difference above 0.1, i.e.
a wrong result rather than bf16 rounding). Timing (PERF.md §4): CUDA events, warm-up,
median; every implementation is captured in a CUDA graph when it can be (N calls per graph,
replay / N; eager otherwise, marked in ``mode``); peagle is also timed eagerly
(``peagle-eager``). Inputs rotate through enough sets to touch >= 4x the L2 (``l2: cold``).
GB/s counts K/V bytes only (B * kv * Hkv * D * 2 B * 2); % is of the copy ceiling measured in the
same run.

    peagle bench ops paged_attention --out benchmarks/results/attention-h200.json
    python benchmarks/bench_attention.py --out benchmarks/results/attention-h200.json
    python benchmarks/bench_attention.py --quick        # a few cases, smoke run
    python benchmarks/bench_attention.py --filter h32-8 --out ...   # one head config
    python benchmarks/bench_attention.py --filter h64-8 --impls mma --out ...  # + a variant
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

import peagle
from peagle.bench import flashinfer_peers
from peagle.bench.timing import (
    Results,
    bench_eager,
    bench_graph,
    copy_ceiling_gbps,
    l2_rotation_sets,
    print_table,
)

FAMILY = "attention"
DESCRIPTION = __doc__.split("\n")[0]

Q_LEN = 14
PAGE = 16
HEADS = [(64, 8, 64), (32, 8, 128)]
BATCHES = [1, 8, 64]
KV_LENS = [1024, 4096, 16384]


class Case:
    """n_sets independent input sets for one shape: a paged cache with shuffled pages and the same
    K/V gathered contiguously for the torch baselines."""

    def __init__(self, b, hq, hkv, d, kv, n_sets, dtype=torch.bfloat16, seed=0, device="cuda"):
        self.device = device
        g = torch.Generator(device=device).manual_seed(seed)
        self.b, self.hq, self.hkv, self.d, self.kv = b, hq, hkv, d, kv
        self.group = hq // hkv
        blocks_per_seq = -(-kv // PAGE)
        num_blocks = n_sets * b * blocks_per_seq
        kw = {"device": device, "dtype": dtype}
        cache = torch.randn(2, num_blocks, PAGE, hkv, d, generator=g, **kw)
        self.key_cache, self.value_cache = cache[0], cache[1]
        perm = torch.randperm(num_blocks, generator=g, device=device).to(torch.int32)
        self.tables = perm.view(n_sets, b, blocks_per_seq)
        self.queries = [
            torch.randn(b * Q_LEN, hq, d, generator=g, **kw) for _ in range(n_sets)
        ]  # fmt: skip
        self.outs = [torch.empty_like(q) for q in self.queries]
        i32 = {"device": device, "dtype": torch.int32}
        self.qsl = torch.arange(0, (b + 1) * Q_LEN, Q_LEN, **i32)
        self.seq_lens = torch.full((b,), kv, **i32)
        self.scale = 1.0 / math.sqrt(d)

    def contiguous_kv(self, s):
        """[B, Hkv, kv, D] K and V of set s (gathered once, outside timing)."""
        idx = self.tables[s].long()  # [B, blocks]
        k = self.key_cache[idx].flatten(1, 2)[:, : self.kv].transpose(1, 2).contiguous()
        v = self.value_cache[idx].flatten(1, 2)[:, : self.kv].transpose(1, 2).contiguous()
        return k, v

    def peagle(self, i):
        s = i % len(self.queries)
        return peagle.paged_attention(
            self.queries[s], self.key_cache, self.value_cache, self.tables[s], self.qsl,
            self.seq_lens, softmax_scale=self.scale, max_query_len=Q_LEN, out=self.outs[s],
        )  # fmt: skip

    def q_bhsd(self, s):
        return self.queries[s].view(self.b, Q_LEN, self.hq, self.d).transpose(1, 2)


def with_impl(fn, impl: str):
    """fn under PEAGLE_ATTN_IMPL=impl (read by the launcher at every call, so at graph capture)."""

    def run(i):
        old = os.environ.get("PEAGLE_ATTN_IMPL")
        os.environ["PEAGLE_ATTN_IMPL"] = impl
        try:
            return fn(i)
        finally:
            if old is None:
                del os.environ["PEAGLE_ATTN_IMPL"]
            else:
                os.environ["PEAGLE_ATTN_IMPL"] = old

    return run


def kv_bytes(c: Case) -> int:
    return c.b * c.kv * c.hkv * c.d * 2 * 2


def make_baselines(c: Case, n_sets: int, with_flex: bool = True):
    """Returns {impl: fn(i)} over contiguous copies of the same K/V, and the gathered K/V."""
    from torch.nn.attention.bias import causal_lower_right

    kvs = [c.contiguous_kv(s) for s in range(n_sets)]
    qs = [c.q_bhsd(s).contiguous() for s in range(n_sets)]
    bias = causal_lower_right(Q_LEN, c.kv)
    fns = {}

    def sdpa(i):
        k, v = kvs[i % n_sets]
        return F.scaled_dot_product_attention(
            qs[i % n_sets], k, v, attn_mask=bias, scale=c.scale, enable_gqa=True
        )

    fns["sdpa"] = sdpa

    # Packed GQA: rows ordered (head-in-group, query row); row (hh, i) sees keys <= kv - 14 + i.
    rows = torch.arange(Q_LEN, device=c.device).repeat(c.group)
    keys = torch.arange(c.kv, device=c.device)
    mask = (keys[None, :] <= c.kv - Q_LEN + rows[:, None])[None, None]
    packed = [
        q.view(c.b, c.hkv, c.group, Q_LEN, c.d).reshape(c.b, c.hkv, c.group * Q_LEN, c.d)
        for q in qs
    ]

    def sdpa_packed(i):
        k, v = kvs[i % n_sets]
        return F.scaled_dot_product_attention(
            packed[i % n_sets], k, v, attn_mask=mask, scale=c.scale
        )

    fns["sdpa-packed-gqa"] = sdpa_packed

    if not with_flex:
        return fns
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        offset = c.kv - Q_LEN

        def bottom_right(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        block_mask = create_block_mask(bottom_right, None, None, Q_LEN, c.kv, device=c.device)
        flex = torch.compile(flex_attention, dynamic=False)

        def flex_fn(i):
            k, v = kvs[i % n_sets]
            return flex(qs[i % n_sets], k, v, block_mask=block_mask, scale=c.scale, enable_gqa=True)

        fns["flex"] = flex_fn
    except Exception as e:  # noqa: BLE001  (report and go on: FlexAttention is optional)
        print(f"flex unavailable: {type(e).__name__}: {e}")
    return fns


def check_outputs(c: Case, fns) -> dict:
    """Max |impl - peagle| on set 0 (bf16 outputs; a few 1e-2 is rounding)."""
    ref = c.peagle(0).float().view(c.b, Q_LEN, c.hq, c.d).clone()
    errs = {}
    for name, fn in fns.items():
        try:
            o = fn(0).float()
        except Exception as e:  # noqa: BLE001
            errs[name] = f"failed: {flashinfer_peers.short_error(e)}"
            continue
        if name.startswith(("peagle[", "flashinfer-")):  # peagle's [B*14, Hq, D] layout
            o = o.view(c.b, Q_LEN, c.hq, c.d).transpose(1, 2)
        elif name == "sdpa-packed-gqa":
            o = o.view(c.b, c.hkv, c.group, Q_LEN, c.d).reshape(c.b, c.hq, Q_LEN, c.d)
        errs[name] = round((o.transpose(1, 2) - ref).abs().max().item(), 4)
    return errs


def time_impl(fn, n_sets, replays):
    calls = max(4, min(n_sets, 64))  # one rotation through the input sets per replay
    try:
        return bench_graph(fn, calls_per_graph=calls, replays=replays), "graph"
    except Exception as e:  # noqa: BLE001  (not capturable: time eagerly)
        print(f"  graph capture failed ({type(e).__name__}); timing eagerly")
        torch.cuda.synchronize()
        return bench_eager(fn, iters=max(100, replays)), "eager"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", help="write JSON results here")
    ap.add_argument("--quick", action="store_true", help="a few small cases")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--no-baselines", action="store_true", help="time peagle only")
    ap.add_argument(
        "--no-flex", action="store_true", help="skip FlexAttention (compiles per shape)"
    )
    ap.add_argument(
        "--filter", nargs="*", help="only cases whose name contains one of these, e.g. h32-8 B64"
    )
    ap.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer peers")
    ap.add_argument(
        "--flashinfer-backends",
        default=",".join(flashinfer_peers.ATTENTION_BACKENDS),
        help="comma-separated FlashInfer backends (default: all)",
    )
    ap.add_argument(
        "--impls",
        default="",
        help="comma-separated extra peagle kernel variants to time (PEAGLE_ATTN_IMPL values)",
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    add_arguments(ap)
    run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> None:
    torch._dynamo.config.cache_size_limit = 64  # FlexAttention recompiles per shape

    torch.backends.cuda.matmul.allow_tf32 = False
    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling: {ceiling:.0f} GB/s (read + write)")
    res = Results(copy_ceiling_gbps=ceiling, extra={"q_len": Q_LEN, "page_size": PAGE})
    if args.no_flashinfer or args.no_baselines:
        fi, fi_skip = None, "--no-flashinfer" if args.no_flashinfer else "--no-baselines"
    else:
        fi, fi_skip = flashinfer_peers.load()
    fi_notes = {"version": flashinfer_peers.version(fi) if fi else None, "skipped": fi_skip,
                "errors": {}}  # fmt: skip
    res.extra["flashinfer"] = fi_notes
    print(f"flashinfer: {fi_notes['version'] or 'skipped: ' + str(fi_skip)}")
    fi_backends = [b for b in args.flashinfer_backends.split(",") if b]
    heads = HEADS[:1] if args.quick else HEADS
    batches = [1, 8] if args.quick else BATCHES
    kv_lens = [1024, 4096] if args.quick else KV_LENS
    for hq, hkv, d in heads:
        for b in batches:
            for kv in kv_lens:
                name = f"B{b}_q{Q_LEN}_h{hq}-{hkv}_d{d}_kv{kv}"
                if args.filter and not any(f in name for f in args.filter):
                    continue
                n_sets = l2_rotation_sets(b * kv * hkv * d * 2 * 2)
                c = Case(b, hq, hkv, d, kv, n_sets, seed=b * 7919 + kv)
                nbytes = kv_bytes(c)
                fns = {} if args.no_baselines else make_baselines(c, n_sets, not args.no_flex)
                fi_errs = {}
                if fi is not None:
                    peers = flashinfer_peers.AttentionPeers(fi, c, n_sets, fi_backends)
                    fns.update(peers.fns)
                    fi_errs.update(peers.errors)
                variants = {
                    f"peagle[{v}]": with_impl(c.peagle, v) for v in args.impls.split(",") if v
                }
                errs = check_outputs(c, {**variants, **fns})
                bad = [k for k, e in errs.items() if not isinstance(e, str) and e > 0.1]
                print(f"{name}: sets={n_sets} max|impl - peagle| = {errs}"
                      + (f"  BAD: {bad}" if bad else ""))  # fmt: skip
                fi_errs.update({k: e for k, e in errs.items()
                                if k.startswith("flashinfer-") and isinstance(e, str)})  # fmt: skip
                if fi_errs:
                    fi_notes["errors"][name] = fi_errs
                    print(f"  flashinfer errors: {fi_errs}")
                all_fns = {"peagle": c.peagle, **variants, **fns}
                for impl, fn in all_fns.items():
                    if isinstance(errs.get(impl), str):
                        continue
                    try:
                        us, mode = time_impl(fn, n_sets, args.replays)
                    except Exception as e:  # noqa: BLE001  (a peer failing while timed)
                        if not impl.startswith("flashinfer-"):
                            raise
                        torch.cuda.synchronize()
                        fi_notes["errors"].setdefault(name, {})[impl] = (
                            "timing: " + flashinfer_peers.short_error(e)
                        )
                        continue
                    gbps = nbytes / (us * 1e-6) / 1e9
                    more = {"max_err": errs[impl]} if impl in errs else {}
                    res.add(name, impl, us, gbps, pct_copy=round(100 * gbps / ceiling, 1),
                            mode=mode, l2="cold", **more)  # fmt: skip
                    if impl == "peagle":
                        us_e = bench_eager(fn, iters=max(100, args.replays))
                        gbps_e = nbytes / (us_e * 1e-6) / 1e9
                        res.add(name, "peagle-eager", us_e, gbps_e,
                                pct_copy=round(100 * gbps_e / ceiling, 1), mode="eager",
                                l2="cold")  # fmt: skip
                peers = None
                del c, fns, all_fns
                torch.cuda.empty_cache()
                if args.out:  # after every case: a run stopped part-way keeps what it measured
                    res.write(args.out)
    print_table(res.rows, ["case", "impl", "median_us", "gbps", "pct_copy", "mode"])
    if args.out:
        res.write(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
