"""Raise one error from a peagle CPU kernel (diagnosing exception handling on a machine)."""

import torch

import peagle  # noqa: F401

try:
    torch.ops.peagle.prepare_next_token_ids(
        torch.zeros(2, 2, dtype=torch.int64),
        torch.zeros(2, dtype=torch.bool),
        torch.zeros(2, dtype=torch.int32),
        10,
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
    )
except RuntimeError as e:
    print("caught:", str(e).splitlines()[0])
