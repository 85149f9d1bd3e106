"""PyTorch / Hugging Face side of the checkpoint interop tests (tests/checkpoint/interop_test.cpp drives it).

Everything here is PyTorch's or transformers' own code path, the independent reference for our C++:

  torchrun -n 2 torch_side.py train-save  ...  FSDP2 trains the Llama of bench/vs_pytorch/vs_pytorch.py (a line-by-line
                                              transcription of ours), dcp.save()s a TorchTitan-style state dict,
                                              writes every tensor of it (full) to a safetensors reference, then
                                              continues training and writes its losses
  torchrun -n 2 torch_side.py load-check  ...  FSDP2 model + AdamW, dcp.load() of a checkpoint we wrote, compares every
                                              tensor with a safetensors reference (exit 1 on a difference)
  python torch_side.py malicious ...           writes .metadata files that run a command when pickle.load()ed
  python torch_side.py run-pickle FILE         pickle.load(FILE), as torch's FileSystemReader does (proves a payload works)
  python torch_side.py hf-make ...             a random LlamaForCausalLM, save_pretrained (sharded + index), its logits
  python torch_side.py hf-logits ...           LlamaForCausalLM (--architecture) .from_pretrained(dir) logits (fp32)
"""
import argparse
import json
import os
import pickle
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "bench", "vs_pytorch"))
import st_io  # noqa: E402


def load_args(path):
    with open(path) as f:
        a = json.load(f)
    for k in ["dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim"]:
        a[k] = int(a[k])
    a["tie_embeddings"] = int(a.get("tie_embeddings", 0))
    a["norm_eps"] = float(a["norm_eps"])
    a["rope_theta"] = float(a["rope_theta"])
    a["rope_scaling"] = a.get("rope_scaling")  # None or a dict (Llama 3.1); the FSDP2 tests use None
    return a


# ---- FSDP2 + DCP ----------------------------------------------------------------------------------------------

def dist_setup():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))


def build(a, mesh, seed, o):
    from torch.distributed.fsdp import fully_shard
    from vs_pytorch import Transformer
    torch.manual_seed(seed)
    model = Transformer(a)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():  # Gloo has no AVG: SUM + division, as bench/vs_pytorch
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    optim = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=o.weight_decay,
                              amsgrad=False, foreach=False, fused=False)
    return model, optim


def train(dist, model, optim, tokens, first, steps, local_batch):
    import torch.nn.functional as F
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first, first + steps):
        rows = tokens[step, rank * local_batch:(rank + 1) * local_batch]
        inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        gl = loss.detach().clone()
        dist.all_reduce(gl, op=dist.ReduceOp.SUM)
        losses.append(gl.item() / world)
    return losses


def titan_state(model, optim, step=None):
    """TorchTitan's checkpoint layout: model keys at the top level, optimizer flattened under `optimizer`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    sd = dict(msd)
    sd["optimizer"] = osd
    if step is not None:
        sd["train_state"] = {"step": step, "ntokens_seen": 0}
        sd["lr_scheduler"] = {"last_epoch": step}
    return sd, msd, osd


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def flat_tensors(sd):
    """Every tensor of a TorchTitan-style state dict under its DCP key, full (all ranks take part)."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                if torch.is_tensor(v2):
                    out[f"{k}.{k2}"] = full(v2).detach().clone()
        elif torch.is_tensor(v):
            out[k] = full(v).detach().clone()
    return out


