"""Shared pytest fixtures: devices to test on, seeded generators, output poisoning."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import peagle  # noqa: F401  (loads torch.ops.peagle)

HAS_CUDA = torch.cuda.is_available()

# The vLLM adapter tests (tests/vllm_env.py) run vLLM's Triton kernels on CPU tensors under the
# Triton interpreter. Triton reads TRITON_INTERPRET when it is first imported (other tests may
# import it through torch.compile first), so it is set here: only where vLLM is installed and no
# GPU is visible (CUDA_VISIBLE_DEVICES must be set and empty for vLLM there).
if importlib.util.find_spec("vllm") is not None and not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
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


def capture_graph(fn, warmup: int = 1) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph (replay it with ``graph.replay()``), after ``warmup`` calls
    on a side stream (lazy initialisation and allocations happen outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


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


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """`peagle generate` on the CPU sets torch to one thread (issue 22); tests calling the CLI
    in-process must not leave that to the tests after them."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
