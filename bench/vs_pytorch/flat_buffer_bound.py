"""What a persistent flat shard buffer could save per step (issue 24): the copies it would remove, timed.

Keeping each group's local shards as views of one flat buffer makes that buffer the all-gather input, so the
copy-in (shard -> all-gather buffer) goes away when nothing is cast or offloaded; keeping the sharded gradients as
views of a flat gradient buffer lets the reduce-scatter write into them, so the gradient copy after it goes away.
This script times exactly those copies for the real shard shapes of a Llama flavor at a world size, per step:
  copy-in: every group's shards, once per forward all-gather and once more per backward re-gather (groups that
           reshard after forward: every block; the root keeps its parameters);
  gradient copy: every shard's gradient once (reduce-scatter output -> .grad).
The result is the most such a rework could save per step on this machine (an upper bound: the copies are timed
alone, with warm caches), to put beside the measured step time.

    .venv/bin/python bench/vs_pytorch/flat_buffer_bound.py --flavor debugmodel --world 2
"""
import argparse
import statistics
import time

import torch


def llama_shapes(dim, n_layers, n_heads, n_kv_heads, vocab, multiple_of):
    """Parameter shapes per group as fully_shard groups them in the trainer: one group per block, the root holding
    embeddings, final norm and output (TorchTitan's Llama 3 module names)."""
    head_dim = dim // n_heads
    hidden = int(2 * 4 * dim / 3)
    hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
    block = [(dim, dim), (n_kv_heads * head_dim, dim), (n_kv_heads * head_dim, dim), (dim, dim),
             (hidden, dim), (dim, hidden), (hidden, dim), (dim,), (dim,)]
    root = [(vocab, dim), (dim,), (vocab, dim)]
    return [block] * n_layers, root


FLAVORS = {  # src/nn/llama.cpp
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab=2048, multiple_of=256),
    "cpu_small": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab=2048, multiple_of=128),
}


def shard_rows(shape, world):
    rows = -(-shape[0] // world)
    return (rows,) + tuple(shape[1:])


def time_copies(shapes, world, repeats):
    srcs = [torch.randn(shard_rows(s, world)) for s in shapes]
    total = sum(t.numel() for t in srcs)
    flat = torch.empty(total)
    views, off = [], 0
    for t in srcs:
        views.append(flat[off:off + t.numel()].view_as(t))
        off += t.numel()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for v, s in zip(views, srcs):
            v.copy_(s)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), total * 4


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--flavor", default="debugmodel", choices=sorted(FLAVORS))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    o = p.parse_args()
    torch.set_num_threads(1)  # one rank's thread on this 2-core machine
    blocks, root = llama_shapes(**FLAVORS[o.flavor])
    block_t, block_bytes = time_copies(blocks[0], o.world, o.repeats)
    root_t, root_bytes = time_copies(root, o.world, o.repeats)
    n = len(blocks)
    copy_in = n * 2 * block_t + root_t           # blocks: forward + backward gather; root: forward only
    grad_copy = n * block_t + root_t             # every shard's gradient once
    copy_in_bytes = n * 2 * block_bytes + root_bytes
    grad_bytes = n * block_bytes + root_bytes
    print(f"flavor {o.flavor}, world {o.world}: per rank and step")
    print(f"  copy-in removed by a flat shard buffer:      {copy_in_bytes / 2**20:7.1f} MiB, {copy_in * 1e3:6.2f} ms")
    print(f"  gradient copy removed by a flat grad buffer: {grad_bytes / 2**20:7.1f} MiB, {grad_copy * 1e3:6.2f} ms")
    print(f"  together at most {(copy_in + grad_copy) * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
