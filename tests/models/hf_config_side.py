"""transformers side of tests/models/hf_config_test.cpp: a small random Llama / Qwen3 / Qwen3-MoE model built
locally with the venv's transformers (no download), saved with save_pretrained, its config.json then edited the
way a user edits it (e.g. YaRN added as a top-level rope_scaling), and transformers' logits on the saved
directory as it reads it back (from_pretrained): the independent reference for our config reader.

  make --family F --base JSON --edit JSON --out DIR [--seed S]
      F: llama | qwen3 | qwen3_moe. JSON --base: configuration class keyword arguments over the defaults below;
      --edit: config.json fields set after saving (null deletes one). Writes DIR/config.json, DIR/model.safetensors
      and DIR/ref.safetensors {tokens [2, 12] int64, logits (edited config), logits_base (saved config)}.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

from qwen3_hf_side import logits, randomize  # this folder is on sys.path

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


def classes(family):
    import transformers as t
    return {"llama": (t.LlamaConfig, t.LlamaForCausalLM), "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM),
            "qwen3_moe": (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM)}[family]


def cmd_make(o):
    torch.manual_seed(o.seed)
    config_cls, model_cls = classes(o.family)
    kwargs = dict(BASE, **(MOE if o.family == "qwen3_moe" else {}))
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0 if o.family == "llama" else 1e6}
    kwargs.update(json.loads(o.base))
    model = randomize(model_cls(config_cls(**kwargs)).float())
    model.save_pretrained(o.out, safe_serialization=True)
    tokens = torch.randint(0, kwargs["vocab_size"], (2, 12), dtype=torch.int64)
    base = logits(model_cls.from_pretrained(o.out, dtype=torch.float32), tokens)
    path = os.path.join(o.out, "config.json")
    cfg = json.load(open(path))
    for k, v in json.loads(o.edit).items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(path, "w"), indent=2)
    reloaded = model_cls.from_pretrained(o.out, dtype=torch.float32)
    ref = logits(reloaded, tokens)
    print("rope as transformers read it:", json.dumps(getattr(reloaded.config, "rope_parameters", None), sort_keys=True))
    save_file({"tokens": tokens, "logits": ref, "logits_base": base}, os.path.join(o.out, "ref.safetensors"))
    print(f"make {o.family}: |edited - saved| = {(ref - base).abs().max():.4g}, logits std {ref.std():.3f}")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("make")
    s.add_argument("--family", choices=["llama", "qwen3", "qwen3_moe"], required=True)
    s.add_argument("--base", default="{}")
    s.add_argument("--edit", default="{}")
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    o = p.parse_args()
    cmd_make(o)


if __name__ == "__main__":
    sys.exit(main())
