# Cross-check of tokenizer_test.cpp's hand-computed BPE ids with Hugging Face's `tokenizers` (tooling only:
# `.venv/bin/pip install tokenizers; .venv/bin/python tests/trainer/check_bpe_with_hf_tokenizers.py`). It prints
# the ids the test expects; the C++ test does not depend on it.
import json, sys
from tokenizers import Tokenizer
# same construction as tests/trainer/tokenizer_test.cpp
def b2u():
    bs = list(range(ord("!"), ord("~")+1)) + list(range(ord("¡"), ord("¬")+1)) + list(range(ord("®"), ord("ÿ")+1))
    cs = bs[:]; n = 0
    for b in range(256):
        if b not in bs: bs.append(b); cs.append(256+n); n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}
m = b2u()
vocab = {m[b]: b for b in range(256)}
merges = [("h","e"),("l","l"),("he","ll"),("hell","o"),("Ġ","w"),("o","r"),("Ġw","or"),("e","l"),("1","2"),("'","s")]
i = 256
for a, b in merges: vocab[a+b] = i; i += 1
j = {"version":"1.0","added_tokens":[{"id":266,"content":"<|endoftext|>","special":True,"single_word":False,"lstrip":False,"rstrip":False,"normalized":False}],
     "normalizer":None,"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":False,"trim_offsets":True,"use_regex":True},
     "post_processor":None,"decoder":{"type":"ByteLevel","add_prefix_space":True,"trim_offsets":True,"use_regex":True},
     "model":{"type":"BPE","dropout":None,"unk_token":None,"continuing_subword_prefix":None,"end_of_word_suffix":None,"fuse_unk":False,"byte_fallback":False,"vocab":vocab,"merges":[a+" "+b for a,b in merges]}}
t = Tokenizer.from_str(json.dumps(j))
for s in ["hello world","yell","it's 123!","a  b","x<|endoftext|>y","é","hi \n","Hello, world.\n\nNext"]:
    print(repr(s), t.encode(s).ids)
print(t.pre_tokenizer.pre_tokenize_str("Hello, world.\n\nNext"))
