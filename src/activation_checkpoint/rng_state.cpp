#include "activation_checkpoint/rng_state.h"

#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

namespace fsdp::detail {
namespace {
at::Generator default_generator(const c10::Device& device) {
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(device);
}
}  // namespace

RngStash RngStash::capture(const std::optional<c10::Device>& device) {
  RngStash stash;
  stash.device_ = device;
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  if (device && !device->is_cpu()) devices.push_back(*device);
  for (const auto& d : devices) {
    at::Generator gen = default_generator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    stash.states_.emplace_back(gen, gen.get_state());
  }
  return stash;
}

void RngStash::apply() const {
  for (const auto& [gen, state] : states_) {
    at::Generator g = gen;
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  }
}

RngFork::RngFork(const RngStash& stash, const std::optional<c10::Device>& device) {
  if (stash.empty()) return;
  outside_ = RngStash::capture(device);
  active_ = true;
  stash.apply();
}

RngFork::~RngFork() {
  if (!active_) return;
  try {
    outside_.apply();
  } catch (...) {
    // Destructors must not throw; the generator keeps the recomputation's state.
  }
}

}  // namespace fsdp::detail
