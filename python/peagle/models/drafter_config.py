"""``config.json`` of an EAGLE-3 / P-EAGLE drafter (SPEC.md §2.3).

The released P-EAGLE checkpoints (``amazon/*-p-eagle``) and autoregressive EAGLE-3 heads use a
Llama ``config.json`` with a few extra fields. :class:`DrafterConfig` reads the fields peagle uses
and keeps the whole dictionary, so a checkpoint saved by peagle carries every field it was loaded
with.

The ``speculators`` format (``speculators_model_type: "peagle"`` or ``"eagle3"``) nests the decoder
layers' fields in ``transformer_layer_config`` (a Llama or Qwen3 config, serialized as its diff
against the transformers defaults) and puts the drafter's own fields at the top level.
:meth:`DrafterConfig.from_dict` flattens it (the defaults come from the transformers config class,
as speculators builds it); :meth:`DrafterConfig.to_speculators_dict` writes it back.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig, LlamaConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Names vLLM accepts for the same model (SPEC §2.3).
KNOWN_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")
# speculators_model_type -> the architecture speculators writes for it.
SPECULATORS_ARCHITECTURES = {"peagle": "PEagleSpeculator", "eagle3": "Eagle3Speculator"}
SPECULATORS_VERSION = "0.9.0"  # the release whose format to_speculators_dict writes
# Decoder-layer architectures (transformer_layer_config.model_type); qwen3 adds q/k RMSNorms.
LAYER_MODEL_TYPES = ("llama", "qwen3")
LAYER_TYPES = ("full_attention", "sliding_attention")
# speculators options that change the forward and that peagle does not implement.
_UNSUPPORTED_SPECULATORS_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")

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
            ``mask_token_id`` (speculators), else None (an autoregressive EAGLE-3 head).
        aux_layer_ids: ``eagle_config.eagle_aux_hidden_state_layer_ids`` or None (target default).
        model_type: the decoder layers' architecture, ``"qwen3"`` (q/k norms) or ``"llama"``.
        sliding_window / layer_types: the drafter's attention windows (:meth:`layer_windows`).
        source_format: ``"eagle3"`` (Llama-style config) or ``"speculators"``.
        raw: the full (flattened) dictionary (unknown fields are written back on save).
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
    model_type: str = "llama"
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    source_format: str = "eagle3"
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def qk_norm(self) -> bool:
        """Qwen3 layers: RMSNorm over each head of q and k (``self_attn.q_norm`` / ``k_norm``,
        ``[head_dim]``) before RoPE."""
        return self.model_type == "qwen3"

    def layer_windows(self) -> list[int | None]:
        """Per layer: the sliding window (a query at position p sees keys at positions
        ``> p - window``, transformers' and speculators' convention) or None (full attention).
        ``layer_types`` picks the windowed layers; without it a ``sliding_window`` applies to all.
        """
        n = self.num_hidden_layers
        if self.sliding_window is None:
            return [None] * n
        if self.layer_types is None:
            return [self.sliding_window] * n
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        source_format = "eagle3"
        if "speculators_model_type" in d:
            d, source_format = _flatten_speculators(d), "speculators"
        missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"drafter config.json lacks required field(s) {missing}")
        arch = d.get("architectures") or []
        if arch and not any(a in KNOWN_ARCHITECTURES for a in arch):
            raise ValueError(
                f"drafter config.json has architectures {arch}; expected one of "
                f"{list(KNOWN_ARCHITECTURES)}, or a speculators-format config "
                f"(speculators_model_type)"
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
        mask = d.get("pard_token", d.get("ptd_token_id", d.get("mask_token_id")))
        v = int(d["vocab_size"])
        n_layers = int(d.get("num_hidden_layers", 1))
        # The decoder layers: Qwen3 (q/k norms) for model_type qwen3, else Llama (as vLLM's
        # LlamaForCausalLMEagle3 reads any model_type).
        model_type = "qwen3" if d.get("model_type") == "qwen3" else "llama"
        window = d.get("sliding_window")
        if window is not None and d.get("use_sliding_window") is False:
            window = None  # Qwen3 keeps the value but ignores it unless use_sliding_window
        layer_types = d.get("layer_types")
        if layer_types is not None:
            layer_types = [str(t) for t in layer_types]
            bad = sorted(set(layer_types) - set(LAYER_TYPES))
            if bad or len(layer_types) != n_layers:
                raise ValueError(
                    f"drafter config.json layer_types {layer_types} must name "
                    f"num_hidden_layers={n_layers} layers, each one of {list(LAYER_TYPES)}"
                )
            if "sliding_attention" in layer_types and window is None:
                raise ValueError("drafter config.json has sliding_attention layers but no window")
        if window is not None and int(window) < 1:
            raise ValueError(f"drafter config.json sliding_window {window} must be >= 1")
        return cls(
            hidden_size=h,
            num_hidden_layers=n_layers,
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
            model_type=model_type,
            sliding_window=None if window is None else int(window),
            layer_types=layer_types,
            source_format=source_format,
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
        if self.model_type == "qwen3":
            d["model_type"] = "qwen3"
        else:
            d.setdefault("model_type", "llama")
        d.pop("mask_token_id", None)  # written as pard_token / ptd_token_id below
        for k in ("sliding_window", "layer_types", "use_sliding_window", "max_window_layers"):
            d.pop(k, None)
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
            if self.layer_types is not None:
                d["layer_types"] = list(self.layer_types)
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

    def to_speculators_dict(
        self,
        *,
        parallel: bool,
        speculative_tokens: int,
        verifier_name_or_path: str | None = None,
        verifier_architectures: list[str] | None = None,
    ) -> dict[str, Any]:
        """The speculators-format ``config.json`` (speculators 0.9's field names):
        ``speculators_model_type`` ``"peagle"`` (``parallel``) or ``"eagle3"``, the decoder layers
        in ``transformer_layer_config`` (their transformers config's diff dict, as speculators
        serializes it), the drafter fields at the top level, and ``speculators_config`` (greedy
        proposals of ``speculative_tokens``, the verifier).

        Raises:
            ValueError: a drafter the format cannot express (``logit_scale`` != 1, no auxiliary
                features, ``hidden_size`` != ``target_hidden_size``: speculators sizes ``fc`` as
                3 x ``hidden_size``; ``parallel`` without a mask token id).
        """
        if self.logit_scale != 1.0:
            raise ValueError(
                f"speculators format has no logit_scale (this drafter's: {self.logit_scale})"
            )
        if not self.use_aux_hidden_state:
            raise ValueError("speculators format always uses auxiliary hidden states (fc)")
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"speculators format needs hidden_size == target_hidden_size, got "
                f"{self.hidden_size} != {self.target_hidden_size}"
            )
        if parallel and self.mask_token_id is None:
            raise ValueError("a speculators P-EAGLE checkpoint needs a mask token id")
        layer_cfg = AutoConfig.for_model(self.model_type, **self._layer_kwargs())
        kind = "peagle" if parallel else "eagle3"
        d: dict[str, Any] = {
            "speculators_model_type": kind,
            "speculators_version": SPECULATORS_VERSION,
            "architectures": [SPECULATORS_ARCHITECTURES[kind]],
            "transformer_layer_config": layer_cfg.to_diff_dict(),
            "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": (
                None if self.aux_layer_ids is None else list(self.aux_layer_ids)
            ),
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "embed_requires_grad": parallel,
            "speculators_config": {
                "algorithm": kind,
                "proposal_methods": [
                    {"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": verifier_name_or_path,
                    "architectures": list(verifier_architectures or []),
                },
            },
        }
        d["transformer_layer_config"].pop("transformers_version", None)
        if parallel:
            d["mask_token_id"] = self.mask_token_id
        return d

    def _layer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the decoder layers' transformers config (Llama or Qwen3)."""
        kw = {k: copy.deepcopy(getattr(self, k)) for k in _LLAMA_FIELDS}
        if self.model_type == "qwen3":
            kw.pop("mlp_bias")
            kw["use_sliding_window"] = self.sliding_window is not None
            kw["max_window_layers"] = 0
        if self.sliding_window is not None:
            kw["sliding_window"] = self.sliding_window
            kw["layer_types"] = list(
                self.layer_types or ["sliding_attention"] * self.num_hidden_layers
            )
        return kw

    def llama_config(self) -> LlamaConfig:
        """A transformers ``LlamaConfig`` for the decoder layers (norms, MLP, rotary)."""
        kw = {k: copy.deepcopy(getattr(self, k)) for k in _LLAMA_FIELDS}  # transformers edits
        return LlamaConfig(**kw)


def _flatten_speculators(d: dict[str, Any]) -> dict[str, Any]:
    """A speculators-format config as the flat dictionary :meth:`DrafterConfig.from_dict` reads:
    ``transformer_layer_config`` completed with its config class's defaults (speculators builds
    ``Qwen3Config`` when it has no ``model_type``), then the drafter's top-level fields."""
    kind = d["speculators_model_type"]
    if kind not in SPECULATORS_ARCHITECTURES:
        raise ValueError(
            f"speculators_model_type {kind!r} is not a drafter peagle loads "
            f"(expected one of {list(SPECULATORS_ARCHITECTURES)})"
        )
    on = [k for k in _UNSUPPORTED_SPECULATORS_FLAGS if d.get(k)]
    if on:
        raise ValueError(f"speculators config sets {on}, which peagle's drafter does not implement")
    layer = dict(d.get("transformer_layer_config") or {})
    model_type = layer.pop("model_type", "qwen3")
    if model_type not in LAYER_MODEL_TYPES:
        raise ValueError(
            f"speculators transformer_layer_config has model_type {model_type!r}; peagle's "
            f"drafter layers are {list(LAYER_MODEL_TYPES)}"
        )
    try:
        flat = AutoConfig.for_model(model_type, **layer).to_dict()
    except Exception as e:  # transformers validates its fields (e.g. layer_types) its own way
        raise ValueError(f"speculators transformer_layer_config is invalid: {e}") from e
    for k in ("architectures", "pard_token", "ptd_token_id"):
        flat.pop(k, None)
    flat["model_type"] = model_type
    flat["architectures"] = [ARCHITECTURE]
    for k in ("draft_vocab_size", "target_hidden_size", "norm_before_residual"):
        if d.get(k) is not None:
            flat[k] = d[k]
    flat["eagle_config"] = {
        "use_aux_hidden_state": True,
        "eagle_aux_hidden_state_layer_ids": d.get("eagle_aux_hidden_state_layer_ids"),
    }
    if kind == "peagle" and d.get("mask_token_id") is not None:
        flat["ptd_token_id"] = d["mask_token_id"]
    return flat
