"""The speculative decode loop (P-EAGLE, EAGLE-3, or no speculation) over peagle's ops."""

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
