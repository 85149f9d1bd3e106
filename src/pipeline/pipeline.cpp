// The pipeline runtime: executes this rank's lowered action list (fsdp/pipeline/schedule.h) once per step.
//
// Transfers. Every activation and gradient goes with a tag that names it — (kind, sending stage, microbatch) —
// so a receive matches its send whatever the posting order (Gloo matches by tag; NCCL pairs in order, which the
// lowering keeps). Receives are posted where the list puts them and waited by the compute that consumes them
// (torch's runtime does the same; waiting at the RECV would serialize the interleaved schedules, see
// SimCosts::recv_waits_in_place). Sends are waited at the end of the step.
//
// Shapes are agreed at the first step: the first time a stage sends a microbatch's activation it sends a small
// header (dtype and sizes) before it, and the receiver allocates from it; later steps reuse the agreed shapes
// and a stage whose output shape changes is an error. Gradients have their activation's shape, known to both.
//
// fully_shard. At the start of a step every FSDP module of a stage is set to no-sync and to keep its parameters
// unsharded after backward; UNSHARD all-gathers them (asynchronously) before the stage's first compute, every
// microbatch's backward accumulates unsharded gradients, and REDUCE_GRAD runs FSDPModule::post_backward() on
// the stage's top FSDP modules: one reduce-scatter per group per step. RESHARD frees the unsharded parameters.
#include <fsdp/pipeline.h>

#include <fsdp/fully_shard.h>
#include <fsdp/pipeline/schedule.h>

#include "pipeline/split_backward.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <map>
#include <optional>
#include <sstream>

namespace fsdp {

double PipelineStepResult::loss_sum() const {
  double sum = 0;
  for (const auto& l : losses) sum += l.item<double>();
  return sum;
}

namespace {

using pipeline::Action;
using pipeline::ActionType;

constexpr int kMaxDims = 8;
constexpr int kHeaderSize = 2 + kMaxDims;  // ndim, dtype, sizes
enum TransferKind { kForwardHeader = 0, kForwardData = 1, kBackwardData = 2 };

int transfer_tag(TransferKind kind, int sending_stage, int microbatch) {
  return ((sending_stage * 3 + kind) << 16) | microbatch;
}

struct Shape {
  std::vector<int64_t> sizes;
  c10::ScalarType dtype = c10::kFloat;
};

// One stage held by this rank, and its microbatches' state during a step.
struct StageRun {
  PipelineStage stage;
  bool is_first = false, is_last = false;
  int prev_rank = -1, next_rank = -1;  // group ranks of the neighbour stages (-1: none)
  bool prev_local = false, next_local = false;
  std::vector<FSDPModule> fsdp_all;  // every fully_shard'ed module of the part
  std::vector<FSDPModule> fsdp_top;  // those with no fully_shard'ed ancestor inside the part
  std::vector<UnshardHandle> unshards;
  std::vector<std::optional<Shape>> in_shapes, out_shapes;  // agreed at the first step, per microbatch

  // Per microbatch, during a step.
  std::vector<at::Tensor> inputs;          // what forward got (leaves requiring grad past the first stage)
  std::vector<at::Tensor> outputs;         // the stage output, or the loss on the last stage
  std::vector<at::Tensor> recv_act;        // RECV_F buffers
  std::vector<Work> recv_act_work;
  std::vector<at::Tensor> out_grads;       // gradients of `outputs` (received, or handed over locally)
  std::vector<Work> out_grads_work;
  std::vector<at::Tensor> input_grads;     // to send upstream
  std::vector<std::unique_ptr<pipeline_detail::SplitBackward>> split;
  int backwards_done = 0;

  void reset_microbatches(int m) {
    inputs.assign(m, at::Tensor());
    outputs.assign(m, at::Tensor());
    recv_act.assign(m, at::Tensor());
    recv_act_work.assign(m, Work());
    out_grads.assign(m, at::Tensor());
    out_grads_work.assign(m, Work());
    input_grads.assign(m, at::Tensor());
    split.clear();
    split.resize(m);
    backwards_done = 0;
    if (in_shapes.size() != static_cast<size_t>(m)) in_shapes.assign(m, std::nullopt);
    if (out_shapes.size() != static_cast<size_t>(m)) out_shapes.assign(m, std::nullopt);
  }
};

bool is_differentiable(const at::Tensor& t) {
  return t.defined() && (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()));
}

}  // namespace

