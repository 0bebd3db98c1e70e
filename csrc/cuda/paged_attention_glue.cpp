// CUDA glue for paged_attention: being written.
#include <torch/library.h>
