// CUDA kernels for verify_chain: being written.
