// Fuzz target: Hugging Face tokenizer.json (byte-level BPE) and the tokenizer's own text handling. Even first
// byte: the rest is a tokenizer.json, loaded and used on a fixed text. Odd: the rest is text, encoded with a small
// fixed tokenizer (the hand-written pre-tokenizer split and the BPE merge loop see arbitrary bytes) and decoded,
// which must give the text back (every byte has an id in that vocabulary).
#include "tokenizer.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>

namespace {

std::unique_ptr<fsdp_train::BpeTokenizer> fixed_tokenizer() {
  nlohmann::json vocab = nlohmann::json::object();
  const auto& m = fsdp_train::byte_to_unicode();
  for (int b = 0; b < 256; ++b) vocab[m[b]] = b;
  const std::pair<const char*, const char*> merges[] = {{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"\xc4\xa0", "w"},
                                                       {"1", "2"},  {"12", "3"}, {"'", "s"}};
  uint32_t id = 256;
  nlohmann::json merge_list = nlohmann::json::array();
  for (const auto& [a, b] : merges) {
    vocab[std::string(a) + b] = id++;
    merge_list.push_back(std::string(a) + " " + b);
  }
  nlohmann::json j = {
      {"added_tokens", {{{"id", id}, {"content", "<|endoftext|>"}, {"special", true}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}},
  };
  return fsdp_train::BpeTokenizer::from_json(j.dump(), "fixed");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string rest(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] & 1) {
    static const auto tok = fixed_tokenizer();
    const auto ids = tok->encode(rest);
    if (tok->decode(ids) != rest) __builtin_trap();
    (void)tok->pre_tokenize(rest);
    return 0;
  }
  try {
    const auto tok = fsdp_train::BpeTokenizer::from_json(rest, "fuzz/tokenizer.json");
    const auto ids = tok->encode("Hello world's 12345 <|endoftext|> \xc3\xa9t\xc3\xa9\n\t  x");
    for (uint32_t id : ids)
      if (static_cast<int64_t>(id) >= tok->vocab_size()) __builtin_trap();
    (void)tok->decode(ids);
    (void)tok->describe();
  } catch (const std::exception&) {
  }
  return 0;
}
