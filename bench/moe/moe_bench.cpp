// fsdp-bench-moe: the MoE block's routed experts with grouped GEMM (at::_grouped_mm) against a loop over the
// experts, forward + backward on one process, alternating the two (same weights, same tokens) so that both see
// the same machine state. Prints one line per configuration with the medians and their ratio.
//
//   build/bench/fsdp-bench-moe [--tokens 2048] [--dim 256] [--hidden 512] [--repeats 15]
#include <fsdp/models/moe.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// One forward + backward of `m` on x; seconds.
double step(fsdp::models::moe::MoE& m, const torch::Tensor& x) {
  m->zero_grad();
  const auto t0 = std::chrono::steady_clock::now();
  m->forward(x).pow(2).mean().backward();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 2048, dim = 256, hidden = 512, repeats = 15;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int64_t v = std::atoll(argv[i + 1]);
    if (k == "--tokens") tokens = v;
    else if (k == "--dim") dim = v;
    else if (k == "--hidden") hidden = v;
    else if (k == "--repeats") repeats = v;
    else {
      std::fprintf(stderr, "fsdp-bench-moe: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  torch::set_num_threads(1);
  std::printf("tokens %lld, dim %lld, hidden %lld, 1 thread, forward + backward, median of %lld (alternating)\n",
              static_cast<long long>(tokens), static_cast<long long>(dim), static_cast<long long>(hidden),
              static_cast<long long>(repeats));
  std::printf("| experts | top-k | grouped GEMM | loop | grouped / loop | max abs diff of outputs |\n|---|---|---|---|---|---|\n");
  for (auto [experts, k] : std::vector<std::pair<int64_t, int64_t>>{{8, 2}, {16, 2}, {64, 8}, {128, 8}}) {
    fsdp::models::moe::MoEOptions o;
    o.dim = dim;
    o.hidden = hidden;
    o.num_experts = experts;
    o.top_k = k;
    o.score_func = "softmax";
    o.route_norm = true;
    fsdp::models::moe::MoE grouped(o);
    o.use_grouped_mm = false;
    fsdp::models::moe::MoE loop(o);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
    grouped->init_weights(gen);
    {
      torch::NoGradGuard no_grad;
      auto src = grouped->named_parameters();
      for (auto& p : loop->named_parameters()) p.value().copy_(src[p.key()]);
    }
    const auto x = torch::randn({tokens, dim}, at::make_generator<at::CPUGeneratorImpl>(2));
    const double diff = (grouped->forward(x) - loop->forward(x)).abs().max().item<double>();
    std::vector<double> tg, tl;
    step(grouped, x);  // warm-up
    step(loop, x);
    for (int64_t r = 0; r < repeats; ++r) {
      if (r % 2 == 0) {
        tg.push_back(step(grouped, x));
        tl.push_back(step(loop, x));
      } else {
        tl.push_back(step(loop, x));
        tg.push_back(step(grouped, x));
      }
    }
    std::printf("| %lld | %lld | %.2f ms | %.2f ms | %.2f | %.1e |\n", static_cast<long long>(experts),
                static_cast<long long>(k), median(tg) * 1e3, median(tl) * 1e3, median(tg) / median(tl), diff);
  }
  return 0;
}
