// One rank of the checkpoint interop tests (started through fsdprun by interop_test). The model is our Llama 3
// (fsdp::models::llama) under fully_shard per block + root on a 1-D mesh over the world, as bench/vs_pytorch.
//
//   interop_worker dcp-resume <dcp-dir> <args.json> <tokens> <steps-before> <steps-after> <local-batch> <seq>
//                             <lr> <weight-decay> <out-dir>
//       load a PyTorch DCP checkpoint (model + AdamW state + train_state.step), save what was loaded as a libfsdp
//       checkpoint <out>/loaded (for the bit-for-bit comparison), train steps-after steps on the token batches
//       that follow, write <out>/ours_losses.json, then save <out>/final (libfsdp) and <out>/final_dcp
//       (SaveOptions::format = PytorchDcp).
//   interop_worker hf-import <args.json> <hf-dir> <tokens> <batch> <seq> <logits-out>
//       import Hugging Face weights (each rank reading only its rows), write the logits of one batch
//   interop_worker hf-export <args.json> <seed> <hf-dir> <tokens> <batch> <seq> <logits-out>
//       random weights (every tensor), export them as Hugging Face files, write the logits of one batch
// Exit status 0 = done; messages name what failed.
#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/models/hf_llama.h>
#include <fsdp/checkpoint/optimizer.h>
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/llama.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/process_group.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <fstream>
#include <iostream>

namespace llama = fsdp::models::llama;
namespace ckpt = fsdp::checkpoint;

namespace {

llama::LlamaArgs read_args(const std::string& path) {
  std::ifstream f(path);
  TORCH_CHECK(f, "interop_worker: cannot open ", path);
  const auto j = nlohmann::json::parse(f);
  llama::LlamaArgs a;
  a.dim = j.at("dim");
  a.n_layers = j.at("n_layers");
  a.n_heads = j.at("n_heads");
  a.n_kv_heads = j.at("n_kv_heads").get<int64_t>();
  a.vocab_size = j.at("vocab_size");
  a.multiple_of = j.at("multiple_of");
  if (!j.at("ffn_dim_multiplier").is_null()) a.ffn_dim_multiplier = j.at("ffn_dim_multiplier").get<double>();
  a.norm_eps = j.at("norm_eps");
  a.rope_theta = j.at("rope_theta");
  a.tie_embeddings = j.at("tie_embeddings").get<int>() != 0;
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const auto& r = j["rope_scaling"];
    a.rope_scaling = llama::RopeScaling{r.at("factor").get<double>(), r.at("low_freq_factor").get<double>(),
                                        r.at("high_freq_factor").get<double>(),
                                        r.at("original_max_position_embeddings").get<int64_t>()};
  }
  TORCH_CHECK(a.ffn_hidden_dim() == j.at("ffn_hidden_dim").get<int64_t>(), "interop_worker: ffn_hidden_dim mismatch");
  return a;
}

at::Tensor read_tokens(const std::string& path, int64_t n) {
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f, "interop_worker: cannot open ", path);
  at::Tensor t = at::empty({n}, at::kLong);
  f.read(static_cast<char*>(t.data_ptr()), n * 8);
  TORCH_CHECK(f.gcount() == n * 8, "interop_worker: ", path, " holds fewer than ", n, " tokens");
  return t;
}

void shard(llama::Transformer& model, const fsdp::DeviceMesh& mesh) {
  fsdp::FullyShardOptions o;
  o.mesh = mesh;
  for (auto& block : model->blocks()) fsdp::fully_shard(block, o);
  fsdp::fully_shard(model, o);
}

void write_logits(llama::Transformer& model, const std::string& tokens, int64_t batch, int64_t seq,
                  const std::string& out, int rank) {
  at::Tensor toks = read_tokens(tokens, batch * seq).view({batch, seq});
  at::Tensor logits;
  {
    c10::NoGradGuard no_grad;
    logits = fsdp::nn::call(model, toks).to(at::kFloat).contiguous();
  }
  if (rank == 0) ckpt::safetensors::save_file(out, {{"logits", logits}});
}

