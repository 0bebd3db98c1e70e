"""The released P-EAGLE heads and their targets at full size, checked on the ``meta`` device.

No multi-GB file is downloaded or allocated: the targets are built from their published
``config.json`` fields on ``meta``, and each drafter checkpoint is a ``config.json`` plus a
*header-only* ``model.safetensors`` (the real format's header with the published tensor shapes and
no data), loaded with ``Eagle3Drafter.from_pretrained(..., device="meta")``.

Pinned by SPEC.md §2.4 (GPT-OSS-20B head): H = H_t = 2880, ``fc`` 8640 -> 2880, ``mask_hidden``
[1, 1, 8640], V = 201088 with a full-vocabulary ``lm_head``, ``ptd_token_id`` 201020, 4 layers,
llama3 RoPE. The heads' attention/MLP widths were not read (SPEC §10): the values in
``peagle.models.released_configs.head_config`` are assumptions, and the loader checks every tensor
against whatever the config says. The Qwen3-Coder head's mask id is likewise an assumption (an id
past Qwen3's special tokens). The published target configs live in the same module.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GptOssConfig, Qwen3MoeConfig

import peagle.models.released_configs as RC
from peagle.models import Eagle3Drafter, TargetRunner
from peagle.models.drafter import read_safetensors_header
from peagle.models.mxfp4 import count_parameters, plan_quantized_load
from peagle.models.released_configs import MXFP4_QUANTIZATION, head_config

GB = 1e9

_MXFP4 = MXFP4_QUANTIZATION
# Published target configs (config.json fields) and published totals (parameters; memory claims).
TARGETS = {
    "gpt-oss-20b": dict(
        cls=GptOssConfig,
        cfg=RC.config_fields("gpt-oss-20b"),
        params=20.9e9,  # "21B parameters, 3.6B active"
        mxfp4_fits=16 * GB,  # "runs within 16 GB of memory"
    ),
    "gpt-oss-120b": dict(
        cls=GptOssConfig,
        cfg=RC.config_fields("gpt-oss-120b"),
        params=116.8e9,  # "117B parameters, 5.1B active"
        mxfp4_fits=80 * GB,  # "fits a single 80 GB GPU"
    ),
    "Qwen3-Coder-30B-A3B-Instruct": dict(
        cls=Qwen3MoeConfig,
        cfg=RC.config_fields("qwen3-coder-30b-a3b"),
        params=30.5e9,  # "30.5B parameters, 3.3B activated"
        mxfp4_fits=None,
    ),
}

# The released heads: pinned fields (SPEC §2.4 / model pages) + assumed widths (see module doc).
HEADS = {
    "amazon/GPT-OSS-20B-P-EAGLE": dict(target="gpt-oss-20b", h=2880, v=201088, mask=201020),
    "amazon/gpt-oss-120b-p-eagle": dict(target="gpt-oss-120b", h=2880, v=201088, mask=201020),
    "amazon/Qwen3-Coder-30B-A3B-Instruct-P-EAGLE": dict(
        target="Qwen3-Coder-30B-A3B-Instruct", h=2048, v=151936, mask=151935
    ),
}


def target_config(name: str):
    t = TARGETS[name]
    return t["cls"](**t["cfg"])


def meta_target(name: str) -> TargetRunner:
    cfg = target_config(name)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return TargetRunner(model)


def head_shapes(cfg: dict) -> dict[str, tuple[str, list[int]]]:
    """Tensor names and shapes of a released head (SPEC §2.4), bf16 except ``d2t``."""
    h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = {
        "embed_tokens.weight": [v, h],
        "fc.weight": [h, 3 * cfg["target_hidden_size"]],
        "mask_hidden": [1, 1, 3 * cfg["target_hidden_size"]],
        "norm.weight": [h],
        "lm_head.weight": [cfg["draft_vocab_size"], h],
    }
    for name, inp in [("midlayer", 2 * h)] + [(f"layers.{k}", h) for k in (1, 2, 3)]:
        t[f"{name}.input_layernorm.weight"] = [h]
        t[f"{name}.post_attention_layernorm.weight"] = [h]
        if name == "midlayer":
            t[f"{name}.hidden_norm.weight"] = [h]
        t[f"{name}.self_attn.q_proj.weight"] = [hq * d, inp]
        t[f"{name}.self_attn.k_proj.weight"] = [hkv * d, inp]
        t[f"{name}.self_attn.v_proj.weight"] = [hkv * d, inp]
        t[f"{name}.self_attn.o_proj.weight"] = [h, hq * d]
        t[f"{name}.mlp.gate_proj.weight"] = [i, h]
        t[f"{name}.mlp.up_proj.weight"] = [i, h]
        t[f"{name}.mlp.down_proj.weight"] = [h, i]
    out = {k: ("BF16", s) for k, s in t.items()}
    out["d2t"] = ("I64", [cfg["draft_vocab_size"]])
    return out


def write_header_only_checkpoint(path, cfg: dict, shapes: dict) -> int:
    """``config.json`` + a safetensors file holding only its header; returns the data size the
    header describes (bytes that are *not* written)."""
    size = {"BF16": 2, "I64": 8, "F32": 4}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dt, shape) in shapes.items():
        n = size[dt] * int(torch.Size(shape).numel())
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    return offset


@pytest.mark.parametrize("name", list(TARGETS))
def test_published_target_builds_on_meta(name):
    t = TARGETS[name]
    pc = count_parameters(target_config(name))
    assert abs(pc.total - t["params"]) < 0.02 * t["params"], pc
    runner = meta_target(name)
    cfg = runner.config
    assert runner.hidden_size == cfg.hidden_size and runner.vocab_size == cfg.vocab_size
    layers = cfg.num_hidden_layers
    if cfg.model_type == "gpt_oss":
        # Layer 0 slides: 128-token windows (127 keys left of the query's own) alternate with
        # full attention; every layer has sinks.
        assert runner.window_left == [127, -1] * (layers // 2)
        assert all(runner.has_sinks) and runner.head_dim == 64
        assert runner.kv_bytes_per_token() == 2 * layers * 8 * 64 * 4  # float32 on meta
    else:
        assert runner.window_left == [-1] * layers and not any(runner.has_sinks)
    assert runner.aux_layer_ids == [2, layers // 2, layers - 3]


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_published_mxfp4_plan(name):
    cfg = target_config(name)
    cfg.quantization_config = dict(_MXFP4)
    big = lambda dev: 1 << 50  # noqa: E731
    native = plan_quantized_load(cfg, device="cuda", kernel_status=lambda d: None, memory_bytes=big)
    assert native.native and native.mxfp4_bytes < TARGETS[name]["mxfp4_fits"]
    assert native.params.mxfp4 > 0.9 * native.params.total  # the experts dominate
    deq = plan_quantized_load(cfg, device="cpu", memory_bytes=big, name=name)
    assert not deq.native and deq.dequantized_bytes == 2 * deq.params.total
    print(f"\n{deq.message}")
    # On a 24 GiB machine (this CI's size) the dequantized load is refused up front.
    with pytest.raises(ValueError, match="more than the 24.0 GiB of cpu"):
        plan_quantized_load(cfg, device="cpu", memory_bytes=lambda d: 24 << 30, name=name)


@pytest.mark.parametrize("head", list(HEADS))
def test_released_head_shapes_load_on_meta(head, tmp_path):
    spec = HEADS[head]
    cfg = head_config(spec["h"], spec["v"], spec["mask"])
    shapes = head_shapes(cfg)
    nbytes = write_header_only_checkpoint(tmp_path / "head", cfg, shapes)
    assert (tmp_path / "head" / "model.safetensors").stat().st_size < 20_000 < nbytes
    header = read_safetensors_header(tmp_path / "head" / "model.safetensors")
    assert header["fc.weight"] == (torch.bfloat16, (spec["h"], 3 * spec["h"]))
    d = Eagle3Drafter.from_pretrained(tmp_path / "head", device="meta")
    assert d.device.type == "meta" and d.dtype == torch.bfloat16
    assert tuple(d.fc.weight.shape) == (spec["h"], 3 * spec["h"])
    assert tuple(d.mask_hidden.shape) == (1, 1, 3 * spec["h"])
    assert tuple(d.lm_head.weight.shape) == (spec["v"], spec["h"])
    assert d.num_layers == 4 and d.config.mask_token_id == spec["mask"]
    d.check_parallel_drafting()
    target = meta_target(spec["target"])
    d.check_target(target.hidden_size, target.vocab_size)
    if head == "amazon/GPT-OSS-20B-P-EAGLE":
        # SPEC §2.4's numbers for this head.
        assert (spec["h"], spec["v"], spec["mask"]) == (2880, 201088, 201020)
        n = sum(p.numel() for p in d.parameters())
        print(f"\n{head}: {n / 1e9:.2f}B parameters with the assumed widths (model page: ~1.8B)")


def test_meta_load_catches_wrong_shapes(tmp_path):
    cfg = head_config(2880, 201088, 201020)
    shapes = head_shapes(cfg)
    shapes["fc.weight"] = ("BF16", [2880, 6144])  # a Qwen3-Coder-sized fc
    write_header_only_checkpoint(tmp_path / "bad", cfg, shapes)
    with pytest.raises(ValueError, match=r"fc.weight has shape \(2880, 6144\)"):
        Eagle3Drafter.from_pretrained(tmp_path / "bad", device="meta")
    # A GPT-OSS head next to the Qwen3-Coder target: hidden sizes differ.
    write_header_only_checkpoint(tmp_path / "ok", cfg, head_shapes(cfg))
    d = Eagle3Drafter.from_pretrained(tmp_path / "ok", device="meta")
    qwen = meta_target("Qwen3-Coder-30B-A3B-Instruct")
    with pytest.raises(ValueError, match="hidden-size mismatch"):
        d.check_target(qwen.hidden_size, qwen.vocab_size)
    (tmp_path / "trunc").mkdir()
    (tmp_path / "trunc" / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_safetensors_header(tmp_path / "trunc" / "model.safetensors")
