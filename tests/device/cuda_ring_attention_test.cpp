// Ring attention on CUDA (issue 38): cp 2 (2 ranks sharing cuda:0, Gloo on CUDA tensors) against the unsharded
// attention. Each chunk pair takes libtorch's CUDA kernel that returns the log-sum-exp
// (src/context_parallel/fused_chunk_attention.h): flash for fp16/bf16 without a mask, memory-efficient for fp32
// and for block_causal's masked pairs, the exact math for what neither takes (fp64 here).
//
// Every rank builds the same global q, k, v [batch, heads, seq, head_dim] and upstream gradient (values the dtype
// holds exactly); the reference is softmax attention written out in double (causal, or causal within documents), differentiated by autograd, not
// a kernel under test. Each rank's output rows and dq, dk, dv rows must lie within the dtype's bound of it (max
// difference over the reference's largest value); the unsharded SDPA in the same dtype is printed alongside, as
// the error a fused kernel has without CP. The chunk length (192 tokens in 2 x 2 head-tail chunks: 48) is not a
// multiple of 32, the memory-efficient kernel's LSE row padding. Not vacuous: every op the ring ran is
// recorded (a global RecordFunction callback: the backward runs on the autograd engine's device thread), and the
// expected kernel's forward and backward must be among them (none of them for fp64); the causal reference
// differs from attention over the whole sequence.
#include "device/device_util.h"

#include <fsdp/context_parallel.h>

#include <ATen/record_function.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <set>
#include <string>

using namespace fsdp_device;

namespace {

// 2 ranks x 2 head-tail chunks of 48 tokens (48 % 32 != 0).
constexpr int64_t kBatch = 2, kHeads = 4, kSeq = 192, kHeadDim = 64;

std::mutex ops_mutex;
std::set<std::string> ops_seen;

std::unique_ptr<at::ObserverContext> record_op(const at::RecordFunction& fn) {
  std::lock_guard<std::mutex> lock(ops_mutex);
  ops_seen.insert(fn.name());
  return nullptr;
}

// The ops run (every thread) while alive.
class OpRecorder {
 public:
  OpRecorder() {
    std::lock_guard<std::mutex> lock(ops_mutex);
    ops_seen.clear();
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(record_op).scopes({at::RecordScope::FUNCTION}));
  }
  ~OpRecorder() { at::removeCallback(handle_); }
  std::set<std::string> seen() const {
    std::lock_guard<std::mutex> lock(ops_mutex);
    return ops_seen;
  }

 private:
  at::CallbackHandle handle_;
};

// Query i sees key j when j <= i and (documents given) both are in the same document. In double.
torch::Tensor reference_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& document_ids, bool causal) {
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  const int64_t L = q.size(2);
  torch::Tensor hidden = torch::zeros({L, L}, torch::dtype(torch::kBool).device(q.device()));
  if (causal) hidden = torch::ones({L, L}, hidden.options()).triu(1);
  if (document_ids.defined()) {
    // [B, 1, L, L]: a key of another document is hidden.
    hidden = hidden.logical_or(document_ids.unsqueeze(2).ne(document_ids.unsqueeze(1)).unsqueeze(1));
  }
  scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(scores, -1), v);
}

double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  return (got.to(torch::kDouble) - want).abs().max().item<double>() / want.abs().max().item<double>();
}

struct Case {
  torch::ScalarType dtype;
  fsdp::CpRotateMethod method;
  fsdp::CpLoadBalancer balancer;
  bool documents;
  const char* forward_op;   // the kernel every pair (or a masked pair) must have run; nullptr: none fused
  const char* backward_op;
  double bound;             // max |ring - reference| / max |reference|
};

