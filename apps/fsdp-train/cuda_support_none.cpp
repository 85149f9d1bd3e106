// cuda_support.h on a CPU build of libtorch: nothing to ask. validate() refuses the CUDA memory snapshot on such
// a build, and training.device = "cuda" stops at start (CUDA is not available), so these are not reached.
#include "cuda_support.h"

#include <c10/util/Exception.h>

namespace fsdp_train::cuda_support {

bool compiled() { return false; }
std::string device_name(int) { return ""; }
int64_t device_total_bytes(int) { return 0; }

void record_memory_history(bool, size_t) {
  TORCH_CHECK(false, "fsdp-train: the CUDA memory snapshot needs a CUDA build of libtorch");
}

std::string memory_snapshot_pickle() {
  TORCH_CHECK(false, "fsdp-train: the CUDA memory snapshot needs a CUDA build of libtorch");
}

}  // namespace fsdp_train::cuda_support
