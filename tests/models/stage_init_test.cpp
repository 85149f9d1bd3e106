// Pipeline ranks initialise only their own stages (src/models/generator_skip.h). The generator's skip equals
// drawing every skipped output (stepped and jumped, from every position in the engine's 624-word block, against
// torch's own mt19937 drawn one by one); and a model built on `meta` with only some parts given storage, then
// initialised whole, holds in those parts exactly the weights of the same model initialised on the CPU (llama3,
// Qwen3-MoE, DeepSeek-V3; pp 2 and pp 4, contiguous and looped stage placements), while the parts left on meta
// drew nothing: the skipped count equals the draws of their shapes (counted here from torch's kernels: one output
// an element for uniform_, normal_fill's element count rounded up with 16 more).
#include "models/generator_skip.h"
#include "models/model_init.h"

#include <fsdp/materialize.h>
#include <fsdp/models/deepseek_v3.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/qwen3.h>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <set>

namespace {

using fsdp::models::detail::MetaDrawSkipping;
using fsdp::models::detail::skip_generator_outputs;

std::vector<uint32_t> outputs(at::Generator& gen, int count) {
  auto* cpu = at::check_generator<at::CPUGeneratorImpl>(gen);
  std::vector<uint32_t> out;
  for (int i = 0; i < count; ++i) out.push_back(cpu->random());
  return out;
}

void draw(at::Generator& gen, uint64_t count) {
  auto* cpu = at::check_generator<at::CPUGeneratorImpl>(gen);
  for (uint64_t i = 0; i < count; ++i) cpu->random();
}

TEST(GeneratorSkip, EqualsDrawingEverySkippedOutput) {
  // Steps (below 2^22) and jumps (above), from the seeded state and from every kind of place in the 624-word block.
  const std::vector<uint64_t> skips{0, 1, 623, 624, 625, 100000, (uint64_t(1) << 22) - 1, uint64_t(1) << 22,
                                    (uint64_t(1) << 22) + 1, 9876543};
  for (uint64_t seed : {uint64_t(0), uint64_t(42), uint64_t(0xdeadbeefcafe)}) {
    for (uint64_t before : {uint64_t(0), uint64_t(1), uint64_t(311), uint64_t(623), uint64_t(624), uint64_t(1300)}) {
      for (uint64_t n : skips) {
        SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::to_string(before) + " drawn, skip " +
                     std::to_string(n));
        at::Generator drawn = at::make_generator<at::CPUGeneratorImpl>(seed);
        at::Generator skipped = at::make_generator<at::CPUGeneratorImpl>(seed);
        draw(drawn, before + n);
        draw(skipped, before);
        skip_generator_outputs(skipped, n);
        ASSERT_EQ(outputs(skipped, 1500), outputs(drawn, 1500));  // across the next block boundary too
      }
    }
  }
}

TEST(GeneratorSkip, FarJumpsComposeAndMove) {
  // Beyond what can be drawn in a test: two jumps equal their sum, and a jump moves the stream.
  const uint64_t a = uint64_t(3) << 40, b = (uint64_t(5) << 37) + 12345;
  at::Generator twice = at::make_generator<at::CPUGeneratorImpl>(7);
  at::Generator once = at::make_generator<at::CPUGeneratorImpl>(7);
  at::Generator unmoved = at::make_generator<at::CPUGeneratorImpl>(7);
  draw(twice, 17);
  draw(once, 17);
  draw(unmoved, 17);
  const auto start = std::chrono::steady_clock::now();
  skip_generator_outputs(twice, a);
  std::cout << "a jump of " << a << " outputs: "
            << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count()
            << " ms (the first one includes finding the polynomial)\n";
  skip_generator_outputs(twice, b);
  skip_generator_outputs(once, a + b);
  const auto got = outputs(twice, 1000);
  EXPECT_EQ(got, outputs(once, 1000));
  EXPECT_NE(got, outputs(unmoved, 1000));
}

TEST(GeneratorSkip, CountsAreTorchKernelsConsumption) {
  // What the draw helpers count for a skipped meta parameter is what torch's CPU kernels take from the generator.
  for (int64_t n : {16, 17, 31, 40, 1000, 1001, 4096}) {
    SCOPED_TRACE(n);
    at::Generator drawn = at::make_generator<at::CPUGeneratorImpl>(5);
    at::Generator skipped = at::make_generator<at::CPUGeneratorImpl>(5);
    at::empty({n}, at::kFloat).normal_(0.0, 1.0, drawn);
    skip_generator_outputs(skipped, fsdp::models::llama::detail::normal_fill_outputs(n).value());
    EXPECT_EQ(outputs(skipped, 700), outputs(drawn, 700));
    at::empty({n}, at::kFloat).uniform_(-0.5, 0.5, drawn);
    skip_generator_outputs(skipped, n);  // trunc_normal_'s uniform_: one output an element
    EXPECT_EQ(outputs(skipped, 700), outputs(drawn, 700));
  }
  EXPECT_FALSE(fsdp::models::llama::detail::normal_fill_outputs(15).has_value());  // torch's serial path: drawn
}

// The parts of a decoder in init order, named by the prefix of their parameters.
struct Part {
  std::string prefix;
  torch::nn::Module* module;
};

