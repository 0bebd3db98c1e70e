"""The CTA- / lane-level numpy emulations of the CUDA kernels (tools/emulate_*.py) still agree
with the CPU op and the references: they check the kernels' index math and selection logic on a
machine without a GPU, so CI runs them (a few random cases each)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.mark.parametrize(
    "script, args, last_line",
    [
        ("emulate_verify_chain.py", ["12"], "ok: 12 cases"),
        ("emulate_paged_attention.py", [], "max|out-ref|="),
    ],
)
def test_emulation_agrees(script, args, last_line):
    r = subprocess.run(
        [sys.executable, str(TOOLS / script), *args], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert last_line in r.stdout.strip().splitlines()[-1]
