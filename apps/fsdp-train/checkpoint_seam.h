#pragma once
// The checkpoint seam of the training loop: the loop calls load() once before the first step and maybe_save()
// after every step (TorchTitan's points). The implementation (checkpoint_seam.cpp) uses libfsdp's distributed
// checkpoints (include/fsdp/checkpoint/) with TorchTitan's [checkpoint] keys and layout:
//   <dump_folder>/<folder>/step-N/   model keys (no prefix), optimizer.state.<fqn>.*, optimizer.param_groups.<fqn>.*,
//                                    train_state.step, train_state.ntokens_seen, lr_scheduler.last_epoch,
//                                    dataloader.dp_rank_<r>, dataloader.world_size, rng.cpu
// Resuming on another number of data-parallel ranks is supported (model/optimizer resharded; the data loader
// repositioned at the same global sample, provided the global batch size is unchanged).

#include <fsdp/process_group.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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
  torch::nn::Module* model = nullptr;  // the whole model (under PP: with other ranks' stages on `meta`)
  // What this rank trains and checkpoints: {model}, or under PP its stages (they keep the whole model's FQNs).
  std::vector<torch::nn::Module*> parts;
  torch::optim::Optimizer* optimizer = nullptr;
  DataLoader* data = nullptr;
  int64_t ntokens_seen = 0;  // global tokens consumed
};

class Checkpointer {
 public:
  virtual ~Checkpointer() = default;
  // Before the first step: restore `state` (and state.step) when a checkpoint exists. Returns true if it did.
  virtual bool load(TrainState& state) = 0;
  // After every step; decides itself whether this step is saved (interval, last step). Raises the error of a
  // failed background save of an earlier step.
  virtual void maybe_save(TrainState& state, bool last_step) = 0;
  // Before the optimizer step (the first change of the saved tensors after a save started): waits until an
  // async save's snapshot, taken in the background, is complete. The stall of an async save is this wait.
  virtual void before_optimizer_step() = 0;
  // Waits for a background save and purge (also done by the destructor, which only logs errors).
  virtual void wait() = 0;
};

// `group`: the job's world group (null for a single process without collectives); `rank` its rank.
std::unique_ptr<Checkpointer> make_checkpointer(const JobConfig& config, int rank, fsdp::ProcessGroupPtr group);

}  // namespace fsdp_train
