// fsdp-plan: per-rank memory and communication of FSDP training of a Llama 3, Qwen3 or DeepSeek-V3 flavor (see
// docs/planner.md).
//
//   fsdp-plan --flavor 8B --shard 8 --compute-dtype bf16 --local-batch 2 --seq 8192 --ac selective
//   fsdp-plan --model qwen3 --flavor 30B-A3B --shard 8 --ep 4 --compute-dtype bf16 --seq 4096 --ac full
//   fsdp-plan --flavor 70B --pp 4 --schedule Interleaved1F1B --microbatches 8 --shard 8 --local-batch 8
//   fsdp-plan --torchtitan-8b        TorchTitan's published 8B / 8 x H100 run, next to its measured memory
#include "plan.h"
#include "user_errors.h"

#include <fsdp/models/qwen3.h>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <cstdio>
#include <iostream>

namespace {

// TorchTitan's published run: Llama 3 8B on 8 x H100, FSDP 8, local batch 2, seq 8192, selective AC,
// bf16 params / fp32 reduce, AdamW fp32 states; TorchTitan's loss upcasts logits and frees them before
// backward. Published: 82.4 GiB max reserved memory per GPU (5,762 tokens/s/GPU).
int torchtitan_8b() {
  using namespace fsdp::plan;
  std::cout << "TorchTitan Llama 3 8B, 8 x H100, FSDP, local batch 2, seq 8192, selective AC, bf16/fp32: "
               "published 82.4 GiB per GPU (max reserved by the CUDA caching allocator)\n\n";
  for (auto kind : {SelectiveKind::Op, SelectiveKind::Layer}) {
    PlanConfig c;
    c.flavor = "8B";
    c.args = fsdp::models::llama::llama3_flavor("8B");
    c.shard = 8;
    c.param_dtype = c10::kFloat;
    c.compute_dtype = c10::kBFloat16;
    c.reduce_dtype = c10::kFloat;
    c.optim_dtype = c10::kFloat;
    c.local_batch = 2;
    c.seq_len = 8192;
    c.ac = ACMode::Selective;
    c.selective = kind;
    c.op_sac_saves_attention = true;  // TorchTitan's op policy (ours keeps matmul outputs only)
    c.loss.upcast_logits = true;
    c.loss.free_logits_before_backward = true;
    Plan p = make_plan(c);
    std::cout << format_plan(p);
    std::printf("  => predicted %.1f GiB vs published 82.4 GiB (%+.0f%%)\n\n",
                static_cast<double>(p.memory.total) / (1 << 30),
                100.0 * (static_cast<double>(p.memory.total) / (1 << 30) / 82.4 - 1.0));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp_apps::hide_cpp_backtraces_unless_requested();
  using namespace fsdp::plan;
  CLI::App app{"fsdp-plan: per-rank memory and communication of FSDP training (Llama 3, Qwen3 dense and MoE, DeepSeek-V3)"};
  std::string flavor = "8B", param = "fp32", compute = "fp32", reduce = "fp32", optim = "fp32", ac = "none",
              selective = "layer", reshard = "true";
  PlanConfig c;
  bool tt8b = false;
  std::string model = "llama3";
  app.add_option("--model", model, "model family: llama3 | qwen3 | deepseek_v3");
  app.add_option("--flavor", flavor, "flavor of the model (llama3: cpu_tiny .. 405B; qwen3: cpu_tiny_moe, 0.6B .. "
                 "32B, 30B-A3B, 235B-A22B; deepseek_v3: cpu_tiny, debugmodel, 16B, 236B, 671B)");
  app.add_option("--replicate", c.replicate, "HSDP replicate degree");
  app.add_option("--shard", c.shard, "FSDP shard degree");
  app.add_option("--tp", c.tp, "tensor parallel degree (TorchTitan's Llama plan, sequence parallel)");
  app.add_option("--cp", c.cp, "context parallel degree (ring attention; FSDP shards over shard x cp)");
  app.add_option("--cp-rotate-method", c.cp_rotate_method, "with --cp: allgather | alltoall (the ring)");
  app.add_option("--cp-load-balancer", c.cp_load_balancer, "with --cp: headtail | none");
  app.add_option("--ep", c.ep, "expert parallel degree (MoE models; divides --shard and the experts)");
  bool no_loss_parallel = false;
  app.add_flag("--no-loss-parallel", no_loss_parallel, "with --tp: logits gathered instead of vocabulary-sharded");
  app.add_option("--param-dtype", param, "sharded parameter / gradient dtype");
  app.add_option("--compute-dtype", compute, "mixed-precision param_dtype (unsharded params, activations)");
  app.add_option("--reduce-dtype", reduce, "gradient reduction dtype");
  app.add_option("--optim-dtype", optim, "optimizer state dtype");
  app.add_option("--optim-states", c.optim_states, "optimizer states per parameter (AdamW: 2)");
  app.add_option("--local-batch", c.local_batch);
  app.add_option("--seq", c.seq_len);
  app.add_option("--ac", ac, "activation checkpointing: none | selective | full");
  app.add_option("--selective", selective, "selective AC kind: layer | op");
  app.add_option("--selective-every", c.selective_every, "layer SAC: checkpoint every N-th block");
  app.add_flag("--keep-last-block", c.keep_last_block_unsharded,
               "the last block is not resharded after forward (fsdp-train's and TorchTitan's default)");
  app.add_flag("--op-sac-attention", c.op_sac_saves_attention,
               "op SAC keeps SDPA outputs too (TorchTitan's policy; ours keeps matmul outputs only)");
  int64_t vocab = 0;
  app.add_option("--vocab", vocab, "vocabulary size (default: the flavor's; fsdp-train's byte-level tokenizer: 258)");
  app.add_option("--reshard", reshard, "blocks' reshard_after_forward: true | false | N");
  app.add_flag("--loss-upcast", c.loss.upcast_logits, "cross-entropy on a float32 copy of the logits (TorchTitan)");
  app.add_flag("--free-logits", c.loss.free_logits_before_backward, "logits freed before backward (TorchTitan)");
  double overhead_mib = 0;
  app.add_option("--runtime-overhead-mib", overhead_mib, "fixed runtime allocations (libtorch CPU: ~4.5)");
  app.add_option("--pp", c.pp, "pipeline parallel degree (pp ranks; the world is pp x replicate x shard x cp x tp)");
  app.add_option("--schedule", c.schedule,
                 "pipeline schedule (torch's names): GPipe | 1F1B | LoopedBFS | Interleaved1F1B | "
                 "InterleavedZeroBubble | ZBVZeroBubble | DualPipeV");
  app.add_option("--microbatches", c.microbatches, "pipeline microbatches per step (must divide --local-batch)");
  app.add_option("--stages-per-rank", c.stages_per_rank, "pipeline stages per pp rank (0: the schedule's default)");
  int64_t layers_per_stage = 0;
  app.add_option("--layers-per-stage", layers_per_stage,
                 "TorchTitan's pipeline_parallel_layers_per_stage (stages = ceil((layers + 2) / this))");
  app.add_option("--first-stage-less-layers", c.first_stage_less_layers,
                 "the embedding counts as this many layers in the split (TorchTitan: 1)");
  app.add_option("--last-stage-less-layers", c.last_stage_less_layers,
                 "norm + output count as this many layers in the split (TorchTitan: 1)");
  app.add_flag("--torchtitan-8b", tt8b, "TorchTitan's published 8B run, next to its published memory");
  CLI11_PARSE(app, argc, argv);
  c.loss_parallel = !no_loss_parallel;
  try {
    if (tt8b) return torchtitan_8b();
    set_model(c, model, flavor);
    c.runtime_overhead = static_cast<int64_t>(overhead_mib * (1 << 20));
    if (vocab > 0) c.args.vocab_size = vocab;
    c.param_dtype = parse_dtype(param);
    c.compute_dtype = parse_dtype(compute);
    c.reduce_dtype = parse_dtype(reduce);
    c.optim_dtype = parse_dtype(optim);
    c.ac = parse_ac_mode(ac);
    TORCH_CHECK(selective == "layer" || selective == "op", "fsdp-plan: --selective must be layer or op");
    c.selective = selective == "op" ? SelectiveKind::Op : SelectiveKind::Layer;
    if (reshard == "true" || reshard == "false") {
      c.block_reshard = reshard == "true" ? 1 : 0;
    } else {
      // N: reshard to N ranks. Digits only, at most 9 (std::stoll alone says "stoll" for a bad value).
      TORCH_CHECK(!reshard.empty() && reshard.size() <= 9 &&
                      reshard.find_first_not_of("0123456789") == std::string::npos,
                  "fsdp-plan: --reshard: expected true, false or a number of ranks, got '", reshard, "'");
      c.block_reshard = std::stoll(reshard);
    }
    if (layers_per_stage != 0) c.layers_per_stage = layers_per_stage;
    std::cout << format_plan(make_plan(c));
  } catch (const std::exception& e) {
    // One line without libtorch's C++ backtrace; it names the problem (and mostly starts with "fsdp-plan:").
    const std::string msg = fsdp_apps::user_message(e);
    std::cerr << (msg.rfind("fsdp-plan:", 0) == 0 ? "" : "fsdp-plan: ") << msg << "\n";
    return 1;
  }
  return 0;
}
