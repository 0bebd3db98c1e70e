"""No module of python/peagle is in an import cycle, counting imports inside functions too
(tools/import_cycles.py reads the sources with ast; nothing is imported)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_import_cycles():
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "import_cycles.py"), str(ROOT / "python" / "peagle")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("no import cycles")


def test_import_cycles_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "import_cycles.py"), str(pkg)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert "pkg.a -> pkg.sub.b" in r.stdout and "pkg.sub.b -> pkg.a" in r.stdout
