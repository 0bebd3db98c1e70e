"""Independent pure-PyTorch reference for ``write_kv_cache`` (SPEC §5)."""

from __future__ import annotations

import torch


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New (cloned, CPU) caches after writing row ``t`` to slot ``slot_mapping[t]``; slots < 0
    write nothing."""
    kc, vc = key_cache.detach().cpu().clone(), value_cache.detach().cpu().clone()
    block_size = kc.shape[1]
    for t, s in enumerate(slot_mapping.detach().cpu().tolist()):
        if s < 0:
            continue
        kc[s // block_size, s % block_size] = key[t].detach().cpu()
        vc[s // block_size, s % block_size] = value[t].detach().cpu()
    return kc, vc
