"""Tiny random mixture-of-experts targets shaped like the released heads' targets (no downloads).

* ``gpt_oss``: ``GptOssForCausalLM`` with everything GPT-OSS-20B/120B has -- alternating
  sliding-window / full layers (window ``SLIDING_WINDOW``, much shorter than the test sequences),
  learned attention sinks (std 1, so they matter), q/k/v/o biases, YaRN RoPE, a top-k router with
  bias and the clamped-SwiGLU experts with biases.
* ``qwen3_moe``: ``Qwen3MoeForCausalLM`` (Qwen3-Coder-30B-A3B's architecture): q/k RMSNorm, a
  softmax top-k router with ``norm_topk_prob``, one dense (``mlp_only_layers``) layer.

As in :mod:`tiny_models`, the ``lm_head`` is built from the (normalised) token embeddings through a
permutation ``g``, so the model mostly predicts ``g(current token)`` with clear logit margins while
attention and the MoE blocks (scaled, not removed) make predictions depend on the context.
:func:`tiny_models.make_drafter` builds a matching drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_models import LAYERS, VOCAB, _perm, _unit_rows
from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

SLIDING_WINDOW = 6
KINDS = ("gpt_oss", "qwen3_moe")
# E2M1 (the MXFP4 element format): sign bit, 2 exponent bits, 1 mantissa bit; code -> value.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def moe_config(
    kind: str,
    *,
    head_dim: int = 16,
    num_experts: int = 4,
    experts_per_tok: int = 2,
    intermediate_size: int = 96,
    max_position_embeddings: int = 256,
    sliding_window: int | None = SLIDING_WINDOW,
    layers: int = LAYERS,
):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=4 * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        num_experts_per_tok=experts_per_tok,
    )
    if kind == "gpt_oss":
        # GPT-OSS's YaRN (truncate=False) with a 4x extension of a 64-position original context.
        return GptOssConfig(
            **common,
            intermediate_size=intermediate_size,
            num_local_experts=num_experts,
            sliding_window=sliding_window,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": max_position_embeddings / 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            intermediate_size=128,
            moe_intermediate_size=intermediate_size,
            num_experts=num_experts,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_theta=10000.0,
            use_sliding_window=sliding_window is not None,
            sliding_window=sliding_window,
        )
    raise ValueError(kind)


def make_moe_target(
    kind: str = "gpt_oss",
    seed: int = 0,
    sharpen: float = 0.5,
    layer_scale: float = 0.3,
    **cfg_kw,
):
    """A tiny float32 MoE causal LM with mostly-bigram, clear-margin greedy behaviour; returns
    ``(model, g)`` like :func:`tiny_models.make_target`."""
    cfg = moe_config(kind, **cfg_kw)
    torch.manual_seed(seed)
    model = (GptOssForCausalLM if kind == "gpt_oss" else Qwen3MoeForCausalLM)(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    g = _perm(VOCAB, gen)
    n = lambda t, std: t.normal_(0.0, std, generator=gen)  # noqa: E731
    with torch.no_grad():
        e = n(model.model.embed_tokens.weight, 1.0)
        w = torch.empty_like(model.lm_head.weight)
        w[g] = _unit_rows(e)
        model.lm_head.weight.copy_(w * sharpen)
        f = (64 / e.shape[1]) ** 0.5
        for layer in model.model.layers:
            at = layer.self_attn
            for lin in (at.q_proj, at.k_proj, at.v_proj):
                n(lin.weight, 0.2 * f)
            n(at.o_proj.weight, 0.2 * f * layer_scale)
            for lin in (at.q_proj, at.k_proj, at.v_proj, at.o_proj):
                if lin.bias is not None:
                    n(lin.bias, 0.05)
            if hasattr(at, "sinks"):
                n(at.sinks, 1.0)
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                ex = mlp.experts
                n(ex.gate_up_proj, 0.2 * f)
                n(ex.down_proj, 0.1 * layer_scale)
                router = getattr(mlp, "router", None) or mlp.gate
                n(router.weight, 1.0 * f)
                if getattr(router, "bias", None) is not None:
                    n(router.bias, 0.5)
                    n(ex.gate_up_proj_bias, 0.05)
                    n(ex.down_proj_bias, 0.05 * layer_scale)
            else:
                n(mlp.gate_proj.weight, 0.2 * f)
                n(mlp.up_proj.weight, 0.2 * f)
                n(mlp.down_proj.weight, 0.1 * layer_scale)
    return model.eval(), g


# ---------------------------------------------------------------------------------------------
# MXFP4 checkpoints (GPT-OSS's published expert format), written by hand
# ---------------------------------------------------------------------------------------------

MXFP4_NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def quantize_experts_to_mxfp4(path: Path, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Replace a saved GPT-OSS checkpoint's expert matrices by random MXFP4 ones.

    Each ``[E, in, out]`` matrix ``model.layers.{i}.mlp.experts.{gate_up,down}_proj`` becomes
    ``*_blocks`` ``[E, out, in/32, 16]`` uint8 (two E2M1 codes per byte, low nibble first along
    ``in``) and ``*_scales`` ``[E, out, in/32]`` uint8 (E8M0: the block's value is
    ``E2M1[code] * 2**(scale - 127)``); ``config.json`` gets ``quantization_config`` as published.

    Returns:
        The dequantized ``[E, in, out]`` float32 matrices by parameter name, computed here
        independently of transformers.
    """
    st = load_file(str(path / "model.safetensors"))
    table = torch.tensor(E2M1)
    expect = {}
    for name in [k for k in st if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, n_in, n_out = st.pop(name).shape
        codes = torch.randint(0, 16, (e, n_out, n_in), generator=gen)
        scales = torch.randint(127 - 9, 127 - 5, (e, n_out, n_in // 32), generator=gen)
        values = table[codes] * torch.exp2(scales - 127.0).repeat_interleave(32, dim=-1)
        expect[name] = values.transpose(1, 2).contiguous()
        pairs = codes.view(e, n_out, n_in // 32, 16, 2)
        st[name + "_blocks"] = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
        st[name + "_scales"] = scales.to(torch.uint8)
    save_file(st, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": MXFP4_NOT_CONVERTED,
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return expect
