// CUDA kernels for paged_attention: being written.
