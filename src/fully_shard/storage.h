#pragma once
// Freeing and re-allocating a tensor's storage in place. FSDP frees unsharded parameters between uses but
// must keep the *same* StorageImpl: autograd may have saved views of a parameter during forward, and those
// views must see the re-gathered data in backward. Resizing the storage's bytes (Python FSDP2's
// storage.resize_(0)) keeps every alias valid. Device-generic: the storage's own allocator is used.

#include <ATen/core/Tensor.h>

namespace fsdp::detail {

// Drops the bytes of `tensor`'s storage (all aliases see an empty storage until re-allocated).
void free_storage(const at::Tensor& tensor);
// Re-allocates `tensor`'s storage to hold exactly its own elements (contents undefined).
void alloc_storage(const at::Tensor& tensor);
bool storage_is_allocated(const at::Tensor& tensor);

}  // namespace fsdp::detail
