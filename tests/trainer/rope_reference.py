"""Independent reference for Llama 3.1 RoPE scaling: TorchTitan's formula (torchtitan/models/common/rope.py,
ComplexRoPE._precompute_cache with scaling="llama"; Meta's llama-models apply_scaling) transcribed with the
standard library only, in float64. Prints one inverse frequency per line (repr, round-trips exactly).

usage: rope_reference.py HEAD_DIM THETA [FACTOR LOW_FREQ_FACTOR HIGH_FREQ_FACTOR ORIGINAL_CONTEXT]
"""
import math
import sys


def frequencies(head_dim, theta, scaling=None):
    freqs = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)][: head_dim // 2]
    if scaling is None:
        return freqs
    factor, low, high, context = scaling
    low_freq_wavelen, high_freq_wavelen = context / low, context / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_freq_wavelen:
            out.append(f)
        elif wavelen > low_freq_wavelen:
            out.append(f / factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    head_dim, theta = int(args[0]), float(args[1])
    scaling = tuple(float(a) for a in args[2:6]) if len(args) >= 6 else None
    for f in frequencies(head_dim, theta, scaling):
        print(repr(f))
