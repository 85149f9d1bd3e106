#pragma once
// The checkpoint seam of the training loop. Checkpointing is a later issue; the loop already calls these hooks
// at TorchTitan's points (load once before the first step, save after each step), so the checkpoint work only
// has to provide a Checkpointer. State that must round-trip: model and optimizer (torch), the data loader's
// position (DataLoader::state(), JSON), the step and the RNG seed. The LR schedule is a pure function of the step.

#include <cstdint>
#include <memory>
#include <string>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace fsdp_train {

class DataLoader;
struct JobConfig;

// What a checkpoint holds, by reference into the running job.
struct TrainState {
  int64_t step = 0;  // optimizer steps completed
  torch::nn::Module* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  DataLoader* data = nullptr;
};

class Checkpointer {
 public:
  virtual ~Checkpointer() = default;
  // Before the first step: restore `state` (and state.step) when a checkpoint exists. Returns true if it did.
  virtual bool load(TrainState& state) = 0;
  // After every step; decides itself whether this step is saved (interval, last step).
  virtual void maybe_save(TrainState& state, bool last_step) = 0;
};

// The current implementation: says once, plainly, that checkpointing is not implemented when it is enabled.
std::unique_ptr<Checkpointer> make_checkpointer(const JobConfig& config, int rank);

}  // namespace fsdp_train
