"""``config.json`` of an EAGLE-3 / P-EAGLE drafter (SPEC.md §2.3).

The released P-EAGLE checkpoints (``amazon/*-p-eagle``) and autoregressive EAGLE-3 heads use a
Llama ``config.json`` with a few extra fields. :class:`DrafterConfig` reads the fields peagle uses
and keeps the whole dictionary, so a checkpoint saved by peagle carries every field it was loaded
with.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import LlamaConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Names vLLM accepts for the same model (SPEC §2.3).
KNOWN_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")

_LLAMA_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "attention_bias",
    "mlp_bias",
    "vocab_size",
)


@dataclass
class DrafterConfig:
    """Fields of a drafter ``config.json`` (defaults as vLLM applies them).

    Attributes:
        mask_token_id: ``pard_token`` if present, else ``ptd_token_id`` (vLLM v0.16 order), else
            None (an autoregressive EAGLE-3 head).
        aux_layer_ids: ``eagle_config.eagle_aux_hidden_state_layer_ids`` or None (target default).
        raw: the full dictionary (unknown fields are written back on save).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    norm_before_residual: bool = False
    use_aux_hidden_state: bool = True
    aux_layer_ids: list[int] | None = None
    logit_scale: float = 1.0
    mask_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"drafter config.json lacks required field(s) {missing}")
        arch = d.get("architectures") or []
        if arch and not any(a in KNOWN_ARCHITECTURES for a in arch):
            raise ValueError(
                f"drafter config.json has architectures {arch}; expected one of "
                f"{list(KNOWN_ARCHITECTURES)} (speculators-format checkpoints are not supported)"
            )
        h = int(d["hidden_size"])
        n_heads = int(d["num_attention_heads"])
        eagle = d.get("eagle_config") or {}
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        if rope_theta is None and isinstance(d.get("rope_parameters"), dict):  # transformers >= 5
            rope_params = dict(d["rope_parameters"])
            rope_theta = rope_params.pop("rope_theta", None)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        mask = d.get("pard_token", d.get("ptd_token_id"))
        v = int(d["vocab_size"])
        return cls(
            hidden_size=h,
            num_hidden_layers=int(d.get("num_hidden_layers", 1)),
            num_attention_heads=n_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(d.get("head_dim") or h // n_heads),
            intermediate_size=int(d.get("intermediate_size", 4 * h)),
            vocab_size=v,
            draft_vocab_size=int(d.get("draft_vocab_size") or v),
            target_hidden_size=int(d.get("target_hidden_size") or h),
            hidden_act=d.get("hidden_act", "silu"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            use_aux_hidden_state=bool(eagle.get("use_aux_hidden_state", True)),
            aux_layer_ids=(
                [int(i) for i in eagle["eagle_aux_hidden_state_layer_ids"]]
                if eagle.get("eagle_aux_hidden_state_layer_ids") is not None
                else None
            ),
            logit_scale=float(d.get("logit_scale", 1.0)),
            mask_token_id=None if mask is None else int(mask),
            raw=dict(d),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> DrafterConfig:
        with open(path) as f:
            try:
                data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` dictionary: the loaded one with peagle's fields updated."""
        d = copy.deepcopy(self.raw)
        d["architectures"] = [ARCHITECTURE]
        d.setdefault("model_type", "llama")
        for k in _LLAMA_FIELDS:
            d[k] = getattr(self, k)
        d.pop("rope_parameters", None)  # rope_theta / rope_scaling are the checkpoint's spelling
        d["draft_vocab_size"] = self.draft_vocab_size
        d["target_hidden_size"] = self.target_hidden_size
        d["norm_before_residual"] = self.norm_before_residual
        d["logit_scale"] = self.logit_scale
        eagle = dict(d.get("eagle_config") or {})
        eagle["use_aux_hidden_state"] = self.use_aux_hidden_state
        if self.aux_layer_ids is not None:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        d["eagle_config"] = eagle
        if self.mask_token_id is not None:
            key = "pard_token" if "pard_token" in self.raw else "ptd_token_id"
            d[key] = self.mask_token_id
        return d

    def llama_config(self) -> LlamaConfig:
        """A transformers ``LlamaConfig`` for the decoder layers (norms, MLP, rotary)."""
        kw = {k: copy.deepcopy(getattr(self, k)) for k in _LLAMA_FIELDS}  # transformers edits
        return LlamaConfig(**kw)