int dcp_resume(char** argv, const fsdp::ProcessGroupPtr& world) {
  const std::string dcp_dir = argv[2], out = argv[11];
  const llama::LlamaArgs args = read_args(argv[3]);
  const int64_t before = std::stoll(argv[5]), after = std::stoll(argv[6]), local_batch = std::stoll(argv[7]),
                seq = std::stoll(argv[8]);
  const double lr = std::stod(argv[9]), wd = std::stod(argv[10]);
  const int rank = world->rank(), W = world->size();
  auto mesh = fsdp::init_device_mesh("cpu", {W}, {"shard"});
  llama::Transformer model(args);
  model->init_weights(/*seed=*/4242);  // anything: the checkpoint replaces it
  shard(model, mesh);
  torch::optim::AdamW optim(model->parameters(),
                            torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(wd));

  ckpt::StateDict sd = ckpt::model_state_dict(*model);
  sd.merge(ckpt::optimizer_state_dict(*model, optim));
  sd.values["train_state.step"] = "0";
  ckpt::LoadOptions lo;
  lo.strict = false;  // PyTorch's extra hyperparameters (foreach, maximize, ...), lr_scheduler, data loader
  const auto res = ckpt::load(sd, dcp_dir, lo);
  TORCH_CHECK(res.missing.empty(), "interop_worker: DCP checkpoint lacks ", res.missing.size(), " keys, e.g. ",
              res.missing.front());
  ckpt::load_model_state_dict(*model, sd);
  ckpt::load_optimizer_state_dict(*model, optim, sd);
  const int64_t step = std::stoll(sd.values.at("train_state.step"));
  TORCH_CHECK(step == before, "interop_worker: train_state.step = ", step, ", expected ", before);
  if (rank == 0) {
    std::cout << "dcp-resume: loaded " << dcp_dir << " (" << res.bytes_read << " bytes on rank 0, "
              << res.unexpected.size() << " checkpoint entries not requested, e.g. "
              << (res.unexpected.empty() ? "-" : res.unexpected.front()) << ")" << std::endl;
  }
  // What was loaded, as a libfsdp checkpoint (values included).
  ckpt::StateDict loaded = ckpt::model_state_dict(*model);
  loaded.merge(ckpt::optimizer_state_dict(*model, optim));
  ckpt::save(loaded, out + "/loaded");

  const int64_t gb = local_batch * W, total = before + after;
  at::Tensor tokens = read_tokens(argv[4], total * gb * (seq + 1)).view({total, gb, seq + 1});
  nlohmann::json losses = nlohmann::json::array();
  for (int64_t s = before; s < total; ++s) {
    at::Tensor rows = tokens[s].narrow(0, rank * local_batch, local_batch);
    at::Tensor inputs = rows.narrow(1, 0, seq).contiguous(), targets = rows.narrow(1, 1, seq).contiguous();
    at::Tensor logits = fsdp::nn::call(model, inputs);
    at::Tensor loss = at::cross_entropy_loss(logits.flatten(0, 1), targets.flatten());
    loss.backward();
    optim.step();
    optim.zero_grad();
    at::Tensor l = loss.detach().clone();
    world->all_reduce(l, fsdp::ReduceOp::Sum).wait();
    losses.push_back(l.item<double>() / W);
  }
  if (rank == 0) {
    std::ofstream f(out + "/ours_losses.json");
    f << losses.dump() << "\n";
  }
  ckpt::StateDict final_sd = ckpt::model_state_dict(*model);
  final_sd.merge(ckpt::optimizer_state_dict(*model, optim));
  final_sd.values["train_state.step"] = std::to_string(total);
  ckpt::save(final_sd, out + "/final");
  ckpt::SaveOptions so;
  so.format = ckpt::Format::PytorchDcp;
  ckpt::save(final_sd, out + "/final_dcp", so);
  return 0;
}

int hf_import(char** argv, const fsdp::ProcessGroupPtr& world) {
  const llama::LlamaArgs args = read_args(argv[2]);
  auto mesh = fsdp::init_device_mesh("cpu", {world->size()}, {"shard"});
  llama::Transformer model(args);
  model->init_weights(/*seed=*/99);
  shard(model, mesh);
  const auto res = fsdp::models::hf::import_llama(*model, argv[3]);
  // Only this rank's rows: about 1/W of the model's bytes (uneven shards round up).
  int64_t total = 0;
  for (const auto& [key, t] : fsdp::sharded_state_dict(*model)) total += t.local().numel() * 4;
  std::cout << "hf-import: rank " << world->rank() << " read " << res.bytes_read << " bytes for " << total
            << " bytes of local shards" << std::endl;
  TORCH_CHECK(res.bytes_read == total, "hf-import: read ", res.bytes_read, " bytes, local shards hold ", total);
  write_logits(model, argv[4], std::stoll(argv[5]), std::stoll(argv[6]), argv[7], world->rank());
  return 0;
}

int hf_export(char** argv, const fsdp::ProcessGroupPtr& world) {
  const llama::LlamaArgs args = read_args(argv[2]);
  auto mesh = fsdp::init_device_mesh("cpu", {world->size()}, {"shard"});
  llama::Transformer model(args);
  model->init_weights(std::stoull(argv[3]));
  {
    // Every tensor random (norms too), identical on every rank, so a wrong name or row mapping shows.
    c10::NoGradGuard no_grad;
    at::Generator gen = at::detail::createCPUGenerator(std::stoull(argv[3]) + 1);
    for (auto& p : model->parameters()) p.add_(at::randn(p.sizes(), gen) * 0.05);
  }
  shard(model, mesh);
  ckpt::SafetensorsExportOptions eo;
  eo.max_file_bytes = 64 << 10;  // several files + model.safetensors.index.json
  fsdp::models::hf::export_llama(*model, argv[4], eo);
  write_logits(model, argv[5], std::stoll(argv[6]), std::stoll(argv[7]), argv[8], world->rank());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    TORCH_CHECK(argc >= 2, "usage: interop_worker <mode> ...");
    const std::string mode = argv[1];
    auto world = fsdp::init_process_group();
    int rc = 1;
    if (mode == "dcp-resume" && argc == 12) rc = dcp_resume(argv, world);
    else if (mode == "hf-import" && argc == 8) rc = hf_import(argv, world);
    else if (mode == "hf-export" && argc == 9) rc = hf_export(argv, world);
    else TORCH_CHECK(false, "interop_worker: bad mode or argument count: ", mode, " (", argc, " args)");
    world->barrier().wait();
    fsdp::destroy_process_group();
    return rc;
  } catch (const std::exception& e) {
    std::cerr << "interop_worker: " << e.what() << std::endl;
    return 1;
  }
}
