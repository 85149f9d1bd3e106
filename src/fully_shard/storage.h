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

// Makes `tensor` (same TensorImpl, autograd metadata kept) show `data`, also from `meta` to a real device,
// which Tensor::set_data refuses as an "incompatible tensor type" (Python's to_empty swaps the Parameter
// object instead; here optimizers and modules hold the TensorImpl, so it must stay). Only for tensors that
// are not part of any autograd graph yet.
void replace_data(const at::Tensor& tensor, const at::Tensor& data);

}  // namespace fsdp::detail