struct Pipeline::Impl {
  ProcessGroupPtr group;
  PipelineLoss loss;
  pipeline::PipelineSchedule schedule;
  std::map<int, StageRun> stages;  // by stage index
  std::vector<PipelineActionSpan> timeline;
  std::vector<Work> pending_sends;
  std::vector<at::Tensor> input_mbs, target_mbs, context_mbs;
  std::vector<at::Tensor> losses;
  bool training = true;

  StageRun& run_of(int stage) {
    auto it = stages.find(stage);
    TORCH_CHECK(it != stages.end(), "fsdp pipeline: the schedule gives stage ", stage, " to this rank (",
                group->rank(), "), which does not hold it");
    return it->second;
  }

  std::string where(const Action& a) const {
    return c10::str("pipeline rank ", group->rank(), ", action ", a.str(), " of ", pipeline::schedule_name(schedule.spec.kind));
  }

  // ---- transfers --------------------------------------------------------------------------------------------
  void send_activation(StageRun& s, int mb) {
    at::Tensor out = s.outputs[mb].detach().contiguous();
    auto& agreed = s.out_shapes[mb];
    if (!agreed) {
      TORCH_CHECK(out.dim() <= kMaxDims, "fsdp pipeline: stage ", s.stage.index, " output has ", out.dim(),
                  " dims; at most ", kMaxDims, " can be sent");
      at::Tensor header = at::zeros({kHeaderSize}, at::kLong);
      header[0] = out.dim();
      header[1] = static_cast<int64_t>(out.scalar_type());
      for (int64_t d = 0; d < out.dim(); ++d) header[2 + d] = out.size(d);
      pending_sends.push_back(group->send(header, s.next_rank, transfer_tag(kForwardHeader, s.stage.index, mb)));
      agreed = Shape{out.sizes().vec(), out.scalar_type()};
    }
    pending_sends.push_back(group->send(out, s.next_rank, transfer_tag(kForwardData, s.stage.index, mb)));
  }

  void receive_activation(StageRun& s, int mb) {
    auto& agreed = s.in_shapes[mb];
    if (!agreed) {
      at::Tensor header = at::zeros({kHeaderSize}, at::kLong);
      group->recv(header, s.prev_rank, transfer_tag(kForwardHeader, s.stage.index - 1, mb)).wait();
      const int64_t ndim = header[0].item<int64_t>();
      TORCH_CHECK(ndim >= 0 && ndim <= kMaxDims, "fsdp pipeline: stage ", s.stage.index,
                  " received a malformed shape header (", ndim, " dims) for microbatch ", mb);
      Shape shape;
      shape.dtype = static_cast<c10::ScalarType>(header[1].item<int64_t>());
      for (int64_t d = 0; d < ndim; ++d) shape.sizes.push_back(header[2 + d].item<int64_t>());
      agreed = shape;
    }
    s.recv_act[mb] = at::empty(agreed->sizes, at::TensorOptions().dtype(agreed->dtype).device(group->device()));
    s.recv_act_work[mb] =
        group->recv(s.recv_act[mb], s.prev_rank, transfer_tag(kForwardData, s.stage.index - 1, mb));
  }

  void send_input_grad(StageRun& s, int mb) {
    at::Tensor g = s.input_grads[mb];
    const Shape& shape = *s.in_shapes[mb];
    // An input that got no gradient is sent as zeros (torch does the same): the receiver waits for it.
    g = g.defined() ? g.contiguous() : at::zeros(shape.sizes, at::TensorOptions().dtype(shape.dtype).device(group->device()));
    pending_sends.push_back(group->send(g, s.prev_rank, transfer_tag(kBackwardData, s.stage.index, mb)));
  }

  void receive_output_grad(StageRun& s, int mb) {
    const Shape& shape = *s.out_shapes[mb];
    s.out_grads[mb] = at::empty(shape.sizes, at::TensorOptions().dtype(shape.dtype).device(group->device()));
    s.out_grads_work[mb] =
        group->recv(s.out_grads[mb], s.next_rank, transfer_tag(kBackwardData, s.stage.index + 1, mb));
  }

  // ---- compute ------------------------------------------------------------------------------------------------
  void wait_unsharded(StageRun& s) {
    for (auto& h : s.unshards) h.wait();
    s.unshards.clear();
  }

