// Host-only check (no GPU needed) of the wgmma operand descriptors of csrc/cuda/paged_attention.cu
// against CuTe: the kernel's shared-memory K/V tiles (tile_offset) must be exactly CuTe's canonical
// 128-byte-swizzle GMMA layouts (K-major for K, MN-major for V), and the descriptors the kernel
// builds for every k16 step (k_operand_desc / v_operand_desc) must carry the start offset, leading
// and stride byte offsets and swizzle mode that CuTe's make_gmma_desc derives for those layouts.
//
//   nvcc -std=c++17 -I csrc/include -I csrc/cuda -I <cutlass>/include \
//        tools/check_paged_attention_gmma.cu -o /tmp/check_gmma && /tmp/check_gmma
//
// (<cutlass>/include: e.g. the nvidia-cutlass wheel's cutlass_library/source/include.) On the host
// CuTe cannot translate a shared-memory pointer, so its descriptors carry start address 0 and
// the check compares start offsets through the addresses of the slices' first elements instead.
// check_moved_tiles compares the kernel's descriptors with the descriptor built field by field
// from the summed address (masked, shifted, or-ed) for every 1024-byte-aligned tile in the 228 KB
// shared-memory window, also with bits set above it (a cluster CTA's rank: such an address must
// reach the descriptor masked), in both of the kernel's forms (k/v_operand_desc<kRows, kStep>).
// A rewrite of the descriptor arithmetic must keep this check green.
#include <cstdint>
#include <cstdio>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "paged_attention_device.cuh"
#include "paged_attention_wgmma.cuh"

using namespace cute;
using Elem = cutlass::bfloat16_t;

namespace {

constexpr uint64_t kStartMask = 0x3FFF;  // descriptor bits 0-13: start address >> 4

int report(const char* what, int n_rows, int d, int bad) {
  std::printf("%s tile [%d x %d]: %s\n", what, n_rows, d, bad ? "MISMATCH" : "ok");
  return bad;
}

// K tile [kRows keys, D]: B operand of S = Q K^T, K-major (N = keys, K = head dim).
template <int kRows, int D>
int check_k_tile() {
  alignas(1024) static Elem buf[kRows * D];
  // CuTe's atom: 8 rows x 64 elements; tile_to_shape fills rows first, then 64-column panels.
  auto layout = tile_to_shape(SM90::GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<kRows>, Int<D>>{});
  auto tensor = make_tensor(make_smem_ptr(buf), layout);
  const char* base = reinterpret_cast<const char*>(buf);
  int bad = 0;
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < D; ++c) {
      const auto addr = reinterpret_cast<const char*>(&tensor(r, c)) - base;
      bad += addr != peagle::attn::tile_offset<kRows>(r, c / 8) + (c % 8) * 2;
    }
  }
  for (int kk = 0; kk < D / 16; ++kk) {
    auto slice = local_tile(tensor, Shape<Int<kRows>, _16>{}, make_coord(0, kk));
    const uint64_t cute_desc = SM90::GMMA::make_gmma_desc<SM90::GMMA::Major::K>(slice).desc_;
    const uint64_t mine = peagle::attn::k_operand_desc<kRows>(0, kk);
    const auto start = reinterpret_cast<const char*>(&slice(0, 0)) - base;
    bad += (mine & ~kStartMask) != (cute_desc & ~kStartMask);
    bad += static_cast<int64_t>((mine & kStartMask) << 4) != start;
  }
  return report("K (K-major)", kRows, D, bad);
}

