// The reference of ft_trainer_test.py: fsdp-train's training replayed in one process, without fully_shard, without
// process groups and without fsdp::ft, given the membership of every step — what a fault-tolerant run of
// fault_tolerance.group_size replica groups must compute under its documented data rule (docs/reliability.md):
//   * replica group r's batch of step t is its share of global batch t (data rank r of group_size, the union of its
//     ranks' samples), whether or not r takes part in step t — an absent group's batch is skipped, nobody reads it;
//   * the gradient of step t is the mean over the step's members of each member's mean-token-loss gradient (plus,
//     for an MoE model with the sequence aux loss, its mean over the member's sequences), and the logged loss the
//     mean of their losses;
//   * then clipping (training.max_norm over the whole gradient), for MoE models the load-balancing bias update on the
//     expert counts of the members' batches, and the optimizer step, as fsdp-train.
// The model, tokenizer, data stream, schedule and optimizer come from fsdp-train's own building blocks (each checked
// against PyTorch elsewhere); what is under test — sharding, the quorum, the cross-group average, the commit vote
// and healing — is not here. The model is model.name's family built through the trainer's model seam
// (model_spec.h: train_spec(name).build, unsharded, on the CPU), so every registered family replays; its MoE layers,
// whatever block holds them, are found by type (moe_layers), as the trainer finds them.
//
//   ft_trainer_reference MEMBERSHIP OUT -- <fsdp-train arguments of the run, [fault_tolerance] included>
// MEMBERSHIP: one line per step, "<step> <id>,<id>,..." (steps 1..N in order); OUT: one line per step, "<step> <loss>".
#include "config.h"
#include "data.h"
#include "lr_schedule.h"
#include "model_spec.h"
#include "moe_balance.h"
#include "parallel_dims.h"
#include "tokenizer.h"

#include <fsdp/models/moe.h>

#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

using namespace fsdp_train;