template <class Model>
std::vector<Part> parts_of(Model& model) {
  std::vector<Part> parts{{"tok_embeddings.", model->tok_embeddings.get()}};
  for (size_t i = 0; i < model->blocks().size(); ++i) {
    parts.push_back({"layers." + std::to_string(i) + ".", model->blocks()[i].get()});
  }
  parts.push_back({"norm.", model->norm.get()});
  if (model->output) parts.push_back({"output.", model->output.get()});
  return parts;
}

// Outputs a whole-model init draws for one parameter, from its name and shape (the models' init recipes: the
// embedding and every MoE tensor by normal_, norms not at all, every other weight by the uniform trunc_normal_).
uint64_t draws_of(const std::string& name, const at::Tensor& p) {
  const uint64_t n = p.numel();
  const bool normal = name == "tok_embeddings.weight" || name.find(".moe.") != std::string::npos;
  if (name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0) return 0;
  if (normal) return n + (n % 16 != 0 ? 16 : 0);
  return n;
}

// Rank `rank` of `pp` holds the blocks of its stages: `looped` places stage s on rank s % pp with 2 stages a rank
// (Interleaved1F1B), otherwise one contiguous run a rank (1F1B); the embedding goes with block 0, norm and output
// with the last block.
std::set<std::string> held_prefixes(size_t n_blocks, int pp, int rank, bool looped) {
  const size_t stages = looped ? 2 * pp : pp;
  std::set<std::string> held;
  for (size_t i = 0; i < n_blocks; ++i) {
    const size_t stage = i * stages / n_blocks;
    if (static_cast<int>(stage % pp) != rank) continue;
    held.insert("layers." + std::to_string(i) + ".");
    if (i == 0) held.insert("tok_embeddings.");
    if (i + 1 == n_blocks) held.insert({"norm.", "output."});
  }
  return held;
}

template <class Model, class Args>
void expect_stages_equal_whole_init(const Args& flavor, const std::string& family) {
  const uint64_t seed = 31;
  Model reference(flavor);
  reference->init_weights(seed);
  Model other_seed(flavor);
  other_seed->init_weights(seed + 1);
  int compared = 0, moved = 0;
  for (int pp : {2, 4}) {
    for (bool looped : {false, true}) {
      for (int rank = 0; rank < pp; ++rank) {
        SCOPED_TRACE(family + " pp " + std::to_string(pp) + (looped ? " looped" : " contiguous") + ", rank " +
                     std::to_string(rank));
        Args args = flavor;
        args.device = c10::kMeta;
        Model model(args);
        const auto parts = parts_of(model);
        const std::set<std::string> held = held_prefixes(model->blocks().size(), pp, rank, looped);
        uint64_t expected_skip = 0;
        for (const auto& part : parts) {
          if (held.count(part.prefix)) {
            fsdp::materialize_module(*part.module, c10::kCPU);
          } else {
            for (const auto& p : part.module->named_parameters()) {
              expected_skip += draws_of(part.prefix + p.key(), p.value());
            }
          }
        }
        const uint64_t skipped_before = MetaDrawSkipping::skipped_outputs_on_this_thread();
        model->init_weights(seed);
        EXPECT_EQ(MetaDrawSkipping::skipped_outputs_on_this_thread() - skipped_before, expected_skip);
        const auto want = reference->named_parameters();
        const auto not_want = other_seed->named_parameters();
        for (const auto& p : model->named_parameters()) {
          const bool is_held = std::any_of(held.begin(), held.end(), [&](const std::string& prefix) {
            return p.key().rfind(prefix, 0) == 0;
          });
          if (!is_held) {
            EXPECT_TRUE(p.value().is_meta()) << p.key();
            continue;
          }
          ASSERT_FALSE(p.value().is_meta()) << p.key();
          EXPECT_TRUE(torch::equal(p.value(), want[p.key()])) << p.key();
          ++compared;
          moved += !torch::equal(want[p.key()], not_want[p.key()]);
        }
      }
    }
  }
  EXPECT_GT(compared, 0);
  EXPECT_GT(moved, compared / 2);  // the seed reaches the weights: equal values are not a constant init
}

TEST(StageInit, LlamaStagesEqualTheWholeModelInit) {
  auto flavor = fsdp::models::llama::llama3_flavor("cpu_small");
  expect_stages_equal_whole_init<fsdp::models::llama::Transformer>(flavor, "llama3 cpu_small");
}

TEST(StageInit, Qwen3MoeStagesEqualTheWholeModelInit) {
  auto flavor = fsdp::models::llama::qwen3_flavor("cpu_tiny_moe");
  expect_stages_equal_whole_init<fsdp::models::llama::Transformer>(flavor, "qwen3 cpu_tiny_moe");
}

TEST(StageInit, DeepSeekV3StagesEqualTheWholeModelInit) {
  auto flavor = fsdp::models::deepseek_v3::deepseek_v3_flavor("cpu_tiny");
  expect_stages_equal_whole_init<fsdp::models::deepseek_v3::DeepSeekV3>(flavor, "deepseek_v3 cpu_tiny");
}

}  // namespace
