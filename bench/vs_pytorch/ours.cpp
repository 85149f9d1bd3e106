// Our side of the side-by-side benchmark against PyTorch FSDP2 (bench/vs_pytorch/run.py drives both).
//
//   fsdp-bench-ours init   --flavor F --seed S --out init.safetensors       initial weights (+ model args)
//   fsdp-bench-ours train  --weights W --tokens T --steps N --local-batch B --seq S --out-dir D [...]
//                          (under fsdprun: fully_shard per block + root, AdamW, cross-entropy mean)
//   fsdp-bench-ours single --weights W --tokens T ... (one process, no FSDP: the roofline's compute limit)
//   train and single take --device cpu (default) | cuda: on CUDA every rank computes on cuda:0 (ranks share the
//   one GPU) and the collectives are Gloo's on CUDA tensors; each step also logs the device's peak allocated
//   bytes. Not yet run on a GPU (docs/benchmarks.md).
//   fsdp-bench-ours memcpy                        (memcpy bandwidth: the roofline's communication limit)
//
// Every rank writes one JSON line per step to D/ours_rank<r>.jsonl: global mean loss, step time, peak RSS
// (VmHWM), bytes this rank sent during the step (CommStats) and collective counts. The training step is
// exactly the Python side's (vs_pytorch.py): forward, cross-entropy mean, backward, AdamW step, zero_grad.
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/comm_stats.h>
#include <fsdp/device_mesh.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/llama.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/process_group.h>

#include "bench_util.h"

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <CLI/CLI.hpp>
#include <torch/optim/adamw.h>

#include <chrono>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <variant>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

namespace llama = fsdp::models::llama;
namespace st = fsdp::checkpoint::safetensors;

namespace {

struct Options {
  std::string flavor = "debugmodel";
  uint64_t seed = 0;
  std::string out;
  std::string weights, tokens, out_dir = ".";
  int64_t steps = 50, local_batch = 2, seq = 128;
  std::string reshard = "default";  // default | true | false | <int>
  int64_t replicate = 1;            // HSDP replicate degree (1 = plain FSDP over the world)
  std::string mp = "fp32";          // fp32 | bf16 (MixedPrecisionPolicy: bf16 params in compute, fp32 reduce)
  double lr = 8e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  bool reset_peak = true;  // reset VmHWM after setup, so the peak is the training phase's
  std::string device = "cpu";  // cpu | cuda (train, single)
  bool tie_embeddings = false;  // init: tie the output layer to the embeddings whatever the flavor says
};

// The device the training runs on. CUDA: cuda:0 for every rank (2 ranks share one GPU over Gloo).
c10::Device bench_device(const Options& o) {
  TORCH_CHECK(o.device == "cpu" || o.device == "cuda", "bench: --device must be cpu or cuda, got '", o.device, "'");
  if (o.device == "cpu") return c10::Device(c10::kCPU);
  TORCH_CHECK(at::hasCUDA(), "bench: --device cuda, but this libtorch has no CUDA device (a CPU-only build, or no "
              "GPU on this machine); the GPU comparison needs a CUDA libtorch and a GPU (not yet run: "
              "docs/benchmarks.md)");
  return c10::Device(c10::kCUDA, 0);
}

// Waits for the device's queued work (nothing to wait for on the CPU), so step times include it.
void sync_device(const c10::Device& device) {
  if (device.is_cuda()) at::accelerator::synchronizeDevice(device.index());
}

// Peak bytes allocated on the device since the last reset (the caching allocator's aggregate stat); 0 on the CPU.
int64_t device_peak_bytes(const c10::Device& device) {
  if (!device.is_cuda()) return 0;
  return at::accelerator::getDeviceStats(device.index()).allocated_bytes[0].peak;
}
// Peak bytes the caching allocator reserved from the driver (TorchTitan's max_reserved); 0 on the CPU.
int64_t device_reserved_peak_bytes(const c10::Device& device) {
  if (!device.is_cuda()) return 0;
  return at::accelerator::getDeviceStats(device.index()).reserved_bytes[0].peak;
}
void reset_device_peak(const c10::Device& device) {
  if (device.is_cuda()) at::accelerator::resetPeakStats(device.index());
}

// Model args travel inside the weights file, so both sides build exactly the same model.
std::map<std::string, std::string> args_metadata(const std::string& flavor, const llama::LlamaArgs& a) {
  std::ostringstream theta, eps;
  theta.precision(17), eps.precision(17);
  theta << a.rope_theta, eps << a.norm_eps;
  std::map<std::string, std::string> meta = {{"flavor", flavor},
          {"dim", std::to_string(a.dim)},
          {"n_layers", std::to_string(a.n_layers)},
          {"n_heads", std::to_string(a.n_heads)},
          {"n_kv_heads", std::to_string(a.kv_heads())},
          {"vocab_size", std::to_string(a.vocab_size)},
          {"ffn_hidden_dim", std::to_string(a.ffn_hidden_dim())},
          {"norm_eps", eps.str()},
          {"rope_theta", theta.str()},
          {"tie_embeddings", a.tie_embeddings ? "1" : "0"}};
  if (a.rope_scaling) {  // Llama 3.1 RoPE scaling (debugmodel has it)
    auto num = [](double v) {
      std::ostringstream s;
      s.precision(17);
      s << v;
      return s.str();
    };
    meta["rope_scaling_factor"] = num(a.rope_scaling->factor);
    meta["rope_low_freq_factor"] = num(a.rope_scaling->low_freq_factor);
    meta["rope_high_freq_factor"] = num(a.rope_scaling->high_freq_factor);
    meta["rope_original_max_position_embeddings"] = std::to_string(a.rope_scaling->original_max_position_embeddings);
  }
  return meta;
}

// The flavor's args with the file's own choice of tied embeddings (init may override the flavor's).
llama::LlamaArgs args_of(const std::string& flavor, bool tie_embeddings) {
  llama::LlamaArgs args = llama::llama3_flavor(flavor);
  args.tie_embeddings = tie_embeddings;
  return args;
}

int cmd_init(const Options& o) {
  const llama::LlamaArgs args = args_of(o.flavor, o.tie_embeddings || llama::llama3_flavor(o.flavor).tie_embeddings);
  llama::Transformer model(args);
  model->init_weights(o.seed);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& item : model->named_parameters()) tensors.emplace_back(item.key(), item.value());
  st::save_file(o.out, tensors, args_metadata(o.flavor, args));
  std::cout << "wrote " << tensors.size() << " tensors (" << llama::num_params(args) << " parameters) to " << o.out
            << "\n";
  return 0;
}