int main(int argc, char** argv) {
  if (argc < 4 || std::string(argv[3]) != "--") {
    std::cerr << "usage: ft_trainer_reference MEMBERSHIP OUT -- <fsdp-train arguments>\n";
    return 2;
  }
  try {
    const JobConfig config = load_config(std::vector<std::string>(argv + 4, argv + argc));
    TORCH_CHECK(config.fault_tolerance.enable, "the run's arguments must enable [fault_tolerance]");
    // The group's size in ranks: the world of each replica job, data_parallel_shard_degree x tensor_parallel_degree
    // x pipeline_parallel_degree x context_parallel_degree (a replica group may be any of these layouts); its data
    // share is that of its data-parallel ranks.
    const int64_t dp_shard = config.parallelism.data_parallel_shard_degree;
    TORCH_CHECK(dp_shard >= 1, "pass --parallelism.data_parallel_shard_degree (the data-parallel ranks of one group)");
    const ParallelDims dims = resolve_parallelism(
        config, dp_shard * config.parallelism.tensor_parallel_degree * config.parallelism.pipeline_parallel_degree *
                    config.parallelism.context_parallel_degree);
    const int64_t groups = dims.ft_groups, A = dims.grad_accum_steps;

    std::vector<std::vector<int>> members;
    {
      std::ifstream in(argv[1]);
      TORCH_CHECK(in, "cannot read ", argv[1]);
      int64_t step = 0;
      std::string ids;
      while (in >> step >> ids) {
        TORCH_CHECK(step == static_cast<int64_t>(members.size()) + 1, argv[1], ": expected step ", members.size() + 1,
                    ", got ", step);
        members.emplace_back();
        std::stringstream ss(ids);
        for (std::string id; std::getline(ss, id, ',');) members.back().push_back(std::stoi(id));
      }
    }

    torch::set_num_threads(1);
    torch::manual_seed(static_cast<uint64_t>(config.debug.seed));
    auto tokenizer = make_tokenizer(config.model.tokenizer_path);
    const auto files = resolve_dataset_files(config.training.dataset, config.training.dataset_path);
    // The shape fsdp-train gives its model (Trainer::build_data): the tokenizer's vocabulary (and EOS under
    // block_causal), the run's sequence length; here whole, on the CPU, initialised unsharded from the seed.
    ModelShape shape;
    shape.vocab_size = tokenizer->vocab_size();
    shape.max_seq_len = config.training.seq_len;
    if (config.model.attn_mask_type == AttnMaskType::BlockCausal) {
      TORCH_CHECK(tokenizer->eos_id(), "model.attn_mask_type = \"block_causal\" needs a tokenizer with an EOS");
      shape.eos_id = static_cast<int64_t>(*tokenizer->eos_id());
    }
    TrainModel model = train_spec(config.model.name).build(config, shape);
    model.init_weights(static_cast<uint64_t>(config.debug.seed), {});

    // Group g's share of every global batch: its data-parallel ranks' samples, in their order (data ranks
    // g*dp .. g*dp+dp-1).
    std::vector<std::unique_ptr<DataLoader>> loaders;
    const TextOptions text{config.training.dataset_text_field, config.training.bad_records == BadRecords::Skip, false};
    for (int64_t g = 0; g < groups; ++g)
      loaders.push_back(std::make_unique<DataLoader>(
          files, tokenizer, shape.vocab_size,
          LoaderOptions{config.training.seq_len, dims.local_batch_size * dims.dp_degree(), A, g, groups}, text));

    const auto& o = config.optimizer;
    auto params = model.module->parameters();
    torch::optim::AdamW optimizer(
        params, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
    const auto& s = config.lr_scheduler;
    const double* decay_ratio = s.decay_ratio ? &*s.decay_ratio : nullptr;
    const LRSchedule schedule =
        LRSchedule::build(config.training.steps, s.warmup_steps, decay_ratio, s.decay_type, s.min_lr_factor);

    const auto moe_blocks = moe_layers(*model.module);
    const double group_batch = static_cast<double>(dims.global_batch_size / groups);
    std::ofstream out(argv[2]);
    for (size_t i = 0; i < members.size(); ++i) {
      const int64_t step = static_cast<int64_t>(i) + 1;
      const double lr = o.lr * schedule.factor(step - 1);
      for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
      optimizer.zero_grad();
      const double n = static_cast<double>(members[i].size());
      double loss = 0;
      for (int g : members[i]) {
        TORCH_CHECK(g >= 0 && g < groups, "step ", step, ": replica ", g, " is not one of ", groups);
        loaders[g]->seek_step(step - 1);
        std::vector<Batch> batches;
        int64_t tokens = 0;
        for (int64_t m = 0; m < A; ++m) {
          batches.push_back(loaders[g]->next());
          for (int64_t l : batches.back().labels) tokens += l != -100;
        }
        for (auto& b : batches) {
          auto inputs = torch::from_blob(b.inputs.data(), {b.batch, b.seq_len}, torch::kLong);
          auto labels = torch::from_blob(b.labels.data(), {b.batch * b.seq_len}, torch::kLong);
          auto logits = model.forward(inputs);
          auto sum = torch::nn::functional::cross_entropy(
              logits.reshape({-1, logits.size(-1)}).to(torch::kFloat), labels,
              torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(-100));
          torch::Tensor step_loss = sum / static_cast<double>(tokens) / n;
          // The MoE sequence balance loss (model.moe_sequence_aux_loss_coeff): each layer's mean over the
          // microbatch's sequences, weighted by its share of the group's batch, averaged over the members like the
          // rest: the mean over every member's sequences.
          for (auto* moe : moe_blocks)
            if (moe->aux_loss().defined())
              step_loss = step_loss + moe->aux_loss() * (static_cast<double>(b.batch) / group_batch / n);
          step_loss.backward();
          loss += sum.item<double>() / static_cast<double>(tokens) / n;
        }
      }
      torch::nn::utils::clip_grad_norm_(params, config.training.max_norm);
      // MoE: the load-balancing bias moves on the expert counts of every member's batch (a no-op for dense models).
      update_expert_load_balance(moe_blocks, nullptr);
      optimizer.step();
      char line[64];
      std::snprintf(line, sizeof line, "%lld %.17g\n", static_cast<long long>(step), loss);
      out << line;
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ft_trainer_reference: " << e.what() << "\n";
    return 1;
  }
}
