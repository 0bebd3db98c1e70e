// CPU implementation of verify_chain: being written.
#include <torch/library.h>
