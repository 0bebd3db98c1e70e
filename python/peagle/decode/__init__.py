"""The speculative decode loop (P-EAGLE, EAGLE-3, or no speculation) over peagle's ops.

One role per module, imports one way (docs/architecture.md, "One decode step"): ``engine``
(``SpecDecoder``: schedule -> build inputs -> run -> sync -> apply -> propose) uses ``scheduler``
(admission, positions, KV blocks), ``builder`` (the step's inputs through ``staging``), ``verify``
(target pass + ``verify_chain``), ``proposers`` (P-EAGLE one pass, EAGLE-3 K passes) and
``cuda_graphs``; ``inputs`` (the step's dataclasses), ``request`` and ``blocks`` are leaves.
"""

from peagle.decode.blocks import BlockAllocator
from peagle.decode.engine import METHODS, SpecDecoder
from peagle.decode.request import RequestOutput, RequestStats, SamplingParams

__all__ = [
    "METHODS",
    "BlockAllocator",
    "RequestOutput",
    "RequestStats",
    "SamplingParams",
    "SpecDecoder",
]
