"""Torch side of the pipeline side-by-side: torch.distributed.pipelining + FSDP2 on Gloo CPU (bench/pipeline).

    python -m torch.distributed.run --standalone --nproc-per-node W bench/pipeline/pp_torch.py \
        --pp P --dp D --schedule 1F1B --microbatches M [--check-reference]

Mesh (pp, dp) over the W = P x D ranks. The model is a chain of L Linear(D, D) + tanh layers in a ModuleDict keyed
"0".."L-1" (FQNs layers.K.weight / layers.K.bias on every stage, as TorchTitan's split keeps them). Its initial
weights and every step's batch are closed-form functions (model_init.py's formulas, computed with the same torch
ops in float64 and cast to float32), so bench/pipeline/pp_bench.cpp builds exactly the same numbers without
sharing an RNG stream or a file.

Layers are split evenly over pp x v stages (v = 1 for GPipe and 1F1B, 2 for the multi-stage schedules); stage s
lives on pp rank s % pp (ZBVZeroBubble, DualPipeV: the V, ranks 0..p-1 then p-1..0). With dp > 1 every layer and every stage
part gets fully_shard over the dp mesh with reshard_after_forward=False (TorchTitan under PP); at dp 1 no FSDP
(TorchTitan applies it only when dp_shard > 1). Loss of a microbatch = its summed squared error / (local batch x
D), backpropagated as is (scale_grads=False), so the sum over microbatches is this dp rank's mean; FSDP2's default
averaging over dp makes the gradients those of the global batch's mean. SGD lr 0.5 momentum 0.9, no clipping.

Rank 0 prints one line `PPBENCH {json}`: per-step losses (sum of microbatch losses, averaged over dp, broadcast
from the last stage), per-step times (max over ranks of zero_grad + schedule step + optimizer step), their median
after --warmup steps. --check-reference also trains the unsplit model on the global batch in every process and
reports (and checks, exit 1 above 1e-5) the max relative loss difference and the max parameter difference.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from model_init import layer_params, step_batch  # noqa: E402

SCHEDULES = ["GPipe", "1F1B", "LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


class Chain(nn.Module):
    """Linear + tanh layers kept in a ModuleDict under their global layer numbers."""

    def __init__(self, first, last, dim, n_layers):
        super().__init__()
        self.layers = nn.ModuleDict()
        for k in range(first, last):
            lin = nn.Linear(dim, dim)
            w, b = layer_params(k, dim)
            with torch.no_grad():
                lin.weight.copy_(w)
                lin.bias.copy_(b)
            self.layers[str(k)] = lin

    def forward(self, x):
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def stages_per_rank(schedule):
    cls = get_schedule_class(schedule)
    return 1 if issubclass(cls, PipelineScheduleSingle) else 2


def stage_to_rank(schedule, pp, num_stages):
    if schedule.lower() in ("zbvzerobubble", "dualpipev"):  # the V: ranks 0..p-1, then p-1..0
        return [s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


def reference(o):
    """The unsplit model on the whole global batch in one process: per-step losses and final parameters."""
    model = Chain(0, o.layers, o.dim, o.layers)
    opt = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
    losses = []
    for step in range(o.steps):
        x, y = step_batch(step, o.global_batch, o.dim)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).sum() / (o.global_batch * o.dim)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--schedule", default="1F1B", help=", ".join(SCHEDULES))
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time")
    p.add_argument("--lr", type=float, default=0.5,
                   help="0.5 so the loss curve moves (~6%% in 20 steps; 0.05 moves it 1%%) and the 1e-5 check bites")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--check-reference", action="store_true")
    p.add_argument("--tol", type=float, default=1e-5, help="--check-reference: max relative loss / param diff")
    o = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if o.pp * o.dp != world:
        raise SystemExit(f"pp_torch.py: --pp {o.pp} x --dp {o.dp} != world size {world}")
    if o.global_batch % o.dp or (o.global_batch // o.dp) % o.microbatches:
        raise SystemExit(f"pp_torch.py: global batch {o.global_batch} must split evenly over dp {o.dp} and then "
                         f"over {o.microbatches} microbatches")
    v = stages_per_rank(o.schedule)
    num_stages = o.pp * v
    if o.layers % num_stages:
        raise SystemExit(f"pp_torch.py: {o.layers} layers do not split evenly over {num_stages} stages "
                         f"(pp {o.pp} x {v} per rank for {o.schedule})")
    per_stage = o.layers // num_stages

    mesh = init_device_mesh("cpu", (o.pp, o.dp), mesh_dim_names=("pp", "dp"))
    pp_group = mesh["pp"].get_group()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    s2r = stage_to_rank(o.schedule, o.pp, num_stages)
    my_stages = [s for s in range(num_stages) if s2r[s] == pp_rank]

    parts, stages = [], []
    for s in my_stages:
        part = Chain(s * per_stage, (s + 1) * per_stage, o.dim, o.layers)
        if o.dp > 1:
            for layer in part.layers.values():
                fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
            fully_shard(part, mesh=mesh["dp"], reshard_after_forward=False)
        parts.append(part)
        stages.append(PipelineStage(part, s, num_stages, torch.device("cpu"), group=pp_group))

    local_batch = o.global_batch // o.dp

    def loss_fn(out, target):  # this microbatch's share of the dp rank's mean
        return (out - target).pow(2).sum() / (local_batch * o.dim)

    cls = get_schedule_class(o.schedule)
    if v == 1:
        sched = cls(stages[0], n_microbatches=o.microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = cls(stages, n_microbatches=o.microbatches, loss_fn=loss_fn, scale_grads=False)
    has_first, has_last = 0 in my_stages, (num_stages - 1) in my_stages
    last_rank = s2r[num_stages - 1]
    params = [q for part in parts for q in part.parameters()]
    opt = torch.optim.SGD(params, lr=o.lr, momentum=o.momentum)

    losses, times = [], []
    for step in range(o.steps):
        x, y = step_batch(step, o.global_batch, o.dim)
        x = x.narrow(0, dp_rank * local_batch, local_batch).contiguous()
        y = y.narrow(0, dp_rank * local_batch, local_batch).contiguous()
        mb_losses = []
        args = (x,) if has_first else ()
        kwargs = dict(target=y, losses=mb_losses) if has_last else {}
        dist.barrier()  # every step starts together on both sides, so per-step max over ranks is the step time
        t0 = time.perf_counter()
        opt.zero_grad()
        sched.step(*args, **kwargs)
        opt.step()
        times.append(time.perf_counter() - t0)
        loss = torch.tensor([float(sum(lv.item() for lv in mb_losses)) if has_last else 0.0], dtype=torch.float64)
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # SUM, then / dp: the mean over dp
        loss /= o.dp
        dist.broadcast(loss, group=pp_group, group_src=last_rank)
        losses.append(loss.item())

    # Step time = the slowest rank's, per step.
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    step_times = t.tolist()
    w = o.warmup if o.steps > o.warmup else 0
    result = {"side": "torch", "torch": torch.__version__, "pp": o.pp, "dp": o.dp, "schedule": o.schedule,
              "stages_per_rank": v, "microbatches": o.microbatches, "dim": o.dim, "layers": o.layers,
              "global_batch": o.global_batch, "steps": o.steps, "warmup": w, "losses": losses,
              "step_times": step_times, "median_step_s": statistics.median(step_times[w:]),
              "threads": torch.get_num_threads()}

    failed = False
    if o.check_reference:
        ref_losses, ref_params = reference(o)
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
        pdiff, pdiff_moved = 0.0, 0.0
        for part in parts:
            for name, q in part.named_parameters():
                full = (q.full_tensor() if hasattr(q, "full_tensor") else q).detach()
                want = ref_params[name]
                k = int(name.split(".")[1])
                init = layer_params(k, o.dim)[0 if name.endswith("weight") else 1]
                err = (full - want).abs().max()
                pdiff = max(pdiff, (err / want.abs().max()).item())
                # the error against how far the reference moved this tensor (informational: float32 noise)
                pdiff_moved = max(pdiff_moved, (err / (want - init).abs().max()).item())
        pd = torch.tensor([pdiff, pdiff_moved], dtype=torch.float64)
        dist.all_reduce(pd, op=dist.ReduceOp.MAX)
        moved = max(abs(ref_losses[0] - l) for l in ref_losses) > 0
        result.update({"ref_losses": ref_losses, "ref_max_rel_loss_diff": rel, "ref_max_rel_param_diff": pd[0].item(),
                       "ref_max_param_diff_over_update": pd[1].item(),
                       "ref_moved": moved})
        failed = not (rel <= o.tol and pd[0].item() <= o.tol and moved)
    if rank == 0:
        print("PPBENCH " + json.dumps(result), flush=True)
        if o.check_reference:
            print(f"{'FAIL' if failed else 'PASS'}: {o.schedule} pp {o.pp} x dp {o.dp}, {o.microbatches} "
                  f"microbatches: max rel loss diff {result['ref_max_rel_loss_diff']:.2e}, max rel param diff "
                  f"{result['ref_max_rel_param_diff']:.2e} (x{result['ref_max_param_diff_over_update']:.1e} of the "
                  f"reference's update) vs single process (tol {o.tol}); loss "
                  f"{ref_losses[0]:.6f} -> {ref_losses[-1]:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
