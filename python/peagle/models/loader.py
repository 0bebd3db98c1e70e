"""Load a target model and its drafter as a matching pair."""

from __future__ import annotations

from pathlib import Path

import torch

from peagle.models.drafter import Eagle3Drafter
from peagle.models.drafter_config import DrafterConfig
from peagle.models.target import TargetRunner


def resolve_drafter_dir(location: str | Path) -> Path:
    """A drafter checkpoint directory: ``location`` itself when it is a directory, else a Hugging
    Face hub id whose ``*.json`` and ``*.safetensors`` files are fetched into (or found in) the hub
    cache. Raises ``OSError`` (from huggingface_hub) when the id cannot be fetched."""
    path = Path(location).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(location), allow_patterns=["*.json", "*.safetensors"]))


def load_model_pair(
    model: str,
    draft_model: str | None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[TargetRunner, Eagle3Drafter | None]:
    """Load the target (transformers) and the drafter (``config.json`` + safetensors; a directory
    or a hub id, :func:`resolve_drafter_dir`).

    The target's auxiliary layers come from the drafter's
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (default ``[2, L//2, L-3]``). A drafter
    without its own ``embed_tokens`` / ``lm_head`` (some EAGLE-3 heads) borrows the target's.
    The drafter gets the target's dtype unless ``dtype`` is given.

    Raises:
        ValueError / FileNotFoundError: unsupported target, malformed drafter checkpoint, or a
            drafter that does not fit the target (hidden size, vocabulary).
    """
    # The drafter's feature layers go to the target at construction: a target whose default
    # [2, L//2, L-3] is not strictly increasing (L < 7) is valid with the drafter's own ids.
    aux_layer_ids = None
    if draft_model is not None:
        draft_model = resolve_drafter_dir(draft_model)
    if draft_model is not None and (Path(draft_model) / "config.json").is_file():
        aux_layer_ids = DrafterConfig.from_json_file(
            Path(draft_model) / "config.json"
        ).aux_layer_ids
    target = TargetRunner.from_pretrained(
        model, dtype=dtype, device=device, aux_layer_ids=aux_layer_ids
    )
    if draft_model is None:
        return target, None
    drafter = Eagle3Drafter.from_pretrained(
        draft_model,
        dtype=dtype or target.dtype,
        device=device,
        shared_embed_tokens=target.embed_tokens.weight.detach(),
        shared_lm_head=target.lm_head.weight.detach(),
    )
    drafter.check_target(target.hidden_size, target.vocab_size)
    if drafter.config.aux_layer_ids is not None:
        target.set_aux_layer_ids(drafter.config.aux_layer_ids)
    return target, drafter