// A model built from the flavor named in the weights file, with the file's weights.
llama::Transformer load_model(const std::string& path, std::string* flavor = nullptr) {
  st::Reader reader(path);
  const auto& meta = reader.metadata();
  TORCH_CHECK(meta.count("flavor"), "bench: ", path, " has no 'flavor' metadata (write it with `init`)");
  const auto tie = meta.find("tie_embeddings");
  llama::Transformer model(args_of(meta.at("flavor"), tie != meta.end() && tie->second == "1"));
  for (auto& item : model->named_parameters()) reader.read_into(item.key(), item.value());
  if (flavor) *flavor = meta.at("flavor");
  return model;
}

// The step's token rows for this rank: rows [rank*B, (rank+1)*B) of step `step` in an int64 file of shape
// [steps, global_batch, seq + 1].
struct Batches {
  at::Tensor all;  // [steps, global_batch, seq+1]
  Batches(const std::string& path, int64_t steps, int64_t global_batch, int64_t seq) {
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    TORCH_CHECK(f, "bench: cannot open tokens file ", path);
    const int64_t want = steps * global_batch * (seq + 1) * 8;
    TORCH_CHECK(static_cast<int64_t>(f.tellg()) >= want, "bench: ", path, " has ", static_cast<int64_t>(f.tellg()),
                " bytes; ", steps, " steps x ", global_batch, " x ", seq + 1, " int64 need ", want);
    f.seekg(0);
    all = at::empty({steps, global_batch, seq + 1}, at::kLong);
    f.read(static_cast<char*>(all.data_ptr()), want);
  }
  std::pair<at::Tensor, at::Tensor> get(int64_t step, int64_t rank, int64_t local_batch) const {
    at::Tensor rows = all[step].narrow(0, rank * local_batch, local_batch);
    return {rows.narrow(1, 0, rows.size(1) - 1).contiguous(), rows.narrow(1, 1, rows.size(1) - 1).contiguous()};
  }
};

