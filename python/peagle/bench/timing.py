"""Timing helpers shared by the benchmarks (method: PERF.md §4, docs/benchmarks.md).

* CUDA events around the region, warm-up first, median of many repetitions.
* Tiny kernels: ``bench_graph`` captures N back-to-back calls in one CUDA graph and divides a
  replay by N (launch gaps removed); ``bench_eager`` reports the eager cost of one call (an event
  pair around every call, median); ``bench_eager_throughput`` times N eager calls back to back
  between ONE event pair and divides by N (what a decode loop issuing calls sees: host launch
  cost overlapped with the GPU work of the previous call).
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


def bench_eager_throughput(
    fn: Callable[[int], object], calls: int = 200, repeats: int = 5, warmup: int = 20
) -> float:
    """Median over ``repeats`` of (time of ``calls`` eager calls back to back) / ``calls``, in µs.

    One CUDA event pair brackets the whole run of calls, so the host-side launch cost of call
    i+1 overlaps the GPU work of call i as in a decode loop; the result is the steady-state cost
    per call (max of host launch cost and GPU time), not the latency of one isolated call.
    """
    if calls < 1 or repeats < 1:
        raise ValueError(f"calls and repeats must be >= 1, got {calls}, {repeats}")
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(calls):
            fn(i)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(times)


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
    """The measured commit: $PEAGLE_COMMIT (set it where the tree has no .git), else git in the
    current directory (a checkout of the measured tree), else git next to this file."""
    import os

    if os.environ.get("PEAGLE_COMMIT"):
        return os.environ["PEAGLE_COMMIT"]
    for root in (Path.cwd(), Path(__file__).resolve().parent):
        try:
            out = subprocess.run(
                ["git", "rev-parse", "--short=12", "HEAD"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return "unknown"


def command_line() -> str:
    """The command that produced a result file (``sys.argv``, shell-quoted): ``python3 script.py
    ...`` for a script, ``peagle bench ...`` for the console entry point."""
    argv = sys.argv or [""]
    if argv[0].endswith(("peagle/__main__.py", "peagle/cli.py")):  # python -m peagle ...
        words = ["peagle", *argv[1:]]
    elif argv[0].endswith(".py"):
        words = [Path(sys.executable).name, *argv]
    else:
        words = [Path(argv[0]).name or "python", *argv[1:]]
    return " ".join(shlex.quote(a) for a in words)


def gpu_name(device: str | torch.device | None = None) -> str:
    """The GPU's name, or "cpu" when ``device`` is a CPU device (or no CUDA device exists)."""
    if device is not None and torch.device(device).type == "cpu":
        return "cpu"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def write_json_atomic(path: str | Path, obj: dict) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file + rename (never half-written)."""
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


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
        return {
            "gpu": gpu_name(),
            "commit": git_commit(),
            "command": command_line(),
            "copy_ceiling_gbps": round(self.copy_ceiling_gbps, 1),
            "torch": torch.__version__,
            "driver": _driver_version(),
            **self.extra,
            "rows": self.rows,
        }

    def write(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_json())


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
    widths = [max([len(k)] + [len(str(r.get(k, ""))) for r in rows]) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r.get(k, "")).ljust(w) for k, w in zip(keys, widths, strict=True)))
