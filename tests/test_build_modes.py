"""Issue 22 items 1-2: how CMake decides on the CUDA kernels (configure only, no compiling).

Run with a CPU torch (CI's first venv) and with a CUDA torch (.ci/run runs this file in the CUDA
venv too): PEAGLE_CUDA=OFF configures with any torch and needs no toolkit; AUTO builds CUDA only
with a CUDA torch, a toolkit and a GPU, and otherwise falls back to a CPU build with one message;
compile jobs never exceed the machine's cores."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CUDA_TORCH = torch.version.cuda is not None
needs_cmake = pytest.mark.skipif(
    shutil.which("cmake") is None or shutil.which("ninja") is None, reason="needs cmake + ninja"
)


def configure(tmp_path, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PEAGLE_")}
    full.update(env)
    return subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path / "b"), "-G", "Ninja",
         f"-DPython3_EXECUTABLE={sys.executable}"],
        env=full, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def cuda_flag(res) -> str:
    m = re.search(r"peagle: torch \S+, C\+\+\d+, CUDA: (ON|OFF)", res.stdout)
    assert m, res.stdout + res.stderr
    return m.group(1)


@needs_cmake
def test_item2_cuda_off_configures_with_any_torch_and_no_toolkit(tmp_path):
    res = configure(tmp_path, PEAGLE_CUDA="OFF", CUDA_HOME=str(tmp_path / "no-toolkit"))
    assert res.returncode == 0, res.stderr
    assert cuda_flag(res) == "OFF" and "building the CPU kernels only" not in res.stderr


@needs_cmake
def test_item1_auto_without_cuda_torch_is_a_quiet_cpu_build(tmp_path):
    if CUDA_TORCH:
        pytest.skip("a CPU torch case")
    res = configure(tmp_path, PEAGLE_CUDA="AUTO")
    assert res.returncode == 0 and cuda_flag(res) == "OFF"
    assert "building the CPU kernels only" not in res.stderr


@needs_cmake
@pytest.mark.skipif(not CUDA_TORCH, reason="needs a CUDA build of torch")
def test_item1_auto_without_a_toolkit_falls_back_to_cpu_with_one_message(tmp_path):
    res = configure(tmp_path, PEAGLE_CUDA="AUTO", CUDA_HOME=str(tmp_path / "no-toolkit"))
    assert res.returncode == 0, res.stderr
    assert cuda_flag(res) == "OFF"
    text = " ".join(res.stderr.split())
    assert text.count("building the CPU kernels only") == 1 and "no CUDA toolkit" in text


@needs_cmake
@pytest.mark.skipif(not CUDA_TORCH or torch.cuda.is_available(), reason="CUDA torch, no GPU")
def test_item1_auto_without_a_gpu_builds_no_cuda_kernels(tmp_path):
    res = configure(tmp_path, PEAGLE_CUDA="AUTO")
    assert res.returncode == 0 and cuda_flag(res) == "OFF"
    assert "sees no GPU" in " ".join(res.stderr.split())


@needs_cmake
def test_item1_cuda_on_without_what_it_needs_is_a_clear_error(tmp_path):
    res = configure(tmp_path, PEAGLE_CUDA="ON", CUDA_HOME=str(tmp_path / "no-toolkit"))
    assert res.returncode != 0
    text = " ".join(res.stderr.split())
    assert ("has no CUDA" in text) if not CUDA_TORCH else ("no CUDA toolkit" in text)


@needs_cmake
def test_item1_compile_jobs_within_the_cores(tmp_path):
    res = configure(tmp_path, PEAGLE_CUDA="OFF")
    assert res.returncode == 0, res.stderr
    b = tmp_path / "b"
    rules = (b / "build.ninja").read_text() + (b / "CMakeFiles" / "rules.ninja").read_text()
    depth = int(re.search(r"pool peagle_compile\s+depth = (\d+)", rules).group(1))
    assert 1 <= depth <= (os.cpu_count() or 1)
    assert "pool = peagle_compile" in rules
