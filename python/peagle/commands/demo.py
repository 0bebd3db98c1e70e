"""``peagle demo``: one P-EAGLE step through every op on sample inputs (see :mod:`peagle.demo`)."""

from __future__ import annotations

import argparse

from peagle.errors import UserError, check_device


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="run one P-EAGLE step through every op on sample inputs",
        description="Run one P-EAGLE step (verify_chain, prepare_draft_inputs, write_kv_cache, "
        "paged_attention) on small sample inputs and print what each op did.",
        epilog="example: peagle demo --device cpu",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample inputs")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    import torch

    from peagle.demo import run_demo

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not device.startswith("cuda"):
        device = check_device("--device", device)  # cpu, or a one-line refusal
    elif not torch.cuda.is_available():
        raise UserError(
            f"demo --device {device}",
            f"needs a CUDA build of torch and a visible GPU (this torch: {torch.__version__}, "
            "CUDA available: no)",
            "use --device cpu",
        )
    run_demo(device, args.seed)
    return 0
