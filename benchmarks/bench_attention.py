"""Thin script: the benchmark is :mod:`peagle.bench.attention` (``peagle bench ops attention``).

python benchmarks/bench_attention.py --help
"""

from peagle.bench.attention import main

if __name__ == "__main__":
    main()