  void forward(StageRun& s, int mb, const Action& a) {
    wait_unsharded(s);
    at::Tensor x;
    if (s.is_first) {
      x = input_mbs.at(mb);
    } else {
      if (!s.prev_local) {
        TORCH_CHECK(s.recv_act[mb].defined(), "fsdp pipeline: ", where(a), ": computing before receiving the input");
        s.recv_act_work[mb].wait();
        x = s.recv_act[mb];
        s.recv_act[mb] = at::Tensor();
      } else {
        x = s.inputs[mb];  // handed over by the previous stage on this rank
        TORCH_CHECK(x.defined(), "fsdp pipeline: ", where(a), ": the previous stage has not run this microbatch");
      }
      x = x.detach();
      if (training && is_differentiable(x)) x.requires_grad_(true);
    }
    s.inputs[mb] = x;
    at::Tensor out = s.stage.forward_with_context
                         ? s.stage.forward_with_context(x, context_mbs.empty() ? at::Tensor() : context_mbs.at(mb))
                         : s.stage.forward(x);
    TORCH_CHECK(out.defined(), "fsdp pipeline: stage ", s.stage.index, " returned an undefined tensor");
    if (!s.is_last && s.out_shapes[mb] && out.sizes() != c10::IntArrayRef(s.out_shapes[mb]->sizes)) {
      TORCH_CHECK(false, "fsdp pipeline: stage ", s.stage.index, " output for microbatch ", mb, " has shape ",
                  out.sizes(), ", but the pipeline agreed on ", c10::IntArrayRef(s.out_shapes[mb]->sizes),
                  " at its first step; the batch shape must stay the same across steps");
    }
    if (s.is_last) {
      at::Tensor l = loss(out, target_mbs.at(mb));
      TORCH_CHECK(l.defined() && l.numel() == 1, "fsdp pipeline: the loss function must return a scalar, got ",
                  l.defined() ? c10::str(l.sizes()) : std::string("an undefined tensor"));
      losses[mb] = l.detach().reshape({});
      s.outputs[mb] = l;
    } else {
      // (A remote next stage's shape is agreed by SEND_F's header; out_shapes stays empty until then.)
      s.outputs[mb] = out;
      if (s.next_local) {
        StageRun& next = run_of(s.stage.index + 1);
        next.inputs[mb] = out.detach();
        next.in_shapes[mb] = Shape{out.sizes().vec(), out.scalar_type()};
        s.out_shapes[mb] = next.in_shapes[mb];
      }
    }
    // Evaluation keeps an output only until SEND_F sends it.
    if (!training && (s.is_last || s.next_local)) s.outputs[mb] = at::Tensor();
  }

  // The gradient arriving at the stage output (undefined for the loss).
  at::Tensor output_grad(StageRun& s, int mb, const Action& a) {
    if (s.is_last) return at::Tensor();
    if (!s.next_local) {
      TORCH_CHECK(s.out_grads[mb].defined(), "fsdp pipeline: ", where(a), ": backward before receiving its gradient");
      s.out_grads_work[mb].wait();
    }
    at::Tensor g = s.out_grads[mb];
    TORCH_CHECK(g.defined(), "fsdp pipeline: ", where(a), ": the next stage has not sent this microbatch's gradient");
    s.out_grads[mb] = at::Tensor();
    return g;
  }

  void hand_input_grad(StageRun& s, int mb, at::Tensor g) {
    s.input_grads[mb] = std::move(g);
    if (s.prev_local) {
      StageRun& prev = run_of(s.stage.index - 1);
      const at::Tensor& x = s.inputs[mb];
      prev.out_grads[mb] = s.input_grads[mb].defined() ? s.input_grads[mb] : at::zeros_like(x);
    }
  }

  std::vector<at::Tensor> differentiable_inputs(StageRun& s, int mb) {
    std::vector<at::Tensor> xs;
    if (!s.is_first && s.inputs[mb].defined() && s.inputs[mb].requires_grad()) xs.push_back(s.inputs[mb]);
    return xs;
  }

  void backward_full(StageRun& s, int mb, const Action& a) {
    wait_unsharded(s);
    at::Tensor root = s.outputs[mb];
    TORCH_CHECK(root.defined(), "fsdp pipeline: ", where(a), ": backward before forward");
    at::Tensor g = output_grad(s, mb, a);
    std::vector<at::Tensor> grads;
    if (g.defined()) grads.push_back(g);
    if (root.requires_grad()) torch::autograd::backward({root}, grads);
    at::Tensor x = s.inputs[mb];
    hand_input_grad(s, mb, (x.defined() && x.requires_grad()) ? x.grad() : at::Tensor());
    s.outputs[mb] = at::Tensor();
    s.inputs[mb] = at::Tensor();
    ++s.backwards_done;
  }

