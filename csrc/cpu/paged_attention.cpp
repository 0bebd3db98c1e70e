// CPU implementation of paged_attention: being written.
#include <torch/library.h>
