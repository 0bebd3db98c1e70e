"""tools/probe_long_context.py (issue 19's HumanEval diagnosis) on the packaged pair: every prompt
set is measured for both the full-attention and the windowed drafter, the prefixed set keeps the
probed windows at its end, and the drafter is left as loaded for the next set."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "probe_long_context",
    Path(__file__).resolve().parent.parent / "tools" / "probe_long_context.py",
)
plc = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(plc)


def test_prefixed_set_ends_with_the_probed_windows():
    class Args:
        num, prefix_windows, stride, cut = 3, 2, 80, 16

    sets = plc.prompt_sets(Args, tok=lambda text, add_special_tokens: {"input_ids": [1, 2, 3]})
    base, pref = sets["eval as shipped"], sets["eval after 2 other windows"]
    assert len(base) == len(pref) == 3
    for b, p in zip(base, pref, strict=True):
        assert p[-len(b) :] == b and len(p) > len(b)
        assert p[: len(b)] != b  # other windows in front, not the probed one repeated


@pytest.mark.slow
def test_probe_smoke_on_the_packaged_pair(tmp_path):
    out = tmp_path / "probe.json"
    argv = ["--num", "2", "--prefix-windows", "1", "--stride", "82", "--cut", "16",
            "--windows", "8", "--k", "3", "--new-tokens", "6", "--methods", "peagle",
            "--out", str(out)]  # fmt: skip
    assert plc.main(argv) == 0
    res = json.loads(out.read_text())
    heads = [r for r in res["rows"] if r["method"] == "peagle"]
    names = {r["prompts"] for r in heads}
    assert {"eval as shipped", "eval after 1 other windows"} <= names
    assert {(r["prompts"], r["drafter_window"]) for r in heads} == {
        (n, w) for n in names for w in (None, 8)
    }
    for r in heads:
        assert 1.0 <= r["acceptance_length"] <= 4.0 and r["spec_steps"] > 0
    for r in (r for r in res["rows"] if r["method"] == "target"):
        assert 0.0 < r["target_margin"] <= r["target_top1_prob"] <= 1.0