  void backward_input(StageRun& s, int mb, const Action& a) {
    wait_unsharded(s);
    at::Tensor root = s.outputs[mb];
    TORCH_CHECK(root.defined(), "fsdp pipeline: ", where(a), ": backward before forward");
    at::Tensor g = output_grad(s, mb, a);
    s.split[mb] = std::make_unique<pipeline_detail::SplitBackward>(root, g, differentiable_inputs(s, mb),
                                                                   s.stage.module->parameters());
    std::vector<at::Tensor> gx = s.split[mb]->backward_input();
    hand_input_grad(s, mb, gx.empty() ? at::Tensor() : gx[0]);
    s.outputs[mb] = at::Tensor();
    s.inputs[mb] = at::Tensor();
  }

  void backward_weight(StageRun& s, int mb, const Action& a) {
    TORCH_CHECK(s.split[mb], "fsdp pipeline: ", where(a), ": W before I");
    s.split[mb]->backward_weight();
    s.split[mb].reset();
    ++s.backwards_done;
  }

  // ---- fully_shard ----------------------------------------------------------------------------------------------
  void begin_step_fsdp(StageRun& s) {
    for (auto& m : s.fsdp_top) {
      m.set_requires_gradient_sync(false);
      m.set_reshard_after_backward(false);
      m.set_is_last_backward(false);
    }
  }

  void reduce_grad(StageRun& s) {
    for (auto& m : s.fsdp_top) {
      m.post_backward();
      m.set_requires_gradient_sync(true);
      m.set_reshard_after_backward(true);
      m.set_is_last_backward(true);
    }
  }

  void execute(const Action& a) {
    if (a.type == ActionType::OverlapFB) {
      // DualPipeV's overlapped pair runs its parts one after the other, forward first, as torch's runtime does:
      // the order and the result are the schedule's; overlapping them (one part's communication under the other's
      // compute) would need a second stream.
      for (const Action& part : a.sub_actions)
        if (training || part.type == ActionType::Forward) execute(part);
      return;
    }
    StageRun& s = run_of(a.stage);
    const int mb = a.microbatch;
    switch (a.type) {
      case ActionType::Unshard:
        for (auto& m : s.fsdp_all) s.unshards.push_back(m.unshard(/*async_op=*/true));
        break;
      case ActionType::Reshard:
        wait_unsharded(s);
        for (auto& m : s.fsdp_all) m.reshard();
        break;
      case ActionType::ReduceGrad:
        reduce_grad(s);
        break;
      case ActionType::Forward:
        forward(s, mb, a);
        break;
      case ActionType::Backward:
        backward_full(s, mb, a);
        break;
      case ActionType::BackwardInput:
        backward_input(s, mb, a);
        break;
      case ActionType::BackwardWeight:
        backward_weight(s, mb, a);
        break;
      case ActionType::SendF:
        send_activation(s, mb);
        if (!training) s.outputs[mb] = at::Tensor();
        break;
      case ActionType::RecvF:
        receive_activation(s, mb);
        break;
      case ActionType::SendB:
        send_input_grad(s, mb);
        s.input_grads[mb] = at::Tensor();
        break;
      case ActionType::RecvB:
        receive_output_grad(s, mb);
        break;
      case ActionType::OverlapFB:  // expanded above
        break;
    }
  }

  std::vector<at::Tensor> split_batch(const at::Tensor& t, const char* what) {
    const int m = schedule.spec.microbatches;
    TORCH_CHECK(t.defined(), "fsdp pipeline: ", what, " are required on pipeline rank ", group->rank(),
                ", which holds the ", what == std::string("inputs") ? "first" : "last", " stage");
    TORCH_CHECK(t.dim() >= 1 && t.size(0) % m == 0, "fsdp pipeline: ", what, " of shape ", t.sizes(),
                " cannot be split into ", m, " equal microbatches along dim 0 (the batch size must be a multiple of "
                "the number of microbatches)");
    return t.chunk(m, 0);
  }

