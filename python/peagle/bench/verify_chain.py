"""Benchmark: peagle.verify_chain (fused, from bf16 logits) vs a vLLM-style multi-op path.

The baseline ("vllm-multiop") is this file's own reimplementation, in plain torch ops, of the
steps vLLM's rejection sampler performs per verification step (vllm/v1/sample/rejection_sampler.py,
v0.13-v0.16 shape; PERF.md §5): cast the logits to fp32, divide by the per-row temperature,
(top-k/top-p by sort + mask), softmax, gather p(x) and accept with float64 uniforms, a recovered
token for EVERY draft position by the exponential race over p with the draft removed, the bonus
token by an exponential race over the bonus row, and the output assembly. vLLM runs its accept
and recovered steps as Triton kernels; here they are torch ops, so the baseline has more
launches but the same full-vocabulary fp32 passes, which dominate its time. It is not vLLM's
code and is not bit-compatible with it.

For B in {1, 8, 64}, K = 7, V in {151936, 201088}, greedy and T = 0.7 (plus top-k/top-p at
B in {1, 64}, and "vllm-draws": peagle given vLLM's random inputs -- float64 uniforms, an
exponential race over [B, V] float32 exponentials, bonus token ids -- as the vLLM adapter
calls it; and "accept=0.6" / "accept=1" at B in {8, 64}: each draft's logit raised so that the
target accepts it with that probability, like a drafter of per-token acceptance 0.6 (mean
acceptance length ~2.4 of 8) or one always accepted -- the plain T = 0.7 rows give the argmax
~22 % of the mass on average and 80 % of the drafts are the argmax, so a draft is accepted ~17 %
of the time and most chains stop at their first draft): both implementations run
on the same inputs in the same process, inside CUDA graphs
(N calls captured back to back, replay / N, median of >= 100 replays), rotating through enough
input sets to exceed the L2 several times (cold L2). Greedy outputs of the two paths are
compared before timing. GB/s counts the bf16 logits bytes once; % is of a device-to-device copy
ceiling measured in the same run (bytes read + written).

FlashInfer's sampling path is a second peer at the random cases (T=0.7, top-k/top-p), when it
imports (``--no-flashinfer`` skips it): ``flashinfer-chain`` (softmax with temperature, top-k /
top-p renorm, ``chain_speculative_sampling`` with one-hot draft probabilities built outside the
timed region) and, at the top-k/top-p cases, ``flashinfer-bonus-tktp``
(``top_k_top_p_sampling_from_logits`` over the B bonus rows alone); see
:mod:`peagle.bench.flashinfer_peers`. Random outputs -- peagle's and FlashInfer's -- are checked
by chi-square against the target distribution before timing (``chi2_p`` in the rows; p < 1e-3
prints BAD). Errors of the peer are recorded under ``flashinfer`` in the results file.

    peagle bench ops verify_chain --out benchmarks/results/verify-h200.json
    python benchmarks/bench_verify.py --out benchmarks/results/verify-h200.json
"""

from __future__ import annotations

import argparse
import math
import re

import torch

from peagle import ops
from peagle.bench import flashinfer_peers
from peagle.bench.stats import chi_square_pit, target_probs
from peagle.bench.timing import (
    Results,
    bench_eager,
    bench_graph,
    copy_ceiling_gbps,
    l2_rotation_sets,
    print_table,
)

FAMILY = "verify"
DESCRIPTION = __doc__.split("\n\n")[0]

K = 7


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def accept_of(mode: str) -> float | None:
    """The draft acceptance probability a case name asks for (``accept=0.6``), else None."""
    m = re.search(r"accept=([0-9.]+)", mode)
    return float(m.group(1)) if m else None


def set_acceptance(logits: torch.Tensor, rows: torch.Tensor, drafts: torch.Tensor, temp: float,
                   accept: float) -> None:  # fmt: skip
    """Raise each draft's logit in place so that the target gives it probability ``accept`` at
    ``temp`` (1: certain), whatever the rest of its row; chains then stop at geometric depths
    (mean acceptance length sum of accept^j), like a drafter of that per-token acceptance."""
    s = logits[rows].float() / temp
    s.scatter_(1, drafts.long().view(-1, 1), -math.inf)
    rest = torch.logsumexp(s, dim=1)
    margin = 60.0 if accept >= 1.0 else math.log(accept / (1.0 - accept))
    logits[rows, drafts.long()] = ((rest + margin) * temp).to(logits.dtype)


