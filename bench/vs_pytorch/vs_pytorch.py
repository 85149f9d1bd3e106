"""PyTorch FSDP2 side of the side-by-side benchmark (run under torchrun; run.py drives both sides).

The model is a line-by-line transcription of our C++ Llama 3 (src/models/llama.cpp), not TorchTitan's code:
  - RMSNorm: normalise in float32, x * rsqrt(mean(x^2) + eps), cast back, times weight;
  - RoPE: interleaved pairs (x[2i], x[2i+1]) rotated as complex numbers, tables cos/sin of
    pos * theta^(-2i/head_dim) computed in float64 and rounded to float32 (TorchTitan's freqs_cis convention),
    with Llama 3.1 frequency scaling when the weights' metadata names it (debugmodel);
  - attention: grouped-query (repeat_interleave of kv heads), scaled_dot_product_attention(is_causal=True),
    i.e. the default 1/sqrt(head_dim) scaling; no biases anywhere;
  - SwiGLU feed-forward w2(silu(w1 x) * w3 x); TorchTitan FQNs so the safetensors file loads as a state dict.
Weights come from the file our side wrote (model args in its metadata), tokens from the same raw int64 file.
Sharding: fully_shard per block (reshard_after_forward as given) then the root (default policy), the same
1-D mesh over the world as ours. On Gloo, gradient reduction uses set_force_sum_reduction_for_comms(True):
SUM collectives + a post-division by the data-parallel size (see run.py's --no-force-sum for the check).
--device cuda: every rank computes on cuda:0 (the ranks share one GPU), collectives are Gloo's on CUDA tensors,
and each step also logs torch.cuda.max_memory_allocated. Not yet run on a GPU (docs/benchmarks.md).
Writes one JSON line per step to <out-dir>/theirs_rank<r>.jsonl.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_io  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def precompute_rope(head_dim, seq_len, theta, scaling=None):
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64)[: head_dim // 2] / head_dim
    freqs = 1.0 / torch.pow(theta, exponents)
    if scaling is not None:  # Llama 3.1 (TorchTitan's RoPE scaling="llama")
        factor, low, high, context = scaling
        wavelen = 2 * math.pi / freqs
        smooth = (context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * freqs / factor + smooth * freqs
        scaled = torch.where(wavelen > context / low, freqs / factor, freqs)
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        freqs = torch.where(medium, smoothed, scaled)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin):
    b, s, h, d = x.shape
    xf = x.float().reshape(b, s, h, d // 2, 2)
    re, im = xf[..., 0], xf[..., 1]
    c = cos.view(1, s, 1, d // 2)
    si = sin.view(1, s, 1, d // 2)
    out = torch.stack([re * c - im * si, re * si + im * c], dim=-1)
    return out.flatten(3).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_heads, self.n_kv_heads = a["n_heads"], a["n_kv_heads"]
        self.head_dim = a["dim"] // a["n_heads"]
        self.wq = nn.Linear(a["dim"], self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, a["dim"], bias=False)

    def forward(self, x, cos, sin):
        bs, seq, _ = x.shape
        xq = self.wq(x).view(bs, seq, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bs, seq, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bs, seq, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rope(xq, cos, sin), apply_rope(xk, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:
            xk = xk.repeat_interleave(n_rep, dim=2)
            xv = xv.repeat_interleave(n_rep, dim=2)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a["dim"], a["ffn_hidden_dim"])
        self.attention_norm = RMSNorm(a["dim"], a["norm_eps"])
        self.ffn_norm = RMSNorm(a["dim"], a["norm_eps"])

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a["vocab_size"], a["dim"])
        self.layers = nn.ModuleList([TransformerBlock(a) for _ in range(a["n_layers"])])
        self.norm = RMSNorm(a["dim"], a["norm_eps"])
        self.output = nn.Linear(a["dim"], a["vocab_size"], bias=False)
        if a["tie_embeddings"]:  # one Parameter for both, as ours (Llama 3.2 1B); FSDP2 shards it in the root group
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        seq = tokens.shape[1]
        if (getattr(self, "_rope", None) is None or self._rope[0].shape[0] != seq
                or self._rope[0].device != h.device):  # cached, as ours; on the model's device (cuda:0 too)
            cos, sin = precompute_rope(self.a["dim"] // self.a["n_heads"], seq, self.a["rope_theta"],
                                       self.a["rope_scaling"])
            self._rope = (cos.to(h.device), sin.to(h.device))
        cos, sin = self._rope
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def model_args(meta):
    ints = ["dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "tie_embeddings"]
    a = {k: int(meta[k]) for k in ints}
    a["norm_eps"] = float(meta["norm_eps"])
    a["rope_theta"] = float(meta["rope_theta"])
    a["rope_scaling"] = None
    if "rope_scaling_factor" in meta:
        a["rope_scaling"] = (float(meta["rope_scaling_factor"]), float(meta["rope_low_freq_factor"]),
                             float(meta["rope_high_freq_factor"]),
                             float(meta["rope_original_max_position_embeddings"]))
    return a


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class CommCounter:
    """Counts the collectives FSDP2 issues and the bytes each rank would send under the same byte model as our
    CommStats (ring all-gather (W-1) x input; reduce-scatter (W-1)/W x input; all-reduce 2(W-1)/W x tensor).
    This is what FSDP2 *asks for*; Gloo's own algorithms may move more (see run.py's notes)."""

    def __init__(self):
        self.calls = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.bytes = 0
        # FSDP2 calls dist.all_gather_single / reduce_scatter_single from torch 2.13 on, and
        # all_gather_into_tensor / reduce_scatter_tensor before (2.11 on the lent GPU machines): wrap whichever of
        # each pair this torch has, detected by name, not by version.
        ag_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        rs_name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        self.collective_names = (ag_name, rs_name)
        ag, rs, ar = getattr(dist, ag_name), getattr(dist, rs_name), dist.all_reduce

        def nbytes(t):
            return t.numel() * t.element_size()

        def size(group):
            return dist.get_world_size(group)

        def all_gather(output, input, *args, group=None, async_op=False, **kw):
            self.calls["all_gather"] += 1
            self.bytes += (size(group) - 1) * nbytes(input)
            return ag(output, input, *args, group=group, async_op=async_op, **kw)

        def reduce_scatter(output, input, *args, group=None, async_op=False, **kw):
            self.calls["reduce_scatter"] += 1
            w = size(group)
            self.bytes += (w - 1) * nbytes(input) // w
            return rs(output, input, *args, group=group, async_op=async_op, **kw)

        def all_reduce(tensor, *args, group=None, async_op=False, **kw):
            self.calls["all_reduce"] += 1
            w = size(group)
            self.bytes += 2 * (w - 1) * nbytes(tensor) // w
            return ar(tensor, *args, group=group, async_op=async_op, **kw)

        setattr(dist, ag_name, all_gather)
        setattr(dist, rs_name, reduce_scatter)
        dist.all_reduce = all_reduce

    def snapshot(self):
        return dict(self.calls), self.bytes


def parse_reshard(s):
    """default | true | false | <int>, as ours.cpp's --reshard."""
    if s in ("default", "true", "false"):
        return {"default": None, "true": True, "false": False}[s]
    return int(s)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--weights", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out-dir", default=".")
    p.add_argument("--reshard", default="default")
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--replicate", type=int, default=1, help="HSDP replicate degree")
    p.add_argument("--mp", default="fp32", choices=["fp32", "bf16"], help="bf16: bf16 params in compute, fp32 reduce")
    p.add_argument("--no-force-sum", action="store_true", help="keep FSDP2's AVG reduce-scatter on Gloo")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: every rank on cuda:0, Gloo collectives on CUDA tensors")
    o = p.parse_args()
    if o.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"vs_pytorch.py: --device cuda, but torch {torch.__version__} sees no CUDA device (a CPU-only "
                         f"build, or no GPU here); the GPU comparison has not been run yet (docs/benchmarks.md)")
    device = torch.device("cuda", 0) if o.device == "cuda" else torch.device("cpu")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def device_peak():
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0

    def device_reserved_peak():  # TorchTitan's max_reserved
        return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0

    baseline_rss = rss_kib("VmRSS")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if o.replicate > 1:  # HSDP: (replicate, shard), as ours
        mesh = init_device_mesh(device.type, (o.replicate, world // o.replicate), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    rss_after_init = rss_kib("VmRSS")

    tensors, meta = st_io.load(o.weights)
    a = model_args(meta)
    model = Transformer(a)
    if a["tie_embeddings"] and "output.weight" not in tensors:  # a tied file stores the shared tensor once
        tensors["output.weight"] = tensors["tok_embeddings.weight"]
    model.load_state_dict(tensors, strict=True)  # raises on any missing/unexpected/mis-shaped tensor
    del tensors
    model.to(device)  # before fully_shard, as ours

    reshard = parse_reshard(o.reshard)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if o.mp == "bf16" \
        else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # root: default policy (kept unsharded between forward and backward)
    if not o.no_force_sum:
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    optim = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=o.weight_decay, amsgrad=False, foreach=False, fused=False)

    gb = o.local_batch * world
    raw = torch.from_file(o.tokens, shared=False, size=o.steps * gb * (o.seq + 1), dtype=torch.int64)
    tokens = raw.view(o.steps, gb, o.seq + 1)

    counter = CommCounter()
    reset_peak_rss()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out = open(os.path.join(o.out_dir, f"theirs_rank{rank}.jsonl"), "w")
    out.write(json.dumps({"event": "setup", "side": "theirs", "world": world, "rank": rank,
                          "flavor": meta.get("flavor"), "torch": torch.__version__, "device": str(device),
                          "force_sum": not o.no_force_sum, "baseline_rss_kib": baseline_rss,
                          "rss_after_init_kib": rss_after_init, "rss_setup_kib": rss_kib("VmRSS")}) + "\n")
    for step in range(o.steps):
        rows = tokens[step, rank * o.local_batch:(rank + 1) * o.local_batch]
        inputs, targets = rows[:, :-1].contiguous().to(device), rows[:, 1:].contiguous().to(device)
        sync()
        calls0, bytes0 = counter.snapshot()
        t0 = time.perf_counter()
        logits = model(inputs)
        flat = logits.flatten(0, 1).float() if o.mp == "bf16" else logits.flatten(0, 1)
        loss = F.cross_entropy(flat, targets.flatten())
        del flat
        loss.backward()
        optim.step()
        optim.zero_grad()
        sync()
        step_time = time.perf_counter() - t0
        calls1, bytes1 = counter.snapshot()
        gl = loss.detach().clone()
        dist.all_reduce(gl, op=dist.ReduceOp.SUM)
        out.write(json.dumps({"event": "step", "step": step, "loss": gl.item() / world, "local_loss": loss.item(),
                              "step_time": step_time, "vmhwm_kib": rss_kib("VmHWM"),
                              "vmrss_kib": rss_kib("VmRSS"), "device_peak_bytes": device_peak(),
                              "device_reserved_peak_bytes": device_reserved_peak(),
                              "bytes_requested": bytes1 - bytes0,
                              "all_gather_calls": calls1["all_gather"] - calls0["all_gather"],
                              "reduce_scatter_calls": calls1["reduce_scatter"] - calls0["reduce_scatter"],
                              "all_reduce_calls": calls1["all_reduce"] - calls0["all_reduce"]}) + "\n")
        out.flush()
        del logits, loss  # as ours, whose step-local tensors die at the end of the iteration
    out.close()
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter teardown: under heavy machine load we saw rare aborts ("terminate called without
    # an active exception", SIGABRT) in torch's process-group teardown at exit, after every result was written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
