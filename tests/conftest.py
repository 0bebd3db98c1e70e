"""Shared pytest fixtures: devices to test on, seeded generators, output poisoning."""

from __future__ import annotations

import pytest
import torch

import peagle  # noqa: F401  (loads torch.ops.peagle)

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

# Every op is tested on CPU; CUDA tests run where a GPU is present and skip elsewhere.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh, seeded CPU generator per test (inputs are drawn on CPU, then moved)."""
    g = torch.Generator()
    g.manual_seed(0x9EA61E)
    return g


def poison_(t: torch.Tensor | None) -> torch.Tensor | None:
    """Fill an output buffer with a sentinel so unwritten elements are detected."""
    if t is None:
        return None
    if t.dtype == torch.bool:
        t.fill_(True)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-12345)
    return t
