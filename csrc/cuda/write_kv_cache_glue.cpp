// CUDA glue for write_kv_cache: being written.
#include <torch/library.h>
