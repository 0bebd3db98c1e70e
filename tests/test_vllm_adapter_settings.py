"""The vLLM adapter without vLLM: import safety, the switch, the version range, the entry point.

These run everywhere (also where vLLM is not installed, e.g. the GPU machine).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

import peagle.vllm
from peagle.vllm import _settings as st


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **env},
    )  # fmt: skip


def test_peagle_never_imports_vllm_at_import_time():
    r = run_python(
        """
        import sys
        import peagle, peagle.ops, peagle.vllm
        import peagle.vllm._patch, peagle.vllm.proposer, peagle.vllm.sampler
        bad = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
        assert not bad, bad
        print("ok")
        """
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_enable_without_vllm_is_a_warning_not_an_error():
    r = run_python(
        """
        import logging, sys
        logging.basicConfig(level=logging.INFO)
        sys.modules["vllm"] = None  # makes `import vllm` raise ImportError
        import peagle.vllm
        assert peagle.vllm.enable() is False
        peagle.vllm.register()  # the entry point never raises into vLLM
        print("ok")
        """
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert "cannot import vllm" in r.stderr


def test_switch_off_does_not_import_vllm():
    r = run_python(
        """
        import sys
        import peagle.vllm
        assert peagle.vllm.enable() is False
        assert "vllm" not in sys.modules
        print("ok")
        """,
        PEAGLE_VLLM="0",
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_entry_point_is_registered():
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "peagle"]
    assert [e.value for e in eps] == ["peagle.vllm:register"]
    assert eps[0].load() is peagle.vllm.register


@pytest.mark.parametrize(
    "version,ok",
    [("0.28.0", True), ("0.28.3", True), ("0.28.0+cu130", True), ("0.28.1.dev5+g12ab", True),
     ("0.29.0", True), ("0.32.0", True), ("0.32.0+cpu", True), ("0.33.0", True),
     ("0.33.1", True), ("0.28.0rc1", False), ("0.28.0.dev3", False), ("0.27.1", False),
     ("0.34.0", False), ("0.34.0rc1", False), ("0.16.0", False), ("1.0.0", False),
     ("unknown", False), ("", False)],
)  # fmt: skip
def test_tested_version_range(version, ok):
    assert st.version_tested(version) is ok


@pytest.mark.parametrize(
    "version,says",
    [("0.27.1", "outside the adapter's tested range >=0.28.0,<0.34; vLLM's own P-EAGLE code"),
     ("0.34.0", "vLLM 0.34 removed the V1 model runner"),
     ("0.35.1+cu130", "vLLM 0.34 removed the V1 model runner")],
)  # fmt: skip
def test_enable_outside_the_range_says_why_and_leaves_vllm_alone(version, says):
    """A vLLM outside the range gets one warning and no hooks; from 0.34 on the warning says that
    vLLM itself has no P-EAGLE path any more (no V1 runner, parallel drafting for dflash/dspark
    only), so the user is not told vLLM's own P-EAGLE code runs."""
    r = run_python(
        f"""
        import logging, sys, types
        logging.basicConfig(level=logging.INFO)
        sys.modules["vllm"] = types.SimpleNamespace(__version__={version!r})
        import peagle.vllm
        assert peagle.vllm.enable() is False and not peagle.vllm.is_enabled()
        peagle.vllm.enable()  # the warning is said once
        print("ok")
        """
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    lines = [line for line in r.stderr.splitlines() if "peagle: vLLM" in line]
    assert len(lines) == 1 and says in lines[0], r.stderr
    if version >= "0.34":
        assert "pip install 'vllm>=0.28.0,<0.34'" in lines[0]
        assert "own P-EAGLE code is used" not in lines[0]


@pytest.mark.parametrize("value,on", [(None, True), ("", True), ("1", True), ("0", False)])
def test_switch_values(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(st.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(st.ENV_SWITCH, value)
    assert st.switch_on() is on


def test_switch_bad_value_warns_once_and_uses_default(monkeypatch, caplog):
    st.forget_messages()
    monkeypatch.setenv(st.ENV_SWITCH, "yes")
    with caplog.at_level(logging.WARNING, logger="vllm.peagle"):
        assert st.switch_on() is (st.DEFAULT_SWITCH == "1")
        st.switch_on()
    assert len([r for r in caplog.records if "'yes'" in r.getMessage()]) == 1


def test_stage_a_stand_in_takes_the_dispatcher_call_style(monkeypatch):
    """Later vLLM releases call Stage A through a warm-up dispatcher
    (``_eagle_prepare_next_token_padded(*args, BLOCK_SIZE_TOKENS=...)``, the kernel in
    ``.kernel``) instead of ``kernel[grid](...)``: inside a peagle proposer's call the stand-in runs
    ``prepare_next_token_ids`` with the same outputs as the kernel's rule, otherwise it calls the
    dispatcher; its attributes stay reachable."""
    import torch

    import peagle.ops
    from peagle.vllm import proposer as prop

    seen = []

    class Dispatcher:
        kernel = "the triton kernel"

        def __call__(self, *args, **kwargs):
            seen.append((args, kwargs))

    stand_in = prop.StageAKernel(Dispatcher())
    assert stand_in.kernel == "the triton kernel"
    sampled = torch.tensor([[3, -1, -1], [4, 5, 6], [7, 8, -1]], dtype=torch.int32)
    discard = torch.tensor([False, True, False, False])  # vLLM's whole persistent buffer
    backup = torch.tensor([10, 11, 12, 13], dtype=torch.int32)
    nxt, valid = torch.full((3,), -7, dtype=torch.int32), torch.full((3,), -7, dtype=torch.int32)
    args = (sampled, discard, backup, nxt, valid, 100, 3, 3, sampled.stride(0))
    stand_in(*args, BLOCK_SIZE_TOKENS=4)  # outside a peagle proposer: vLLM's dispatcher
    assert len(seen) == 1 and seen[0][1] == {"BLOCK_SIZE_TOKENS": 4} and stand_in.calls == 0
    token = prop.stage_a_active().set(True)
    try:
        stand_in(*args, BLOCK_SIZE_TOKENS=4)
    finally:
        prop.stage_a_active().reset(token)
    assert len(seen) == 1 and stand_in.calls == 1
    want_next, want_valid = peagle.ops.prepare_next_token_ids(sampled, discard[:3], backup[:3], 100)
    assert nxt.tolist() == want_next.tolist() == [3, 11, 8]
    assert valid.tolist() == want_valid.tolist() == [1, 0, 2]


def test_rejection_sample_stand_in_takes_only_the_standard_method():
    """The verify stand-in hands a call to peagle only for the method verify_chain implements
    exactly: standard rejection sampling with float32 exponentials and every argument vLLM added
    later at its default (0.33's ``fly_*``: a set ``fly_window_size`` is its lossy FLy method).
    Synthetic acceptance, float64 exponentials, FLy and unknown non-default arguments go to
    vLLM's own function; a call that does not bind does too (vLLM raises its own TypeError)."""
    import inspect

    from peagle.vllm import _patch

    def rejection_sample_033(
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
        target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=False,
        synthetic_conditional_rates=None, use_fp64_gumbel=False, fly_window_size=None,
        fly_entropy_threshold=None, fly_entropy_top_k=3,
    ):  # fmt: skip
        pass

    sig = inspect.signature(rejection_sample_033)
    core = tuple(range(8))
    std = dict(synthetic_mode=False, synthetic_conditional_rates=None, use_fp64_gumbel=False)
    fly_off = dict(fly_window_size=None, fly_entropy_threshold=None, fly_entropy_top_k=3)
    assert _patch.standard_method_call(sig, core, {})
    assert _patch.standard_method_call(sig, core, {**std, **fly_off})  # what 0.33's forward passes
    for changed in (
        dict(synthetic_mode=True),
        dict(synthetic_conditional_rates=object()),
        dict(use_fp64_gumbel=True),
        dict(fly_window_size=4),
        dict(fly_window_size=4, fly_entropy_threshold=0.5),
        dict(fly_entropy_top_k=5),
    ):
        assert not _patch.standard_method_call(sig, core, {**std, **fly_off, **changed}), changed
    assert not _patch.standard_method_call(sig, core, {"no_such_argument": 1})
    assert not _patch.standard_method_call(sig, core[:7], {})
