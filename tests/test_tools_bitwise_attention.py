"""tools/bitwise_attention.py: its cases are valid paged_attention inputs with the cache layouts'
strides (run through the CPU op here; the CUDA dump needs a GPU), and compare flags every
differing fingerprint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bitwise_attention as bw  # noqa: E402

from peagle import ops  # noqa: E402


@pytest.mark.parametrize("case", bw.CASES, ids=lambda c: c.name)
def test_cases_are_valid_inputs_with_their_layout_strides(case):
    q, kc, vc, table, qsl, sl = bw.make_inputs(case, seed=7, device="cpu")
    assert len(case.q_lens) == len(case.kv_lens) == table.shape[0]
    slot = case.hkv * case.d  # a plain cache's slot stride
    expected = {
        "plain": (case.page * slot, slot),
        "split2": (case.page * slot, slot),
        "interleaved": (2 * case.page * slot, slot),
        "padded": (case.page * case.hkv * (case.d + 8), case.hkv * (case.d + 8)),
        "head_major": (case.page * slot, case.d),
    }[case.layout]
    assert (kc.stride(0), kc.stride(1)) == expected and (vc.stride(0), vc.stride(1)) == expected
    again = bw.make_inputs(case, seed=7, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip((q, kc, vc, table), again[:4], strict=True))
    out = ops.paged_attention(q, kc, vc, table, qsl, sl, window_left=case.window_left)
    assert torch.isfinite(out.float()).all()


def test_compare_flags_each_differing_fingerprint(tmp_path, capsys):
    rows = {"a|auto|s0|kernel": "x1", "a|auto|s1|kernel": "x2", "b|mma|s3|cluster": "error: no"}
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({"gpu": "g", "rows": rows}))
    new.write_text(json.dumps({"gpu": "g", "rows": rows}))
    assert bw.compare(str(old), str(new)) == 0
    new.write_text(json.dumps({"gpu": "g", "rows": {**rows, "a|auto|s1|kernel": "y"}}))
    assert bw.compare(str(old), str(new)) == 1
    printed = capsys.readouterr().out
    assert "DIFF a|auto|s1|kernel: x2 -> y" in printed and "1 differ (1 without a merge)" in printed


def test_dump_names_the_setting_that_lost_the_context(tmp_path, monkeypatch, capsys):
    # An illegal address kills the CUDA context: the dump must stop there, name that setting and
    # keep the fingerprints before it (a crash in the next allocation named nothing).
    calls = []

    def fake_fingerprint(args, c, splits):
        calls.append(splits)
        if len(calls) == 3:
            raise bw.Fault("CUDA error: an illegal memory access was encountered")
        return f"h{len(calls)}"

    monkeypatch.setattr(bw, "make_inputs", lambda c, seed: ())
    monkeypatch.setattr(bw, "fingerprint", fake_fingerprint)
    path = tmp_path / "bits.json"
    assert bw.dump(str(path), quick=False) == 2
    rows = json.loads(path.read_text())["rows"]
    fault = "fault: CUDA error: an illegal memory access was encountered"
    assert list(rows.values()) == ["h1", "h2", fault]
    fault_key = list(rows)[2]
    assert f"FAULT {fault_key}" in capsys.readouterr().out
    assert "PEAGLE_ATTN_IMPL" not in bw.os.environ and "PEAGLE_ATTN_MERGE" not in bw.os.environ
