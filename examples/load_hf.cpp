// Load a Hugging Face model directory (config.json + safetensors) in one call, nothing mapped by hand.
// Build: part of the project (examples/), or in your own CMake project with
//   find_package(libfsdp REQUIRED)  target_link_libraries(app PRIVATE fsdp::fsdp)
// Run:   ./load_hf_example <dir>   a Llama, Qwen3 or Qwen3-MoE directory (e.g. downloaded from the hub)
//        ./load_hf_example         without one: writes a small random Qwen3-MoE with YaRN RoPE to a temporary
//                                  directory first (export_qwen3), then loads that
#include <fsdp/models/hf_config.h>
#include <fsdp/models/hf_qwen3.h>
#include <fsdp/models/qwen3.h>

#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <string>

namespace hf = fsdp::models::hf;
namespace llama = fsdp::models::llama;

int main(int argc, char** argv) {
  try {
    std::string dir;
    llama::Transformer original{nullptr};
    if (argc > 1) {
      dir = argv[1];
    } else {
      auto args = llama::qwen3_flavor("cpu_tiny_moe");
      args.rope_scaling = llama::RopeScaling{};
      args.rope_scaling->type = llama::RopeScaling::Type::Yarn;
      args.rope_scaling->factor = 4.0;
      args.rope_scaling->original_max_position_embeddings = 1024;
      original = llama::Transformer(args);
      original->init_weights(/*seed=*/0);
      dir = (std::filesystem::temp_directory_path() / ("load_hf_example_" + std::to_string(::getpid()))).string();
      hf::export_qwen3(*original, dir);
    }

    // 1. The args: every config.json field that changes the computation, mapped or refused by name.
    const hf::HfConfig config = hf::read_config(dir);
    std::cout << dir << ": model_type " << config.model_type << ", " << config.args.n_layers << " layers, dim "
              << config.args.dim << ", head_dim " << config.args.head_dim() << ", "
              << (config.args.moe ? std::to_string(config.args.moe->num_experts) + " experts" : std::string("dense"))
              << ", RoPE " << (config.args.rope_scaling ? llama::rope_type_name(config.args.rope_scaling->type) : "default")
              << ", " << llama::num_params(config.args) << " parameters\n";

    // 2. The model with its weights (or: build from config.args yourself, e.g. on the meta device and sharded,
    //    then hf::import_hf(*model, dir)).
    llama::Transformer model = hf::load_model(dir);
    model->eval();
    torch::NoGradGuard no_grad;
    const auto tokens = torch::arange(8, torch::kLong).view({1, 8}) % config.args.vocab_size;
    const auto logits = model->forward(tokens);
    std::cout << "logits " << logits.sizes() << ", next token after the prompt: " << logits[0][-1].argmax().item<int64_t>()
              << "\n";
    if (!original.is_empty()) {
      original->eval();
      const double diff = (original->forward(tokens) - logits).abs().max().item<double>();
      std::cout << "max |loaded - original| = " << diff << "\n";
      std::filesystem::remove_all(dir);
      if (diff > 1e-6) return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "load_hf_example: " << e.what() << "\n";
    return 1;
  }
}
