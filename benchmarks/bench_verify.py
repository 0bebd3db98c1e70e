"""Thin script: :mod:`peagle.bench.verify_chain` (``peagle bench ops verify_chain``).

python benchmarks/bench_verify.py --help
"""

from peagle.bench.verify_chain import main

if __name__ == "__main__":
    main()
