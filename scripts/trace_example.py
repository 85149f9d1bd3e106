"""A real Chrome trace for the README's `fsdp-train plot-trace` picture (fsdp-train writes no traces yet):
PyTorch FSDP2 (fully_shard) on 2 CPU ranks over Gloo, PyTorch's profiler around 2 training steps of a 4-block
MLP, one trace file per rank.

    .venv/bin/python scripts/trace_example.py /tmp/trace            # writes /tmp/trace/rank{0,1}.json
    build/apps/fsdp-train/fsdp-train plot-trace /tmp/trace/rank0.json /tmp/trace/rank1.json timeline.png
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard


def run(rank, world, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
              for _ in range(4)]
    model = torch.nn.Sequential(*blocks)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # warm-up: the profiled steps are steady-state ones
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with torch.profiler.record_function("train_step"):
                step()
    prof.export_chrome_trace(os.path.join(out, f"rank{rank}.json"))
    dist.destroy_process_group()


if __name__ == "__main__":
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "trace"
    os.makedirs(out_dir, exist_ok=True)
    mp.spawn(run, args=(2, out_dir), nprocs=2)
