"""User errors: one ``peagle: <what>: <why> (<what to do>)`` line on stderr, exit status 2.

Commands raise :class:`UserError` for anything the user can fix (a flag, a file, the machine);
``peagle.cli.main`` catches it once and prints it. Anything else is a bug and may traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

EXIT_USAGE = 2
HUB_UNREACHABLE = "cannot be downloaded: huggingface.co is unreachable, and it is not cached"


class UserError(SystemExit):
    """A mistake in the user's input or environment, reported as one line.

    A :class:`SystemExit`, so that code outside ``peagle.cli.main`` (the ``benchmarks/`` scripts,
    ``python -m`` of a module) still exits with the line and no traceback, and ``except
    Exception`` blocks do not swallow it.

    Args:
        what: the thing at fault, e.g. ``"--max-num-seqs"`` or a file path.
        why: what is wrong with it.
        todo: what to do about it (optional).
    """

    def __init__(self, what: str, why: str, todo: str | None = None) -> None:
        self.what, self.why, self.todo = what, why, todo
        super().__init__(self.line())

    def line(self) -> str:
        text = f"{self.what}: {_one_line(self.why)}"
        return f"{text} ({self.todo})" if self.todo else text


def _one_line(text: str) -> str:
    """The first line of an exception message, stripped (library messages run on)."""
    lines = [s.strip() for s in str(text).strip().splitlines() if s.strip()]
    return lines[0] if lines else str(text)


def first_line(exc: BaseException) -> str:
    """``exc``'s message as one line (its type name when it has none)."""
    return _one_line(str(exc)) or type(exc).__name__


def looks_like_path(name: str) -> bool:
    """A model argument meant as a local path rather than a hub id (``org/name``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()


def check_model_location(flag: str, name: str) -> None:
    """Refuse a local model path that does not exist (transformers would call it a bad hub id)."""
    path = Path(name).expanduser()
    if looks_like_path(name) and not path.exists():
        raise UserError(
            f"{flag} {name}", "no such directory", "pass a model directory or a hub id (org/name)"
        )
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {name}", "not a directory", "pass the checkpoint's directory")


def check_device(flag: str, name: str | None) -> str:
    """``name`` (cpu, cuda, cuda:N) checked against this torch and machine; returns it."""
    import torch

    if name is None:  # a GPU only when this build has kernels for it
        if torch.cuda.is_available() and not _built_with_cuda():
            print(
                "peagle: note: running on the CPU: this build has no CUDA kernels (rebuild with a "
                "CUDA toolkit to use the GPU)",
                file=sys.stderr,
            )
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise UserError(f"{flag} {name}", "unknown device", "use cpu, cuda or cuda:N")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                f"{flag} {name}",
                f"no usable CUDA GPU (torch {torch.__version__}, CUDA "
                f"{torch.version.cuda or 'none'}, GPUs visible: 0)",
                "use --device cpu",
            )
        n = torch.cuda.device_count()
        if index and int(index) >= n:
            raise UserError(
                f"{flag} {name}", f"this machine has {n} GPU(s): cuda:0..cuda:{n - 1}", None
            )
        if not _built_with_cuda():
            raise UserError(
                f"{flag} {name}",
                "this peagle build has no CUDA kernels (built with PEAGLE_CUDA=OFF or without a "
                "CUDA toolkit)",
                "rebuild with a CUDA toolkit: PEAGLE_CUDA=ON pip install --no-build-isolation "
                "--no-deps ., or use --device cpu",
            )
    return name


def _built_with_cuda() -> bool:
    from peagle import _read_build_info

    info = _read_build_info()
    return info is None or bool(info.WITH_CUDA)


def go_offline_if_hub_unreachable(name: str) -> bool:
    """For a hub id: when huggingface.co does not resolve, switch the hub client to offline mode
    (cached models still load) instead of retrying for ~45 s. Returns True when it did."""
    import os
    import socket
    import threading

    if looks_like_path(name) or os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_ENDPOINT"):
        return False
    resolved: list[bool] = []

    def probe() -> None:
        try:
            socket.getaddrinfo("huggingface.co", 443)
            resolved.append(True)
        except OSError:
            resolved.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(3.0)
    if resolved and resolved[0]:
        return False
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:  # already imported: its constants were read at import time
        import huggingface_hub.constants as hub_constants

        hub_constants.HF_HUB_OFFLINE = True
    except ImportError:
        pass
    return True
