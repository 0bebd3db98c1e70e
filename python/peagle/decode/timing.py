"""Phase timing for per-request statistics without extra host syncs.

On CPU a phase is timed with ``perf_counter``. On CUDA it is bracketed by CUDA events whose elapsed
time is read later, once the decode loop has synchronised anyway (after verification), so timing
adds no synchronisation of its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from peagle.decode.request import Request


class PhaseClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[object, object, list[Request], str]] = []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start, reqs: Iterable[Request], attr: str) -> None:
        """Add the phase's duration to ``req.stats.<attr>`` of every request that took part."""
        reqs = list(reqs)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((start, end, reqs, attr))
            return
        dt = time.perf_counter() - start
        for r in reqs:
            setattr(r.stats, attr, getattr(r.stats, attr) + dt)

    def resolve(self) -> None:
        """Account every finished CUDA phase (call after a host sync)."""
        keep = []
        for start, end, reqs, attr in self._pending:
            if not end.query():
                keep.append((start, end, reqs, attr))
                continue
            dt = start.elapsed_time(end) / 1000.0
            for r in reqs:
                setattr(r.stats, attr, getattr(r.stats, attr) + dt)
        self._pending = keep