std::optional<fsdp::ReshardAfterForward> parse_reshard(const std::string& s) {
  if (s == "default") return std::nullopt;
  if (s == "true") return fsdp::ReshardAfterForward(true);
  if (s == "false") return fsdp::ReshardAfterForward(false);
  return fsdp::ReshardAfterForward(std::stoi(s));
}

torch::optim::AdamW make_adamw(const Options& o, std::vector<at::Tensor> params) {
  return torch::optim::AdamW(std::move(params), torch::optim::AdamWOptions(o.lr)
                                                    .betas({o.beta1, o.beta2})
                                                    .eps(o.eps)
                                                    .weight_decay(o.weight_decay)
                                                    .amsgrad(false));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int cmd_train(const Options& o) {
  const int64_t baseline_rss = bench::rss_kib("VmRSS");
  const c10::Device device = bench_device(o);
  fsdp::InitOptions init;
  if (device.is_cuda()) {  // Gloo on CUDA tensors: several ranks may share the one GPU (NCCL refuses that)
    init.backend = "gloo";
    init.device = "cuda:0";
  }
  auto world = fsdp::init_process_group(init);
  const int rank = world->rank(), W = world->size();
  TORCH_CHECK(o.replicate >= 1 && W % o.replicate == 0, "bench: --replicate ", o.replicate,
              " does not divide the world size ", W);
  const int64_t R = o.replicate, S = W / o.replicate;
  // 1-D: FSDP over the world; 2-D (replicate, shard): HSDP, as torch's init_device_mesh on the Python side.
  const std::string mesh_device = device.is_cuda() ? "cuda" : "cpu";
  auto mesh = R > 1 ? fsdp::init_device_mesh(mesh_device, {R, S}, {"replicate", "shard"})
                    : fsdp::init_device_mesh(mesh_device, {W}, {"shard"});
  const int64_t rss_after_init = bench::rss_kib("VmRSS");
  const int64_t anon_after_init = bench::rss_kib("RssAnon");

  std::string flavor;
  llama::Transformer model = load_model(o.weights, &flavor);
  model->to(device);  // before fully_shard: the shards live where the mesh computes
  const auto& args = model->args();
  // Bottom-up: each block is one group, the root group holds embeddings, final norm and output.
  fsdp::FullyShardOptions block_opts;
  block_opts.mesh = mesh;
  block_opts.reshard_after_forward = parse_reshard(o.reshard);
  TORCH_CHECK(o.mp == "fp32" || o.mp == "bf16", "bench: --mp must be fp32 or bf16, got ", o.mp);
  const bool bf16 = o.mp == "bf16";
  if (bf16) {  // TorchTitan's default: bf16 unsharded params / activations, fp32 gradient reduction
    block_opts.mp_policy.param_dtype = at::kBFloat16;
    block_opts.mp_policy.reduce_dtype = at::kFloat;
  }
  for (auto& block : model->blocks()) fsdp::fully_shard(block, block_opts);
  fsdp::FullyShardOptions root_opts;
  root_opts.mesh = mesh;  // root: default policy (not resharded after forward), as PyTorch's root
  root_opts.mp_policy = block_opts.mp_policy;
  fsdp::fully_shard(model, root_opts);
  auto optim = make_adamw(o, model->parameters());
  Batches batches(o.tokens, o.steps, o.local_batch * W, o.seq);

  // Analytic optimum bytes sent per rank per step: each parameter is all-gathered in forward and its gradient
  // reduce-scattered within the shard group, (S-1)/S of its bytes each time; a resharded block is re-gathered in
  // backward, (S-1)/S of its bytes again, or (N-1)/N within N ranks under hpZ (reshard_after_forward = N). Ours
  // adds shard padding and 16-byte alignment on top. The root keeps the default (not resharded after forward).
  // Note: the measured bytes_sent below sums the mesh's groups; hpZ's N-rank groups are internal to fully_shard,
  // so their backward all-gathers are not in it.
  int64_t regather_ways = S;  // the group size of the backward all-gather of the blocks (1 = none)
  if (block_opts.reshard_after_forward) {
    const auto& r = *block_opts.reshard_after_forward;
    if (std::holds_alternative<bool>(r)) {
      regather_ways = std::get<bool>(r) ? S : 1;
    } else {
      regather_ways = std::get<int>(r);
    }
  }
  const int64_t P = llama::num_params(args);
  int64_t P_blocks = 0;  // parameters of the transformer blocks (the non-root groups)
  for (int64_t l = 0; l < args.n_layers; ++l) {
    const int64_t hd = args.head_dim();
    P_blocks += args.dim * args.n_heads * hd * 2 + 2 * args.dim * args.kv_heads() * hd +
                3 * args.dim * args.ffn_hidden_dim() + 2 * args.dim;
  }
  // HSDP adds the all-reduce of every gradient shard (P/S elements) across the R replicas: 2(R-1)/R of it.
  const double frac = static_cast<double>(S - 1) / S;
  const double regather_frac = static_cast<double>(regather_ways - 1) / regather_ways;
  const double all_reduce = 2.0 * static_cast<double>(R - 1) / R * static_cast<double>(P) / S;
  // All-gathers move the compute dtype (bf16 under --mp bf16), reductions fp32.
  const double ag_bytes = bf16 ? 2.0 : 4.0;
  const double optimum = ag_bytes * (frac * static_cast<double>(P) + regather_frac * static_cast<double>(P_blocks)) +
                         4.0 * (frac * static_cast<double>(P) + all_reduce);

  if (o.reset_peak) bench::reset_peak_rss();
  sync_device(device);
  reset_device_peak(device);
  const int64_t rss_setup = bench::rss_kib("VmRSS");
  std::ofstream out(o.out_dir + "/ours_rank" + std::to_string(rank) + ".jsonl");
  out << "{\"event\":\"setup\",\"side\":\"ours\",\"world\":" << W << ",\"rank\":" << rank << ",\"flavor\":\""
      << flavor << "\",\"device\":\"" << device.str() << "\",\"params\":" << P
      << ",\"baseline_rss_kib\":" << baseline_rss
      << ",\"rss_after_init_kib\":" << rss_after_init << ",\"anon_after_init_kib\":" << anon_after_init
      << ",\"rss_setup_kib\":" << rss_setup
      << ",\"optimum_bytes_per_step\":" << static_cast<int64_t>(optimum) << "}\n";

  // Bytes and calls summed over the mesh's groups (shard, and replicate under HSDP).
  auto mesh_stats = [&mesh] {
    fsdp::CommStats sum;
    for (int64_t d = 0; d < mesh.ndim(); ++d) {
      const fsdp::CommStats& s = fsdp::comm_stats(*mesh.group(d));
      sum.bytes_sent += s.bytes_sent;
      sum.all_gather_calls += s.all_gather_calls;
      sum.reduce_scatter_calls += s.reduce_scatter_calls;
      sum.all_reduce_calls += s.all_reduce_calls;
    }
    return sum;
  };
  for (int64_t step = 0; step < o.steps; ++step) {
    auto [cpu_inputs, cpu_targets] = batches.get(step, rank, o.local_batch);
    const at::Tensor inputs = cpu_inputs.to(device), targets = cpu_targets.to(device);
    sync_device(device);
    // The last step records each collective's timeline (issued / transfers done / caller waiting) to report
    // how much of the communication was hidden behind compute. Recording adds an observer thread that waits
    // on the transfers: one step of N, so the median step time is unaffected.
    const bool record = step == o.steps - 1 && W > 1;
    for (int64_t d = 0; record && d < mesh.ndim(); ++d) fsdp::record_timeline(*mesh.group(d), true);
    const fsdp::CommStats before = mesh_stats();
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor logits = fsdp::nn::call(model, inputs);
    // Under bf16 the loss is computed on a float32 copy of the logits (TorchTitan's cross_entropy_loss).
    at::Tensor flat = bf16 ? logits.flatten(0, 1).to(at::kFloat) : logits.flatten(0, 1);
    at::Tensor loss = at::cross_entropy_loss(flat, targets.flatten());
    flat = at::Tensor();
    loss.backward();
    optim.step();
    optim.zero_grad();
    sync_device(device);
    const double step_time = seconds_since(t0);
    const fsdp::CommStats after = mesh_stats();
    // Global mean loss for the log (outside the timed step and the byte count).
    at::Tensor l = loss.detach().clone();
    world->all_reduce(l, fsdp::ReduceOp::Sum).wait();
    const double global_loss = l.item<double>() / W;
    out << "{\"event\":\"step\",\"step\":" << step << ",\"loss\":" << bench::fmt(global_loss)
        << ",\"local_loss\":" << bench::fmt(loss.item<double>()) << ",\"step_time\":" << bench::fmt(step_time)
        << ",\"vmhwm_kib\":" << bench::rss_kib("VmHWM") << ",\"vmrss_kib\":" << bench::rss_kib("VmRSS")
        << ",\"rss_anon_kib\":" << bench::rss_kib("RssAnon") << ",\"rss_file_kib\":" << bench::rss_kib("RssFile")
        << ",\"rss_shmem_kib\":" << bench::rss_kib("RssShmem")
        << ",\"device_peak_bytes\":" << device_peak_bytes(device)
        << ",\"device_reserved_peak_bytes\":" << device_reserved_peak_bytes(device) << ",\"bytes_sent\":" << (after.bytes_sent - before.bytes_sent)
        << ",\"all_gather_calls\":" << (after.all_gather_calls - before.all_gather_calls)
        << ",\"reduce_scatter_calls\":" << (after.reduce_scatter_calls - before.reduce_scatter_calls)
        << ",\"all_reduce_calls\":" << (after.all_reduce_calls - before.all_reduce_calls) << "}\n";
    if (record) {
      // in flight: issued -> transfers done; exposed: the training thread blocked in wait() for it.
      double in_flight = 0, exposed = 0;
      int64_t n = 0;
      for (int64_t d = 0; d < mesh.ndim(); ++d) {
        for (const fsdp::CollectiveSpan& span : fsdp::comm_timeline(*mesh.group(d))) {
          if (span.completed == fsdp::CollectiveSpan::Clock::time_point{}) continue;
          in_flight += std::chrono::duration<double>(span.completed - span.issued).count();
          exposed += std::chrono::duration<double>(span.wait_end - span.wait_begin).count();
          ++n;
        }
        fsdp::record_timeline(*mesh.group(d), false);
      }
      out << "{\"event\":\"overlap\",\"step\":" << step << ",\"collectives\":" << n
          << ",\"in_flight_s\":" << bench::fmt(in_flight) << ",\"exposed_s\":" << bench::fmt(exposed) << "}\n";
    }
    out.flush();
  }
  world->barrier().wait();
  fsdp::destroy_process_group();
  return 0;
}

// One fp32 training step without the log, timed: forward (through fsdp::nn::call when FSDP's hooks must run),
// cross-entropy mean, backward, AdamW step, zero_grad. Returns the seconds it took and the loss.
std::pair<double, double> timed_step(llama::Transformer& model, torch::optim::AdamW& optim, const at::Tensor& inputs,
                                     const at::Tensor& targets, bool through_hooks,
                                     const c10::Device& device = c10::Device(c10::kCPU)) {
  sync_device(device);
  const auto t0 = std::chrono::steady_clock::now();
  at::Tensor logits = through_hooks ? fsdp::nn::call(model, inputs) : model->forward(inputs);
  // A bf16 model's loss on float32 logits, as the train command (a no-op for fp32 logits).
  at::Tensor loss = at::cross_entropy_loss(logits.flatten(0, 1).to(at::kFloat), targets.flatten());
  loss.backward();
  optim.step();
  optim.zero_grad();
  sync_device(device);
  const double seconds = seconds_since(t0);
  return {seconds, loss.item<double>()};
}

// The same per-rank work on one process without FSDP: the compute limit of the roofline.
int cmd_single(const Options& o) {
  const c10::Device device = bench_device(o);
  llama::Transformer model = load_model(o.weights);
  model->to(device);
  // The plain-training baseline in the dtype FSDP computes in under --mp bf16: the model itself in bf16.
  TORCH_CHECK(o.mp == "fp32" || o.mp == "bf16", "bench: --mp must be fp32 or bf16, got ", o.mp);
  if (o.mp == "bf16") model->to(at::kBFloat16);
  auto optim = make_adamw(o, model->parameters());
  Batches batches(o.tokens, o.steps, o.local_batch, o.seq);
  // Under fsdprun (several copies at once, to measure the compute limit under the same core sharing as W
  // ranks) each copy writes its own file; alone, single.jsonl.
  const char* rank_env = std::getenv("RANK");
  std::ofstream out(o.out_dir + (rank_env ? "/single_rank" + std::string(rank_env) + ".jsonl" : "/single.jsonl"));
  reset_device_peak(device);
  for (int64_t step = 0; step < o.steps; ++step) {
    auto [inputs, targets] = batches.get(step, 0, o.local_batch);
    const auto [step_time, loss] =
        timed_step(model, optim, inputs.to(device), targets.to(device), /*through_hooks=*/false, device);
    out << "{\"event\":\"step\",\"step\":" << step << ",\"loss\":" << bench::fmt(loss)
        << ",\"step_time\":" << bench::fmt(step_time) << ",\"device_peak_bytes\":" << device_peak_bytes(device)
        << ",\"device_reserved_peak_bytes\":" << device_reserved_peak_bytes(device)
        << "}\n";
  }
  return 0;
}

// World size 1: the model under fully_shard against the same model without FSDP, in one process, their steps
// interleaved (step s of one, then step s of the other, the order swapped every step), so both see the same
// machine load and the noise of this shared box cancels in the per-pair ratios. Both start from the same weights
// and train on the same batches; the losses must stay bit-identical (the fast path copies and casts nothing;
// tests/fully_shard/world1_fast_path_test.cpp proves the aliasing itself).
int cmd_world1(const Options& o) {
  fsdp::InitOptions init;
  if (!std::getenv("RANK")) {  // alone, without fsdprun: a world of one (no store is needed for one rank)
    init.rank = 0;
    init.world_size = 1;
    init.master_addr = "127.0.0.1";
    init.master_port = 0;
  }
  auto world = fsdp::init_process_group(init);
  TORCH_CHECK(world->size() == 1, "bench: world1 runs in one process (not under fsdprun with several ranks)");
  auto mesh = fsdp::init_device_mesh("cpu", {1}, {"shard"});
  llama::Transformer plain = load_model(o.weights);
  llama::Transformer sharded = load_model(o.weights);
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh;
  for (auto& block : sharded->blocks()) fsdp::fully_shard(block, opts);
  fsdp::fully_shard(sharded, opts);
  auto optim_plain = make_adamw(o, plain->parameters());
  auto optim_sharded = make_adamw(o, sharded->parameters());
  Batches batches(o.tokens, o.steps, o.local_batch, o.seq);
  // The FSDP side really is under fully_shard (root and every block): the timing would be vacuous otherwise.
  int64_t sharded_modules = fsdp::fsdp_module(*sharded) ? 1 : 0;
  for (auto& block : sharded->blocks()) sharded_modules += fsdp::fsdp_module(*block) ? 1 : 0;
  TORCH_CHECK(sharded_modules == 1 + static_cast<int64_t>(sharded->blocks().size()), "bench: world1: only ",
              sharded_modules, " modules are under fully_shard");
  std::ofstream out(o.out_dir + "/world1.jsonl");
  std::vector<double> t_plain, t_fsdp, ratios;
  bool identical = true;
  double first_loss = 0, last_loss = 0;
  const int64_t warmup = std::min<int64_t>(3, o.steps / 4);
  for (int64_t step = 0; step < o.steps; ++step) {
    const auto [inputs, targets] = batches.get(step, 0, o.local_batch);
    std::pair<double, double> a, b;  // (seconds, loss) of the plain model, of the fully_shard one
    if (step % 2 == 0) {
      a = timed_step(plain, optim_plain, inputs, targets, /*through_hooks=*/false);
      b = timed_step(sharded, optim_sharded, inputs, targets, /*through_hooks=*/true);
    } else {
      b = timed_step(sharded, optim_sharded, inputs, targets, /*through_hooks=*/true);
      a = timed_step(plain, optim_plain, inputs, targets, /*through_hooks=*/false);
    }
    identical = identical && a.second == b.second;
    if (step == 0) first_loss = a.second;
    last_loss = a.second;
    out << "{\"event\":\"step\",\"step\":" << step << ",\"plain_s\":" << bench::fmt(a.first)
        << ",\"fsdp_s\":" << bench::fmt(b.first) << ",\"plain_loss\":" << bench::fmt(a.second)
        << ",\"fsdp_loss\":" << bench::fmt(b.second) << "}\n";
    if (step < warmup) continue;
    t_plain.push_back(a.first);
    t_fsdp.push_back(b.first);
    ratios.push_back(b.first / a.first);
  }
  TORCH_CHECK(!ratios.empty(), "bench: world1 needs --steps >= 2");
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  const double m_plain = median(t_plain), m_fsdp = median(t_fsdp), m_ratio = median(ratios);
  out << "{\"event\":\"summary\",\"steps_timed\":" << ratios.size() << ",\"median_plain_s\":"
      << bench::fmt(m_plain) << ",\"median_fsdp_s\":" << bench::fmt(m_fsdp) << ",\"ratio_of_medians\":"
      << bench::fmt(m_fsdp / m_plain) << ",\"median_pair_ratio\":" << bench::fmt(m_ratio)
      << ",\"best_plain_s\":" << bench::fmt(*std::min_element(t_plain.begin(), t_plain.end()))
      << ",\"best_fsdp_s\":" << bench::fmt(*std::min_element(t_fsdp.begin(), t_fsdp.end()))
      << ",\"losses_identical\":" << (identical ? "true" : "false") << ",\"first_loss\":" << bench::fmt(first_loss)
      << ",\"last_loss\":" << bench::fmt(last_loss) << "}\n";
  std::printf("world 1, %zu timed steps (interleaved): median step plain %.1f ms, fully_shard %.1f ms; ratio of "
              "medians %.4f, median of per-step ratios %.4f; losses %s (%.4f -> %.4f)\n",
              ratios.size(), m_plain * 1e3, m_fsdp * 1e3, m_fsdp / m_plain, m_ratio,
              identical ? "bit-identical" : "DIFFER", first_loss, last_loss);
  fsdp::destroy_process_group();
  return identical ? 0 : 1;
}

// Single-threaded memcpy bandwidth over buffers much larger than the caches (GB/s = 1e9 bytes/s), best of 5:
// every byte a process sends through loopback TCP is copied at least once, so bytes / this is a lower bound on
// communication time on this machine.
int cmd_memcpy(const Options&) {
  const int64_t n = 256 << 20;
  std::vector<char> a(n, 1), b(n, 0);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), n);
    best = std::min(best, seconds_since(t0));
    a[i] = b[n - 1 - i];  // keep the copies observable
  }
  std::cout << "{\"event\":\"memcpy\",\"bytes\":" << n << ",\"seconds\":" << bench::fmt(best)
            << ",\"gb_per_s\":" << bench::fmt(n / best / 1e9) << "}\n";
  return 0;
}

