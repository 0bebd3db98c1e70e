// Philox4x32-10 counter-based random numbers (Salmon, Moraes, Dror, Shaw: "Parallel Random
// Numbers: As Easy as 1, 2, 3", SC'11; the Random123 library) and the draws verify_chain makes
// from it. Torch-free and usable on host and device (PEAGLE_HD), so the CPU op and the CUDA
// kernels produce bit-identical words; tests/reference/philox.py is an independent Python
// implementation checked against Random123's known-answer vectors.
//
// Counter layout used by peagle (SPEC §6.6; normative text in SPEC §6.9):
//   key     = (lo32(seed), hi32(seed))
//   counter = (lo32(offset), hi32(offset), index, stream)
// A request's draws depend only on its (seed, offset) and the (index, stream) of the draw.
#pragma once
#include <cmath>
#include <cstdint>

#include "peagle/common.h"

namespace peagle {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;  // multipliers
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // Weyl key increments (golden ratio, sqrt(3) - 1)
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

// Streams of verify_chain's draws (the fourth counter word).
constexpr uint32_t kStreamAccept = 0;     // acceptance uniforms, index = draft position j
constexpr uint32_t kStreamRecovered = 1;  // the recovered token's sampling uniform, index 0
constexpr uint32_t kStreamBonus = 2;      // the bonus token's sampling uniform, index 0

struct Philox4 {
  uint32_t x[4];
};

PEAGLE_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
#if defined(__CUDA_ARCH__)
  *lo = a * b;
  *hi = __umulhi(a, b);
#else
  const uint64_t prod = static_cast<uint64_t>(a) * b;
  *lo = static_cast<uint32_t>(prod);
  *hi = static_cast<uint32_t>(prod >> 32);
#endif
}

// Ten rounds of Philox4x32 on counter (c0..c3) with key (k0, k1).
PEAGLE_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kPhiloxM0, c0, &hi0, &lo0);
    philox_mulhilo(kPhiloxM1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  Philox4 out;
  out.x[0] = c0;
  out.x[1] = c1;
  out.x[2] = c2;
  out.x[3] = c3;
  return out;
}

// The four words for (seed, offset, index, stream) in peagle's layout.
PEAGLE_HD Philox4 philox_draw(int64_t seed, int64_t offset, uint32_t index, uint32_t stream) {
  const uint64_t s = static_cast<uint64_t>(seed), o = static_cast<uint64_t>(offset);
  return philox4x32_10(static_cast<uint32_t>(o), static_cast<uint32_t>(o >> 32), index, stream,
                       static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
}

// 53-bit uniform in [0, 1) from two words: ((w0 >> 5) * 2^26 + (w1 >> 6)) / 2^53 (exact in fp64).
PEAGLE_HD double uniform53(uint32_t w0, uint32_t w1) {
  return (static_cast<double>(w0 >> 5) * 67108864.0 + static_cast<double>(w1 >> 6)) /
         9007199254740992.0;
}

// Acceptance draw of draft position j (stream 0, words 0 and 1).
PEAGLE_HD double acceptance_uniform(int64_t seed, int64_t offset, uint32_t j) {
  const Philox4 w = philox_draw(seed, offset, j, kStreamAccept);
  return uniform53(w.x[0], w.x[1]);
}

// Sampling draw of the recovered token (stream 1) or the bonus token (stream 2): index 0, words 0
// and 1. The token is found by inverse-CDF sampling with it (kernels/verify_chain.h).
PEAGLE_HD double sampling_uniform(int64_t seed, int64_t offset, uint32_t stream) {
  const Philox4 w = philox_draw(seed, offset, 0u, stream);
  return uniform53(w.x[0], w.x[1]);
}

}  // namespace peagle
