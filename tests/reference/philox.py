"""Philox4x32-10 in numpy, written from the published algorithm (Salmon et al., SC'11) — used only
by the tests to regenerate the random draws that peagle's kernels make (counter layout in
csrc/include/peagle/kernels/philox.h), so the pure-PyTorch reference can be fed the same draws.

Checked against Random123's known-answer vectors (``tests/kat_vectors``, lines
``philox4x32 10 ...``) in tests/test_verify_chain.py.
"""

from __future__ import annotations

import numpy as np

_MASK = np.uint64(0xFFFFFFFF)
_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_SHIFT = np.uint64(32)

STREAM_ACCEPT = 0
STREAM_RECOVERED = 1
STREAM_BONUS = 2


def philox4x32_10(counter, key) -> tuple[np.ndarray, ...]:
    """Ten Philox4x32 rounds. ``counter``: 4 words, ``key``: 2 words (ints or broadcastable
    arrays of values < 2^32). Returns four uint64 arrays holding 32-bit words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _MASK for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & _MASK for k in key)
    for rnd in range(10):
        if rnd:
            k0 = (k0 + _W0) & _MASK
            k1 = (k1 + _W1) & _MASK
        prod0 = _M0 * c0  # < 2^64: exact in uint64
        prod1 = _M1 * c2
        hi0, lo0 = prod0 >> _SHIFT, prod0 & _MASK
        hi1, lo1 = prod1 >> _SHIFT, prod1 & _MASK
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _split64(x: int) -> tuple[int, int]:
    x &= 0xFFFFFFFFFFFFFFFF  # two's complement for negative int64 seeds/offsets
    return x & 0xFFFFFFFF, x >> 32


def draw(seed: int, offset: int, index, stream: int) -> tuple[np.ndarray, ...]:
    """peagle's layout: key = (lo(seed), hi(seed)), counter = (lo(offset), hi(offset), index,
    stream)."""
    s_lo, s_hi = _split64(int(seed))
    o_lo, o_hi = _split64(int(offset))
    index = np.asarray(index, dtype=np.uint64)
    return philox4x32_10((o_lo, o_hi, index, stream), (s_lo, s_hi))


def acceptance_uniforms(seed: int, offset: int, n: int) -> np.ndarray:
    """float64 [n]: u_j = ((w0 >> 5) * 2^26 + (w1 >> 6)) / 2^53 from (index j, stream 0)."""
    w0, w1, _, _ = draw(seed, offset, np.arange(n), STREAM_ACCEPT)
    a = (w0 >> np.uint64(5)).astype(np.float64)
    b = (w1 >> np.uint64(6)).astype(np.float64)
    return (a * 67108864.0 + b) / 9007199254740992.0


def sampling_uniform(seed: int, offset: int, stream: int) -> float:
    """float64 in [0, 1): the recovered (stream 1) or bonus (stream 2) token's inverse-CDF draw,
    index 0, words 0 and 1, same formula as the acceptance uniforms."""
    w0, w1, _, _ = draw(seed, offset, np.arange(1), stream)
    a = float((w0 >> np.uint64(5))[0])
    b = float((w1 >> np.uint64(6))[0])
    return (a * 67108864.0 + b) / 9007199254740992.0
