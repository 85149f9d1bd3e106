"""Closed-form initial weights and batches of the pipeline side-by-side (bench/pipeline).

Both sides compute these with the same torch ops in float64 and cast to float32 (pp_bench.cpp's layer_params /
step_batch spell the same expressions, operation for operation), so they start from and train on identical numbers
without sharing an RNG stream or a file. The i*j terms decorrelate rows, so the layers are not rank-1-like.
"""
import math

import torch


def layer_params(k, dim):
    """Layer k's Linear(dim, dim): weight [out i, in j] = sin(0.37 i + 0.11 j + 0.013 i j + 1.3 k) / sqrt(dim),
    bias [i] = 0.1 cos(0.23 i + 0.7 k)."""
    i = torch.arange(dim, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(dim, dtype=torch.float64).unsqueeze(0)
    w = torch.sin(i * 0.37 + j * 0.11 + (i * j) * 0.013 + 1.3 * k) * (1.0 / math.sqrt(dim))
    b = torch.cos(torch.arange(dim, dtype=torch.float64) * 0.23 + 0.7 * k) * 0.1
    return w.to(torch.float32), b.to(torch.float32)


def step_batch(step, global_batch, dim):
    """Step `step`'s global batch: inputs [b, d] = sin(0.71 b + 0.29 d + 0.017 b d + 0.5 step),
    targets = 0.5 cos(0.43 b + 0.19 d + 0.007 b d + 0.3 step). dp rank r takes rows [r B/dp, (r+1) B/dp)."""
    b = torch.arange(global_batch, dtype=torch.float64).unsqueeze(1)
    d = torch.arange(dim, dtype=torch.float64).unsqueeze(0)
    x = torch.sin(b * 0.71 + d * 0.29 + (b * d) * 0.017 + 0.5 * step)
    y = torch.cos(b * 0.43 + d * 0.19 + (b * d) * 0.007 + 0.3 * step) * 0.5
    return x.to(torch.float32), y.to(torch.float32)
