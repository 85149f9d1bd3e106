"""Hugging Face side of tests/models/qwen3_hf_test.cpp: small random Qwen3 / Qwen3-MoE models built locally with
the venv's transformers (no download), and their logits, as the independent reference for our import/export.

  make --kind K --out DIR --seed S     DIR/hf (transformers 5's in-memory stacked experts, its state dict),
                                        DIR/hf_per_expert (save_pretrained: one tensor per expert, the hub layout),
                                        DIR/ref.safetensors {tokens [2, 9] int64, logits float32}
  logits --dir MODEL --tokens IN --out OUT   logits of MODEL (e.g. our export) on IN's "tokens"
"""
import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

KINDS = {
    # dense Qwen3 with QK-norm; head_dim 8 * 4 heads = 32 = hidden (a second dense kind below has it differ)
    "dense": dict(moe=False, hidden=32, heads=4, kv=2, head_dim=8, tie=False),
    "dense_wide_heads": dict(moe=False, hidden=32, heads=4, kv=2, head_dim=16, tie=True),
    # MoE on layer 1 only (decoder_sparse_step 2, layer 2 in mlp_only_layers): dense and MoE layers mixed
    "moe": dict(moe=True, step=2, mlp_only=[2], hidden=32, heads=4, kv=2, head_dim=8, tie=False),
    "moe_all": dict(moe=True, step=1, mlp_only=[], hidden=32, heads=4, kv=2, head_dim=8, tie=False),
}


def config(kind):
    k = KINDS[kind]
    common = dict(vocab_size=128, hidden_size=k["hidden"], intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=k["heads"], num_key_value_heads=k["kv"], head_dim=k["head_dim"],
                  rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  tie_word_embeddings=k["tie"], max_position_embeddings=64)
    if not k["moe"]:
        from transformers import Qwen3Config
        return Qwen3Config(**common)
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**common, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                          decoder_sparse_step=k["step"], mlp_only_layers=k["mlp_only"], norm_topk_prob=True)


def model_class(cfg):
    if cfg.model_type == "qwen3_moe":
        from transformers import Qwen3MoeForCausalLM
        return Qwen3MoeForCausalLM
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM


def randomize(model):
    """Every tensor random and well away from its init (norms too, so a swapped q_norm/k_norm or a missing QK-norm
    shows); router gates large enough that no two experts' scores are within rounding."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def logits(model, tokens):
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float().contiguous()


def cmd_make(o):
    torch.manual_seed(o.seed)
    cfg = config(o.kind)
    model = randomize(model_class(cfg)(cfg).float())
    # save_pretrained writes the hub layout: transformers 5.24 turns its in-memory stacked experts back into one
    # tensor per expert (model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight).
    per = os.path.join(o.out, "hf_per_expert")
    model.save_pretrained(per, safe_serialization=True)
    # transformers 5's stacked layout (mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F]): its state dict.
    hf = os.path.join(o.out, "hf")
    os.makedirs(hf, exist_ok=True)
    shutil.copy(os.path.join(per, "config.json"), hf)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    stacked = sum(k.endswith("experts.gate_up_proj") for k in state)
    per_expert = sum(k.endswith(".gate_proj.weight") and ".experts." in k
                     for k in load_file(os.path.join(per, "model.safetensors")))
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), dtype=torch.int64)
    save_file({"tokens": tokens, "logits": logits(model, tokens)}, os.path.join(o.out, "ref.safetensors"))
    n_moe = sum(type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers)
    print(f"make {o.kind}: {sum(p.numel() for p in model.parameters())} parameters, {n_moe} MoE layers, "
          f"{stacked} stacked gate_up_proj, {per_expert} per-expert gate_proj, logits std {logits(model, tokens).std():.3f}")


def cmd_logits(o):
    cfg = json.load(open(os.path.join(o.dir, "config.json")))
    from transformers import AutoConfig
    model = model_class(AutoConfig.from_pretrained(o.dir)).from_pretrained(o.dir, dtype=torch.float32)
    tokens = load_file(o.tokens)["tokens"]
    save_file({"logits": logits(model, tokens)}, o.out)
    print("logits:", type(model).__name__, cfg["model_type"])


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
    o = p.parse_args()
    {"make": cmd_make, "logits": cmd_logits}[o.cmd](o)


if __name__ == "__main__":
    sys.exit(main())
