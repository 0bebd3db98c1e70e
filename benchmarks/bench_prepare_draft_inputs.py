"""Thin script: :mod:`peagle.bench.prepare_draft_inputs` (`peagle bench ops prepare_draft_inputs`).

python benchmarks/bench_prepare_draft_inputs.py --help
"""

from peagle.bench.prepare_draft_inputs import main

if __name__ == "__main__":
    main()
