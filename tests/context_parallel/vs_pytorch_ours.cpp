// Our side of the side-by-side with PyTorch's own context_parallel (vs_pytorch_context_parallel.py drives both):
// one causal self-attention layer (x Wq, x Wk, x Wv, fsdp::ring_attention, Wo) over this rank's head-tail chunks
// of the sequence, forward and backward against a given output gradient, on the inputs the driver wrote.
//   fsdprun --nproc-per-node N vs_pytorch_ours <workdir> <allgather|alltoall> <headtail|none> <heads> <timed repetitions>
// Reads <workdir>/inputs.safetensors (x [batch, seq, dim], wq, wk, wv, wo [dim, dim] as y = x W, dout like x) and
// writes <workdir>/ours_<method>_<balancer>_rank<r>.safetensors: this rank's output and dx chunks, the weight gradients summed
// over the cp ranks, and the median wall time of one forward + backward (after one untimed warm-up).
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/context_parallel.h>
#include <fsdp/process_group.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace st = fsdp::checkpoint::safetensors;

struct Layer {
  torch::Tensor wq, wk, wv, wo;
};

// [batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim], as a model hands SDPA its heads.
torch::Tensor heads_first(const torch::Tensor& t, int64_t heads) {
  return t.view({t.size(0), t.size(1), heads, t.size(2) / heads}).transpose(1, 2);
}

torch::Tensor forward(const torch::Tensor& x, const Layer& w, int64_t heads, const fsdp::ProcessGroupPtr& cp,
                      const fsdp::ContextParallelOptions& options) {
  auto q = heads_first(x.matmul(w.wq), heads), k = heads_first(x.matmul(w.wk), heads),
       v = heads_first(x.matmul(w.wv), heads);
  auto attn = fsdp::ring_attention(q, k, v, cp, options);
  return attn.transpose(1, 2).reshape({x.size(0), x.size(1), -1}).matmul(w.wo);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr,
                 "usage: vs_pytorch_ours <workdir> <allgather|alltoall> <headtail|none> <heads> <timed repetitions>\n");
    return 2;
  }
  const std::string dir = argv[1];
  fsdp::ContextParallelOptions options;
  options.rotate_method = fsdp::parse_cp_rotate_method(argv[2]);
  options.load_balancer = fsdp::parse_cp_load_balancer(argv[3]);
  const int64_t heads = std::stoll(argv[4]), reps = std::stoll(argv[5]);
  fsdp::InitOptions init;
  init.backend = "gloo";
  auto cp = fsdp::init_process_group(init);
  const int64_t rank = cp->rank(), size = cp->size();

  auto in = st::load_file(dir + "/inputs.safetensors");
  auto shard = [&](const torch::Tensor& t) {
    return fsdp::context_parallel_shard(t, /*seq_dim=*/1, rank, size, options.load_balancer).contiguous();
  };
  const torch::Tensor x_local = shard(in.at("x")), dout_local = shard(in.at("dout"));
  Layer w{in.at("wq").clone().requires_grad_(), in.at("wk").clone().requires_grad_(),
          in.at("wv").clone().requires_grad_(), in.at("wo").clone().requires_grad_()};

  torch::Tensor out, dx;
  std::vector<double> ms;
  for (int64_t i = 0; i <= reps; ++i) {  // i = 0: the warm-up, and the results written
    for (auto* p : {&w.wq, &w.wk, &w.wv, &w.wo})
      if (p->grad().defined()) p->mutable_grad().zero_();
    auto x = x_local.clone().requires_grad_();
    cp->barrier().wait();
    const auto t0 = std::chrono::steady_clock::now();
    auto y = forward(x, w, heads, cp, options);
    y.backward(dout_local);
    const auto t1 = std::chrono::steady_clock::now();
    if (i == 0) {
      out = y.detach();
      dx = x.grad();
    } else {
      ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
  }
  std::sort(ms.begin(), ms.end());
  // Each rank's weight gradients cover its tokens only: the sum over the cp ranks is the whole sequence's.
  std::vector<std::pair<std::string, at::Tensor>> results{{"out", out}, {"dx", dx}};
  for (const auto& [name, p] : std::vector<std::pair<std::string, torch::Tensor>>{
           {"dwq", w.wq}, {"dwk", w.wk}, {"dwv", w.wv}, {"dwo", w.wo}}) {
    auto g = p.grad().clone();
    cp->all_reduce(g).wait();
    results.emplace_back(name, g);
  }
  results.emplace_back("median_ms", torch::tensor({ms.empty() ? 0.0 : ms[ms.size() / 2]}, torch::kDouble));
  st::save_file(dir + "/ours_" + argv[2] + "_" + argv[3] + "_rank" + std::to_string(rank) + ".safetensors", results);
  return 0;
}