def cmd_train_save(o):
    import torch.distributed.checkpoint as dcp
    dist, mesh = dist_setup()
    rank = dist.get_rank()
    a = load_args(o.args)
    model, optim = build(a, mesh, o.seed, o)
    gb = o.local_batch * dist.get_world_size()
    total = o.steps_before + o.steps_after
    tokens = torch.from_file(o.tokens, shared=False, size=total * gb * (o.seq + 1), dtype=torch.int64)
    tokens = tokens.view(total, gb, o.seq + 1)
    before = train(dist, model, optim, tokens, 0, o.steps_before, o.local_batch)
    sd, _, _ = titan_state(model, optim, o.steps_before)
    # TorchTitan also saves each data-parallel rank's data loader state as pickled bytes (not plain data).
    sd["dataloader"] = {f"dp_rank_{rank}": pickle.dumps({"sample": 123, "rank": rank}), "world_size": 2}
    dcp.save(sd, checkpoint_id=o.dir)
    ref = flat_tensors(sd)
    if rank == 0:
        st_io.save(o.ref, ref)
    after = train(dist, model, optim, tokens, o.steps_before, o.steps_after, o.local_batch)
    if rank == 0:
        with open(o.losses, "w") as f:
            json.dump({"before": before, "after": after}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def cmd_load_check(o):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    dist, mesh = dist_setup()
    rank = dist.get_rank()
    a = load_args(o.args)
    model, optim = build(a, mesh, o.seed, o)
    ref, _ = st_io.load(o.ref)
    sd, msd, osd = titan_state(model, optim)
    fresh = flat_tensors(sd)
    moved = [k for k in ref if k in fresh and not torch.equal(fresh[k].to(ref[k].dtype), ref[k])]
    problems = []
    if len(moved) < len(ref) // 2:
        problems.append(f"only {len(moved)} of {len(ref)} reference tensors differ from a fresh model: vacuous")
    dcp.load(sd, checkpoint_id=o.dir)
    set_state_dict(model, optim, model_state_dict={k: v for k, v in sd.items() if k != "optimizer"},
                   optim_state_dict=sd["optimizer"], options=StateDictOptions(flatten_optimizer_state_dict=True))
    sd2, _, osd2 = titan_state(model, optim)  # read back from the live model and optimizer
    got = flat_tensors(sd2)
    checked = 0
    for k, r in ref.items():
        if k not in got:
            problems.append(f"{k}: not in PyTorch's state dict")
            continue
        g = got[k]
        if k.endswith(".step"):
            same = g.item() == r.item()
        else:
            same = g.dtype == r.dtype and g.shape == r.shape and torch.equal(g, r)
        if not same:
            problems.append(f"{k}: differs (max abs {(g.double() - r.double()).abs().max().item():.3e})")
        checked += 1
    for k in got:
        if k not in ref:
            problems.append(f"{k}: loaded by PyTorch but not in the reference")
    lr = [v for k, v in osd2.items() if k.startswith("param_groups.") and k.endswith(".lr")]
    if not lr or any(abs(x - o.expect_lr) > 1e-15 for x in lr):
        problems.append(f"param_groups lr {lr[:3]} != {o.expect_lr}")
    if rank == 0:
        print(f"load-check: {checked} tensors compared, {len(problems)} problem(s)")
        for p in problems[:30]:
            print("  " + p)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(1 if problems else 0)


# ---- hostile pickles ------------------------------------------------------------------------------------------

class RunsCommand:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def cmd_malicious(o):
    """Three .metadata files whose unpickling runs `touch <marker>`: a bare os.system call, one hidden inside an
    otherwise genuine DCP Metadata (storage_meta replaced), and a hand-written GLOBAL 'os system'."""
    from torch.distributed.checkpoint.metadata import Metadata
    os.makedirs(o.out, exist_ok=True)
    cmd = f"touch {o.marker}"
    with open(os.path.join(o.out, "bare.metadata"), "wb") as f:
        pickle.dump(RunsCommand(cmd), f)
    md = Metadata(state_dict_metadata={}, storage_data={}, storage_meta=RunsCommand(cmd))
    with open(os.path.join(o.out, "inside.metadata"), "wb") as f:
        pickle.dump(md, f)
    with open(os.path.join(o.out, "handwritten.metadata"), "wb") as f:
        f.write(b"cos\nsystem\n(X" + len(cmd).to_bytes(4, "little") + cmd.encode() + b"tR.")


def cmd_run_pickle(o):
    with open(o.file, "rb") as f:
        pickle.load(f)


def cmd_dcp_fixture(o):
    """A one-process dcp.save with every kind of entry (for the parser tests) and a JSON manifest of what it holds."""
    import torch.distributed.checkpoint as dcp
    g = torch.Generator().manual_seed(0)
    sd = {
        "w": torch.randn(5, 3, generator=g),
        "b16": torch.randn(4, generator=g).to(torch.bfloat16),
        "i64": torch.arange(6, dtype=torch.int64).view(2, 3),
        "scalar": torch.tensor(2.5),
        "optimizer": {"state.w.step": torch.tensor(3.0), "param_groups.w.lr": 0.001,
                      "param_groups.w.betas": (0.9, 0.95), "param_groups.w.amsgrad": False,
                      "param_groups.w.foreach": None, "param_groups.w.name": "group-0"},
        "train_state": {"step": 7, "nested": {"a": [1, 2.5, "x"]}},
        "dataloader": {"dp_rank_0": b"\x80\x04opaque"},
    }
    dcp.save(sd, checkpoint_id=o.out, no_dist=True)
    tensors = {}
    for k, v in sd.items():
        if torch.is_tensor(v):
            tensors[k] = v
    tensors["optimizer.state.w.step"] = sd["optimizer"]["state.w.step"]
    st_io.save(os.path.join(o.out + ".ref.safetensors"), tensors)
    manifest = {"values": {"optimizer.param_groups.w.lr": 0.001, "optimizer.param_groups.w.betas": [0.9, 0.95],
                           "optimizer.param_groups.w.amsgrad": False, "optimizer.param_groups.w.foreach": None,
                           "optimizer.param_groups.w.name": "group-0", "train_state.step": 7,
                           "train_state.nested.a": [1, 2.5, "x"]},
                "unreadable": ["dataloader.dp_rank_0"]}
    with open(o.out + ".manifest.json", "w") as f:
        json.dump(manifest, f)


def cmd_dcp_read(o):
    """dcp_to_torch_save-style check of a DCP directory we wrote: every tensor equals the reference."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = o.dir.rstrip("/") + ".pt"
    dcp_to_torch_save(o.dir, out)
    got = torch.load(out, weights_only=False)
    ref, _ = st_io.load(o.ref)
    bad = []

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, prefix + k + ".")
            else:
                yield prefix + k, v
    flat_got = dict(flat(got))
    for k, r in ref.items():
        g = flat_got.get(k)
        if g is None or not torch.is_tensor(g) or g.dtype != r.dtype or not torch.equal(g, r):
            bad.append(k)
    print(f"dcp-read: {len(ref)} tensors, {len(bad)} differ: {bad[:10]}")
    print("values:", json.dumps({k: v for k, v in flat_got.items() if not torch.is_tensor(v)}, default=str))
    sys.exit(1 if bad else 0)


# ---- Hugging Face ---------------------------------------------------------------------------------------------

def hf_config(a, rope_scaling=None):
    from transformers import LlamaConfig
    rope = {"rope_type": "default", "rope_theta": a["rope_theta"]}
    if rope_scaling:  # Llama 3.1
        rope = dict(rope_scaling, rope_type="llama3", rope_theta=a["rope_theta"])
    return LlamaConfig(hidden_size=a["dim"], intermediate_size=a["ffn_hidden_dim"], num_hidden_layers=a["n_layers"],
                       num_attention_heads=a["n_heads"], num_key_value_heads=a["n_kv_heads"],
                       vocab_size=a["vocab_size"], rms_norm_eps=a["norm_eps"], rope_parameters=rope,
                       tie_word_embeddings=bool(a["tie_embeddings"]), max_position_embeddings=2048,
                       head_dim=a["dim"] // a["n_heads"], attention_bias=False, mlp_bias=False)


def hf_logits(model, tokens_path, batch, seq):
    toks = torch.from_file(tokens_path, shared=False, size=batch * seq, dtype=torch.int64).view(batch, seq)
    model.eval()
    with torch.no_grad():
        return model(input_ids=toks).logits.float().contiguous()


def cmd_hf_make(o):
    from transformers import LlamaForCausalLM
    a = load_args(o.args)
    torch.manual_seed(o.seed)
    model = LlamaForCausalLM(hf_config(a, a.get("rope_scaling"))).float()
    with torch.no_grad():  # every tensor random (norms too), so a swapped mapping cannot go unnoticed
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(o.out, max_shard_size=o.max_shard_size, safe_serialization=True)
    st_io.save(o.logits, {"logits": hf_logits(model, o.tokens, o.batch, o.seq)})


def cmd_hf_logits(o):
    import transformers
    cls = getattr(transformers, o.architecture)  # LlamaForCausalLM, Qwen3MoeForCausalLM, ...
    model = cls.from_pretrained(o.dir, dtype=torch.float32)
    st_io.save(o.logits, {"logits": hf_logits(model, o.tokens, o.batch, o.seq)})
    print("hf-logits:", type(model).__name__, "config", json.dumps(model.config.to_dict().get("rope_parameters")))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ["train-save", "load-check"]:
        s = sub.add_parser(name)
        s.add_argument("--args", required=True)
        s.add_argument("--dir", required=True)
        s.add_argument("--ref", required=True)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--lr", type=float, default=2e-3)
        s.add_argument("--weight-decay", type=float, default=0.1)
        s.add_argument("--local-batch", type=int, default=3)
        s.add_argument("--seq", type=int, default=16)
        s.add_argument("--tokens")
        s.add_argument("--steps-before", type=int, default=3)
        s.add_argument("--steps-after", type=int, default=10)
        s.add_argument("--losses")
        s.add_argument("--expect-lr", type=float, default=0.0)
    s = sub.add_parser("malicious")
    s.add_argument("--out", required=True)
    s.add_argument("--marker", required=True)
    s = sub.add_parser("run-pickle")
    s.add_argument("file")
    s = sub.add_parser("dcp-fixture")
    s.add_argument("--out", required=True)
    s = sub.add_parser("dcp-read")
    s.add_argument("--dir", required=True)
    s.add_argument("--ref", required=True)
    for name in ["hf-make", "hf-logits"]:
        s = sub.add_parser(name)
        s.add_argument("--args")
        s.add_argument("--dir")
        s.add_argument("--out")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--max-shard-size", default="64KB")
        s.add_argument("--tokens", required=True)
        s.add_argument("--batch", type=int, default=2)
        s.add_argument("--seq", type=int, default=16)
        s.add_argument("--logits", required=True)
        s.add_argument("--architecture", default="LlamaForCausalLM")  # hf-logits: the transformers class to load
    o = p.parse_args()
    {"train-save": cmd_train_save, "load-check": cmd_load_check, "malicious": cmd_malicious,
     "run-pickle": cmd_run_pickle, "dcp-fixture": cmd_dcp_fixture, "dcp-read": cmd_dcp_read,
     "hf-make": cmd_hf_make, "hf-logits": cmd_hf_logits}[o.cmd](o)


if __name__ == "__main__":
    main()
