"""PyTorch's own context parallelism on the CPU, for docs/context_parallel.md (run by hand, 2 or 4 ranks):

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/context_parallel/pytorch_ring_attention_cpu.py

1. The public `context_parallel` context manager with causal SDPA: on the CPU (torch 2.13) it fails, the CPU flash
   op having no DTensor sharding rule; the error is printed.
2. Its ring itself, `_templated_ring_attention` (internal API), given the CPU flash op: forward output against
   causal SDPA on the full sequence, for both rotate methods, with and without head-tail load balancing, the
   same cases as tests/context_parallel (which checks ours, forward and backward, against attention in double).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import set_rotate_method
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention


def head_tail(t, rank, size, balance):
    chunks = t.chunk(2 * size if balance else size, dim=2)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=2) if balance else chunks[rank]


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(2024)
    q, k, v = (torch.randn(2, 3, 24, 8, generator=gen) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    try:
        qq, kk, vv = q.clone(), k.clone(), v.clone()
        with context_parallel(mesh, buffers=[qq, kk, vv], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        print(f"rank {rank} context_parallel on CPU: ran", flush=True)
    except Exception as e:  # noqa: BLE001 - the point is to report it
        print(f"rank {rank} context_parallel on CPU: {type(e).__name__}: {e}", flush=True)

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    for method in ("allgather", "alltoall"):
        set_rotate_method(method)
        for balance in (True, False):
            cp_attention._cp_options.enable_load_balance = balance
            out, *_ = cp_attention._templated_ring_attention(
                mesh.get_group(), 2, op, head_tail(q, rank, size, balance), head_tail(k, rank, size, balance),
                head_tail(v, rank, size, balance), is_causal=True)
            diff = (out - head_tail(ref, rank, size, balance)).abs().max().item()
            print(f"rank {rank} _templated_ring_attention {method} load_balance={balance}: max diff vs full "
                  f"causal SDPA {diff:.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
