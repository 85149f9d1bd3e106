#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/). Run from anywhere; the files are
committed, this script documents how they were made. Seeds are small valid inputs plus a few near-misses, so the
fuzzer starts inside the parsers' accepting paths. Standard library only (independent of the C++ writers)."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
ROOT = os.path.dirname(os.path.dirname(HERE))


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def xxh_placeholder(i):
    return "%016x" % (0x0123456789ABCDEF + i)


# ---- checkpoint_metadata: libfsdp-checkpoint metadata.json (docs/checkpoint.md) -----------------------------
def metadata(tensors, files, block=64, values=None):
    return json.dumps({"format": "libfsdp-checkpoint", "version": 1, "hash": "xxh3-64", "block_bytes": block,
                       "world_size": 2, "saved_on": "mesh (2,) dp_shard", "files": files, "tensors": tensors,
                       "values": values or {}}, indent=1)


# w: [4, 3] F32 in two row shards (one per rank file); b: [3] F32 in one chunk; step: 0-dim I64.
w_chunks = [{"offsets": [0, 0], "sizes": [2, 3], "file": "rank-00000.bin", "offset": 0, "length": 24,
             "hashes": [xxh_placeholder(0)]},
            {"offsets": [2, 0], "sizes": [2, 3], "file": "rank-00001.bin", "offset": 0, "length": 24,
             "hashes": [xxh_placeholder(1)]}]
tensors = {"layers.0.w": {"dtype": "F32", "shape": [4, 3], "chunks": w_chunks},
           "layers.0.b": {"dtype": "BF16", "shape": [3], "chunks": [
               {"offsets": [0], "sizes": [3], "file": "rank-00000.bin", "offset": 24, "length": 6,
                "hashes": [xxh_placeholder(2)]}]},
           "step": {"dtype": "I64", "shape": [], "chunks": [
               {"offsets": [], "sizes": [], "file": "rank-00001.bin", "offset": 24, "length": 8,
                "hashes": [xxh_placeholder(3)]}]}}
files = {"rank-00000.bin": {"size": 30}, "rank-00001.bin": {"size": 32}}
put("checkpoint_metadata", "valid_two_ranks.json", metadata(tensors, files, values={"step": 7, "lr": [0.1, 2e-4],
                                                                                       "loader": {"epoch": 0}}))
big = {"emb": {"dtype": "F16", "shape": [64, 8], "chunks": [
    {"offsets": [0, 0], "sizes": [64, 8], "file": "rank-00000.bin", "offset": 0, "length": 1024,
     "hashes": [xxh_placeholder(i) for i in range(16)]}]}}
put("checkpoint_metadata", "valid_multi_block.json", metadata(big, {"rank-00000.bin": {"size": 1024}}))
put("checkpoint_metadata", "empty.json", metadata({}, {}))
overlap = json.loads(metadata(tensors, files))
overlap["tensors"]["layers.0.w"]["chunks"][1]["offsets"] = [1, 0]
put("checkpoint_metadata", "overlapping_chunks.json", json.dumps(overlap))
trav = json.loads(metadata(tensors, files))
trav["files"]["../escape.bin"] = {"size": 1}
put("checkpoint_metadata", "path_traversal.json", json.dumps(trav))


# ---- safetensors: first byte 0 = a .safetensors file, 1 = model.safetensors.index.json -----------------------
def safetensors(entries, metadata=None):
    header, data = {}, b""
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


put("safetensors", "two_tensors", b"\0" + safetensors(
    [("w", "F32", [2, 3], struct.pack("<6f", *range(6))), ("ids", "I64", [2], struct.pack("<2q", 5, -1))],
    {"format": "pt"}))
put("safetensors", "dtypes", b"\0" + safetensors(
    [("a", "BF16", [2], b"\x80\x3f\x00\x40"), ("b", "F16", [1, 1], b"\x00\x3c"), ("c", "U8", [3], b"\1\2\3"),
     ("d", "BOOL", [1], b"\1"), ("e", "F64", [], struct.pack("<d", 2.5)), ("f", "F8_E4M3", [2], b"\x38\x40")]))
put("safetensors", "empty_tensor", b"\0" + safetensors([("z", "F32", [0, 4], b"")]))
put("safetensors", "index", b"\1" + json.dumps({"metadata": {"total_size": 48}, "weight_map": {
    "w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}).encode())

# ---- toml_config: fsdp-train job configs ----------------------------------------------------------------------
with open(os.path.join(ROOT, "configs", "debug.toml")) as f:
    put("toml_config", "debug.toml", f.read())
put("toml_config", "overrides.toml", """
[job]
dump_folder = "/tmp/x"
[training]
local_batch_size = 2
global_batch_size = 8
seq_len = 64
steps = 3
mixed_precision_param = "float32"
[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = -1
[checkpoint]
enable = true
interval = 1
exclude_from_loading = ["dataloader", "lr_scheduler"]
[lr_scheduler]
decay_ratio = 0.5
decay_type = "cosine"
""")
put("toml_config", "bad_key.toml", "[training]\nstepz = 3\n")

# ---- tokenizer_json: first byte even = tokenizer.json, odd = text for the fixed tokenizer --------------------
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


m = bytes_to_unicode()
vocab = {m[b]: b for b in range(256)}
merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("1", "2")]
for i, (a, b) in enumerate(merges):
    vocab[a + b] = 256 + i
tok = {"version": "1.0", "normalizer": None,
       "added_tokens": [{"id": 300, "content": "<|begin_of_text|>", "special": True},
                        {"id": 301, "content": "<|end_of_text|>", "special": True}],
       "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
       "model": {"type": "BPE", "vocab": vocab, "merges": [a + " " + b for a, b in merges]}}
put("tokenizer_json", "bpe_string_merges.json", b"\0" + json.dumps(tok).encode())
tok2 = dict(tok, model=dict(tok["model"], merges=[[a, b] for a, b in merges], ignore_merges=True))
tok2["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
put("tokenizer_json", "llama3_style.json", b"\0" + json.dumps(tok2).encode())
put("tokenizer_json", "text_ascii", b"\1Hello world, it's 2024: hello   hello\n\tworld's 123456!")
put("tokenizer_json", "text_utf8", "\x01caf\u00e9 \u65e5\u672c\u8a9e \U0001F600 <|endoftext|>x\r\n".encode())

# ---- token_file: first byte % 3 = 0 .tok, 1 .u16, 2 .u32 ------------------------------------------------------
def tok_file(tokens, width=2, vocab=258, count=None):
    n = len(tokens) if count is None else count
    h = b"FSDPTOK1" + struct.pack("<IIQII", 1, width, n, vocab, 0)
    return h + b"".join(struct.pack("<H" if width == 2 else "<I", t) for t in tokens)


put("token_file", "tok_u16", b"\0" + tok_file([256, 72, 105, 257] * 5))
put("token_file", "tok_u32", b"\0" + tok_file([256, 70000 - 1, 3, 257], width=4, vocab=70000))
put("token_file", "tok_short", b"\0" + tok_file([1, 2, 3], count=9))
put("token_file", "raw_u16", b"\1" + struct.pack("<8H", *range(8)))
put("token_file", "raw_u32", b"\2" + struct.pack("<5I", 256, 1, 2, 3, 257))
print("seed corpora written under", CORPUS)
