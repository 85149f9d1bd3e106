// What autograd saves per block and for the loss (docs/planner.md, "Activations"): the planner's activation model,
// per token of the batch, from the model args (the parameters' shapes come from the seam: plan_model.cpp).
#include "plan_internal.h"

#include <fsdp/models/moe.h>

#include <algorithm>

namespace fsdp::plan::detail {
namespace {

// What an MoE feed-forward (src/models/moe.cpp; with ep > 1 src/expert_parallel) saves for backward, under uniform
// routing (each ep rank receives, and its experts compute, T k rows in all), split by what the bytes scale with:
// `routed` per token the MoE block routes (this TP rank's 1/tp of the sequence under TP: the router and the routed
// experts see only the local tokens), `shared` per token of the whole sequence (the shared experts run on the
// gathered sequence with 1/tp of their hidden dim). k = top_k, E experts, F = expert hidden, Fs = shared experts'
// hidden, e = compute dtype bytes. docs/planner.md lists the tensors.
struct MoESaved {
  int64_t routed = 0, shared = 0;
};
MoESaved moe_saved(const PlanConfig& c) {
  const models::moe::MoEOptions o = c.args.moe_options();
  const int64_t e = bytes_of(c.compute_dtype), k = o.top_k, E = o.num_experts, F = o.hidden, D = c.args.dim,
                Fs = ceil_div(o.hidden * o.num_shared_experts, c.tp);
  MoESaved out;
  out.routed = 4 * E                        // router scores (softmax / sigmoid output, float32)
               + 8 * k                      // chosen expert ids (gather's index)
               + (o.route_norm ? 4 * k + 4 : 0)  // chosen scores and their sum (the normalising division)
               + 8 * k + 8 * k              // slot -> token index (index_select, index_add), expert order (weights')
               + 4 * k                      // each slot's weight (float32) for the weight multiply
               + k * D * e                  // the experts' input rows (grouped GEMM's saved input)
               + 4 * k * F * e              // SwiGLU of the rows: w1 out, silu out, w3 out, product
               + 4 * k * D                  // expert outputs in float32, the weight multiply's other operand
               + k * D * e                  // the weighted outputs (index_add's source: its backward expands to it)
               + (c.ep > 1 ? 16 * k : 0);   // EP: the regrouping permutation and its inverse (index_select's indices)
  out.shared = 4 * Fs * e;                  // shared experts' SwiGLU (their input is the norm's saved output)
  return out;
}

}  // namespace

ActivationModel activation_model(const PlanConfig& c, int64_t T, const fsdp_train::AttentionShape& seam_attention) {
  const auto& a = c.args;
  // A model built otherwise (PlanConfig::build_model) has no TrainModel to report its kernel's shape: a Llama-family
  // decoder's (K / V repeated to every head under GQA, as the family's build reports it).
  const fsdp_train::AttentionShape attention =
      seam_attention.heads > 0 ? seam_attention : fsdp_train::AttentionShape{a.n_heads, a.head_dim(), a.head_dim()};
  const int64_t e = bytes_of(c.compute_dtype), TP = c.tp;
  ActivationModel out;
  // With TP, heads and the FFN hidden dim are split (per token of the whole sequence, which the colwise layers
  // see gathered); norms run on this rank's 1/tp of the tokens (sequence parallel).
  const int64_t D = a.dim, hq = a.n_heads * a.head_dim() / TP, hkv = a.kv_heads() * a.head_dim() / TP,
                F = ceil_div(a.ffn_hidden_dim(), TP), heads = a.n_heads / TP;
  // QK-norm (Qwen3): q_norm / k_norm over head_dim save their float32 input (wq / wk out, which RoPE alone would
  // not keep), the normalized tensor (compute dtype) and one float32 rsqrt per head row; their output goes to
  // RoPE, whose roped result SDPA saves (counted in attn).
  const int64_t qk = a.qk_norm ? (4 + e) * (hq + hkv) + 4 * (heads + a.kv_heads() / TP) : 0;
  // RMSNorm: float32 input (the input itself in fp32, an upcast copy otherwise), normalized (compute dtype)
  // saved for the weight multiply, output saved by the next linear(s). Under TP (sequence parallel) the norm
  // runs on T/tp tokens and its output is not saved: it is all-gathered (whose backward needs nothing) and the
  // colwise linears save the gathered [T, D] copy instead.
  const int64_t norm = TP > 1 ? (4 * D + e * D) / TP + e * D : 4 * D + 2 * e * D;
  // Attention: q (roped), k and v as SDPA sees them (repeated to n_heads under GQA), SDPA output (= wo
  // input), log-sum-exp (fp32 per head); at the kernel's head dims, the seam's (MLA's q/k and v differ).
  TORCH_CHECK(attention.heads == a.n_heads && attention.qk_head_dim > 0 && attention.v_head_dim > 0,
              "fsdp-plan internal: the seam's attention (", attention.heads, " heads) is not the args' (", a.n_heads,
              ")");
  // MLA (DeepSeek-V3): its low-rank projections run on the whole (gathered) sequence with replicated weights, and
  // their RMSNorms save as the block's do: q_norm its float32 input (wq_a's output, or its float32 copy) and the
  // normalized tensor and output (wq_b's input); kv_norm the same at the latent's width, except that in float32 its
  // input is a view of wkv_a's output and keeps the rope key's columns alive with it. The rope parts, the
  // concatenations and the head views save nothing more (rope multiplies by constants).
  int64_t latent = 0;
  if (const auto& mla = c.latent_attention) {
    latent = (mla->q_lora_rank > 0 ? 4 * mla->q_lora_rank + 2 * e * mla->q_lora_rank : 0) +
             4 * (e == 4 ? mla->kv_lora_rank + mla->qk_rope_head_dim : mla->kv_lora_rank) + 2 * e * mla->kv_lora_rank;
  }
  const int64_t attn = e * heads * (2 * attention.qk_head_dim + 2 * attention.v_head_dim) + 4 * heads + latent;
  // SwiGLU: w1 out (silu input), silu out, w3 out, product (w2 input).
  const int64_t ffn = 4 * e * F;
  const int64_t full_per_token = 2 * norm + attn + qk + ffn;
  // Under TP the MoE block routes this rank's T/tp tokens (sequence parallel through the block): the router gate
  // saves the ffn_norm's local output, and the shared experts' colwise w1 / w3 the gathered copy [T, D] (without
  // TP the norm's one output serves both, as in a dense block).
  const int64_t T_routed = T / TP;
  int64_t moe_layer = 0, moe_workspace = 0, moe_op_sac = 0;
  if (a.moe) {
    const models::moe::MoEOptions o = a.moe_options();
    const MoESaved ms = moe_saved(c);
    const int64_t Fs = ceil_div(o.hidden * o.num_shared_experts, TP);
    const int64_t ffn_norm = TP > 1 ? (4 * D + 2 * e * D) / TP + (Fs > 0 ? e * D : 0) : norm;
    moe_layer = T * (norm + ffn_norm + attn + qk + ms.shared) + T_routed * ms.routed;
    // Gradients in flight through an MoE block's backward: the residual ones, the routed rows' (3 F of SwiGLU,
    // the rows' D, the float32 outputs' 4 D) and the shared experts'. Rough (docs/planner.md).
    moe_workspace = T * e * (2 * D / TP + 3 * Fs) + T_routed * o.top_k * (e * (3 * o.hidden + D) + 4 * D);
    // Op-level SAC: the block's matmuls (aten::mm) in order are wq, wk, wv, wo, the router gate, then the shared
    // experts' w1, w3, w2; the routed experts' grouped GEMM (_grouped_mm, which the policy does not intercept) is
    // recomputed. The odd ones are kept: wq, wv, the gate's [T/tp, E] logits and the shared experts' w3 output.
    moe_op_sac = T * e * (D / TP + hq + hkv + Fs) + T_routed * o.num_experts * e;
  }
  // Gradients in flight through a dense block's backward: the incoming and outgoing residual gradients and the
  // SwiGLU intermediates'. Rough (docs/planner.md).
  const int64_t dense_workspace = T * e * (2 * D / TP + 3 * F);
  for (int64_t l = 0; l < a.n_layers; ++l) {
    out.layer_full.push_back(is_moe(a, l) ? moe_layer : T * full_per_token);
    out.layer_workspace.push_back(is_moe(a, l) ? moe_workspace : dense_workspace);
    (is_moe(a, l) ? out.moe_per_layer : out.dense_per_layer) = out.layer_full.back();
  }
  out.full_per_layer = a.n_layers > 0 ? out.layer_full.front() : T * full_per_token;
  out.checkpointed_per_layer = T * e * D / TP;  // the block input only (sequence-sharded under TP)
  // Op-level SAC: the block input and a copy of every other matmul output (wq, wv, w1, w2); TorchTitan's policy
  // also keeps the SDPA output and log-sum-exp. Under TP the rowwise w2's matmul output is the full-sequence
  // partial sum [T, D], saved before its reduce-scatter.
  const int64_t op_sac_per_token =
      e * (D / TP + hq + hkv + F + D) + (c.op_sac_saves_attention ? e * hq + 4 * heads : 0);
  out.layer_saved = out.layer_full;
  out.recomputed.assign(a.n_layers, false);
  for (int64_t l = 0; l < a.n_layers; ++l) {
    if (c.ac == ACMode::Full ||
        (c.ac == ACMode::Selective && c.selective == SelectiveKind::Layer &&
         (l + 1) % std::max<int64_t>(c.selective_every, 1) == 0)) {  // TorchTitan: every N-th block
      out.layer_saved[l] = out.checkpointed_per_layer;
      out.recomputed[l] = true;
    } else if (c.ac == ACMode::Selective && c.selective == SelectiveKind::Op) {  // the saved op outputs, the rest recomputed
      out.layer_saved[l] = is_moe(a, l) ? moe_op_sac + (c.op_sac_saves_attention ? T * (e * hq + 4 * heads) : 0)
                                        : T * op_sac_per_token;
      out.recomputed[l] = true;
    }
  }
  out.final_norm = T * norm;
  // Logits per rank: vocabulary-sharded under loss parallel, gathered otherwise.
  const int64_t V = TP > 1 && c.loss_parallel ? ceil_div(a.vocab_size, TP) : a.vocab_size;
  out.logits = T * V * e;
  out.lsm = T * V * 4;  // log-softmax output (float32 when upcast; = compute dtype otherwise)
  out.lsm_bytes = c.loss.upcast_logits ? out.lsm : T * V * e;
  out.loss_forward = out.logits + out.lsm_bytes + (c.loss.upcast_logits ? out.lsm : 0);
  // The largest block's (an MoE and a dense block differ), for the moments that take one block of any kind.
  out.grad_workspace = dense_workspace;
  for (int64_t w : out.layer_workspace) out.grad_workspace = std::max(out.grad_workspace, w);
  // Under GQA the kernel gets K and V repeated to the query heads (so does the ring under cp); without GQA
  // n_kv_heads = n_heads.
  out.attention = fsdp_train::attention_memory({heads, attention.qk_head_dim, attention.v_head_dim}, T, e, c.cp,
                                               c.cp_rotate_method == "allgather");
  out.largest_full = T * full_per_token;
  for (int64_t f : out.layer_full) out.largest_full = std::max(out.largest_full, f);
  return out;
}

}  // namespace fsdp::plan::detail