// V tile [kRows keys, D]: B operand of O += P V, MN-major (N = head dim, K = keys).
template <int kRows, int D>
int check_v_tile() {
  alignas(1024) static Elem buf[kRows * D];
  // CuTe's atom: 64 MN elements x 8 K rows; K (keys) tiled first, then 64-column MN panels.
  auto layout = tile_to_shape(SM90::GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<Int<D>, Int<kRows>>{},
                              Step<_2, _1>{});
  auto tensor = make_tensor(make_smem_ptr(buf), layout);
  const char* base = reinterpret_cast<const char*>(buf);
  int bad = 0;
  for (int key = 0; key < kRows; ++key) {
    for (int c = 0; c < D; ++c) {
      const auto addr = reinterpret_cast<const char*>(&tensor(c, key)) - base;
      bad += addr != peagle::attn::tile_offset<kRows>(key, c / 8) + (c % 8) * 2;
    }
  }
  // With a single 64-column panel (D == 64) the leading byte offset is unused (CuTe writes 0).
  const uint64_t lbo_mask = D == 64 ? (uint64_t{0x3FFF} << 16) : 0;
  for (int kk = 0; kk < kRows / 16; ++kk) {
    auto slice = local_tile(tensor, Shape<Int<D>, _16>{}, make_coord(0, kk));
    const uint64_t cute_desc = SM90::GMMA::make_gmma_desc<SM90::GMMA::Major::MN>(slice).desc_;
    const uint64_t mine = peagle::attn::v_operand_desc<kRows>(0, kk);
    const auto start = reinterpret_cast<const char*>(&slice(0, 0)) - base;
    bad += (mine & ~(kStartMask | lbo_mask)) != (cute_desc & ~(kStartMask | lbo_mask));
    bad += static_cast<int64_t>((mine & kStartMask) << 4) != start;
  }
  return report("V (MN-major)", kRows, D, bad);
}

// The PTX ISA descriptor of a 128-byte-swizzle operand at shared-memory byte address `addr`,
// field by field, written independently of the kernel's header.
uint64_t desc_by_fields(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t{1} << 62);
}

// The K/Q and V descriptors of every k16 step of a [kRows, D] tile at shared-memory address
// `base`, in both forms (step: head_dim 64; summed: head_dim 128): mismatches against the
// field-by-field form of the summed address.
template <int kRows, int D>
int check_tile_at(uint32_t base) {
  int bad = 0;
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t k_addr = base + (kk >> 2) * (kRows * 128) + (kk & 3) * 32;
    const uint64_t want = desc_by_fields(k_addr, 16, 1024);
    bad += peagle::attn::k_operand_desc<kRows, true>(base, kk) != want;
    bad += peagle::attn::k_operand_desc<kRows, false>(base, kk) != want;
  }
  for (int kk = 0; kk < kRows / 16; ++kk) {
    const uint64_t want = desc_by_fields(base + kk * 16 * 128, kRows * 128, 1024);
    bad += peagle::attn::v_operand_desc<kRows, true>(base, kk) != want;
    bad += peagle::attn::v_operand_desc<kRows, false>(base, kk) != want;
  }
  return bad;
}

// Every k16 step of a [kRows, D] tile at every 1024-byte-aligned base below 228 KB (the kernel's
// K/V stages and Q tiles; the Q tile's second warpgroup starts 8 KB in): the kernel's descriptor
// equals the field-by-field one of the summed address, for K-major (K and Q) and MN-major (V).
// The bases also carry bits above the 256 KB window: a CTA of a cluster launch has its rank there
// (a descriptor built without the mask read other rows of shared memory in those CTAs only).
template <int kRows, int D>
int check_moved_tiles() {
  int bad = 0;
  const uint32_t high_bits[] = {0u, 1u << 18, 1u << 24, 3u << 24, 15u << 24, 0xFFFC0000u};
  for (const uint32_t hi : high_bits) {
    for (uint32_t low = 0; low < 228u * 1024u; low += 1024u) {
      bad += check_tile_at<kRows, D>(hi | low);
    }
  }
  return report("K/Q and V descriptors at every base", kRows, D, bad);
}

}  // namespace

int main() {
  // Every (kBlockN, head_dim) the kernel instantiates.
  // Q tiles (A operand, K-major): [kBlockM = 64 / 128 rows, D].
  const int bad = check_k_tile<64, 64>() + check_k_tile<64, 128>() + check_k_tile<32, 128>() +
                  check_k_tile<128, 64>() + check_k_tile<128, 128>() + check_v_tile<64, 64>() +
                  check_v_tile<64, 128>() + check_v_tile<32, 128>() + check_moved_tiles<32, 128>() +
                  check_moved_tiles<64, 64>() + check_moved_tiles<64, 128>() +
                  check_moved_tiles<128, 64>() + check_moved_tiles<128, 128>();
  std::printf("%s\n", bad ? "FAILED" : "all descriptors match CuTe");
  return bad ? 1 : 0;
}
