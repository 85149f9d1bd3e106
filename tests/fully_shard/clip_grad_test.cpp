// fsdp::clip_grad_norm_ with every p-norm (inf, 1, 2, 3, 0.5) equals torch::nn::utils::clip_grad_norm_ on the
// single-process model with the same gradients (1e-6): the returned total norm and every clipped gradient, over
// FSDP-sharded parameters (a shard group of 2), HSDP (2 replicas of a 1-rank shard group: the replicated copies
// count once) and tensor-parallel parameters (colwise / rowwise shards plus replicated rowwise biases). Each
// case clips for real (the clip coefficient is checked < 1). p <= 0 and NaN are refused.
#include "fully_shard/fsdp_test_util.h"

#include <fsdp/clip_grad.h>
#include <fsdp/tensor_parallel.h>

#include <cmath>
#include <limits>

using namespace fsdp_test;

namespace {

constexpr int64_t kBatch = 12;
const double kInf = std::numeric_limits<double>::infinity();
const std::vector<double> kNorms = {kInf, 1.0, 2.0, 3.0, 0.5};

// Two colwise -> rowwise pairs (13 and 11 hidden: uneven over 2 ranks).
struct PairImpl : torch::nn::Module {
  PairImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(7, 13));
    fc2 = register_module("fc2", torch::nn::Linear(13, 9));
    fc3 = register_module("fc3", torch::nn::Linear(9, 11));
    fc4 = register_module("fc4", torch::nn::Linear(11, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = fsdp::nn::call(fc2, torch::relu(fsdp::nn::call(fc1, x)));
    return fsdp::nn::call(fc4, torch::tanh(fsdp::nn::call(fc3, torch::tanh(h))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, fc4{nullptr};
};
TORCH_MODULE(Pair);

std::pair<torch::Tensor, torch::Tensor> batch() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  return {torch::randn({kBatch, 7}, gen), torch::randn({kBatch, 5}, gen)};
}

struct Reference {
  double norm = 0;
  std::map<std::string, torch::Tensor> clipped;  // full clipped gradients by FQN
};

// Single process, whole batch, torch's clipping at max_norm = `fraction` of the unclipped norm.
Reference reference(double p, double fraction, double* max_norm) {
  torch::manual_seed(3);
  Pair ref;
  auto [x, y] = batch();
  torch::mse_loss(ref->forward(x), y).backward();
  std::vector<torch::Tensor> params = ref->parameters();
  const double unclipped = torch::nn::utils::clip_grad_norm_(params, 1e30, p);
  *max_norm = fraction * unclipped;
  Reference out;
  out.norm = torch::nn::utils::clip_grad_norm_(params, *max_norm, p);
  for (const auto& item : ref->named_parameters()) out.clipped[item.key()] = item.value().grad().clone();
  EXPECT_NEAR(out.norm, unclipped, 1e-6 * unclipped);
  return out;
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(1e-12, want.abs().max().item<double>());
  EXPECT_LE((got - want).abs().max().item<double>() / scale, 1e-6) << what;
}

// FSDP or HSDP over `mesh` (its last dim shards): each rank backpropagates its half of the batch and clips; its
// gradient shards must equal its dim-0 chunk (torch.chunk sizes) of the reference's clipped gradients.
void check_fully_shard(const fsdp::DeviceMesh& mesh, const std::string& label) {
  const int64_t rank = test_world()->rank(), world = test_world()->size();
  const int64_t shard_dim = mesh.ndim() - 1;
  const int64_t shards = mesh.group(shard_dim)->size(), shard_rank = mesh.local_rank(shard_dim);
  for (double p : kNorms) {
    const std::string what = label + ", p = " + std::to_string(p);
    double max_norm = 0;
    const Reference ref = reference(p, 0.3, &max_norm);
    torch::manual_seed(3);
    Pair model;
    fsdp::FullyShardOptions opts;
    opts.mesh = mesh;
    for (auto* fc : {&model->fc1, &model->fc2, &model->fc3, &model->fc4}) fsdp::fully_shard(*fc, opts);
    fsdp::fully_shard(model, opts);
    auto [x, y] = batch();
    const int64_t local = kBatch / world;
    torch::mse_loss(fsdp::nn::call(model, x.narrow(0, rank * local, local)), y.narrow(0, rank * local, local))
        .backward();
    const double norm = fsdp::clip_grad_norm_(*model, max_norm, p).item<double>();
    EXPECT_NEAR(norm, ref.norm, 1e-6 * ref.norm) << what;
    EXPECT_LT(max_norm / norm, 1.0) << what << ": the case must clip";
    size_t compared = 0;
    for (const auto& item : model->named_parameters()) {
      const torch::Tensor& full = ref.clipped.at(item.key());
      const auto chunks = full.chunk(shards, 0);
      const torch::Tensor want =
          shard_rank < static_cast<int64_t>(chunks.size()) ? chunks[shard_rank] : full.narrow(0, 0, 0);
      ASSERT_TRUE(item.value().grad().defined()) << what << " " << item.key();
      expect_close(item.value().grad(), want, what + " " + item.key());
      ++compared;
    }
    EXPECT_EQ(compared, ref.clipped.size()) << what;
  }
}

}  // namespace

TEST(ClipGradNorm, EveryPNormOverFullyShardedParameters) {
  if (test_world()->size() != 2) GTEST_SKIP() << "written for 2 ranks";
  check_fully_shard(fsdp::init_device_mesh("cpu", {2}, {"shard"}), "FSDP shard 2");
}

TEST(ClipGradNorm, EveryPNormOverHsdpReplicas) {
  if (test_world()->size() != 2) GTEST_SKIP() << "written for 2 ranks";
  check_fully_shard(fsdp::init_device_mesh("cpu", {2, 1}, {"replicate", "shard"}), "HSDP 2x1");
}

TEST(ClipGradNorm, EveryPNormOverTensorParallelParameters) {
  if (test_world()->size() != 2) GTEST_SKIP() << "written for 2 ranks";
  auto mesh = fsdp::init_device_mesh("cpu", {2}, {"tp"});
  const int64_t r = mesh.local_rank(0);
  for (double p : kNorms) {
    const std::string what = "TP 2, p = " + std::to_string(p);
    double max_norm = 0;
    const Reference ref = reference(p, 0.3, &max_norm);
    torch::manual_seed(3);
    Pair model;
    fsdp::parallelize_module(model, mesh,
                             {{"fc1", fsdp::ColwiseParallel{}}, {"fc2", fsdp::RowwiseParallel{}},
                              {"fc3", fsdp::ColwiseParallel{}}, {"fc4", fsdp::RowwiseParallel{}}});
    auto [x, y] = batch();  // tensor parallel: every rank sees the whole batch
    torch::mse_loss(fsdp::nn::call(model, x), y).backward();
    const double norm = fsdp::clip_grad_norm_(*model, max_norm, p).item<double>();
    EXPECT_NEAR(norm, ref.norm, 1e-6 * ref.norm) << what;
    EXPECT_LT(max_norm / norm, 1.0) << what << ": the case must clip";
    // This rank's piece of each reference gradient: colwise splits weight rows and bias, rowwise weight columns
    // (its bias is replicated), in torch.chunk sizes.
    for (const auto& item : model->named_parameters()) {
      const std::string& fqn = item.key();
      const torch::Tensor& want_full = ref.clipped.at(fqn);
      const bool colwise = fqn.rfind("fc1.", 0) == 0 || fqn.rfind("fc3.", 0) == 0;
      const bool rowwise_weight = (fqn == "fc2.weight" || fqn == "fc4.weight");
      torch::Tensor want = colwise ? want_full.chunk(2, 0)[r] : rowwise_weight ? want_full.chunk(2, 1)[r] : want_full;
      expect_close(item.value().grad(), want, what + " " + fqn);
    }
  }
}

TEST(ClipGradNorm, RefusesNonPositiveAndNanNorms) {
  torch::manual_seed(3);
  Pair model;
  auto [x, y] = batch();
  torch::mse_loss(model->forward(x), y).backward();
  for (double p : {0.0, -1.0, -kInf, std::nan("")}) {
    try {
      fsdp::clip_grad_norm_(*model, 1.0, p);
      ADD_FAILURE() << "norm_type " << p << " accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("norm_type must be > 0"), std::string::npos) << e.what();
    }
  }
}
