"""Per-kernel profile of the verify and attention cases that miss their targets, under ``ncu``.

Run (H200; ``.ab``-style wrapper scripts just call these):

    ncu --clock-control none --metrics <list> --csv \
        python3 tools/profile_kernels.py verify > ncu-verify.csv
    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        --csv python3 tools/profile_kernels.py attention > ncu-attention.csv

then turn the CSVs into the results file ``peagle bench report`` renders:

    python tools/profile_kernels.py summarize --commit <sha> \
        --out benchmarks/results/profile-kernels-h200.json \
        verify:default=ncu-verify.csv attention:default=ncu-attention.csv

Each case runs 3 times (ncu flushes caches between kernels by default: cold L2) and prints its
name first. ncu serialises kernels and leaves the clocks alone (``--clock-control none``), so
its times for kernels of a few microseconds run above the graph-replay medians of
``peagle bench``: read the split between kernels and their limiters here, the times there.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
from pathlib import Path

# The first peagle kernel of each call of an op; the kernels after it, up to the next one, are
# the rest of that call.
CALL_START = {"verify": "row_stats_kernel", "attention": "paged_attention_kernel<"}
# ncu metric names (--metrics lists, or the sections' display names) -> summary fields
FIELDS = {
    "time_us": ("gpu__time_duration.sum", "Duration"),
    "dram_pct": ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "DRAM Throughput"),
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "Compute (SM) Throughput"),
    "occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active", "Achieved Occupancy"),
    "registers": ("launch__registers_per_thread", "Registers Per Thread"),
    "dram_read_mb": ("dram__bytes_read.sum",),
}


def verify_cases() -> None:
    import torch

    from peagle import ops

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
        for _ in range(3):  # max_num_draft_tokens given: no host sync, as in a decode step
            ops.verify_chain(logits, drafts, cu, t, seeds, offs, max_num_draft_tokens=k, **kw)
        torch.cuda.synchronize()


def attention_cases() -> None:
    import torch

    from peagle import ops

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


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _to_field(metric: str, unit: str, value: str) -> tuple[str, float] | None:
    for field, names in FIELDS.items():
        if metric in names:
            x = _number(value)
            if field == "time_us":  # ncu reports ns, us or ms by its own choice
                x = x * {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0,
                         "ms": 1e3, "msecond": 1e3}[unit]  # fmt: skip
            elif field == "dram_read_mb":
                x = x * {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}[unit]
            return field, x
    return None


def parse_ncu_csv(text: str, family: str) -> list[dict]:
    """``[{case, kernel, grid, block, <fields>: [one value per call]}]`` from ncu's ``--csv``
    output mixed with the script's own case lines (ncu prints its rows after the program's)."""
    cases = [ln for ln in text.splitlines() if ln.startswith(family + " ")]
    rows = list(csv.DictReader(io.StringIO("\n".join(ln for ln in text.splitlines()
                                                     if ln.startswith('"')))))  # fmt: skip
    kernels: dict[str, dict] = {}
    for r in rows:
        k = kernels.setdefault(r["ID"], {"name": r["Kernel Name"], "grid": r["Grid Size"],
                                         "block": r["Block Size"]})  # fmt: skip
        f = _to_field(r["Metric Name"], r["Metric Unit"], r["Metric Value"])
        if f:
            k[f[0]] = f[1]
    ours = [k for _, k in sorted(kernels.items(), key=lambda kv: int(kv[0]))
            if k["name"].startswith("void peagle::")]  # fmt: skip
    calls: list[list[dict]] = []
    for k in ours:
        if CALL_START[family] in k["name"] or not calls:
            calls.append([])
        calls[-1].append(k)
    if len(calls) != 3 * len(cases):
        raise ValueError(f"{family}: {len(calls)} calls of peagle kernels for {len(cases)} cases "
                         "x 3 runs; was the profile cut short?")  # fmt: skip
    out = []
    for i, case in enumerate(cases):
        runs = calls[3 * i : 3 * i + 3]
        for j, k in enumerate(runs[0]):
            name = k["name"].removeprefix("void peagle::<unnamed>::").split("(")[0]
            row = {"case": case.removeprefix(family + " "), "kernel": name,
                   "grid": k["grid"], "block": k["block"]}  # fmt: skip
            for field in FIELDS:
                vals = [run[j][field] for run in runs if field in run[j]]
                if vals:
                    row[field] = round(statistics.median(vals), 2)
            out.append(row)
    return out


def summarize(args) -> int:
    res = {"gpu": args.gpu, "commit": args.commit, "tool": "ncu --clock-control none",
           "command": args.command, "profiles": []}  # fmt: skip
    for spec in args.inputs:
        head, _, path = spec.rpartition("=")  # a label may hold "=" (an env setting)
        family, _, label = head.partition(":")
        if family not in CALL_START or not path:
            raise SystemExit(f"summarize: {spec!r}: expected verify|attention[:label]=CSV")
        rows = parse_ncu_csv(Path(path).read_text(), family)
        res["profiles"].append({"family": family, "label": label or "default", "rows": rows})
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}: " + ", ".join(f"{p['family']}:{p['label']} {len(p['rows'])} rows"
                                          for p in res["profiles"]))  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["summarize"]:
        ap = argparse.ArgumentParser(prog="profile_kernels.py summarize")
        ap.add_argument("inputs", nargs="+", help="FAMILY[:LABEL]=NCU_CSV")
        ap.add_argument("--out", required=True)
        ap.add_argument("--commit", required=True)
        ap.add_argument("--gpu", default="NVIDIA H200")
        ap.add_argument("--command", default="tools/profile_kernels.py under ncu (its docstring)",
                        help="the ncu command lines that wrote the CSVs")  # fmt: skip
        return summarize(ap.parse_args(argv[1:]))
    for n in argv or ["verify", "attention"]:
        {"verify": verify_cases, "attention": attention_cases}[n]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
