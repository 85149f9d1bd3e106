"""safetensors by hand (struct + json, no extra packages): the Python side of our format interop.

Format: u64 little-endian header length N, N bytes of JSON (space-padded to 8), then raw little-endian data.
Used by vs_pytorch.py to load the C++ bench's initial weights, and by tests/checkpoint to cross-check the
C++ reader/writer against an independent implementation:

    python st_io.py write-fixture OUT     writes the fixture tensors (see fixture()) with metadata
    python st_io.py check-fixture IN      reads a file written by C++ and checks it equals fixture()
"""
import json
import struct
import sys

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def save(path, tensors, metadata=None):
    """tensors: dict name -> tensor (written in insertion order)."""
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def load(path):
    """Returns (dict name -> tensor, metadata dict)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode())
    metadata = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        buf = bytearray(data[base + b:base + e])
        t = torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"]).clone()
    return out, metadata


def fixture():
    """Values both languages can compute independently (arange-based)."""
    return {
        "layers.0.weight": (torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.5 - 1.0),
        "half": torch.arange(6, dtype=torch.float64).reshape(2, 3).to(torch.float16) / 4,
        "bf16": torch.arange(5, dtype=torch.float32).to(torch.bfloat16) * 2,
        "ids": torch.arange(7, dtype=torch.int64) - 3,
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 5, dtype=torch.float32),
        "mask": torch.tensor([True, False, True]),
    }


FIXTURE_METADATA = {"format": "pt", "writer": "st_io.py"}


def main(argv):
    cmd, path = argv[1], argv[2]
    if cmd == "write-fixture":
        save(path, fixture(), FIXTURE_METADATA)
        return 0
    if cmd == "check-fixture":
        got, meta = load(path)
        want = fixture()
        assert set(got) == set(want), f"names differ: {sorted(got)} vs {sorted(want)}"
        for k, v in want.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, f"{k}: {got[k].dtype}{tuple(got[k].shape)}"
            assert torch.equal(got[k], v), f"{k}: values differ"
        assert meta == FIXTURE_METADATA, f"metadata {meta}"
        print("ok")
        return 0
    raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