// Effective send bandwidth of our collectives on this machine (Gloo over loopback TCP), at the message size of
// one FSDP group: all-gather of `mib` MiB per rank and reduce-scatter of W x `mib` MiB, median of 20 after 3
// warm-ups, timed between barriers. bytes_sent (CommStats) / time = what bytes per step cost here.
int cmd_collectives(const Options& o, double mib) {
  auto world = fsdp::init_process_group();
  const int W = world->size();
  const int64_t n = static_cast<int64_t>(mib * (1 << 20) / 4);
  at::Tensor out = at::empty({W * n}, at::kFloat);
  at::Tensor in = at::ones({n}, at::kFloat);
  at::Tensor rs_in = at::ones({W * n}, at::kFloat), rs_out = at::empty({n}, at::kFloat);
  // All-gather and reduce-scatter alternate within one loop, so both see the same machine load (this box is
  // shared: measured one after the other, their ratio drifts with whatever else runs).
  std::vector<double> t_ags, t_rss;
  int64_t ag_bytes = 0, rs_bytes = 0;
  for (int i = 0; i < 23; ++i) {
    for (int which = 0; which < 2; ++which) {
      world->barrier().wait();
      fsdp::reset_comm_stats(*world);
      const auto t0 = std::chrono::steady_clock::now();
      if (which == 0) {
        world->all_gather_into_tensor(out, in).wait();
      } else {
        world->reduce_scatter_tensor(rs_out, rs_in, fsdp::ReduceOp::Sum).wait();
      }
      const double t = seconds_since(t0);
      if (i < 3) continue;
      (which == 0 ? t_ags : t_rss).push_back(t);
      (which == 0 ? ag_bytes : rs_bytes) = fsdp::comm_stats(*world).bytes_sent;
    }
  }
  auto median = [](std::vector<double> t) {
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const double t_ag = median(t_ags), t_rs = median(t_rss);
  if (world->rank() == 0) {
    std::ofstream f(o.out_dir + "/collectives.json");
    f << "{\"event\":\"collectives\",\"world\":" << W << ",\"mib\":" << bench::fmt(mib)
      << ",\"all_gather_s\":" << bench::fmt(t_ag) << ",\"all_gather_bytes\":" << ag_bytes
      << ",\"all_gather_gb_per_s\":" << bench::fmt(ag_bytes / t_ag / 1e9) << ",\"reduce_scatter_s\":"
      << bench::fmt(t_rs) << ",\"reduce_scatter_bytes\":" << rs_bytes << ",\"reduce_scatter_gb_per_s\":"
      << bench::fmt(rs_bytes / t_rs / 1e9) << "}\n";
  }
  world->barrier().wait();
  fsdp::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"libfsdp side of the PyTorch FSDP2 comparison"};
  app.require_subcommand(1);
  Options o;
  auto* init = app.add_subcommand("init", "write initial weights (safetensors, with model args as metadata)");
  init->add_option("--flavor", o.flavor, "llama3 flavor")->required();
  init->add_option("--seed", o.seed);
  init->add_option("--out", o.out)->required();
  init->add_flag("--tie-embeddings", o.tie_embeddings, "one weight for the embeddings and the output layer");
  auto add_train_opts = [&](CLI::App* c) {
    c->add_option("--weights", o.weights)->required();
    c->add_option("--tokens", o.tokens)->required();
    c->add_option("--steps", o.steps);
    c->add_option("--local-batch", o.local_batch);
    c->add_option("--seq", o.seq);
    c->add_option("--out-dir", o.out_dir);
    c->add_option("--lr", o.lr);
    c->add_option("--weight-decay", o.weight_decay);
  };
  auto* train = app.add_subcommand("train", "FSDP training under fsdprun");
  add_train_opts(train);
  train->add_option("--reshard", o.reshard, "reshard_after_forward of the blocks: default|true|false|<int>");
  train->add_option("--replicate", o.replicate, "HSDP replicate degree (mesh replicate x world/replicate)");
  train->add_option("--mp", o.mp, "fp32 | bf16 (bf16 params in compute, fp32 reduce, loss on fp32 logits)");
  train->add_flag("!--no-reset-peak", o.reset_peak, "keep VmHWM from process start");
  train->add_option("--device", o.device, "cpu | cuda (every rank on cuda:0, Gloo collectives on CUDA tensors)");
  auto* single = app.add_subcommand("single", "the same per-rank work without FSDP (one process)");
  add_train_opts(single);
  single->add_option("--device", o.device, "cpu | cuda");
  single->add_option("--mp", o.mp, "fp32 | bf16 (the plain model in bf16)");
  auto* world1 = app.add_subcommand("world1", "world size 1: fully_shard vs the plain model, steps interleaved");
  add_train_opts(world1);
  auto* memcpy_cmd = app.add_subcommand("memcpy", "memcpy bandwidth");
  double coll_mib = 1.0;
  auto* coll = app.add_subcommand("collectives", "collective bandwidth under fsdprun (Gloo, loopback)");
  coll->add_option("--mib", coll_mib, "per-rank message size, MiB");
  coll->add_option("--out-dir", o.out_dir);
  CLI11_PARSE(app, argc, argv);
  try {
    if (*init) return cmd_init(o);
    if (*train) return cmd_train(o);
    if (*single) return cmd_single(o);
    if (*world1) return cmd_world1(o);
    if (*memcpy_cmd) return cmd_memcpy(o);
    if (*coll) return cmd_collectives(o, coll_mib);
  } catch (const c10::Error& e) {
    std::cerr << "fsdp-bench-ours: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-bench-ours: " << e.what() << "\n";
    return 1;
  }
  return 2;
}
