"""Thin script: :mod:`peagle.bench.paged_attention` (``peagle bench ops paged_attention``).

python benchmarks/bench_attention.py --help
"""

from peagle.bench.paged_attention import main

if __name__ == "__main__":
    main()
