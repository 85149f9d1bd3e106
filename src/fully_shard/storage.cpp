#include "fully_shard/storage.h"

#include <c10/core/StorageImpl.h>

namespace fsdp::detail {

void free_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == 0) return;
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

void alloc_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  TORCH_CHECK(tensor.storage_offset() == 0 && tensor.is_contiguous(),
              "fsdp internal: alloc_storage expects a contiguous tensor that owns its storage");
  if (storage->nbytes() == nbytes) return;
  TORCH_CHECK(storage->nbytes() == 0, "fsdp internal: re-allocating a storage that is still allocated (",
              storage->nbytes(), " bytes, want ", nbytes, ")");
  at::Allocator* allocator = storage->allocator();
  TORCH_CHECK(allocator != nullptr, "fsdp internal: storage on ", storage->device(), " has no allocator");
  storage->set_data_ptr_noswap(allocator->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

void replace_data(const at::Tensor& tensor, const at::Tensor& data) {
  if (!tensor.is_meta()) {
    tensor.set_data(data);
    return;
  }
  TORCH_CHECK(tensor.dtype() == data.dtype(), "fsdp internal: replace_data changes dtype");
  // A meta tensor was never used in a graph (no grad accumulator to reset): swapping its metadata and
  // storage is what set_data does after its type check.
  tensor.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
}

}  // namespace fsdp::detail
