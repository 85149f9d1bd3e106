// One optimizer step of the Trainer (trainer_parts.h): the step's batches (cut for context parallelism), forward
// and backward through the model or the pipeline, the MoE balance loss, gradient clipping, the fault-tolerant
// vote, the expert-load update and the optimizer step; the timeouts and profiled groups the step runs under.
#include "tensor_memory.h"
#include "trainer_parts.h"

#include <fsdp/clip_grad.h>
#include <fsdp/context_parallel.h>
#include <fsdp/models/moe.h>  // the MoE layer (any family): its aux loss
#include <fsdp/util/timer.h>

#include <torch/torch.h>

#include <chrono>

namespace fsdp_train {

std::vector<double> all_reduce(const fsdp::ProcessGroupPtr& group, std::vector<double> values, fsdp::ReduceOp op) {
  if (!group) return values;
  auto t = torch::tensor(values, torch::kDouble).to(group->device());
  group->all_reduce(t, op).wait();
  t = t.cpu();
  auto* p = t.data_ptr<double>();
  return std::vector<double>(p, p + values.size());
}

torch::Tensor Trainer::document_ids_of(const torch::Tensor& tokens) const {
  return step_.model.document_ids ? step_.model.document_ids(tokens) : torch::Tensor();
}

double Trainer::forward_backward(std::vector<Batch>& batches, double global_tokens, TrainSummary::TensorMemory& tmem,
                                 double& aux_sum) {
  double local_loss_sum = 0;
  const bool aux_on = config_.model.moe_sequence_aux_loss_coeff > 0 && !step_.moe_blocks.empty();
  for (auto& b : batches) {
    // The host batch onto the training device (no copy on the CPU).
    auto inputs = torch::from_blob(b.inputs.data(), {b.batch, b.seq_len}, torch::kLong).to(device_);
    if (step_.pipeline) {
      // The first stage takes the tokens, the last the labels; each rank runs its part of the schedule.
      step_.pipeline_global_tokens = global_tokens;
      auto labels = torch::from_blob(b.labels.data(), {b.batch, b.seq_len}, torch::kLong).to(device_);
      // Under CP the rows are this rank's chunks already, and so are their document ids (cut from the whole rows).
      const torch::Tensor ids =
          b.document_ids.empty()
              ? document_ids_of(inputs)
              : torch::from_blob(b.document_ids.data(), {b.batch, b.seq_len}, torch::kLong).to(device_);
      const auto result = step_.pipeline->step(step_.plan.holds_first_stage ? inputs : torch::Tensor(),
                                          step_.plan.holds_last_stage ? labels : torch::Tensor(), ids);
      local_loss_sum += result.loss_sum() * global_tokens;  // 0 off the last stage
      continue;
    }
    auto labels = torch::from_blob(b.labels.data(), {b.batch * b.seq_len}, torch::kLong).to(device_);
    // Each MoE layer's balance loss is the mean over this microbatch's sequences: weighted by the microbatch's
    // share of the global batch, the sum over microbatches and ranks is the mean over every sequence of the
    // step (what one process computes on the whole batch). The layers tie it to their output (TorchTitan's
    // autograd function), so its gradient comes from the graph the backward runs, also under activation
    // checkpointing, where the first pass has no graph and the recomputation must not add it twice.
    // [fault_tolerance]: the share of this replica group's batch (the quorum's average of the gradients makes it
    // the mean over every member's sequences).
    const double aux_weight =
        static_cast<double>(b.batch) / static_cast<double>(dims_.global_batch_size / dims_.ft_groups);
    if (aux_on)
      for (auto* moe : step_.moe_blocks) moe->set_aux_loss_grad_scale(aux_weight);
    auto logits = b.document_ids.empty()
                      ? step_.model.forward(inputs)
                      : step_.model.forward_with_document_ids(
                            inputs, torch::from_blob(b.document_ids.data(), {b.batch, b.seq_len}, torch::kLong).to(device_));
    auto loss_sum = step_.loss_sum_of(logits.reshape({-1, logits.size(-1)}), labels);
    if (track_tensors_) tmem.forward = tensor_memory::live_bytes();
    // Divided by the global count: summed over micro-batches and ranks, this is the full-batch gradient.
    torch::Tensor loss = loss_sum / global_tokens;
    if (aux_on) {
      // The value only (its gradient flows through the layers' outputs, above).
      double aux = 0;
      for (auto* moe : step_.moe_blocks)
        if (moe->aux_loss().defined()) aux += moe->aux_loss().detach().to(torch::kDouble).item<double>();
      aux_sum += aux * aux_weight;
    }
    loss.backward();
    local_loss_sum += loss_sum.item<double>();
  }
  return local_loss_sum;
}

void Trainer::attach_fault_tolerance() {
  // FSDP's all-reduce hook takes a module with one parameter group. A block whose routed experts shard apart (over
  // the expert-parallel mesh's data ranks, or on dim 1) has two, so every block holding an MoE layer has its
  // gradients averaged after backward instead, in one flat all-reduce of its parameters' local gradients: the
  // average is element-wise and the same-coordinates ranks of two groups hold the same shards, so it is the same
  // average, only not overlapped with backward. (The blocks are the modules with an MoE layer as a direct child;
  // the root's and a stage's own parameters are outside every block.)
  std::vector<fsdp::FSDPModule> hooked;
  for (auto& m : step_.plan.fsdp_modules) {
    bool holds_moe = false;
    for (const auto& child : m.module().children()) holds_moe = holds_moe || child->as<fsdp::models::moe::MoEImpl>();
    if (!holds_moe) {
      hooked.push_back(m);
      continue;
    }
    for (const auto& p : m.module().parameters()) step_.ft_after_backward_params.push_back(p);
  }
  services_.ft->attach(hooked);
}

void Trainer::sum_expert_counts_over_quorum() {
  if (step_.moe_blocks.empty()) return;
  // Each layer's local counts summed over the same-coordinates ranks of the quorum's groups; the data-parallel sum
  // after the vote (update_expert_load_balance) then covers every rank of every member: the bias moves on the
  // whole quorum's batch, the same in every group (what one process training on that batch computes).
  std::vector<at::Tensor> rows;
  for (auto* moe : step_.moe_blocks) rows.push_back(moe->tokens_per_expert().to(at::kCPU, at::kDouble));
  at::Tensor counts = at::stack(rows);
  services_.ft->sum_counts(counts);
  for (size_t l = 0; l < step_.moe_blocks.size(); ++l)
    step_.moe_blocks[l]->tokens_per_expert().copy_(counts[static_cast<int64_t>(l)]);
}

double Trainer::clip_gradients() {
  if (step_.pipeline) {
    // Over every stage of every pp rank (TorchTitan's clip_grad_norm_ with pp_mesh).
    std::vector<std::shared_ptr<torch::nn::Module>> parts;
    for (auto& stage : step_.plan.stages) parts.push_back(stage.module);
    return fsdp::clip_grad_norm_(parts, config_.training.max_norm, 2.0, step_.plan.pp_group).item<double>();
  }
  if (step_.plan.fsdp) return fsdp::clip_grad_norm_(*step_.model.module, config_.training.max_norm).item<double>();
  return torch::nn::utils::clip_grad_norm_(step_.params, config_.training.max_norm);
}

torch::Tensor Trainer::context_parallel_chunks(const torch::Tensor& global) const {
  if (dims_.cp == 1) return global;
  const auto balancer = config_.parallelism.context_parallel_load_balancer == CpLoadBalancer::HeadTail
                            ? fsdp::CpLoadBalancer::HeadTail
                            : fsdp::CpLoadBalancer::None;
  return fsdp::context_parallel_shard(global, /*seq_dim=*/1, dims_.cp_rank_of(env_.rank), dims_.cp, balancer);
}

Batch Trainer::context_parallel_chunks(Batch b) const {
  if (dims_.cp == 1) return b;
  // The cp ranks of a data-parallel rank read the same samples; each keeps its chunks of every row, for the
  // tokens and the labels alike (the positions follow in the model: apply_cp).
  auto cut = [&](std::vector<int64_t>& v) {
    const auto t = context_parallel_chunks(torch::from_blob(v.data(), {b.batch, b.seq_len}, torch::kLong));
    v.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  };
  if (step_.model.document_ids) {
    // block_causal: a chunk's document ids count the EOS of the whole row before it.
    const auto ids =
        step_.model.document_ids(torch::from_blob(b.inputs.data(), {b.batch, b.seq_len}, torch::kLong)).contiguous();
    b.document_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
    cut(b.document_ids);
  }
  cut(b.inputs);
  cut(b.labels);
  b.seq_len /= dims_.cp;
  return b;
}

std::vector<Batch> Trainer::step_batches(int64_t step) {
  if (step_.pending_step == step) return step_.pending_batches;  // a retried step (fault tolerance): the same data
  std::vector<Batch> batches;
  for (int64_t m = 0; m < dims_.grad_accum_steps; ++m)
    batches.push_back(context_parallel_chunks(services_.loader->next()));
  if (services_.ft) {
    step_.pending_step = step;
    step_.pending_batches = batches;
  }
  return batches;
}

Trainer::StepResult Trainer::train_step(int64_t step, bool ready) {
  StepResult r;
  r.lr = config_.optimizer.lr * step_.lr_schedule->factor(step - 1);
  for (auto& group : step_.optimizer->param_groups()) group.options().set_lr(r.lr);
  step_.optimizer->zero_grad();

  // Data first, so that the global token count is known before any backward.
  const auto t_data = fsdp::util::SteadyClock::now();
  std::vector<Batch> batches = step_batches(step);
  for (const Batch& b : batches)
    for (int64_t l : b.labels) r.local_tokens += l != -100;
  r.data_seconds = fsdp::util::seconds_since(t_data);
  // The TP and PP ranks of a data-parallel rank hold the same tokens: count them once.
  const double global_tokens =
      all_reduce(env_.group, {static_cast<double>(r.local_tokens)})[0] / static_cast<double>(dims_.tp * dims_.pp);

  TrainSummary::TensorMemory tmem;
  if (track_tensors_) {
    tmem.start = tensor_memory::live_bytes();
    tensor_memory::reset_peak();
  }
  double aux_sum = 0;
  r.local_loss_sum = forward_backward(batches, global_tokens, tmem, aux_sum);
  if (step_.plan.stage_aux_loss && step_.plan.stage_aux_loss->defined()) {
    // Under PP the stages attached their layers' balance loss to each microbatch's backward (parallelize).
    aux_sum += step_.plan.stage_aux_loss->item<double>();
    *step_.plan.stage_aux_loss = torch::Tensor();
  }
  if (config_.model.moe_sequence_aux_loss_coeff > 0 && !step_.moe_blocks.empty()) {
    // Under TP each rank's balance loss is its tokens' share of the whole sequences' (MoEImpl's sequence
    // parallel group): the sum over the TP ranks is the loss.
    r.aux_loss = all_reduce(env_.group, {aux_sum})[0];
    outputs_.summary.aux_losses.push_back(r.aux_loss);
  }
  auto global_loss = [&] {
    return all_reduce(env_.group, {r.local_loss_sum})[0] / static_cast<double>(dims_.tp) / global_tokens;
  };
  if (services_.ft) {
    // The loss of this replica group's batch averaged over the quorum's groups, as their gradients are; before the
    // vote, so that a failure here discards the step too.
    if (!step_.plan.fsdp) services_.ft->average_gradients(step_.params);
    if (!step_.ft_after_backward_params.empty()) services_.ft->average_gradients(step_.ft_after_backward_params);
    r.loss = services_.ft->average(global_loss());
    if (r.aux_loss >= 0) outputs_.summary.aux_losses.back() = r.aux_loss = services_.ft->average(r.aux_loss);
    sum_expert_counts_over_quorum();
  }
  r.grad_norm = clip_gradients();
  if (services_.ft && !(r.committed = services_.ft->commit(ready, step))) {
    step_.optimizer->zero_grad();  // the step is dropped: no update, its gradients gone
    // Its expert counts and balance loss too: the retry counts its batches again.
    for (auto* moe : step_.moe_blocks) moe->tokens_per_expert().zero_();
    if (r.aux_loss >= 0) outputs_.summary.aux_losses.pop_back();
    return r;
  }
  step_.pending_step = -1;
  // MoE: the step's expert load over the data-parallel ranks drives the load-balancing bias (TorchTitan runs
  // this as an optimizer step pre-hook; gradient accumulation has summed every microbatch's counts).
  // Without PP over step_.plan.dp_group, the world here: under TP each rank routes its own slice of the sequence, so
  // the sum over dp x tp counts every token once. Under PP over each stage's data-parallel ranks (its MoE layers
  // live there only), shared over the stages.
  r.expert_load = step_.pipeline ? update_expert_load_balance(step_.moe_blocks, step_.moe_held,
                                                              step_.plan.stage_dp_groups, step_.plan.pp_group)
                                 : update_expert_load_balance(step_.moe_blocks, step_.plan.dp_group);
  if (!r.expert_load.empty()) outputs_.summary.expert_loads.push_back(r.expert_load);
  services_.checkpointer->before_optimizer_step();  // an async save's background snapshot is complete
  step_.optimizer->step();
  if (track_tensors_) {
    tmem.peak = tensor_memory::peak_bytes();
    outputs_.summary.tensor_memory.push_back(tmem);
  }
  if (!services_.ft) r.loss = global_loss();
  outputs_.summary.losses.push_back(r.loss);
  outputs_.summary.grad_norms.push_back(r.grad_norm);
  return r;
}

// The groups whose collectives a profiled step times (profiling.h): the world and every group of the meshes.
std::vector<fsdp::ProcessGroupPtr> Trainer::profiled_groups() const {
  std::vector<fsdp::ProcessGroupPtr> groups{env_.group, step_.plan.dp_group, step_.plan.pp_group};
  for (const fsdp::DeviceMesh* mesh : {&step_.plan.mesh, &step_.plan.tp_mesh, &step_.plan.fsdp_mesh}) {
    if (!mesh->valid()) continue;
    for (int64_t d = 0; d < mesh->ndim(); ++d) groups.push_back(mesh->group(d));
  }
  return groups;
}

// Every group the step uses (the mesh's groups carry FSDP's all-gathers and reduce-scatters), not only the
// world: a rank that stops participating must make the others fail within comm.train_timeout_seconds.
void Trainer::set_train_timeouts() {
  if (!env_.group) return;
  const std::chrono::seconds t(config_.comm.train_timeout_seconds);
  env_.group->set_timeout(t);
  if (step_.plan.dp_group) step_.plan.dp_group->set_timeout(t);
  for (const fsdp::DeviceMesh* mesh : {&step_.plan.mesh, &step_.plan.fsdp_mesh}) {
    if (!mesh->valid()) continue;
    for (int64_t d = 0; d < mesh->ndim(); ++d)
      if (auto g = mesh->group(d)) g->set_timeout(t);
  }
}

}  // namespace fsdp_train
