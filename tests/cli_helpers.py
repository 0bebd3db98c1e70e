"""Asserting the CLI's user errors: exit status 2 and one ``peagle: ...`` line on stderr."""

from __future__ import annotations

import re
import sys

from peagle.cli import main


def user_error(capsys, argv, stdin=None, monkeypatch=None, match: str | None = None) -> str:
    """Run ``peagle argv``; expect a user error. Returns the error line (``match``: a regex it
    must contain). Notes and warnings (``peagle ...`` lines) may precede it; nothing else."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", stdin)
    capsys.readouterr()  # what the test printed before (e.g. saving models)
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2, err
    assert "Traceback" not in err
    assert lines and lines[-1].startswith("peagle: "), err
    assert all(x.startswith("peagle") for x in lines), err
    if match is not None:
        assert re.search(match, lines[-1]), lines[-1]
    return lines[-1]
