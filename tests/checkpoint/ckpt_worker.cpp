// One rank of the multi-process checkpoint tests, started through fsdprun by checkpoint_roundtrip_test.
//
//   ckpt_worker save <dir> <mesh> <optim>   train a sharded MLP 3 steps, write an independent reference
//                                           (<dir>.ref.safetensors: full parameters from fsdp::full_state_dict and
//                                           the optimizer's own state tensors all-gathered), then save <dir>
//   ckpt_worker load <dir> <mesh> <optim>   build a different model and optimizer, load <dir>, gather the same
//                                           way and compare with the reference bit for bit
//   ckpt_worker saveloop <folder> <mesh> -   save step-1, step-2, ... forever (keep_latest_k 2), each step's tensors
//                                           filled with values derived from the step: the crash test kills it
//   ckpt_worker stimport <file> <mesh> -    import a safetensors file written by one process into a sharded model
//                                           (each rank reading only its own rows: bytes counted against the
//                                           rows it owns), compare with the file, then export_safetensors to
//                                           <file>.export/ in small files for the test to compare
//   ckpt_worker golden <dir> <mesh> -       save a fixed state (no RNG, no training: the same bytes on every
//                                           run) as <dir>/libfsdp and <dir>/dcp; rank 0 then converts each into
//                                           the other format (<dir>/libfsdp-to-dcp, <dir>/dcp-to-libfsdp). The
//                                           test hashes every file against committed hashes (byte identity of the
//                                           writers across refactors)
//   <mesh>: "N" (1-D over N ranks) or "RxS" (HSDP: R replicas x S shards); <optim>: adamw | adam | sgd
// Exit status 0 = everything matched; messages name what did not.
#include "comm/dist_env.h"
#include "fully_shard/fsdp_test_util.h"

#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/checkpoint/model_safetensors.h>
#include <fsdp/checkpoint/optimizer.h>
#include <fsdp/checkpoint/safetensors.h>

#include <iostream>

using namespace fsdp_test;
namespace ckpt = fsdp::checkpoint;

namespace {

fsdp::DeviceMesh make_mesh(const std::string& spec) {
  auto x = spec.find('x');
  if (x == std::string::npos) return fsdp::init_device_mesh("cpu", {std::stoll(spec)}, {"shard"});
  return fsdp::init_device_mesh("cpu", {std::stoll(spec.substr(0, x)), std::stoll(spec.substr(x + 1))},
                                {"replicate", "shard"});
}

MLP make_model(uint64_t seed) {
  torch::manual_seed(seed);
  return MLP(7, 67, 131, 5, 3);  // uneven shards on 2, 3, 4 ranks
}

std::unique_ptr<torch::optim::Optimizer> make_optim(const std::string& kind, MLP& model, double lr) {
  auto params = model->parameters();
  if (kind == "adamw") return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr).weight_decay(0.05));
  if (kind == "adam")
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr).amsgrad(true).betas({0.8, 0.9}));
  if (kind == "sgd")
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(lr).momentum(0.9).dampening(0.1));
  throw std::runtime_error("unknown optimizer " + kind);
}

// The independent reference: full parameters and the optimizer's own state tensors, gathered.
std::map<std::string, torch::Tensor> gather_reference(MLP& model, torch::optim::Optimizer& optim, const std::string& kind) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [k, v] : fsdp::full_state_dict(*model, {/*cpu_offload=*/true, /*rank0_only=*/false})) out["model/" + k] = v;
  auto layout = fsdp::sharded_state_dict(*model);
  for (const auto& item : model->named_parameters()) {
    const auto& l = layout.at(item.key());
    auto full = [&](const torch::Tensor& t) {
      return fsdp::ShardedTensor::from_local(t.contiguous(), l.mesh(), l.placements(), l.sizes()).full_tensor();
    };
    auto& s = *optim.state().at(item.value().unsafeGetTensorImpl());
    const std::string p = "optim/" + item.key() + "/";
    if (kind == "sgd") {
      out[p + "momentum_buffer"] = full(static_cast<torch::optim::SGDParamState&>(s).momentum_buffer());
      continue;
    }
    auto get = [&](auto& st) {
      out[p + "exp_avg"] = full(st.exp_avg());
      out[p + "exp_avg_sq"] = full(st.exp_avg_sq());
      if (st.max_exp_avg_sq().defined()) out[p + "max_exp_avg_sq"] = full(st.max_exp_avg_sq());
      out[p + "step"] = torch::tensor({st.step()}, torch::kLong);
    };
    if (kind == "adamw") get(static_cast<torch::optim::AdamWParamState&>(s));
    else get(static_cast<torch::optim::AdamParamState&>(s));
  }
  return out;
}

