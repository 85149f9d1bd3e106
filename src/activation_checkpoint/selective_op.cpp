#include "activation_checkpoint/selective_op.h"

#include "activation_checkpoint/stats.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <mutex>

namespace fsdp::detail {
namespace {

// Below autograd, above the backends, and used by nothing else in a libtorch process (it is reserved for a C++
// FakeTensor mode that libtorch does not register).
constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;

thread_local SelectiveOpScope::Context* tls_context = nullptr;

// The output shape the matmul on the stack would produce (checked against the kept output during replay).
std::vector<int64_t> expected_sizes(const std::string& op, const torch::jit::Stack& stack, size_t n_args) {
  auto arg = [&](size_t i) { return torch::jit::peek(stack, i, n_args).toTensor(); };
  if (op == "aten::mm") return {arg(0).size(0), arg(1).size(1)};
  if (op == "aten::addmm") return {arg(1).size(0), arg(2).size(1)};
  return {arg(0).size(0), arg(0).size(1), arg(1).size(2)};  // aten::bmm
}

void matmul_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::DispatchKeySet below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey);
  // Matmuls issued inside the real kernel are not the model's: keep them out of the count.
  c10::impl::ExcludeDispatchKeyGuard no_reentry(kKey);
  SelectiveOpScope::Context* ctx = tls_context;
  if (!ctx || !ctx->stash) {
    op.redispatchBoxed(below, stack);
    return;
  }
  CheckpointCounters& counters = *ctx->stash->counters;
  const bool keep = (++ctx->count % 2) == 1;  // TorchTitan: odd-numbered matmuls are MUST_SAVE
  if (ctx->mode == SelectiveOpMode::Record) {
    op.redispatchBoxed(below, stack);
    ++ctx->stash->total;
    if (keep) {
      // A copy, not an alias: code after the matmul may change its output in place through a tensor with its own
      // version counter (linear's matmul path adds the bias in place to an _unsafe_view of the mm output), which
      // no version check on an alias would see.
      ctx->stash->kept.push_back({op.schema().name(), stack->back().toTensor().clone()});
      ++counters.mm_saved;
    }
    return;
  }
  if (!keep) {
    ++counters.mm_recomputed;
    op.redispatchBoxed(below, stack);
    return;
  }
  const std::string& name = op.schema().name();
  TORCH_CHECK(ctx->next_kept < ctx->stash->kept.size(), "fsdp: selective activation checkpointing: the recomputation ",
              "ran more matmuls than the forward (", ctx->stash->total, "); the checkpointed forward must run the same ",
              "operations every time");
  const MatmulStash::Entry& entry = ctx->stash->kept[ctx->next_kept++];
  const size_t n_args = op.schema().arguments().size();
  const std::vector<int64_t> sizes = expected_sizes(name, *stack, n_args);
  TORCH_CHECK(entry.op == name && entry.value.sizes() == c10::IntArrayRef(sizes), "fsdp: selective activation ",
              "checkpointing: matmul #", ctx->count, " of the recomputation is ", name, " with output ",
              c10::IntArrayRef(sizes), ", but at forward it was ", entry.op, " with output ", entry.value.sizes(),
              "; the checkpointed forward must run the same operations every time");
  torch::jit::drop(*stack, n_args);
  // A copy again: the recomputation may change it in place (see above), and a retained graph replays it again.
  stack->emplace_back(entry.value.clone());
  ++counters.mm_reused;
}

}  // namespace

SelectiveOpScope::SelectiveOpScope(MatmulStash* stash, SelectiveOpMode mode)
    : context_{stash, mode},
      previous_(tls_context),
      included_(stash != nullptr && !c10::impl::tls_is_dispatch_key_included(kKey)) {
  tls_context = &context_;
  if (included_) c10::impl::tls_set_dispatch_key_included(kKey, true);
}

SelectiveOpScope::~SelectiveOpScope() {
  tls_context = previous_;
  if (included_) c10::impl::tls_set_dispatch_key_included(kKey, false);
}

void SelectiveOpScope::check_complete() const {
  if (!context_.stash) return;
  TORCH_CHECK(context_.count == context_.stash->total, "fsdp: selective activation checkpointing: the recomputation ran ",
              context_.count, " matmuls, the forward ", context_.stash->total,
              "; the checkpointed forward must run the same operations every time");
}

void ensure_selective_op_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    TORCH_CHECK(!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kKey),
                "fsdp: selective activation checkpointing needs the dispatch key ", kKey,
                ", but this libtorch already registers a fallback for it");
    // Never destroyed: the registrations must outlive every checkpointed module.
    auto* fallback = new torch::Library(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    fallback->fallback(torch::CppFunction::makeFallthrough());
    auto* kernels = new torch::Library(torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__);
    for (const char* name : {"mm", "addmm", "bmm"}) {
      kernels->impl(name, torch::CppFunction::makeFromBoxedFunction<&matmul_kernel>());
    }
  });
}

}  // namespace fsdp::detail
