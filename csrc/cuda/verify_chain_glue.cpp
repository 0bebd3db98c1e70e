// CUDA glue for verify_chain: being written.
#include <torch/library.h>