int run(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: ckpt_worker save|load <dir> <mesh> <optim>\n";
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2], mesh_spec = argv[3], kind = argv[4];
  auto world = test_world();
  auto mesh = make_mesh(mesh_spec);
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh;
  const double lr = 1e-2;
  int failures = 0;
  auto fail = [&](const std::string& what) {
    ++failures;
    std::cerr << "rank " << world->rank() << ": " << what << "\n";
  };

  if (mode == "saveloop") {
    auto sd_for = [&](int64_t step) {
      ckpt::StateDict sd;
      for (int i = 0; i < 3; ++i) {
        auto full = torch::arange(300000, torch::kFloat).reshape({3000, 100}) * 0 + static_cast<float>(step * 10 + i);
        sd.tensors["t" + std::to_string(i)] = fsdp::distribute_tensor(full, mesh, mesh.ndim() == 2 ?
            fsdp::Placements{fsdp::Replicate(), fsdp::Shard(0)} : fsdp::Placements{fsdp::Shard(0)});
      }
      sd.values["step"] = std::to_string(step);
      return sd;
    };
    for (int64_t step = 1;; ++step) {
      ckpt::save(sd_for(step), ckpt::step_path(dir, step));
      if (world->rank() == 0) ckpt::purge(dir, 2);
    }
  }

  if (mode == "stimport") {
    MLP model = make_model(99);
    shard_mlp(model, opts);
    const auto res = ckpt::import_safetensors(*model, dir);
    const auto ref = fsdp::checkpoint::safetensors::load_file(dir);
    auto got = fsdp::full_state_dict(*model, {/*cpu_offload=*/true, /*rank0_only=*/false});
    if (got.size() != ref.size()) fail("model has " + std::to_string(got.size()) + " tensors, the file " + std::to_string(ref.size()));
    // The rows this rank owns: torch.chunk over the shard dim (the last mesh dim), ceil-sized chunks.
    const int64_t shards = mesh.size(mesh.ndim() - 1), index = mesh.coordinate()[mesh.ndim() - 1];
    int64_t expected_bytes = 0;
    MLP fresh = make_model(99);
    auto fresh_params = fresh->named_parameters();
    for (const auto& [k, r] : ref) {
      auto it = got.find(k);
      if (it == got.end()) { fail("not imported: " + k); continue; }
      if (!torch::equal(it->second, r)) fail("not bit-identical: " + k);
      if (torch::equal(fresh_params[k], r)) fail("the file's " + k + " equals the fresh model's (trivial test)");
      const int64_t rows = r.size(0), per = (rows + shards - 1) / shards;
      const int64_t mine = std::max<int64_t>(0, std::min(rows, (index + 1) * per) - index * per);
      expected_bytes += mine * (r.numel() / rows) * static_cast<int64_t>(r.element_size());
    }
    if (res.bytes_read != expected_bytes) {
      fail("read " + std::to_string(res.bytes_read) + " bytes, its rows hold " + std::to_string(expected_bytes));
    }
    ckpt::SafetensorsExportOptions eo;
    eo.max_file_bytes = 4096;  // several files and an index
    eo.metadata["source"] = "ckpt_worker";
    const auto ex = ckpt::export_safetensors(*model, dir + ".export", eo);
    std::cout << "rank " << world->rank() << " read " << res.bytes_read << " bytes; exported " << ex.total_bytes
              << " bytes in " << ex.files.size() << " files; " << (failures ? "FAILED" : "all equal") << "\n";
    return failures ? 1 : 0;
  }

  if (mode == "golden") {
    // Every kind of entry a save writes: uneven row shards (the last rank's may be empty), column shards, a
    // replicated tensor (written by rank 0 only), whole tensors of several dtypes, a scalar, an empty tensor,
    // values (TorchTitan-style keys, so the DCP planner data covers nested paths).
    const int64_t n = mesh.size(0);
    const int64_t r = mesh.coordinate()[0];
    auto rows = [&](int64_t total, int64_t cols, double scale) {
      auto full = torch::arange(total * cols, torch::kFloat).reshape({total, cols}).mul(scale);
      return fsdp::ShardedTensor::from_local(full.chunk(n, 0).size() > static_cast<size_t>(r)
                                                 ? full.chunk(n, 0)[r].contiguous()
                                                 : torch::empty({0, cols}),
                                             mesh, {fsdp::Shard(0)}, {total, cols});
    };
    ckpt::StateDict sd;
    sd.tensors["model.w1"] = rows(7, 5, 0.5);
    sd.tensors["model.w2"] = rows(2, 3, -1.25);  // fewer rows than ranks on 3 ranks: an empty shard
    auto cols = torch::arange(4 * 9, torch::kFloat).reshape({4, 9}).to(torch::kBFloat16);
    sd.tensors["model.wc"] = fsdp::ShardedTensor::from_local(cols.chunk(n, 1)[r].contiguous(), mesh, {fsdp::Shard(1)}, {4, 9});
    sd.tensors["model.rep"] = fsdp::ShardedTensor::from_local(torch::linspace(-1, 1, 6), mesh, {fsdp::Replicate()}, {6});
    sd.tensors["optimizer.state.model.w1.exp_avg"] = rows(7, 5, 0.125);
    sd.full["model.ids"] = torch::arange(10, torch::kLong).reshape({5, 2});
    sd.full["model.half"] = torch::arange(12, torch::kFloat).to(torch::kHalf);
    sd.full["optimizer.state.model.w1.step"] = torch::scalar_tensor(static_cast<int64_t>(3), torch::kLong);
    sd.full["model.empty"] = torch::empty({0, 4});
    sd.values["train_state.step"] = "3";
    sd.values["lr_scheduler.state"] = R"({"last_epoch": 3, "base_lrs": [0.001], "name": "warmup"})";
    ckpt::SaveOptions so;
    so.block_bytes = 64;
    so.saved_on = "mesh " + mesh_spec;
    ckpt::save(sd, dir + "/libfsdp", so);
    so.format = ckpt::Format::PytorchDcp;
    ckpt::save(sd, dir + "/dcp", so);
    if (world->rank() == 0) {
      ckpt::ConvertOptions co;
      co.to = ckpt::Format::PytorchDcp;
      ckpt::convert(dir + "/libfsdp", dir + "/libfsdp-to-dcp", co);
      co.to = ckpt::Format::Libfsdp;
      ckpt::convert(dir + "/dcp", dir + "/dcp-to-libfsdp", co);
    }
    world->barrier().wait();
    std::cout << "rank " << world->rank() << " saved the golden state\n";
    return 0;
  }

  if (mode == "save") {
    MLP model = make_model(5);
    shard_mlp(model, opts);
    auto optim = make_optim(kind, model, lr);
    for (int64_t step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step * 16 + world->rank(), 4, 7, 5);
      optim->zero_grad();
      torch::mse_loss(fsdp::nn::call(model, x), y).backward();
      optim->step();
    }
    auto ref = gather_reference(model, *optim, kind);
    if (world->rank() == 0) {
      std::vector<std::pair<std::string, torch::Tensor>> items(ref.begin(), ref.end());
      fsdp::checkpoint::safetensors::save_file(dir + ".ref.safetensors", items);
    }
    auto sd = ckpt::model_state_dict(*model);
    sd.merge(ckpt::optimizer_state_dict(*model, *optim));
    ckpt::SaveOptions so;
    so.block_bytes = 256;  // many checksum blocks per chunk: partial reads verify sub-ranges
    so.saved_on = "mesh " + mesh_spec;
    auto res = ckpt::save(sd, dir, so);
    std::cout << "rank " << world->rank() << " wrote " << res.local_bytes << " of " << res.total_bytes << " bytes\n";
    return 0;
  }

  // load: a different model and an optimizer with other hyperparameters and no state yet.
  MLP model = make_model(99);
  shard_mlp(model, opts);
  auto optim = make_optim(kind, model, 0.5);
  auto sd = ckpt::model_state_dict(*model);
  sd.merge(ckpt::optimizer_state_dict(*model, *optim));
  auto res = ckpt::load(sd, dir);
  ckpt::load_model_state_dict(*model, sd);
  ckpt::load_optimizer_state_dict(*model, *optim, sd);

  const auto ref = fsdp::checkpoint::safetensors::load_file(dir + ".ref.safetensors");
  const auto got = gather_reference(model, *optim, kind);
  if (ref.size() != got.size()) fail("reference has " + std::to_string(ref.size()) + " entries, loaded " + std::to_string(got.size()));
  bool nontrivial_state = false, params_changed = false;
  MLP fresh = make_model(99);
  auto fresh_params = fresh->named_parameters();
  for (const auto& [k, r] : ref) {
    auto it = got.find(k);
    if (it == got.end()) {
      fail("missing " + k);
      continue;
    }
    if (!torch::equal(it->second, r)) fail("not bit-identical: " + k);
    if (k.rfind("optim/", 0) == 0 && k.find("/step") == std::string::npos && r.abs().sum().item<double>() > 0)
      nontrivial_state = true;
    if (k.rfind("optim/", 0) == 0 && k.find("/step") != std::string::npos && r.item<int64_t>() != 3)
      fail("reference step of " + k + " is not 3");
    if (k.rfind("model/", 0) == 0 && !torch::equal(r, fresh_params[k.substr(6)])) params_changed = true;
  }
  if (!nontrivial_state) fail("reference optimizer state is all zeros (trivial test)");
  if (!params_changed) fail("reference parameters equal the fresh model's (trivial test)");
  for (auto& g : optim->param_groups()) {
    if (g.options().get_lr() != lr) fail("lr not restored: " + std::to_string(g.options().get_lr()));
  }
  // Only this rank's byte ranges were read: about its share of the data (+ checksum-block rounding).
  const int64_t total = ckpt::inspect(dir).total_bytes;
  const int64_t share = total / mesh.size(mesh.ndim() - 1);
  if (res.bytes_read > share + 64 * 1024) {
    fail("read " + std::to_string(res.bytes_read) + " bytes; its share of " + std::to_string(total) + " is " +
         std::to_string(share));
  }
  std::cout << "rank " << world->rank() << " read " << res.bytes_read << " of " << total << " bytes; "
            << (failures ? "FAILED" : "all equal") << "\n";
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  int rc = 0;
  try {
    rc = run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "ckpt_worker: " << e.what() << "\n";
    rc = 1;
  }
  try {
    if (fsdp::is_initialized()) fsdp::world()->barrier().wait();
    fsdp::destroy_process_group();
  } catch (...) {
  }
  return rc;
}
