// The model seam's registry (model_spec.h): one registration per model family, in one list.
#include "model_spec.h"

#include "models/deepseek_v3/deepseek_v3_spec.h"
#include "models/llama3/llama3_spec.h"
#include "models/qwen3/qwen3_spec.h"

namespace fsdp_train {
namespace {

const std::vector<TrainSpec>& registry() {
  static const std::vector<TrainSpec> specs = {
      llama3::train_spec(),  // models/llama3
      qwen3::train_spec(),   // models/qwen3 (Qwen3 and Qwen3-MoE)
      deepseek_v3::train_spec(),  // models/deepseek_v3
  };
  return specs;
}

}  // namespace

const TrainSpec& train_spec(const std::string& model_name) {
  for (const auto& spec : registry()) {
    if (spec.name == model_name) return spec;
  }
  std::string known;
  for (const auto& spec : registry()) known += (known.empty() ? "" : ", ") + spec.name;
  throw ConfigError("config error: model.name = \"" + model_name + "\" is not a registered model family (" + known +
                    ")");
}

std::vector<std::string> train_spec_names() {
  std::vector<std::string> names;
  for (const auto& spec : registry()) names.push_back(spec.name);
  return names;
}

}  // namespace fsdp_train