  PipelineStepResult run(const at::Tensor& inputs, const at::Tensor& targets, const at::Tensor& context, bool train) {
    training = train;
    const int m = schedule.spec.microbatches;
    input_mbs.clear();
    target_mbs.clear();
    if (stages.count(0)) input_mbs = split_batch(inputs, "inputs");
    if (stages.count(schedule.num_stages - 1)) target_mbs = split_batch(targets, "targets");
    context_mbs = context.defined() ? split_batch(context, "context") : std::vector<at::Tensor>();
    losses.assign(m, at::Tensor());
    // Evaluation agrees its own shapes (its batch may differ from training's): it sends the shape headers every
    // time and leaves the training shapes as they were.
    std::map<int, std::pair<std::vector<std::optional<Shape>>, std::vector<std::optional<Shape>>>> training_shapes;
    if (!train) {
      for (auto& [index, s] : stages) {
        training_shapes[index] = {std::move(s.in_shapes), std::move(s.out_shapes)};
        s.in_shapes.clear();
        s.out_shapes.clear();
      }
    }
    for (auto& [index, s] : stages) s.reset_microbatches(m);
    timeline.clear();
    pending_sends.clear();
    std::optional<c10::AutoGradMode> grad_mode;
    grad_mode.emplace(train);
    if (train) {
      for (auto& [index, s] : stages) begin_step_fsdp(s);
    }
    for (const Action& a : schedule.actions.at(group->rank())) {
      if (!train && (a.type == ActionType::Backward || a.type == ActionType::BackwardInput ||
                     a.type == ActionType::BackwardWeight || a.type == ActionType::SendB ||
                     a.type == ActionType::RecvB || a.type == ActionType::ReduceGrad)) {
        continue;  // evaluation: forward actions only (the order stays deadlock-free without the backward ones)
      }
      PipelineActionSpan span;
      span.action = a.str();
      span.start = std::chrono::steady_clock::now();
      {
        // A named range per action for libtorch's profiler ("PP:1F3", as torch.distributed.pipelining names them).
        at::RecordFunction range(at::RecordScope::USER_SCOPE);
        if (range.isActive()) range.before("PP:" + span.action);
        execute(a);
      }
      span.end = std::chrono::steady_clock::now();
      timeline.push_back(std::move(span));
    }
    for (auto& w : pending_sends) w.wait();
    pending_sends.clear();
    if (!train) {
      for (auto& [index, s] : stages) {
        s.in_shapes = std::move(training_shapes[index].first);
        s.out_shapes = std::move(training_shapes[index].second);
      }
    }
    if (train) {
      for (auto& [index, s] : stages) {
        TORCH_CHECK(s.backwards_done == m, "fsdp pipeline: stage ", index, " ran ", s.backwards_done,
                    " backwards for ", m, " microbatches");
      }
    }
    PipelineStepResult result;
    if (stages.count(schedule.num_stages - 1)) result.losses = losses;
    input_mbs.clear();
    target_mbs.clear();
    context_mbs.clear();
    return result;
  }
};

namespace {

// The schedule `options` name (or the CSV file they point at), over the ranks of `group`.
pipeline::PipelineSchedule schedule_of(const ProcessGroupPtr& group, const PipelineOptions& options) {
  TORCH_CHECK(group, "fsdp::Pipeline: a pipeline process group is required");
  TORCH_CHECK(options.microbatches >= 1, "fsdp::Pipeline: microbatches must be >= 1, got ", options.microbatches);
  const int pp = group->size();
  pipeline::ScheduleSpec spec;
  spec.kind = options.schedule_csv.empty() ? pipeline::parse_schedule_name(options.schedule) : pipeline::ScheduleKind::Csv;
  spec.pp = pp;
  spec.microbatches = options.microbatches;
  if (options.num_stages > 0) {
    TORCH_CHECK(options.num_stages % pp == 0, "fsdp::Pipeline: ", options.num_stages,
                " stages cannot be spread evenly over the ", pp, " ranks of the pipeline group");
    spec.stages_per_rank = options.num_stages / pp;
  } else {
    spec.stages_per_rank = pipeline::default_stages_per_rank(spec.kind);
  }
  return options.schedule_csv.empty()
             ? pipeline::build_schedule(spec)
             : pipeline::load_schedule_csv(options.schedule_csv, pp, pp * spec.stages_per_rank, options.microbatches);
}

}  // namespace

Pipeline::Pipeline(std::vector<PipelineStage> stages, ProcessGroupPtr group, PipelineLoss loss,
                   PipelineOptions options)
    : Pipeline(std::move(stages), group, std::move(loss), schedule_of(group, options)) {}

