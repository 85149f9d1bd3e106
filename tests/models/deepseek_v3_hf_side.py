"""Hugging Face side of tests/models/deepseek_v3_hf_test.cpp: small random DeepseekV3ForCausalLM models built
locally with the venv's transformers (no download), and their logits, the independent reference for our import,
export and config.json reading.

  make --kind K --out DIR --seed S     DIR/hf_per_expert (save_pretrained: one tensor per expert, the hub layout),
                                        DIR/hf (the in-memory state dict: stacked gate_up_proj / down_proj),
                                        DIR/ref.safetensors {tokens [2, 9] int64, logits float32}
  logits --dir MODEL --tokens IN --out OUT   logits of MODEL (e.g. our export) on IN's "tokens"
  count --dir DIR                      transformers' parameter count of DIR/config.json (built on meta), to DIR/count
"""
import argparse
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

# Both kinds: sigmoid routing limited to 2 of 4 groups (8 experts, top 2), one shared expert, routed scale 2.5,
# a dense first layer, YaRN with mscale != mscale_all_dim (cos/sin and the softmax scale both scaled).
KINDS = {
    "lora": dict(q_lora_rank=16, norm_topk_prob=True),
    "no_lora": dict(q_lora_rank=None, norm_topk_prob=False),
}


def config(kind):
    from transformers import DeepseekV3Config
    k = KINDS[kind]
    return DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=k["q_lora_rank"], qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=k["norm_topk_prob"], max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 0.8},
        tie_word_embeddings=False, num_nextn_predict_layers=0)


def randomize(model):
    """Every tensor random and away from its init (norms too); router gates large enough that no two experts'
    scores are within rounding; the load-balancing bias random so that it changes the choice."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


def logits(model, tokens):
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float().contiguous()


def cmd_make(o):
    from transformers import DeepseekV3ForCausalLM
    torch.manual_seed(o.seed)
    cfg = config(o.kind)
    model = randomize(DeepseekV3ForCausalLM(cfg).float())
    per = os.path.join(o.out, "hf_per_expert")
    model.save_pretrained(per, safe_serialization=True)
    hf = os.path.join(o.out, "hf")
    os.makedirs(hf, exist_ok=True)
    shutil.copy(os.path.join(per, "config.json"), hf)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    stacked = sum(k.endswith("experts.gate_up_proj") for k in state)
    per_expert = sum(".experts." in k and k.endswith(".gate_proj.weight")
                     for k in load_file(os.path.join(per, "model.safetensors")))
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), dtype=torch.int64)
    out = logits(model, tokens)
    save_file({"tokens": tokens, "logits": out}, os.path.join(o.out, "ref.safetensors"))
    n_moe = sum(type(layer.mlp).__name__.endswith("MoE") for layer in model.model.layers)
    print(f"make {o.kind}: {sum(p.numel() for p in model.parameters())} parameters, {n_moe} MoE layers, "
          f"{stacked} stacked gate_up_proj, {per_expert} per-expert gate_proj, logits std {out.std():.3f}")


def cmd_logits(o):
    from transformers import DeepseekV3ForCausalLM
    model = DeepseekV3ForCausalLM.from_pretrained(o.dir, dtype=torch.float32)
    tokens = load_file(o.tokens)["tokens"]
    save_file({"logits": logits(model, tokens)}, o.out)
    print("logits:", type(model).__name__)


def cmd_count(o):
    from transformers import AutoConfig, DeepseekV3ForCausalLM
    cfg = AutoConfig.from_pretrained(o.dir)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    with open(os.path.join(o.dir, "count"), "w") as f:
        f.write(str(n))
    print("count:", n)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("make")
    s.add_argument("--kind", choices=sorted(KINDS), required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("logits")
    s.add_argument("--dir", required=True)
    s.add_argument("--tokens", required=True)
    s.add_argument("--out", required=True)
    s = sub.add_parser("count")
    s.add_argument("--dir", required=True)
    o = p.parse_args()
    {"make": cmd_make, "logits": cmd_logits, "count": cmd_count}[o.cmd](o)


if __name__ == "__main__":
    sys.exit(main())
