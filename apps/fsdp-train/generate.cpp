// Text generation from a checkpoint (see generate.h).
#include "generate.h"

#include "model_spec.h"

#include "tokenizer.h"

#include <fsdp/checkpoint/checkpoint.h>

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace fsdp_train {
namespace fs = std::filesystem;
namespace ckpt = fsdp::checkpoint;

std::string resolve_checkpoint_dir(const std::string& path) {
  if (!fs::exists(path)) throw std::runtime_error("generate: checkpoint '" + path + "' does not exist");
  if (ckpt::checkpoint_format(path)) return path;
  if (auto latest = ckpt::latest_step(path)) return ckpt::step_path(path, *latest);
  throw std::runtime_error("generate: '" + path + "' is neither a checkpoint (no metadata.json or .metadata) nor a folder of "
                           "complete step-N checkpoints");
}

std::string find_job_config(const std::string& step_dir) {
  fs::path p = fs::absolute(step_dir);
  for (int up = 0; up < 3 && p.has_parent_path(); ++up, p = p.parent_path())
    if (fs::exists(p / "config.toml")) return (p / "config.toml").string();
  return "";
}

namespace {

// The next token from the last position's logits [vocab].
int64_t sample(const at::Tensor& logits_in, const GenerateOptions& o, at::Generator& gen) {
  auto logits = logits_in.to(torch::kCPU, torch::kFloat);  // sampled with a CPU generator: the same on any device
  if (o.temperature <= 0) return logits.argmax().item<int64_t>();
  logits = logits / o.temperature;
  if (o.top_k > 0 && o.top_k < logits.size(0)) {
    const auto kth = std::get<0>(logits.topk(o.top_k)).min();
    logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
  }
  auto probs = torch::softmax(logits, 0);
  return at::multinomial(probs, 1, false, gen).item<int64_t>();
}

}  // namespace

GenerateResult generate(const JobConfig& config, const GenerateOptions& o) {
  GenerateResult r;
  r.checkpoint_dir = resolve_checkpoint_dir(o.checkpoint);
  auto tokenizer = make_tokenizer(config.model.tokenizer_path);
  ModelShape shape;
  shape.vocab_size = tokenizer->vocab_size();  // as the trainer built it
  shape.max_seq_len = config.training.seq_len;
  // The prompt and its continuation are one document (generation stops at EOS): block_causal attention is causal.
  JobConfig causal = config;
  causal.model.attn_mask_type = AttnMaskType::Causal;
  const TrainModel built = train_spec(config.model.name).build(causal, shape);
  torch::nn::Module& model = *built.module;
  // One sequence through a small model is a chain of tiny matmuls: intra-op threads cost more than they give
  // (9x slower with 2 threads for cpu_small on a busy 2-core machine). OMP_NUM_THREADS still decides if set.
  if (!std::getenv("OMP_NUM_THREADS") && built.num_params < 100'000'000) torch::set_num_threads(1);

  // Every parameter whole, whatever the number of ranks that saved it (checksums verified).
  ckpt::Reader reader(r.checkpoint_dir);
  {
    torch::NoGradGuard no_grad;
    for (auto& item : model.named_parameters()) {
      at::Tensor saved;
      try {
        saved = reader.read(item.key());
      } catch (const std::exception& e) {
        throw std::runtime_error("generate: checkpoint '" + r.checkpoint_dir + "' has no usable '" + item.key() +
                                 "' for " + config.model.name + " " + config.model.flavor + " (vocab " + std::to_string(shape.vocab_size) +
                                 "; is --config the job that trained it?): " + e.what());
      }
      if (saved.sizes() != item.value().sizes()) {
        std::ostringstream msg;
        msg << "generate: '" << item.key() << "' in '" << r.checkpoint_dir << "' has shape " << saved.sizes()
            << ", " << config.model.name << " " << config.model.flavor << " with vocab " << shape.vocab_size << " expects "
            << item.value().sizes() << " (is --config the job that trained it?)";
        throw std::runtime_error(msg.str());
      }
      item.value().copy_(saved);  // a bfloat16/float16 export is cast to float32
    }
    // MoE load-balancing biases steer the routing: the trained ones, not zeros.
    for (auto& item : model.named_buffers()) {
      if (item.key().find("expert_bias") != std::string::npos) item.value().copy_(reader.read(item.key()));
    }
  }
  // On the job's training.device when this process has it (a job trained on a GPU samples on one); else the CPU.
  const c10::Device job_device(config.training.device);
  const c10::Device device = job_device.is_cuda() && at::hasCUDA() ? job_device : c10::Device(c10::kCPU);
  if (!device.is_cpu()) model.to(device);
  model.eval();
  torch::NoGradGuard no_grad;

  if (tokenizer->bos_id()) r.prompt_tokens.push_back(*tokenizer->bos_id());
  for (uint32_t t : tokenizer->encode(o.prompt)) r.prompt_tokens.push_back(t);
  std::vector<int64_t> sequence(r.prompt_tokens.begin(), r.prompt_tokens.end());
  const int64_t capacity = static_cast<int64_t>(sequence.size()) + o.max_new_tokens;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const auto eos = tokenizer->eos_id();

  std::function<at::Tensor(const at::Tensor&)> cached_forward;  // keeps its KV cache between calls
  r.kv_cache = o.kv_cache && static_cast<bool>(built.cached_forward);  // a family without one re-runs the sequence
  if (r.kv_cache) cached_forward = built.cached_forward(capacity);
  std::vector<int64_t> pending = sequence;  // tokens not yet run through the model (with the cache)
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    at::Tensor logits;
    if (r.kv_cache) {
      auto input = torch::tensor(pending, torch::kLong).view({1, -1}).to(device);
      logits = cached_forward(input);  // the cache is made on the model's device (after the move above)
    } else {
      auto input = torch::tensor(sequence, torch::kLong).view({1, -1}).to(device);
      logits = built.forward(input);
    }
    const int64_t next = sample(logits[0][logits.size(1) - 1], o, gen);
    r.new_tokens.push_back(static_cast<uint32_t>(next));
    if (eos && next == static_cast<int64_t>(*eos)) break;
    sequence.push_back(next);
    pending = {next};
  }
  std::vector<uint32_t> text_tokens = r.new_tokens;
  if (!text_tokens.empty() && eos && text_tokens.back() == *eos) text_tokens.pop_back();
  r.text = tokenizer->decode(text_tokens);
  return r;
}

