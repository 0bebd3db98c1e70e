"""`peagle demo` runs every op end to end and prints what it did."""

from __future__ import annotations

import subprocess
import sys

from peagle.cli import main


def test_demo_runs_every_op(capsys):
    main(["demo", "--device", "cpu"])
    out = capsys.readouterr().out
    for name in ("verify_chain", "prepare_draft_inputs", "write_kv_cache + paged_attention"):
        assert name in out
    assert "output_token_ids           [[5, 9, 6, -1], [7, 7, 1," in out


def test_python_dash_m_help():
    res = subprocess.run([sys.executable, "-m", "peagle", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "demo" in res.stdout
