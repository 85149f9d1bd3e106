"""Side by side with PyTorch's own context parallelism (issue 38), on this CPU, over Gloo, through fsdprun.

    python vs_pytorch_context_parallel.py --fsdprun FSDPRUN --ours VS_PYTORCH_OURS --workdir DIR
        [--nproc 2] [--seq 256] [--heads 4] [--head-dim 16] [--reps 0] [--markdown]

One causal self-attention layer, y = SDPA(x Wq, x Wk, x Wv, causal) Wo, with the same weights, input x and output
gradient dout on both sides, at cp = nproc, for both rotate methods, with head-tail chunks (PyTorch's default load
balancer) and with contiguous chunks (no load balancing):
  - PyTorch: torch.distributed.tensor.experimental.context_parallel (the public API; x is its buffer) around
    F.scaled_dot_product_attention. On the CPU that API alone fails: the CPU flash op
    (aten._scaled_dot_product_flash_attention_for_cpu) has neither a DTensor sharding rule nor a CP handler, only
    the CUDA flash/efficient/cuDNN ops do. `enable_pytorch_cp_on_cpu` adds both, each a few lines, and routes the op
    to PyTorch's own ring (_templated_ring_attention and its backward) with the CPU op as the kernel, exactly as
    PyTorch's CUDA handler does with the CUDA op. PyTorch's CP code (sharding, rotation, merging) is unchanged.
  - ours: vs_pytorch_ours (fsdp::ring_attention), the same layer in C++.
Checks (fp32, 1e-5 relative to the largest magnitude): each rank's output and dx chunks and the weight gradients
(summed over the cp ranks) of ours equal PyTorch's, and both equal the unsharded layer on one process (plain causal
SDPA over the whole sequence). Not vacuous: PyTorch's ring handler ran on every rank (counted), and the causal
result differs from the non-causal one by more than 1e-2. With --reps N both sides also time N forward + backward
passes (median, after a warm-up) and the driver prints a markdown table (--markdown).
Exit 0 when every check passes, 1 otherwise.
"""
import argparse
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

METHODS = ("allgather", "alltoall")
BALANCERS = ("headtail", "none")  # ours' names; PyTorch: load balancing on / off