Pipeline::Pipeline(std::vector<PipelineStage> stages, ProcessGroupPtr group, PipelineLoss loss,
                   pipeline::PipelineSchedule schedule)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(group, "fsdp::Pipeline: a pipeline process group is required");
  TORCH_CHECK(loss, "fsdp::Pipeline: a loss function is required");
  const int pp = group->size();
  const pipeline::ScheduleSpec spec = schedule.spec;
  TORCH_CHECK(spec.pp == pp && static_cast<int>(schedule.actions.size()) == pp, "fsdp::Pipeline: the ",
              pipeline::schedule_name(spec.kind), " schedule was built for ", spec.pp,
              " pipeline ranks, but the pipeline group has ", pp);
  TORCH_CHECK(spec.microbatches >= 1, "fsdp::Pipeline: microbatches must be >= 1, got ", spec.microbatches);
  Impl& p = *impl_;
  p.group = std::move(group);
  p.loss = std::move(loss);
  p.schedule = std::move(schedule);
  TORCH_CHECK(p.schedule.num_stages < 1024 && spec.microbatches < 65536, "fsdp::Pipeline: at most 1023 stages ",
              "and 65535 microbatches");
  const int rank = p.group->rank();
  const std::vector<int> mine = p.schedule.stages_of_rank(rank);
  std::vector<int> given;
  for (auto& st : stages) {
    TORCH_CHECK(st.module, "fsdp::Pipeline: stage ", st.index, " has no module");
    TORCH_CHECK(st.forward || st.forward_with_context, "fsdp::Pipeline: stage ", st.index, " has no forward function");
    TORCH_CHECK(st.index >= 0 && st.index < p.schedule.num_stages, "fsdp::Pipeline: stage index ", st.index,
                " is outside [0, ", p.schedule.num_stages, ")");
    given.push_back(st.index);
  }
  std::sort(given.begin(), given.end());
  TORCH_CHECK(given == mine, "fsdp::Pipeline: pipeline rank ", rank, " was given stages ", c10::IntArrayRef(std::vector<int64_t>(given.begin(), given.end())),
              ", but the ", pipeline::schedule_name(spec.kind), " schedule with ", p.schedule.num_stages,
              " stages over ", pp, " ranks places stages ", c10::IntArrayRef(std::vector<int64_t>(mine.begin(), mine.end())),
              " on it");
  for (auto& st : stages) {
    StageRun run;
    const int s = st.index;
    run.is_first = s == 0;
    run.is_last = s == p.schedule.num_stages - 1;
    if (!run.is_first) {
      run.prev_rank = p.schedule.stage_to_rank[s - 1];
      run.prev_local = run.prev_rank == rank;
    }
    if (!run.is_last) {
      run.next_rank = p.schedule.stage_to_rank[s + 1];
      run.next_local = run.next_rank == rank;
    }
    // FSDP modules of the part, in pre-order; "top" ones have no FSDP ancestor inside the part.
    std::vector<std::string> top_prefixes;
    for (const auto& item : st.module->named_modules("", /*include_self=*/true)) {
      auto m = fsdp_module(*item.value());
      if (!m) continue;
      run.fsdp_all.push_back(*m);
      const std::string& name = item.key();
      const bool nested = std::any_of(top_prefixes.begin(), top_prefixes.end(), [&](const std::string& pre) {
        return pre.empty() || name.rfind(pre + ".", 0) == 0;
      });
      if (!nested) {
        run.fsdp_top.push_back(*m);
        top_prefixes.push_back(name);
      }
    }
    run.stage = std::move(st);
    p.stages.emplace(s, std::move(run));
  }
}

Pipeline::~Pipeline() = default;

PipelineStepResult Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets, const at::Tensor& context) {
  return impl_->run(inputs, targets, context, /*train=*/true);
}

PipelineStepResult Pipeline::eval(const at::Tensor& inputs, const at::Tensor& targets, const at::Tensor& context) {
  return impl_->run(inputs, targets, context, /*train=*/false);
}

const pipeline::PipelineSchedule& Pipeline::schedule() const { return impl_->schedule; }

std::string Pipeline::describe(bool with_comms) const { return pipeline::format_schedule(impl_->schedule, with_comms); }

const std::vector<PipelineActionSpan>& Pipeline::last_step_timeline() const { return impl_->timeline; }

std::vector<std::shared_ptr<torch::nn::Module>> Pipeline::modules() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& [index, s] : impl_->stages) out.push_back(s.stage.module);
  return out;
}

}  // namespace fsdp
