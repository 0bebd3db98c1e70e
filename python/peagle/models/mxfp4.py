"""Loading MXFP4-quantized targets (GPT-OSS): keep MXFP4 or dequantize, and say what it costs.

GPT-OSS checkpoints store the MoE expert weights (``mlp.experts.gate_up_proj`` / ``down_proj``,
about 90% of the parameters) as MXFP4: 4-bit E2M1 values in blocks of 32 sharing one 8-bit
power-of-two scale (``*_blocks`` / ``*_scales`` tensors, ``quantization_config.quant_method ==
"mxfp4"``). transformers runs them natively only with its triton kernels (CUDA compute capability
>= 7.5, ``triton`` >= 3.4, the ``kernels`` package, and the kernel repository fetched from the
Hugging Face Hub or its cache); otherwise it dequantizes them to bf16 at load time, which needs
about 3.8x the memory of the MXFP4 experts. peagle decides up front, prints the estimate, and
refuses a dequantized load that cannot fit the device.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

MODES = ("auto", "dequantize", "native")
# One 4-bit value plus 1/32 of an 8-bit shared scale per weight.
MXFP4_BYTES_PER_WEIGHT = 0.5 + 1.0 / 32
GIB = 1 << 30


def _count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _size(b: float) -> str:
    for div, unit in ((GIB, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if b >= div:
            return f"{b / div:.1f} {unit}"
    return f"{int(b)} B"


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model built from its config: ``total``, of which ``mxfp4`` are stored as
    MXFP4 in the checkpoint (expert weight matrices, not their biases)."""

    total: int
    mxfp4: int

    def bytes(self, dtype: torch.dtype, mxfp4_native: bool) -> int:
        dense = self.total - self.mxfp4 if mxfp4_native else self.total
        quant = self.mxfp4 * MXFP4_BYTES_PER_WEIGHT if mxfp4_native else 0
        return int(dense * dtype.itemsize + quant)


def is_mxfp4_config(config) -> bool:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return False
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method)).lower() == "mxfp4"


def count_parameters(config) -> ParamCount:
    """Count the model's parameters on the ``meta`` device (no memory, any size).

    Expert weights are the parameters ``gate_up_proj`` / ``down_proj`` of modules whose class name
    ends in ``Experts`` (what transformers' MXFP4 integration quantizes).
    """
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = mx = 0
    for mod in model.modules():
        experts = type(mod).__name__.endswith("Experts")
        for name, p in mod.named_parameters(recurse=False):
            total += p.numel()
            if experts and name in ("gate_up_proj", "down_proj"):
                mx += p.numel()
    return ParamCount(total, mx)


def mxfp4_kernel_status(device: torch.device) -> str | None:
    """None when transformers' MXFP4 kernels can run on ``device``, else the reason they cannot.
    (The kernel repository itself is fetched at load time; a failure there falls back in
    ``auto`` mode.)"""
    if device.type != "cuda":
        return f"transformers' MXFP4 kernels need a CUDA device (loading on {device.type})"
    cap = torch.cuda.get_device_capability(device)
    if cap < (7, 5):
        return f"MXFP4 kernels need compute capability >= 7.5, {device} has {cap[0]}.{cap[1]}"
    from transformers.utils import import_utils

    if not import_utils.is_triton_available("3.4.0"):
        return "MXFP4 kernels need triton >= 3.4, which is not installed"
    if not import_utils.is_kernels_available():
        return "MXFP4 kernels need the `kernels` package, which is not installed"
    return None


def _memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


