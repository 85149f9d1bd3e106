"""Does Gloo honour ReduceOp.AVG in reduce_scatter / all_reduce in this torch? (PyTorch issue 162338: it was
dropped to SUM.) Run: .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 bench/vs_pytorch/gloo_avg_check.py
With torch 2.13.0 both are correct; vs_pytorch.py still uses set_force_sum_reduction_for_comms(True) by default
(SUM, then divide by the data-parallel size: the same arithmetic as ours); run.py --no-force-sum checks AVG."""
import torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
inp = torch.arange(2 * w, dtype=torch.float32) + r  # rank-dependent
out = torch.empty(2)
try:
    dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.AVG)
    want = (torch.arange(2 * w, dtype=torch.float32).view(w, 2)[r] + (w - 1) / 2)
    print(f"rank {r}: reduce_scatter AVG -> {out.tolist()} expected {want.tolist()}")
except Exception as e:
    print(f"rank {r}: reduce_scatter AVG raised {type(e).__name__}: {str(e)[:200]}")
t = torch.tensor([float(r + 1)])
try:
    dist.all_reduce(t, op=dist.ReduceOp.AVG); print(f"rank {r}: all_reduce AVG -> {t.item()} expected {(w + 1) / 2}")
except Exception as e:
    print(f"rank {r}: all_reduce AVG raised {type(e).__name__}: {str(e)[:200]}")
dist.destroy_process_group()
