"""`import peagle` refuses a torch it was not built against and warns about GPUs it has no
kernels for, naming both and how to rebuild."""

from __future__ import annotations

import types

import pytest
import torch

import peagle


def fake_info(**kw):
    base = dict(TORCH_VERSION=torch.__version__, TORCH_CUDA=torch.version.cuda or "",
                WITH_CUDA=True, CUDA_ARCHS="9.0a;10.0a")  # fmt: skip
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_build_info_matches_running_torch():
    info = peagle._read_build_info()
    assert info is not None, "the CMake-generated _build_info.py is missing"
    assert info.TORCH_VERSION.split("+")[0] == torch.__version__.split("+")[0]
    assert "peagle_ops" in str(peagle._find_library())


def test_other_torch_version_is_refused(monkeypatch):
    monkeypatch.setattr(peagle, "_read_build_info", lambda: fake_info(TORCH_VERSION="2.9.1"))
    with pytest.raises(ImportError) as e:
        peagle._check_torch_version()
    msg = str(e.value)
    assert "built against torch 2.9.1" in msg and torch.__version__ in msg
    assert "pip install --no-build-isolation" in msg and "PEAGLE_CUDA_ARCHS" in msg


def test_other_cuda_runtime_is_refused(monkeypatch):
    monkeypatch.setattr(peagle, "_read_build_info", lambda: fake_info(TORCH_CUDA="11.8"))
    with pytest.raises(ImportError, match="CUDA 11.8"):
        peagle._check_torch_version()


def test_gpu_without_kernels_warns(monkeypatch):
    monkeypatch.setattr(peagle, "_read_build_info", lambda: fake_info(CUDA_ARCHS="9.0a"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA B200")
    with pytest.warns(RuntimeWarning, match=r"sm_100\).*built for 9.0a.*PEAGLE_CUDA_ARCHS=10.0a"):
        peagle._check_gpu_arch()


def test_gpu_with_kernels_is_quiet(monkeypatch, recwarn):
    monkeypatch.setattr(peagle, "_read_build_info", lambda: fake_info(CUDA_ARCHS="9.0a;10.0a"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    peagle._check_gpu_arch()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_every_op_is_registered_with_cpu_and_fake_kernels():
    from torch._library.simple_registry import singleton

    for name in ("prepare_next_token_ids", "prepare_draft_inputs", "write_kv_cache",
                 "paged_attention", "verify_chain"):  # fmt: skip
        assert "CPU" in torch._C._dispatch_dump(f"peagle::{name}"), name
        assert singleton.find(f"peagle::{name}").fake_impl.kernel is not None, name