@dataclass
class QuantPlan:
    """How a quantized checkpoint will be loaded (see :func:`plan_quantized_load`).

    Attributes:
        native: keep MXFP4 (transformers' triton kernels) instead of dequantizing.
        dtype: dtype of every non-MXFP4 weight (and of the dequantized experts).
        params: parameter counts; ``weight_bytes`` the estimate for this plan, ``mxfp4_bytes``
            and ``dequantized_bytes`` both alternatives.
        message: what is printed before loading.
        fallback: ``auto`` mode may retry dequantized when the native load fails.
    """

    name: str
    device: torch.device
    native: bool
    reason: str
    dtype: torch.dtype
    params: ParamCount
    mxfp4_bytes: int
    dequantized_bytes: int
    message: str
    fallback: QuantPlan | None = None

    @property
    def weight_bytes(self) -> int:
        return self.mxfp4_bytes if self.native else self.dequantized_bytes

    def load(self, path: str, log: Callable[[str], None] | None = None):
        """``AutoModelForCausalLM.from_pretrained`` with this plan's quantization config."""
        from transformers import AutoModelForCausalLM, Mxfp4Config

        kw = {}
        if self.device.type == "cuda":
            kw["device_map"] = str(self.device)  # MXFP4 swizzling / dequantization on the GPU
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=self.dtype,
                quantization_config=Mxfp4Config(dequantize=not self.native),
                **kw,
            )
            # transformers dequantizes on the GPU to bf16 whatever `dtype` says: honour the plan.
            return model if self.native else model.to(self.dtype)
        except Exception as e:  # kernel hub unreachable, triton failure, ...
            if self.fallback is None:
                raise
            if log is not None:
                log(f"peagle: native MXFP4 load failed ({type(e).__name__}: {e})")
                log(self.fallback.message)
            return self.fallback.load(path, log)


def plan_quantized_load(
    config,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    mode: str = "auto",
    name: str = "the target",
    kernel_status: Callable[[torch.device], str | None] = mxfp4_kernel_status,
    memory_bytes: Callable[[torch.device], int | None] = _memory_bytes,
) -> QuantPlan | None:
    """Decide how to load a checkpoint with MXFP4 experts (None for any other checkpoint).

    Args:
        mode: ``"auto"`` (native when :func:`mxfp4_kernel_status` allows it, else dequantize),
            ``"dequantize"`` or ``"native"``.
        dtype: dtype of the non-MXFP4 weights (default bf16; fp32 is allowed for tests).

    Raises:
        ValueError: unknown mode; ``native`` without usable kernels; a dequantized load whose
            weights alone exceed the device memory (the load would fail after minutes).
    """
    if mode not in MODES:
        raise ValueError(f"mxfp4 mode must be one of {MODES}, got {mode!r}")
    if not is_mxfp4_config(config):
        return None
    device = torch.device(device)
    dtype = dtype or torch.bfloat16
    params = count_parameters(config)
    mx_bytes = params.bytes(dtype, mxfp4_native=True)
    dq_bytes = params.bytes(dtype, mxfp4_native=False)
    blocker = kernel_status(device)
    if mode == "native" and blocker is not None:
        raise ValueError(f"{name}: MXFP4 weights requested natively, but {blocker}")
    dt_name = str(dtype).removeprefix("torch.")
    sizes = (
        f"{_count(params.mxfp4)} of its {_count(params.total)} parameters are MXFP4 experts; "
        f"weights take ~{_size(mx_bytes)} as MXFP4, ~{_size(dq_bytes)} dequantized to {dt_name}"
    )

    def dequant_plan(reason: str) -> QuantPlan:
        limit = memory_bytes(device)
        if limit is not None and dq_bytes > limit:
            raise ValueError(
                f"{name}: {reason}, so its MXFP4 experts would be dequantized to {dt_name}: "
                f"~{_size(dq_bytes)} of weights, more than the {_size(limit)} of {device}. Load "
                f"it where transformers' MXFP4 kernels run (CUDA, triton >= 3.4, the `kernels` "
                f"package), or on a larger device"
            )
        msg = (
            f"peagle: {name}: {sizes}. {reason[0].upper() + reason[1:]}: dequantizing the "
            f"experts at load time (~{_size(dq_bytes)} of weights on {device}, plus the KV "
            f"cache)."
        )
        return QuantPlan(name, device, False, reason, dtype, params, mx_bytes, dq_bytes, msg)

    if mode == "dequantize":
        return dequant_plan("dequantization was requested (mxfp4='dequantize')")
    if blocker is not None:
        return dequant_plan(blocker)
    msg = (
        f"peagle: {name}: {sizes}. Keeping MXFP4 with transformers' kernels "
        f"(~{_size(mx_bytes)} of weights on {device}, plus the KV cache)."
    )
    fallback = None
    if mode == "auto":
        try:
            fallback = dequant_plan("the native MXFP4 load failed")
        except ValueError:
            fallback = None
    return QuantPlan(
        name,
        device,
        True,
        "MXFP4 kernels are usable",
        dtype,
        params,
        mx_bytes,
        dq_bytes,
        msg,
        fallback,
    )
