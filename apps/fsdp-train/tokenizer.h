#pragma once
// Tokenizers for fsdp-train: byte-level (the default: 256 byte ids + BOS + EOS) and Hugging Face tokenizer.json
// byte-level BPE (GPT-2 / Llama 3 style: GPT-2 byte-to-unicode alphabet, ranked merges, a regex-like
// pre-tokenizer split). No torch headers.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace fsdp_train {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Token ids of `text` without BOS/EOS.
  virtual std::vector<uint32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<uint32_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;  // 1 + the largest id
  virtual std::optional<uint32_t> bos_id() const = 0;
  virtual std::optional<uint32_t> eos_id() const = 0;
  virtual std::string describe() const = 0;
};

// id b = byte b; BOS = 256, EOS = 257; vocab 258. encode/decode are exact inverses on any bytes.
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<uint32_t>& ids) const override;
  int64_t vocab_size() const override { return 258; }
  std::optional<uint32_t> bos_id() const override { return 256u; }
  std::optional<uint32_t> eos_id() const override { return 257u; }
  std::string describe() const override { return "byte-level (vocab 258)"; }
};

// Hugging Face tokenizer.json with model.type "BPE" over the GPT-2 byte-level alphabet.
// Supported: model.vocab, model.merges ("a b" strings or ["a", "b"] pairs), model.ignore_merges,
// added_tokens (matched verbatim in the text, longest first), ByteLevel pre-tokenizer with add_prefix_space.
// The split is GPT-2's pattern ('s|'t|'re|'ve|'m|'ll|'d| ?L+| ?N+| ?[^sLN]+|s+(?!S)|s+) with L = ASCII letters
// and every non-ASCII code point, N = ASCII digits, s = ASCII whitespace; when the file's Split regex is Llama 3's
// (digits in groups of 1-3), digit runs are cut into groups of 3 as well. Other normalizers are rejected.
// BOS/EOS: the first added token named <|begin_of_text|>, <s>, <|startoftext|> / <|end_of_text|>, </s>,
// <|endoftext|>, when present.
class BpeTokenizer final : public Tokenizer {
 public:
  static std::unique_ptr<BpeTokenizer> from_file(const std::string& path);
  static std::unique_ptr<BpeTokenizer> from_json(std::string_view json_text, const std::string& source = "<json>");

  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<uint32_t>& ids) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<uint32_t> bos_id() const override { return bos_; }
  std::optional<uint32_t> eos_id() const override { return eos_; }
  std::string describe() const override;

  // Exposed for tests: the pre-tokenizer's pieces of `text` (raw bytes, before the byte-to-unicode mapping).
  std::vector<std::string> pre_tokenize(std::string_view text) const;

 private:
  BpeTokenizer() = default;
  void bpe(const std::string& word, std::vector<uint32_t>& out) const;

  std::unordered_map<std::string, uint32_t> vocab_;  // token string (mapped alphabet) -> id
  std::unordered_map<uint32_t, std::string> id_to_token_;
  std::unordered_map<std::string, int64_t> merge_rank_;  // "a b" -> rank
  std::vector<std::pair<std::string, uint32_t>> added_;  // content -> id, longest first
  std::unordered_map<uint32_t, std::string> added_by_id_;
  bool ignore_merges_ = false;
  bool add_prefix_space_ = false;
  bool split_digits_3_ = false;
  int64_t vocab_size_ = 0;
  std::optional<uint32_t> bos_, eos_;
  std::string source_;
};

// GPT-2's reversible byte -> printable unicode mapping (as UTF-8 strings), and its inverse.
const std::vector<std::string>& byte_to_unicode();

// "" -> ByteTokenizer; otherwise a tokenizer.json path (or a directory containing tokenizer.json).
std::shared_ptr<const Tokenizer> make_tokenizer(const std::string& path);

}  // namespace fsdp_train
