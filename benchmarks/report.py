"""Thin script: regenerates docs/results.md and the docs/*.png plots from
benchmarks/results/*.json (:mod:`peagle.bench.report`; also ``peagle bench report``).

    python benchmarks/report.py
"""

from peagle.bench.report import main

if __name__ == "__main__":
    main()
