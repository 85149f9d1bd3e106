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
# ---- cli_values: fsdp-train command-line arguments, one per line ---------------------------------------------
put("cli_values", "overrides", "\n".join([
    "--training.steps", "5", "--training.seq_len=32", "--training.local_batch_size", "2",
    "--training.global_batch_size", "8", "--optimizer.lr", "3e-4", "--lr_scheduler.decay_type", "cosine",
    "--lr_scheduler.decay_ratio", "0.5", "--checkpoint.enable", "--checkpoint.interval", "2",
    "--checkpoint.exclude_from_loading", "dataloader,lr_scheduler", "--parallelism.data_parallel_shard_degree", "-1",
    "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2",
    "--model.flavor", "cpu_tiny", "--job.dump_folder", "/tmp/fuzz-out"]))
put("cli_values", "bool_flags", "--checkpoint.enable\n--validation.enable=false\n--metrics.enable_tensorboard\n--training.steps\n3")
put("cli_values", "bad_value", "--training.seq_len\nabc\n--training.steps=1e3")
put("cli_values", "huge_sizes", "--training.seq_len\n1000000000000\n--training.local_batch_size\n999999999999")
put("cli_values", "unknown_key", "--training.stepz\n3")

# ---- loader_state: DataLoader::state() of the harness's loader (seq_len 5, local batch 2, 2 accumulation steps,
# data rank 1 of 2) over "@DATA@/a.tok" (1000 tokens) and "@DATA@/b.u16" (123 tokens) ------------------------
def loader_state(epoch=0, file=0, offset=0, consumed=0, next_sample=0, micro=0, **over):
    st = {"stream": {"epoch": epoch, "file": file, "offset": offset, "consumed": consumed, "num_files": 2,
                     "file_name": ["@DATA@/a.tok", "@DATA@/b.u16"][file if file in (0, 1) else 0]},
          "next_sample": next_sample, "micro": micro, "seq_len": 5, "local_batch_size": 2, "grad_accum_steps": 2,
          "dp_rank": 1, "dp_degree": 2}
    st.update(over)
    return json.dumps(st)


put("loader_state", "fresh.json", loader_state())
# after 3 micro-batches: step 1 micro 1 of rank 1 -> samples 6..7 delivered, next sample 8 (36 tokens each 6)
put("loader_state", "mid_epoch.json", loader_state(consumed=48, next_sample=8, micro=3))
put("loader_state", "second_file.json", loader_state(file=1, consumed=10, next_sample=170, micro=41))
put("loader_state", "second_epoch.json", loader_state(epoch=1, file=0, consumed=4, next_sample=190, micro=46))
put("loader_state", "other_run.json", loader_state(seq_len=6))

# ---- store_wire: client byte streams to the c10d TCPStore server (torch's TCPStoreBackend.hpp QueryType):
# VALIDATE 0, SET 1, COMPARE_SET 2, GET 3, ADD 4, CHECK 5, WAIT 6, GETNUMKEYS 7, DELETE_KEY 8, APPEND 9,
# MULTI_GET 10, MULTI_SET 11, CANCEL_WAIT 12, PING 13, QUEUE_PUSH 14, QUEUE_POP 15, QUEUE_LEN 16, LIST_KEYS 17,
# BARRIER 18. Strings and byte vectors: u64 little-endian length, then the bytes; validation: u32 magic.
def w_str(b):
    b = b if isinstance(b, bytes) else b.encode()
    return struct.pack("<Q", len(b)) + b


VALIDATE = b"\0" + struct.pack("<I", 0x3C85F7CE)
put("store_wire", "set_get", VALIDATE + b"\1" + w_str("k") + w_str(b"value") + b"\3" + w_str("k"))
put("store_wire", "add_check", VALIDATE + b"\4" + w_str("counter") + struct.pack("<q", 5) +
    b"\5" + struct.pack("<Q", 2) + w_str("counter") + w_str("absent"))
put("store_wire", "compare_set_append", VALIDATE + b"\2" + w_str("c") + w_str(b"") + w_str(b"new") +
    b"\x09" + w_str("c") + w_str(b"-more") + b"\3" + w_str("c"))
put("store_wire", "multi", VALIDATE + b"\x0b" + struct.pack("<Q", 2) + w_str("a") + w_str(b"1") + w_str("b") +
    w_str(b"2") + b"\x0a" + struct.pack("<Q", 2) + w_str("a") + w_str("b") + b"\7" + b"\x08" + w_str("a"))
put("store_wire", "wait_cancel", VALIDATE + b"\6" + struct.pack("<Q", 1) + w_str("never") + b"\x0c")
put("store_wire", "ping_queue", VALIDATE + b"\x0d" + struct.pack("<I", 1234) + b"\x0e" + w_str("q") + w_str(b"x") +
    b"\x10" + w_str("q") + b"\x0f" + w_str("q") + b"\x11")
