"""Thin script: the benchmark is :mod:`peagle.bench.verify` (``peagle bench ops verify``).

python benchmarks/bench_verify.py --help
"""

from peagle.bench.verify import main

if __name__ == "__main__":
    main()