def cp_chunks(t, rank, size, balancer, dim=1):
    """This rank's chunks of the sequence: head-tail (chunks i and 2 cp - 1 - i of 2 cp) or contiguous (chunk i)."""
    if balancer == "none":
        return t.chunk(size, dim=dim)[rank]
    chunks = t.chunk(2 * size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


def layer(x, w, heads, causal=True):
    b, s, d = x.shape
    q, k, v = ((x @ w[n]).view(b, s, heads, d // heads).transpose(1, 2) for n in ("wq", "wk", "wv"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out.transpose(1, 2).reshape(b, s, d) @ w["wo"]


# ---------------------------------------------------------------- PyTorch's side (run under fsdprun, one per rank)

HANDLER_CALLS = [0]


def enable_pytorch_cp_on_cpu():
    """Gives PyTorch's context_parallel what it lacks on the CPU: a sharding rule (everything sharded on the sequence
    dim, as its CUDA rules) and a CP handler for the CPU flash op and its backward, which call PyTorch's own ring."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    from torch.distributed.tensor.experimental._context_parallel import _sharding_rules as cp_rules

    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def fwd_strategy(op_schema):  # outputs (out, logsumexp), inputs (q, k, v)
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, [[Shard(2)] * 5],
                                               input_index=2)

    def bwd_strategy(op_schema):  # outputs (dq, dk, dv), inputs (dout, q, k, v, out, logsumexp)
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema,
                                               [[Shard(2)] * 9], input_index=3)

    def handler(op_call, args, kwargs):  # PyTorch's _sdpa_handler, with the CPU op as the ring's kernel
        HANDLER_CALLS[0] += 1
        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        DTensor._op_dispatcher.sharding_propagator.propagate(info)
        sharding = info.output_sharding
        assert sharding is not None and not sharding.needs_redistribute
        group, a, kw = info.compute_mesh.get_group(), info.local_args, dict(info.local_kwargs)
        if op_call is fwd:
            q, k, v = a[:3]
            dropout_p = a[3] if len(a) > 3 else kw.pop("dropout_p", 0.0)
            is_causal = a[4] if len(a) > 4 else kw.pop("is_causal", False)
            res = cp_attention._templated_ring_attention(group, 2, fwd, q, k, v, is_causal=is_causal,
                                                         dropout_p=dropout_p, **kw)
        else:
            dout, q, k, v, out, lse, dropout_p, is_causal = a[:8]
            res = cp_attention._templated_ring_attention_backward(
                group, 2, bwd, grad_out=dout, grad_out_name="grad_out", query=q, key=k, value=v, out=out,
                logsumexp=lse, is_causal=is_causal, dropout_p=dropout_p, **kw)
        return DTensor._op_dispatcher.wrap(res, sharding.output_spec)

    cp_attention.custom_ops[fwd] = handler
    cp_attention.custom_ops[bwd] = handler
    register = cp_rules.register_cp_sharding_rules

    def register_with_cpu():
        first = not cp_rules._cp_strategy_contexts
        register()
        if first:
            for op, fn, schema in ((fwd, fwd_strategy, RuntimeSchemaInfo(3)), (bwd, bwd_strategy, None)):
                ctx = cp_rules._op_strategy_context(op, fn, schema)
                ctx.__enter__()
                cp_rules._cp_strategy_contexts[op] = ctx

    cp_rules.register_cp_sharding_rules = register_with_cpu


def run_pytorch(args):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("cp",))
    inputs = load_file(os.path.join(args.workdir, "inputs.safetensors"))
    if args.try_plain:  # the public API as it ships: report what it says on this CPU
        try:
            x = inputs["x"].clone()
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
                layer(x, inputs, args.heads)
            print(f"rank {rank}: context_parallel as shipped ran on the CPU", flush=True)
        except Exception as e:  # noqa: BLE001 - the point is to report it
            print(f"rank {rank}: context_parallel as shipped, on the CPU: {type(e).__name__}: {e}", flush=True)
        leave(dist)
    enable_pytorch_cp_on_cpu()
    w = {n: inputs[n].clone().requires_grad_() for n in ("wq", "wk", "wv", "wo")}
    for method, balancer in ((m, b) for m in METHODS for b in BALANCERS):
        set_rotate_method(method)
        # context_parallel picks its head-tail balancer when this is on (and the length divides by 2 cp).
        cp_attention._cp_options.enable_load_balance = balancer == "headtail"
        dout_local = cp_chunks(inputs["dout"], rank, size, balancer)
        times, calls_before = [], HANDLER_CALLS[0]
        for i in range(args.reps + 1):  # i = 0: the warm-up, and the results written
            for p in w.values():
                p.grad = None
            x = inputs["x"].clone()
            dist.barrier()
            t0 = time.perf_counter()
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1], no_restore_buffers={x}):
                x.requires_grad_()
                y = layer(x, w, args.heads)
                y.backward(dout_local)
            t1 = time.perf_counter()
            if i == 0:
                result = {"out": y.detach().clone(), "dx": x.grad.clone()}
            else:
                times.append((t1 - t0) * 1e3)
        for n, p in w.items():
            g = p.grad.clone()
            dist.all_reduce(g)
            result["d" + n] = g
        times.sort()
        result["median_ms"] = torch.tensor([times[len(times) // 2] if times else 0.0], dtype=torch.float64)
        result["handler_calls"] = torch.tensor([HANDLER_CALLS[0] - calls_before])
        save_file(result, os.path.join(args.workdir, f"pytorch_{method}_{balancer}_rank{rank}.safetensors"))
    leave(dist)


def leave(dist):
    """Every rank done, then out without the interpreter's teardown: after the failed call above, torch 2.13's
    process-group teardown aborted one rank now and then ("terminate called without an active exception")."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- the driver

def rel_diff(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def launch(args, cmd, what, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    full = [args.fsdprun, "--nproc-per-node", str(args.nproc), "--timeout", str(timeout)] + cmd
    t0 = time.monotonic()
    proc = subprocess.run(full, env=env, capture_output=True, text=True, timeout=timeout + 30)
    if proc.returncode != 0:
        print(proc.stdout + proc.stderr)
        raise SystemExit(f"{what} failed (exit {proc.returncode}): {' '.join(full)}")
    return proc.stdout + proc.stderr, time.monotonic() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fsdprun"), p.add_argument("--ours"), p.add_argument("--workdir", required=True)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--reps", type=int, default=0)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--pytorch-rank", action="store_true", help=argparse.SUPPRESS)  # under fsdprun: PyTorch's side
    p.add_argument("--try-plain", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.pytorch_rank:
        return run_pytorch(args)
    torch.set_num_threads(1)
    os.makedirs(args.workdir, exist_ok=True)
    for f in os.listdir(args.workdir):
        os.remove(os.path.join(args.workdir, f))
    dim = args.heads * args.head_dim
    gen = torch.Generator().manual_seed(38)
    randn = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).float()
    inputs = {"x": randn(args.batch, args.seq, dim), "dout": randn(args.batch, args.seq, dim)}
    for n in ("wq", "wk", "wv", "wo"):
        inputs[n] = randn(dim, dim, scale=dim ** -0.5)
    save_file(inputs, os.path.join(args.workdir, "inputs.safetensors"))

    # The unsharded reference: the same layer on one process over the whole sequence, plain causal SDPA.
    w = {n: inputs[n].clone().requires_grad_() for n in ("wq", "wk", "wv", "wo")}
    x = inputs["x"].clone().requires_grad_()
    y = layer(x, w, args.heads)
    y.backward(inputs["dout"])
    ref = {"out": y.detach(), "dx": x.grad, **{"d" + n: t.grad for n, t in w.items()}}
    non_causal = layer(inputs["x"], inputs, args.heads, causal=False)
    ok = True
    if rel_diff(non_causal, ref["out"]) < 1e-2:
        print("FAIL: the causal reference does not differ from non-causal attention")
        ok = False

    me = [sys.executable, os.path.abspath(__file__), "--workdir", args.workdir, "--heads", str(args.heads),
          "--reps", str(args.reps)]
    plain_log, _ = launch(args, me + ["--pytorch-rank", "--try-plain"], "PyTorch's context_parallel as shipped", 300)
    print("\n".join(line for line in plain_log.splitlines() if "context_parallel as shipped" in line))
    launch(args, me + ["--pytorch-rank"], "PyTorch's context_parallel", 600)
    cases = [(m, b) for m in METHODS for b in BALANCERS]
    for method, balancer in cases:
        launch(args, [args.ours, args.workdir, method, balancer, str(args.heads), str(args.reps)],
               f"ours ({method}, {balancer})", 600)

    rows = []
    for method, balancer in cases:
        case = f"{method}_{balancer}"
        worst = {"ours vs PyTorch": 0.0, "ours vs unsharded": 0.0, "PyTorch vs unsharded": 0.0}
        ms = {"ours": 0.0, "pytorch": 0.0}
        for rank in range(args.nproc):
            theirs = load_file(os.path.join(args.workdir, f"pytorch_{case}_rank{rank}.safetensors"))
            ours = load_file(os.path.join(args.workdir, f"ours_{case}_rank{rank}.safetensors"))
            if theirs["handler_calls"].item() < 2:
                print(f"FAIL: {case} rank {rank}: PyTorch's ring handler ran {theirs['handler_calls'].item()} times")
                ok = False
            for name, want in ref.items():
                want = cp_chunks(want, rank, args.nproc, balancer) if name in ("out", "dx") else want
                for key, a, b in (("ours vs PyTorch", ours[name], theirs[name]), ("ours vs unsharded", ours[name], want),
                                  ("PyTorch vs unsharded", theirs[name], want)):
                    d = rel_diff(a, b)
                    worst[key] = max(worst[key], d)
                    if not d <= 1e-5:
                        print(f"FAIL: {case} rank {rank} {name}: {key} differ by {d:.2e} (relative) > 1e-5")
                        ok = False
            for side, res in (("ours", ours), ("pytorch", theirs)):
                ms[side] = max(ms[side], res["median_ms"].item())
        print(f"{method}, {balancer}: max relative difference " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
        rows.append((f"{method}, {balancer}", worst, ms))
    if args.markdown:
        print(f"\ncp {args.nproc}, batch {args.batch} x {args.seq} tokens, {args.heads} heads x {args.head_dim}, fp32, "
              f"1 thread per rank; {args.reps} timed forward + backward passes after a warm-up, median (slowest rank)")
        print("\n| rotate method, chunks | ours (ms) | PyTorch context_parallel (ms) | ours / PyTorch | ours vs PyTorch | "
              "ours vs unsharded | PyTorch vs unsharded |")
        print("|---|---|---|---|---|---|---|")
        for method, worst, ms in rows:
            ratio = ms["ours"] / ms["pytorch"] if ms["pytorch"] else float("nan")
            print(f"| {method} | {ms['ours']:.1f} | {ms['pytorch']:.1f} | {ratio:.2f} | "
                  f"{worst['ours vs PyTorch']:.1e} | {worst['ours vs unsharded']:.1e} | "
                  f"{worst['PyTorch vs unsharded']:.1e} |")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
