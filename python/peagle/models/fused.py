"""Fewer kernels per dense decoder layer: what a decode step's CUDA graph replays.

A small model's decode step is launch-bound: transformers' modules spend ~40 kernels per layer
(8 per RMSNorm alone), each a few microseconds in a graph. For the plain Llama-family shapes
these paths give the same math in fewer kernels:

* RMSNorm: ``F.rms_norm`` (fp32 inside, one rounding to the input dtype, as transformers) times
  the weight: 2 kernels instead of 8;
* q/k/v: one GEMM over the concatenated weights (and biases), split into views;
* gate/up: one GEMM over the concatenated weights, then ``silu(gate) * up``.

The concatenated weights *are* the modules' storage afterwards (each module's ``weight`` becomes
a view into them), so memory does not grow and in-place weight updates stay visible. Anything
else (MoE blocks, GPT-OSS norms, other activations) keeps the module's own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# transformers classes whose forward is exactly ``w * (x.float() * rsqrt(mean(x^2) + eps)).to(x)``
_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
_DENSE_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
_SILU = ("SiLU", "SiLUActivation")  # torch's, transformers' (ACT2FN["silu"])


def weights_key(layers) -> tuple:
    """What a fused plan of ``layers`` was built from: each layer's q and gate weights' data
    pointers and dtypes. ``.to()`` rebinds weights to new storage (the key changes: rebuild);
    in-place updates and loads keep the storage (the plan stays valid: it shares it)."""
    key = []
    for la in layers:
        for mod in (getattr(la.self_attn, "q_proj", None), getattr(la.mlp, "gate_proj", None)):
            w = getattr(mod, "weight", None)
            key.append(None if w is None else (w.data_ptr(), w.dtype, w.device))
    return tuple(key)


def rms_norm(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward, fused when it is a plain transformers RMSNorm."""
    if type(module).__name__ not in _RMS_NORMS:
        return module
    w, eps = module.weight, module.variance_epsilon
    shape = (w.shape[0],)
    return lambda x: w * F.rms_norm(x, shape, eps=eps)


def _concat_into(mods: list[torch.nn.Linear], attr: str) -> torch.Tensor | None:
    """One tensor holding ``mods``' ``attr`` (weight / bias) in order; each module's parameter
    becomes a view into it."""
    parts = [getattr(m, attr) for m in mods]
    if any(p is None for p in parts):
        return None
    with torch.inference_mode(False), torch.no_grad():
        cat = torch.cat([p.detach() for p in parts], 0)
        off = 0
        for p in parts:
            p.data = cat[off : off + p.shape[0]]
            off += p.shape[0]
    return cat


@dataclass
class FusedLayer:
    """The fused pieces of one decoder layer (None: that piece runs the module's forward)."""

    input_norm: Callable
    post_norm: Callable
    qkv: tuple[torch.Tensor, torch.Tensor | None, list[int]] | None
    gate_up: tuple[torch.Tensor, int, torch.nn.Linear] | None

    def project_qkv(self, attn: torch.nn.Module, x: torch.Tensor):
        """``(q, k, v)`` as ``[T, N]`` tensors (views of one GEMM's output when fused)."""
        if self.qkv is None:
            return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        w, b, sizes = self.qkv
        return F.linear(x, w, b).split(sizes, dim=-1)

    def mlp(self, layer: torch.nn.Module, x: torch.Tensor, fallback: Callable) -> torch.Tensor:
        if self.gate_up is None:
            return fallback(layer, x)
        w, inter, down = self.gate_up
        gate, up = F.linear(x, w).split(inter, dim=-1)
        return down(F.silu(gate) * up)


def fuse_layer(layer: torch.nn.Module) -> FusedLayer:
    """Fuse what is plain in ``layer`` (rebinds its q/k/v and gate/up weights as views)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = None
    projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if all(isinstance(p, torch.nn.Linear) for p in projs) and (
        len({p.bias is None for p in projs}) == 1
    ):
        w = _concat_into(projs, "weight")
        b = _concat_into(projs, "bias")
        qkv = (w, b, [p.out_features for p in projs])
    gate_up = None
    if (
        type(mlp).__name__ in _DENSE_MLPS
        and type(getattr(mlp, "act_fn", None)).__name__ in _SILU
        and mlp.gate_proj.bias is None
        and mlp.up_proj.bias is None
    ):
        w = _concat_into([mlp.gate_proj, mlp.up_proj], "weight")
        gate_up = (w, mlp.gate_proj.out_features, mlp.down_proj)
    return FusedLayer(
        rms_norm(layer.input_layernorm), rms_norm(layer.post_attention_layernorm), qkv, gate_up
    )