int generate_main(const std::vector<std::string>& args) {
  constexpr const char* usage =
      "usage: fsdp-train generate --checkpoint DIR --prompt TEXT [--max_new_tokens N] [--temperature T]\n"
      "                           [--top_k K] [--seed S] [--no_kv_cache] [--config FILE] [--section.key value ...]\n"
      "DIR: a step-N checkpoint folder or the folder holding them (the latest is used). The model and tokenizer\n"
      "come from --config, else the config.toml of the job that wrote DIR, else the default config.\n";
  GenerateOptions o;
  std::vector<std::string> config_args;
  bool have_prompt = false, have_config = false;
  auto number = [&](const std::string& flag, const std::string& v) {
    char* end = nullptr;
    const double d = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0') throw ConfigError("generate: " + flag + " expects a number, got '" + v + "'");
    return d;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool has_value = i + 1 < args.size();
    if (a == "--help" || a == "-h") {
      std::cout << usage;
      return 0;
    } else if (a == "--no_kv_cache") {
      o.kv_cache = false;
    } else if ((a == "--checkpoint" || a == "--prompt" || a == "--max_new_tokens" || a == "--temperature" ||
                a == "--top_k" || a == "--seed") && !has_value) {
      std::cerr << "fsdp-train generate: " << a << " needs a value\n" << usage;
      return 2;
    } else if (a == "--checkpoint") {
      o.checkpoint = args[++i];
    } else if (a == "--prompt") {
      o.prompt = args[++i];
      have_prompt = true;
    } else if (a == "--max_new_tokens") {
      o.max_new_tokens = static_cast<int64_t>(number(a, args[++i]));
    } else if (a == "--temperature") {
      o.temperature = number(a, args[++i]);
    } else if (a == "--top_k") {
      o.top_k = static_cast<int64_t>(number(a, args[++i]));
    } else if (a == "--seed") {
      o.seed = static_cast<uint64_t>(number(a, args[++i]));
    } else {
      if (a == "--config") have_config = true;
      config_args.push_back(a);
    }
  }
  if (o.checkpoint.empty() || !have_prompt) {
    std::cerr << usage;
    return 2;
  }
  if (o.max_new_tokens < 0 || o.top_k < 0 || o.temperature < 0) {
    std::cerr << "fsdp-train generate: --max_new_tokens, --top_k and --temperature must be >= 0\n";
    return 2;
  }
  const std::string dir = resolve_checkpoint_dir(o.checkpoint);
  if (!have_config) {
    const std::string found = find_job_config(dir);
    if (!found.empty()) config_args.insert(config_args.begin(), {"--config", found});
  }
  const JobConfig config = load_config(config_args);
  const GenerateResult r = generate(config, o);
  std::cerr << "generate: " << config.model.name << " " << config.model.flavor << " from " << r.checkpoint_dir << ", "
            << r.new_tokens.size() << " new tokens (temperature " << o.temperature << ", top_k " << o.top_k
            << ", seed " << o.seed << (r.kv_cache ? ", KV cache" : o.kv_cache ? ", no KV cache: the model has none" : ", no KV cache") << ")\n";
  std::cout << o.prompt << r.text << std::endl;
  return 0;
}

}  // namespace fsdp_train
