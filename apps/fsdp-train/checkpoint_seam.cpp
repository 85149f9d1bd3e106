// See checkpoint_seam.h.
#include "checkpoint_seam.h"

#include "config.h"

#include <iostream>

namespace fsdp_train {
namespace {

class NotImplementedCheckpointer final : public Checkpointer {
 public:
  NotImplementedCheckpointer(bool enabled, int rank) : enabled_(enabled), rank_(rank) {}
  bool load(TrainState&) override {
    if (enabled_ && rank_ == 0)
      std::cout << "checkpoint.enable = true, but checkpointing is not implemented yet (a later issue): training "
                   "starts from scratch and nothing is saved"
                << std::endl;
    return false;
  }
  void maybe_save(TrainState&, bool) override {}

 private:
  bool enabled_;
  int rank_;
};

}  // namespace

std::unique_ptr<Checkpointer> make_checkpointer(const JobConfig& config, int rank) {
  return std::make_unique<NotImplementedCheckpointer>(config.checkpoint.enable, rank);
}

}  // namespace fsdp_train
