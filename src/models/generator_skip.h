#pragma once
// Skipping ahead in a CPU generator's stream without drawing the numbers in between, so that a pipeline rank can
// initialise its own stages' parameters with exactly the numbers a whole-model init gives them (model_init.h).

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace fsdp::models::detail {

// Advances `gen` (an at::CPUGeneratorImpl: torch's mt19937) past its next `n` 32-bit outputs: afterwards it gives
// what it would have given after `n` calls of random(). Short skips step the engine; long ones jump in time that
// grows with log(n), not n (the jump-ahead of F2-linear generators by their characteristic polynomial: Haramoto,
// Matsumoto, Nishimura, Panneton, L'Ecuyer 2008). The cached normal samples of the generator are left alone.
void skip_generator_outputs(at::Generator& gen, uint64_t n);

// A pipeline rank builds the whole model on `meta` and gives storage only to its own stages' parameters; the
// whole-model init then reaches the other stages' parameters still on meta, where its draws used to be made in
// full and thrown away. While a MetaDrawSkipping for `gen` is alive (one per init_weights call), the draw helpers
// (model_init.h) ask skip_draw() first: for a meta parameter it counts the outputs the draw would take and draws
// nothing; before the next real draw the generator jumps past all the counted outputs at once. A rank so draws
// only its own stages' numbers and its weights are still bit for bit the whole-model init's.
class MetaDrawSkipping {
 public:
  explicit MetaDrawSkipping(const at::Generator& gen);
  ~MetaDrawSkipping();
  MetaDrawSkipping(const MetaDrawSkipping&) = delete;
  MetaDrawSkipping& operator=(const MetaDrawSkipping&) = delete;

  // A draw of `outputs` generator outputs into `param` is about to be made from `gen`. True: skip it (param is on
  // meta, under a MetaDrawSkipping of gen, and the count is known). False: draw as usual (the counted outputs of
  // earlier skips are jumped over first). nullopt outputs: a draw whose consumption is not a plain count (torch's
  // serial normal path keeps a cached sample in the generator), always drawn.
  static bool skip_draw(const at::Tensor& param, std::optional<uint64_t> outputs, at::Generator& gen);
  // All the outputs skip_draw() has skipped on this thread so far (tests count them against the shapes).
  static uint64_t skipped_outputs_on_this_thread();

 private:
  at::Generator gen_;
  uint64_t pending_outputs_ = 0;
  MetaDrawSkipping* outer_ = nullptr;  // an init_weights inside another one's (the innermost one's generator wins)
};

}  // namespace fsdp::models::detail