def make_set(
    b: int,
    v: int,
    temp: float,
    top: tuple[int, float] | None,
    seed: int,
    draws: bool = False,
    accept: float | None = None,
) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = b * (K + 1)
    logits = (torch.randn(rows, v, device="cuda", generator=g) * 3.0).to(torch.bfloat16)
    draft_rows = (torch.arange(b * K, device="cuda") // K) * (K + 1) + torch.arange(
        b * K, device="cuda"
    ) % K
    # Drafts agree with the target's argmax 80% of the time, so chains stop at varied depths.
    drafts = logits[draft_rows].float().argmax(-1).to(torch.int32)
    rand_ids = torch.randint(0, v, (b * K,), device="cuda", generator=g, dtype=torch.int32)
    keep = torch.rand(b * K, device="cuda", generator=g) < 0.8
    drafts = torch.where(keep, drafts, rand_ids)
    if accept is not None:
        set_acceptance(logits, draft_rows, drafts, temp, accept)
    s = {
        "logits": logits,
        "drafts": drafts,
        "draft_rows": draft_rows,
        "cu": torch.arange(1, b + 1, device="cuda", dtype=torch.int32) * K,
        "temperature": torch.full((b,), temp, device="cuda"),
        "seeds": torch.arange(b, device="cuda", dtype=torch.int64) + 1234,
        "offsets": torch.zeros(b, device="cuda", dtype=torch.int64),
        "top_k": None,
        "top_p": None,
        "uniforms": None,
        "exponentials": None,
        "bonus": None,
    }
    if draws:  # vLLM's random inputs, as the adapter passes them
        s["uniforms"] = torch.rand(b * K, device="cuda", generator=g, dtype=torch.float64)
        s["exponentials"] = torch.empty(b, v, device="cuda").exponential_(generator=g)
        s["bonus"] = torch.randint(0, v, (b,), device="cuda", generator=g, dtype=torch.int32)
    if top is not None:
        s["top_k"] = torch.full((b,), top[0], device="cuda", dtype=torch.int32)
        s["top_p"] = torch.full((b,), top[1], device="cuda")
    return s


# ---------------------------------------------------------------------------------------------
# the two implementations
# ---------------------------------------------------------------------------------------------


class Peagle:
    def __init__(self, b: int):
        self.out = ops.VerifyOutput(
            torch.empty(b, K + 1, dtype=torch.int32, device="cuda"),
            torch.empty(b, dtype=torch.int32, device="cuda"),
            None,
        )

    def __call__(self, s: dict) -> ops.VerifyOutput:
        return ops.verify_chain(
            s["logits"], s["drafts"], s["cu"], s["temperature"], s["seeds"], s["offsets"],
            top_k=s["top_k"], top_p=s["top_p"], uniforms=s["uniforms"],
            exponentials=s["exponentials"], bonus_token_ids=s["bonus"], max_num_draft_tokens=K,
            out=self.out,
        )  # fmt: skip


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Sort-based top-k/top-p mask in the shape of vLLM's apply_top_k_top_p (plain torch)."""
    srt, idx = logits.sort(dim=-1, descending=False)
    kth = srt.gather(1, (srt.shape[1] - k.long()).clamp(0, srt.shape[1] - 1).unsqueeze(1))
    srt = srt.masked_fill(srt < kth, float("-inf"))
    cum = srt.softmax(dim=-1).cumsum(dim=-1)
    mask = cum <= 1 - p.unsqueeze(1)
    mask[:, -1] = False
    srt = srt.masked_fill(mask, float("-inf"))
    return torch.empty_like(srt).scatter_(1, idx, srt)


