"""Timing helpers shared by the benchmarks (method: PERF.md §4).

* CUDA events around the region, warm-up first, median of many repetitions.
* Tiny kernels: ``bench_graph`` captures N back-to-back calls in one CUDA graph and divides a
  replay by N (launch gaps removed); ``bench_eager`` reports the eager cost separately.
* Cold L2: pass several input sets (``fn(i)`` picks set ``i % n``) whose total size exceeds the
  60 MB L2 a few times; ``l2_rotation_sets`` says how many are needed.
* ``copy_ceiling_gbps`` measures the device-to-device copy bandwidth (bytes read + written) in
  the same run, the reference for "% of ceiling".
* ``Results`` writes ``{"gpu","commit","command","copy_ceiling_gbps","rows":[...]}``.
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

L2_BYTES = 60 * 1024 * 1024  # H200; read from the device when available


def l2_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).L2_cache_size) or L2_BYTES
    return L2_BYTES


def l2_rotation_sets(bytes_per_set: int, factor: int = 4, max_sets: int = 64) -> int:
    """Input sets needed so that rotating through them touches ``factor`` x the L2."""
    if bytes_per_set <= 0:
        return 1
    return max(1, min(max_sets, -(-factor * l2_bytes() // bytes_per_set)))


def bench_eager(fn: Callable[[int], object], iters: int = 200, warmup: int = 20) -> float:
    """Median µs of one eager call (host launch overhead included), CUDA events per call."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))


def bench_graph(
    fn: Callable[[int], object],
    calls_per_graph: int = 20,
    replays: int = 50,
    warmup: int = 3,
) -> float:
    """Median µs per call: ``calls_per_graph`` calls (cycling ``fn(i)``) captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls_per_graph):  # warm-up outside capture (allocations, autotuning)
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            fn(i)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls_per_graph)
    return statistics.median(times)


def copy_ceiling_gbps(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written."""
    src = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9


def git_commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


@dataclass
class Results:
    """Benchmark rows in the project's JSON format."""

    copy_ceiling_gbps: float
    rows: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def add(self, case: str, impl: str, median_us: float, gbps: float | None = None, **more):
        row = {"case": case, "impl": impl, "median_us": round(median_us, 3)}
        row["gbps"] = None if gbps is None else round(gbps, 1)
        row.update(more)
        self.rows.append(row)

    def to_json(self) -> dict:
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        return {
            "gpu": gpu,
            "commit": git_commit(),
            "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
            "copy_ceiling_gbps": round(self.copy_ceiling_gbps, 1),
            "torch": torch.__version__,
            "driver": _driver_version(),
            **self.extra,
            "rows": self.rows,
        }

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def print_table(rows: list[dict], keys: list[str]) -> None:
    widths = [max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r.get(k, "")).ljust(w) for k, w in zip(keys, widths, strict=True)))
