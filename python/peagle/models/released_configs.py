"""Published configs of the released P-EAGLE heads' targets and the heads' assumed shapes.

The targets' fields are their published ``config.json`` values (gpt-oss-20b / gpt-oss-120b /
Qwen3-Coder-30B-A3B-Instruct); :func:`target_config` builds the transformers config, which the
tests put on the ``meta`` device and ``peagle bench e2e --projection-shape`` fills with random
weights on the GPU. The heads' pinned fields are SPEC.md §2.4 (GPT-OSS-20B head: H 2880, fc
8640 -> 2880, V 201088, ``ptd_token_id`` 201020, 4 layers, llama3 RoPE); their attention/MLP
widths were NOT read from the checkpoints (SPEC §10): :func:`head_config`'s 32/8 heads x 64 and
intermediate 3H are the project's assumptions, as is the Qwen3-Coder head's mask id.

:func:`shrink` gives the same architecture at test size (few layers, small hidden, few experts):
the CPU tests run the full-shape code path with it.
"""

from __future__ import annotations

import copy

GPT_OSS_COMMON = dict(
    hidden_size=2880,
    intermediate_size=2880,
    head_dim=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    num_experts_per_tok=4,
    vocab_size=201088,
    sliding_window=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=150000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    attention_bias=True,
    swiglu_limit=7.0,
    tie_word_embeddings=False,
)
MXFP4_QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
QWEN3_CODER_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=151936,
    max_position_embeddings=262144,
    rope_theta=10000000.0,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
    tie_word_embeddings=False,
)

# name -> (model_type, published config fields, published total parameters, released head)
TARGETS = {
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        cfg=dict(GPT_OSS_COMMON, num_hidden_layers=24, num_local_experts=32),
        params=20.9e9,  # "21B parameters, 3.6B active"
        head=dict(name="amazon/GPT-OSS-20B-P-EAGLE", h=2880, v=201088, mask=201020),
    ),
    "gpt-oss-120b": dict(
        model_type="gpt_oss",
        cfg=dict(GPT_OSS_COMMON, num_hidden_layers=36, num_local_experts=128),
        params=116.8e9,  # "117B parameters, 5.1B active"
        head=dict(name="amazon/gpt-oss-120b-p-eagle", h=2880, v=201088, mask=201020),
    ),
    "qwen3-coder-30b-a3b": dict(
        model_type="qwen3_moe",
        cfg=QWEN3_CODER_30B_A3B,
        params=30.5e9,  # "30.5B parameters, 3.3B activated"
        head=dict(
            name="amazon/Qwen3-Coder-30B-A3B-Instruct-P-EAGLE", h=2048, v=151936, mask=151935
        ),  # fmt: skip
    ),
}

# The test-size versions (same architectures): fields overridden by :func:`shrink`.
_SHRINK = {
    "gpt_oss": dict(
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=512,
        sliding_window=8,
        max_position_embeddings=4096,
    ),  # fmt: skip
    "qwen3_moe": dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=4096,
    ),  # fmt: skip
}


def config_fields(name: str, tiny: bool = False) -> dict:
    """The published fields of target ``name`` (``tiny``: :func:`shrink`-ed)."""
    if name not in TARGETS:
        raise KeyError(f"unknown released target {name!r}; known: {', '.join(TARGETS)}")
    t = TARGETS[name]
    cfg = copy.deepcopy(t["cfg"])
    return shrink(t["model_type"], cfg) if tiny else cfg


def shrink(model_type: str, cfg: dict) -> dict:
    """``cfg`` with few layers, a small hidden size, few experts and a small vocabulary."""
    out = dict(cfg, **_SHRINK[model_type])
    if model_type == "gpt_oss" and isinstance(out.get("rope_scaling"), dict):
        # keep YaRN's factor consistent: max_position_embeddings / original = 32
        out["rope_scaling"] = dict(out["rope_scaling"], original_max_position_embeddings=128)
    return out


def target_config(name: str, tiny: bool = False):
    """The transformers config (``GptOssConfig`` / ``Qwen3MoeConfig``) of target ``name``."""
    from transformers import GptOssConfig, Qwen3MoeConfig

    cls = GptOssConfig if TARGETS[name]["model_type"] == "gpt_oss" else Qwen3MoeConfig
    return cls(**config_fields(name, tiny), bos_token_id=None, eos_token_id=None,
               pad_token_id=None)  # fmt: skip


def head_config(
    h: int, v: int, mask: int, *, num_layers: int = 4, aux_layer_ids=None, tiny: bool = False
) -> dict:
    """A released head's ``config.json`` (P-EAGLE: 4 layers; an EAGLE-3 head: 1). Attention and
    MLP widths are ASSUMED (SPEC §10): 32 query / 8 KV heads x 64, intermediate 3H (``tiny``: 4/2
    heads x 16)."""
    heads, kv, hd = (4, 2, 16) if tiny else (32, 8, 64)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "target_hidden_size": h,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,  # assumed
        "num_key_value_heads": kv,  # assumed
        "head_dim": hd,  # assumed
        "intermediate_size": 3 * h,  # assumed
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 4096,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_residual": False,
        "vocab_size": v,
        "draft_vocab_size": v,
        "eagle_config": {"use_aux_hidden_state": True},
        "ptd_token_id": mask,
        "torch_dtype": "bfloat16",
    }
    if aux_layer_ids is not None:
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    return cfg