void run_case(const fsdp::ProcessGroupPtr& cp, const Case& c) {
  const torch::Device device = cp->device();
  const int64_t rank = cp->rank(), size = cp->size();
  const std::string what = std::string(c10::toString(c.dtype)) + (c.documents ? " block_causal" : " causal") + ", " +
                           fsdp::to_string(c.method) + ", " + fsdp::to_string(c.balancer);
  SCOPED_TRACE(what);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(38);
  // Values the dtype holds exactly, so that the reference sees the very inputs the kernels get: the bounds
  // measure the kernels' own rounding, not the inputs'.
  auto input = [&] {
    return torch::randn({kBatch, kHeads, kSeq, kHeadDim}, gen, torch::dtype(torch::kDouble)).to(c.dtype).to(
        torch::TensorOptions().dtype(torch::kDouble).device(device));
  };
  const torch::Tensor q = input(), k = input(), v = input(), g = input();
  torch::Tensor ids;
  if (c.documents) {
    // Documents of random lengths, one crossing the ranks' chunks: a new document where the flag is set.
    ids = (torch::rand({kBatch, kSeq}, gen) < 0.04).to(torch::kLong).cumsum(1).to(device);
  }
  // The reference, in double.
  auto rq = q.clone().requires_grad_(), rk = k.clone().requires_grad_(), rv = v.clone().requires_grad_();
  const torch::Tensor ref = reference_attention(rq, rk, rv, ids, /*causal=*/true);
  (ref * g).sum().backward();
  ASSERT_GT(relative_error(reference_attention(q, k, v, torch::Tensor(), false), ref.detach()), 1e-2)
      << "the causal mask matters";

  auto shard = [&](const torch::Tensor& t, int64_t dim) {
    return fsdp::context_parallel_shard(t, dim, rank, size, c.balancer);
  };
  auto lq = shard(q, 2).to(c.dtype).requires_grad_(), lk = shard(k, 2).to(c.dtype).requires_grad_(),
       lv = shard(v, 2).to(c.dtype).requires_grad_();
  torch::Tensor out;
  std::set<std::string> seen;
  {
    OpRecorder recorder;
    const fsdp::ContextParallelOptions options{c.method, c.balancer};
    out = c.documents ? fsdp::block_causal_ring_attention(
                            lq, lk, lv, fsdp::context_parallel_gather_document_ids(shard(ids, 1), cp), cp, options)
                      : fsdp::ring_attention(lq, lk, lv, cp, options);
    (out * shard(g, 2).to(c.dtype)).sum().backward();
    torch::cuda::synchronize();
    seen = recorder.seen();
  }
  const double e_out = relative_error(out.detach(), shard(ref.detach(), 2));
  const double e_dq = relative_error(lq.grad(), shard(rq.grad(), 2));
  const double e_dk = relative_error(lk.grad(), shard(rk.grad(), 2));
  const double e_dv = relative_error(lv.grad(), shard(rv.grad(), 2));
  EXPECT_LE(e_out, c.bound) << "output";
  EXPECT_LE(e_dq, c.bound) << "dq";
  EXPECT_LE(e_dk, c.bound) << "dk";
  EXPECT_LE(e_dv, c.bound) << "dv";
  // The error of the unsharded attention in the same dtype (libtorch's SDPA picks its kernel), for scale.
  double e_sdpa = -1;
  if (!c.documents) {
    const auto whole = at::scaled_dot_product_attention(q.to(c.dtype), k.to(c.dtype), v.to(c.dtype), {}, 0.0, true);
    e_sdpa = relative_error(whole, ref.detach());
  }
  const std::string fused[] = {"aten::_scaled_dot_product_flash_attention",
                               "aten::_scaled_dot_product_flash_attention_backward",
                               "aten::_scaled_dot_product_efficient_attention",
                               "aten::_scaled_dot_product_efficient_attention_backward"};
  if (c.forward_op) {
    EXPECT_TRUE(seen.count(c.forward_op)) << c.forward_op << " did not run";
    EXPECT_TRUE(seen.count(c.backward_op)) << c.backward_op << " did not run";
  } else {
    for (const auto& op : fused) EXPECT_FALSE(seen.count(op)) << op << " ran (expected the math path)";
  }
  std::string ran;
  for (const auto& op : fused)
    if (seen.count(op)) ran += (ran.empty() ? "" : ", ") + op.substr(6);
  std::cout << "[cuda ring attention] rank " << rank << " of " << size << ", " << what << ": kernels {"
            << (ran.empty() ? "math" : ran) << "}, max error / max |ref|: out " << e_out << ", dq " << e_dq << ", dk "
            << e_dk << ", dv " << e_dv << " (bound " << c.bound << "; unsharded SDPA out " << e_sdpa << ")\n";
}

}  // namespace

TEST(CudaRingAttention, FusedKernelsMatchUnshardedAttention) {
  FSDP_REQUIRE_CUDA();
  DeviceWorld dw("gloo", "cuda:0");
  const auto& cp = dw.group();
  ASSERT_TRUE(cp->device().is_cuda());
  if (cp->size() != 2) GTEST_SKIP() << "cp 2: 2 ranks";
  using M = fsdp::CpRotateMethod;
  using B = fsdp::CpLoadBalancer;
  const char *flash = "aten::_scaled_dot_product_flash_attention",
             *flash_bw = "aten::_scaled_dot_product_flash_attention_backward",
             *efficient = "aten::_scaled_dot_product_efficient_attention",
             *efficient_bw = "aten::_scaled_dot_product_efficient_attention_backward";
  // Bounds: a few units of the dtype's rounding of O(1) values (bf16 2^-8, fp16 2^-11); fp32 (and fp64, which the
  // math path computes in fp32) with margin.
  for (const Case& c : {Case{torch::kBFloat16, M::AllToAll, B::HeadTail, false, flash, flash_bw, 3e-2},
                        Case{torch::kHalf, M::AllGather, B::None, false, flash, flash_bw, 5e-3},
                        Case{torch::kFloat, M::AllToAll, B::HeadTail, false, efficient, efficient_bw, 1e-4},
                        Case{torch::kBFloat16, M::AllToAll, B::HeadTail, true, efficient, efficient_bw, 3e-2},
                        Case{torch::kFloat, M::AllGather, B::None, true, efficient, efficient_bw, 1e-4},
                        Case{torch::kDouble, M::AllToAll, B::HeadTail, false, nullptr, nullptr, 1e-4}}) {
    run_case(cp, c);
  }
}
