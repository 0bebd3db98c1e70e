"""Thin script: :mod:`peagle.bench.report` (``peagle bench report``) with this checkout's
benchmarks/results and docs/ as the default paths.

    python benchmarks/report.py
"""

from pathlib import Path

from peagle.bench.report import main

if __name__ == "__main__":
    main(root=Path(__file__).resolve().parent.parent)
