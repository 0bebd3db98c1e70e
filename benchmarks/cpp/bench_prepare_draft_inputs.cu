// Microbenchmark of the one-launch draft step (launch_prepare_draft_inputs), torch-free.
// Uniform decode batches: B requests x (K+1) target rows, random accepted counts, bf16 hidden
// rows of size H. Prints µs per step (eager and CUDA graph), GB/s on the hidden bytes
// (T_in*H*2 read + T_out*H*2 written) and % of the copy ceiling measured in the same run.
//
//   bench_prepare_draft_inputs [K=7]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_common.h"
#include "peagle/kernels/prepare_draft_inputs.h"

namespace {

template <typename T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  BENCH_CHECK(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)));
  if (!v.empty()) BENCH_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
T* device_buffer(size_t n) {
  T* d = nullptr;
  BENCH_CHECK(cudaMalloc(&d, std::max<size_t>(n, 1) * sizeof(T)));
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  const int k = argc > 1 ? std::atoi(argv[1]) : 7;
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  const double ceiling = bench::copy_ceiling_gbps(stream);
  std::printf("copy ceiling %.0f GB/s, K=%d, bf16\n", ceiling, k);
  std::printf("%6s %6s %10s %10s %10s %8s\n", "H", "B", "graph_us", "eager_us", "GB/s", "%ceil");
  bench::Rng rng(2026);
  for (int h : {2880, 4096}) {
    for (int b : {1, 8, 64, 256}) {
      const int block_size = 16, vocab = 201088;
      const int64_t t_in = int64_t(b) * (k + 1), t_out = t_in + int64_t(b) * (k - 1);
      std::vector<int32_t> ids(t_in), qsl(b + 1), seq(b), sampled(size_t(b) * (k + 1)), cu(b);
      std::vector<int64_t> pos(t_in);
      std::vector<uint8_t> discard(b, 0);
      std::vector<int32_t> backup(b);
      const int width = 512;
      std::vector<int32_t> table(size_t(b) * width);
      for (int r = 0; r < b; ++r) {
        const int p0 = rng.uniform(0, 4000);
        qsl[r] = r * (k + 1);
        seq[r] = p0 + k + 1;
        cu[r] = (r + 1) * k;
        backup[r] = rng.uniform(0, vocab - 1);
        const int valid = rng.uniform(1, k + 1);
        for (int c = 0; c <= k; ++c) sampled[size_t(r) * (k + 1) + c] = c < valid ? rng.uniform(0, vocab - 1) : -1;
        for (int j = 0; j <= k; ++j) {
          ids[qsl[r] + j] = rng.uniform(0, vocab - 1);
          pos[qsl[r] + j] = p0 + j;
        }
        for (int c = 0; c < width; ++c) table[size_t(r) * width + c] = r * width + c;
      }
      qsl[b] = int32_t(t_in);
      std::vector<uint16_t> hidden(size_t(t_in) * h), mask(h);
      for (auto& x : hidden) x = uint16_t(0x3c00 + rng.uniform(0, 255));
      for (auto& x : mask) x = uint16_t(0x3c00 + rng.uniform(0, 255));

      peagle::PrepareDraftInputsParams p;
      p.target_token_ids = to_device(ids);
      p.target_positions = to_device(pos);
      p.query_start_loc = to_device(qsl);
      p.seq_lens = to_device(seq);
      p.sampled_token_ids = to_device(sampled);
      p.sampled_stride = k + 1;
      p.num_sampled_cols = k + 1;
      p.discard_request_mask = reinterpret_cast<const bool*>(to_device(discard));
      p.backup_next_token_ids = to_device(backup);
      p.cu_num_draft_tokens = to_device(cu);
      p.block_table = to_device(table);
      p.block_table_stride = width;
      p.max_blocks_per_seq = width;
      p.target_hidden = reinterpret_cast<const char*>(to_device(hidden));
      p.target_hidden_stride = int64_t(h) * 2;
      p.mask_hidden = reinterpret_cast<const char*>(to_device(mask));
      p.hidden_row_bytes = int64_t(h) * 2;
      p.hidden_states = reinterpret_cast<char*>(device_buffer<uint16_t>(size_t(t_out) * h));
      p.hidden_stride = int64_t(h) * 2;
      p.num_reqs = b;
      p.num_target_tokens = t_in;
      p.num_out_rows = t_out;
      p.num_slots = k;
      p.shift = 1;
      p.mask_token_id = vocab - 1;
      p.padding_token_id = 0;
      p.block_size = block_size;
      p.max_model_len = 1 << 20;
      p.vocab_size = vocab;
      p.input_ids = device_buffer<int32_t>(t_out);
      p.positions = device_buffer<int64_t>(t_out);
      p.is_rejected = device_buffer<bool>(t_out);
      p.is_masked = device_buffer<bool>(t_out);
      p.slot_mapping = device_buffer<int64_t>(t_out);
      p.token_indices_to_sample = device_buffer<int32_t>(size_t(b) * k);
      p.new_query_start_loc = device_buffer<int32_t>(b + 1);
      p.new_seq_lens = device_buffer<int32_t>(b);
      p.next_token_ids = device_buffer<int32_t>(b);
      p.valid_sampled_tokens_count = device_buffer<int32_t>(b);

      auto step = [&](int) { BENCH_CHECK(peagle::launch_prepare_draft_inputs(p, stream)); };
      const double eager = bench::time_eager(step, stream);
      const double graph = bench::time_graph(step, stream);
      const double bytes = double(t_in + t_out) * h * 2;
      const double gbps = bytes / (graph * 1e-6) / 1e9;
      std::printf("%6d %6d %10.2f %10.2f %10.0f %7.1f%%\n", h, b, graph, eager, gbps,
                  100.0 * gbps / ceiling);
      for (const void* ptr :
           {static_cast<const void*>(p.target_token_ids), static_cast<const void*>(p.target_positions),
            static_cast<const void*>(p.query_start_loc), static_cast<const void*>(p.seq_lens),
            static_cast<const void*>(p.sampled_token_ids), static_cast<const void*>(p.discard_request_mask),
            static_cast<const void*>(p.backup_next_token_ids), static_cast<const void*>(p.cu_num_draft_tokens),
            static_cast<const void*>(p.block_table), static_cast<const void*>(p.target_hidden),
            static_cast<const void*>(p.mask_hidden), static_cast<const void*>(p.hidden_states),
            static_cast<const void*>(p.input_ids), static_cast<const void*>(p.positions),
            static_cast<const void*>(p.is_rejected), static_cast<const void*>(p.is_masked),
            static_cast<const void*>(p.slot_mapping), static_cast<const void*>(p.token_indices_to_sample),
            static_cast<const void*>(p.new_query_start_loc), static_cast<const void*>(p.new_seq_lens),
            static_cast<const void*>(p.next_token_ids), static_cast<const void*>(p.valid_sampled_tokens_count)})
        BENCH_CHECK(cudaFree(const_cast<void*>(ptr)));
    }
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}
