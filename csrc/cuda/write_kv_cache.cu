// CUDA kernels for write_kv_cache: being written.
