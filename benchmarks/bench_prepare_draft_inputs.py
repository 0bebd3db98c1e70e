"""Thin script: the benchmark is :mod:`peagle.bench.prep` (``peagle bench ops prep``).

python benchmarks/bench_prepare_draft_inputs.py --help
"""

from peagle.bench.prep import main

if __name__ == "__main__":
    main()
