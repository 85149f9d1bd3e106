#pragma once
// RNG stash for activation checkpointing: forward and recomputation must draw the same random numbers (dropout
// masks), and the recomputation must not move the generators the rest of the program sees.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <utility>
#include <vector>

namespace fsdp::detail {

class RngStash {
 public:
  RngStash() = default;
  // The CPU generator, plus the default generator of `device` when it is not the CPU (like PyTorch: one device
  // type, the one the region's tensors live on).
  static RngStash capture(const std::optional<c10::Device>& device);
  void apply() const;
  bool empty() const { return states_.empty(); }

 private:
  std::vector<std::pair<at::Generator, at::Tensor>> states_;
  std::optional<c10::Device> device_;
};

// torch.random.fork_rng: sets the stashed states for its lifetime, then puts back the states it found.
class RngFork {
 public:
  RngFork(const RngStash& stash, const std::optional<c10::Device>& device);
  ~RngFork();
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngStash outside_;
  bool active_ = false;
};

}  // namespace fsdp::detail