def vllm_multiop(s: dict, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification step the way vLLM's sampler path does it, in plain torch ops."""
    logits = s["logits"].float()  # fp32 cast of every row (draft rows + bonus rows)
    rows, v = logits.shape
    b = rows // (K + 1)
    bonus_rows = torch.arange(b, device="cuda") * (K + 1) + K
    drafts = s["drafts"].long().view(b, K)
    if greedy:
        target_argmax = logits.argmax(dim=-1)
        draft_argmax = target_argmax[s["draft_rows"]].view(b, K)
        accept = drafts == draft_argmax
        emitted_tok = draft_argmax  # the correction is the argmax
        bonus = target_argmax[bonus_rows]
    else:
        temp = s["temperature"].repeat_interleave(K + 1)
        logits = logits.div_(temp.unsqueeze(1))
        if s["top_k"] is not None:
            logits = _top_k_top_p(
                logits, s["top_k"].repeat_interleave(K + 1), s["top_p"].repeat_interleave(K + 1)
            )
        probs = logits.softmax(dim=-1)  # fp32 target probabilities, [B*(K+1), V]
        target_probs = probs[s["draft_rows"]]  # [B*K, V]
        uniforms = torch.rand(b * K, dtype=torch.float64, device="cuda")
        p_x = target_probs.gather(1, drafts.view(-1, 1)).squeeze(1)
        accept = (uniforms <= p_x).view(b, K)
        # Recovered token at every position: exponential race over p with the draft removed.
        q = torch.empty(b, v, device="cuda").exponential_()
        residual = target_probs.scatter(1, drafts.view(-1, 1), 0.0)
        recovered = (residual.view(b, K, v) / q.unsqueeze(1)).argmax(dim=-1)
        emitted_tok = recovered
        # Bonus token: exponential race over the bonus row.
        q2 = torch.empty(b, v, device="cuda").exponential_()
        bonus = (probs[bonus_rows] / q2).argmax(dim=-1)
    # Output assembly: accepted prefix, the correction (or bonus), -1 after.
    acc_prefix = accept.int().cumprod(dim=1)
    num_accepted = acc_prefix.sum(dim=1)
    cols = torch.arange(K + 1, device="cuda").unsqueeze(0)
    body = torch.where(acc_prefix.bool(), drafts, emitted_tok)
    body = torch.cat([body, bonus.unsqueeze(1)], dim=1)
    out = torch.where(cols <= num_accepted.unsqueeze(1), body, torch.full_like(body, -1))
    return out.to(torch.int32), num_accepted.to(torch.int32)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def check_peagle_random(peagle, s: dict, temp: float, top, n_samples: int = 4096):
    """Chi-square of peagle's first emitted token of every request against the request's first
    target row, over repeated calls with the Philox offset advanced."""
    b = s["cu"].numel()
    reps = max(1, -(-n_samples // b))
    outs = []
    for r in range(reps):
        got = peagle({**s, "offsets": s["offsets"] + r})
        outs.append(got.output_token_ids[:, 0].clone())
    v = s["logits"].shape[1]
    rows = s["logits"].view(b, K + 1, v)[:, 0]
    top_k, top_p = top if top is not None else (None, None)
    p = target_probs(rows, temp, top_k, top_p)
    return chi_square_pit(torch.cat(outs), p, rows=torch.arange(b).repeat(reps),
                          generator=torch.Generator().manual_seed(0))  # fmt: skip


def run_flashinfer(res: Results, fi, sets, name, temp, top, calls, replays, logit_bytes) -> None:
    """FlashInfer's sampling path on the same sets: chi-square first, then CUDA-graph timing."""
    notes = res.extra["flashinfer"]
    try:
        peer = flashinfer_peers.VerifyPeer(fi, sets, K, temp, top)
    except Exception as e:  # noqa: BLE001  (recorded, not fatal)
        notes["errors"].setdefault(name, {})["flashinfer-chain"] = flashinfer_peers.short_error(e)
        return
    impls = {"flashinfer-chain": (lambda i: peer.chain(i), peer.check_chain)}
    if top is not None:
        impls["flashinfer-bonus-tktp"] = (lambda i: peer.bonus(i), peer.check_bonus)
    n_sets = len(sets)
    for impl, (fn, check) in impls.items():
        try:
            chi = check()
            torch.cuda.synchronize()
            t = bench_graph(fn, min(calls, 4), replays)
            mode = "graph"
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            notes["errors"].setdefault(name, {})[impl] = flashinfer_peers.short_error(e)
            print(f"{name:40s} {impl}: {flashinfer_peers.short_error(e)}")
            continue
        nbytes = logit_bytes if impl == "flashinfer-chain" else logit_bytes // (K + 1)
        gbps = nbytes / (t * 1e-6) / 1e9
        res.add(name, impl, t, gbps, pct_of_copy=round(100 * gbps / res.copy_ceiling_gbps, 1),
                mode=mode, input_sets=n_sets, chi2_p=round(chi.p_value, 4),
                chi2_samples=chi.n)  # fmt: skip
        print(f"{name:40s} {impl} {t:8.1f} us  chi2 p={chi.p_value:.3g} (n={chi.n})"
              + ("  BAD" if not chi.ok() else ""))  # fmt: skip


def case_name(b: int, v: int, mode: str) -> str:
    return f"B={b},K={K},V={v},{mode}"


def run_case(res: Results, b: int, v: int, mode: str, temp: float, top, replays: int,
             fi=None) -> None:  # fmt: skip
    logit_bytes = b * (K + 1) * v * 2
    draws = "vllm-draws" in mode
    n_sets = l2_rotation_sets(logit_bytes + (b * v * 4 if draws else 0))
    accept = accept_of(mode)
    sets = [make_set(b, v, temp, top, seed=i, draws=draws, accept=accept) for i in range(n_sets)]
    name = case_name(b, v, mode)
    peagle = Peagle(b)
    greedy = temp == 0.0
    # Correctness before timing.
    got = peagle(sets[0])
    want_out, want_acc = vllm_multiop(sets[0], greedy)
    torch.cuda.synchronize()
    valid = (got.output_token_ids >= 0) & (got.output_token_ids < v)
    emitted = torch.arange(K + 1, device="cuda").unsqueeze(0) <= got.num_accepted.unsqueeze(1)
    assert bool((valid == emitted).all()), f"{name}: peagle output not well formed"
    chi = None
    if greedy:
        assert torch.equal(got.output_token_ids, want_out), f"{name}: greedy outputs differ"
        assert torch.equal(got.num_accepted, want_acc)
    elif not draws:
        chi = check_peagle_random(peagle, sets[0], temp, top)
        print(
            f"{name}: peagle chi2 p={chi.p_value:.3g} (n={chi.n})" + ("" if chi.ok() else "  BAD")
        )
    calls = 10 if b * v < 64 * 151936 else 5
    t_peagle = bench_graph(lambda i: peagle(sets[i % n_sets]), calls, replays)
    t_peagle_eager = bench_eager(lambda i: peagle(sets[i % n_sets]), iters=replays)
    t_vllm = bench_graph(lambda i: vllm_multiop(sets[i % n_sets], greedy), min(calls, 4), replays)
    for impl, t in (("peagle", t_peagle), ("vllm-multiop", t_vllm)):
        gbps = logit_bytes / (t * 1e-6) / 1e9
        more = (
            {"chi2_p": round(chi.p_value, 4), "chi2_samples": chi.n}
            if chi and impl == "peagle"
            else {}
        )
        res.add(
            name, impl, t, gbps, pct_of_copy=round(100 * gbps / res.copy_ceiling_gbps, 1),
            mode="graph", input_sets=n_sets, **more,
        )  # fmt: skip
    res.add(name, "peagle", t_peagle_eager, None, mode="eager")
    print(
        f"{name:40s} peagle {t_peagle:8.1f} us ({logit_bytes / t_peagle / 1e3:6.0f} GB/s)  "
        f"eager {t_peagle_eager:8.1f} us   vllm-multiop {t_vllm:8.1f} us   "
        f"x{t_vllm / t_peagle:.1f}"
    )
    if fi is not None and not greedy and not draws:
        run_flashinfer(res, fi, sets, name, temp, top, calls, replays, logit_bytes)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=None, help="write JSON results here")
    ap.add_argument("--quick", action="store_true", help="B=8, V=201088 only, fewer replays")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer peer")
    ap.add_argument(
        "--filter", nargs="*", help="only cases whose name contains one of these, e.g. top_k B=64"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    add_arguments(ap)
    run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> None:
    ceiling = copy_ceiling_gbps()
    res = Results(ceiling, extra={"K": K, "dtype": "bfloat16", "l2": "cold (rotating sets)"})
    print(f"copy ceiling: {ceiling:.0f} GB/s")
    fi, fi_skip = (None, "--no-flashinfer") if args.no_flashinfer else flashinfer_peers.load()
    res.extra["flashinfer"] = {
        "version": flashinfer_peers.version(fi) if fi else None,
        "skipped": fi_skip,
        "errors": {},
    }
    print(f"flashinfer: {res.extra['flashinfer']['version'] or 'skipped: ' + str(fi_skip)}")
    batches = [8] if args.quick else [1, 8, 64]
    vocabs = [201088] if args.quick else [151936, 201088]
    cases = []
    for v in vocabs:
        for b in batches:
            cases.append((b, v, "greedy", 0.0, None))
            cases.append((b, v, "T=0.7", 0.7, None))
    for b in [1, 64] if not args.quick else [8]:
        cases.append((b, 201088, "T=0.7,top_k=50,top_p=0.9", 0.7, (50, 0.9)))
    for b in [1, 64] if not args.quick else [8]:
        cases.append((b, 201088, "T=0.7,vllm-draws", 0.7, None))
    # Drafts the target accepts with probability 0.6 (mean acceptance length ~2.4 of 8, near
    # P-EAGLE's published 2.6) and always (every row needed: early exit's worst case).
    for a in ["0.6", "1"]:
        for b in [8, 64] if not args.quick else [8]:
            cases.append((b, 201088, f"T=0.7,accept={a}", 0.7, None))

    for b, v, mode, temp, top in cases:
        name = case_name(b, v, mode)
        if args.filter and not any(f in name for f in args.filter):
            continue
        run_case(res, b, v, mode, temp, top, args.replays, fi)
        torch.cuda.empty_cache()

    print()
    print_table(res.rows, ["case", "impl", "mode", "median_us", "gbps", "pct_of_copy"])
    if args.out:
        res.write(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
