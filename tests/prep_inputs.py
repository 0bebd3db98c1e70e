"""Random draft-step batches: moved to :mod:`peagle.bench.prep_inputs` (the benchmarks ship in the
package); re-exported here for the tests and tools that import ``prep_inputs``."""

from peagle.bench.prep_inputs import DraftStepBatch, make_batch

__all__ = ["DraftStepBatch", "make_batch"]
