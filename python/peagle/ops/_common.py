"""What every op module shares: the op namespace, sentinels and the ``PEAGLE_DEBUG_CHECKS`` hook.

A leaf of :mod:`peagle.ops` (imports only torch).
"""

from __future__ import annotations

import os

import torch

PADDING_SLOT_ID = -1
PLACEHOLDER_TOKEN_ID = -1

_ops = torch.ops.peagle

_DEBUG_CHECKS = os.environ.get("PEAGLE_DEBUG_CHECKS", "0") not in ("", "0")


def _debug_checks_enabled() -> bool:
    """``PEAGLE_DEBUG_CHECKS`` is read once at import (the wrappers sit on the hot path)."""
    return _DEBUG_CHECKS


def _debug_check_on_cpu(op, args: list) -> None:
    """Run ``op`` on CPU copies of ``args`` so the CPU kernel's value checks see CUDA inputs."""
    if not _debug_checks_enabled():
        return
    if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        return
    op(*[a.detach().cpu().clone() if isinstance(a, torch.Tensor) else a for a in args])


def register_noop_fakes(*names: str) -> None:
    """Fake (meta) kernels of ops that only mutate caller-provided outputs and return nothing: the
    fakes only have to exist (shape checks happen in the real kernels); ``torch.compile`` traces
    the ops through auto-functionalization."""
    for name in names:

        def _fake(*args, **kwargs):  # noqa: ARG001
            return None

        torch.library.register_fake(f"peagle::{name}")(_fake)