put("store_wire", "no_validation", b"\1" + w_str("k") + w_str(b"v"))
put("store_wire", "huge_length", VALIDATE + b"\1" + struct.pack("<Q", 1 << 62) + b"k")
# The relay's rules (the harness's small limits: key 64, value 256, 100 keys, request 1024 bytes).
put("store_wire", "relay_limits", VALIDATE + b"\x0b" + struct.pack("<Q", 3) + w_str("a") + w_str(b"x" * 200) +
    w_str("b") + w_str(b"y" * 250) + w_str("c") + w_str(b"z" * 250) + b"\x05" + struct.pack("<Q", 101))
put("store_wire", "relay_count_over_request", VALIDATE + b"\x0b" + struct.pack("<Q", 70) + w_str("a") + w_str(b"1"))
put("store_wire", "relay_wait_then_cancel", VALIDATE + b"\6" + struct.pack("<Q", 1) + w_str("later") + b"\x0c" +
    b"\3" + w_str("a") + b"\x11" + b"\x12" + w_str("barrier") + struct.pack("<q", 1) + b"\x0f" + w_str("q"))

# ---- hf_config: byte 0 bit 0 = the file (0 config.json, 1 model.safetensors), bit 1 = the model (0 Llama,
# 1 Qwen3); the harness's tiny model: dim 8, 1 layer, 2 heads of 4 (1 kv head), FFN 16, vocabulary 16 ----------
def hf_config(qwen3, **over):
    c = {"architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
         "model_type": "qwen3" if qwen3 else "llama", "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
         "vocab_size": 16, "rms_norm_eps": 1e-6 if qwen3 else 1e-5, "max_position_embeddings": 16,
         "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
         "rope_theta": 1000000.0 if qwen3 else 500000.0}
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_theta"]}
    c.update(over)
    return json.dumps(c, indent=2).encode()


def hf_tensors(qwen3):
    shapes = [("model.embed_tokens.weight", [16, 8]), ("model.norm.weight", [8]), ("lm_head.weight", [16, 8])]
    p = "model.layers.0."
    shapes += [(p + "self_attn.q_proj.weight", [8, 8]), (p + "self_attn.k_proj.weight", [4, 8]),
               (p + "self_attn.v_proj.weight", [4, 8]), (p + "self_attn.o_proj.weight", [8, 8]),
               (p + "mlp.gate_proj.weight", [16, 8]), (p + "mlp.up_proj.weight", [16, 8]),
               (p + "mlp.down_proj.weight", [8, 16]), (p + "input_layernorm.weight", [8]),
               (p + "post_attention_layernorm.weight", [8])]
    if qwen3:
        shapes += [(p + "self_attn.q_norm.weight", [4]), (p + "self_attn.k_norm.weight", [4])]
    out = []
    for name, shape in sorted(shapes):
        n = 1
        for d in shape:
            n *= d
        out.append((name, "F32", shape, struct.pack("<%df" % n, *[(i % 7) * 0.01 for i in range(n)])))
    return out


put("hf_config", "llama_config.json", b"\0" + hf_config(False))
put("hf_config", "qwen3_config.json", b"\2" + hf_config(True))
put("hf_config", "llama_rope_scaling.json", b"\0" + hf_config(False, rope_scaling={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}))
put("hf_config", "llama_wrong_types.json", b"\0" + hf_config(False, hidden_size="8", tie_word_embeddings="no"))
put("hf_config", "llama_weights", b"\1" + safetensors(hf_tensors(False), {"format": "pt"}))
put("hf_config", "qwen3_weights", b"\3" + safetensors(hf_tensors(True), {"format": "pt"}))

# ---- regressions of this issue (#40), small enough to replay on every run ------------------------------------
put("tokenizer_json", "regression_nested_sequence.json", b"\0" + json.dumps(dict(tok, pre_tokenizer=(
    lambda d: [d := {"type": "Sequence", "pretokenizers": [d]} for _ in range(12)][-1])(
    {"type": "ByteLevel", "add_prefix_space": False}))).encode())
put("tokenizer_json", "regression_wrong_types.json", b"\0" + json.dumps(dict(
    tok, added_tokens=[{"id": "300", "content": 5}], pre_tokenizer={"type": "ByteLevel", "add_prefix_space": "yes"}))
    .encode())
put("safetensors", "regression_shape_overflow", b"\0" + safetensors([("w", "U8", [1 << 62, 4], b"")]))
put("safetensors", "regression_shape_overflow_zero", b"\0" + safetensors([("w", "U8", [1 << 40, 1 << 40, 0], b"")]))
print("seed corpora written under", CORPUS)
