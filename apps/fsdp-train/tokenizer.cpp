// Byte-level and Hugging Face byte-level BPE tokenizers (see tokenizer.h).
#include "tokenizer.h"

#include "file_content.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace fsdp_train {

// ---- byte-level --------------------------------------------------------------------------------------------

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<uint32_t>& ids) const {
  std::string out;
  for (uint32_t id : ids)
    if (id < 256) out += static_cast<char>(id);  // BOS/EOS have no text
  return out;
}

// ---- GPT-2 byte <-> unicode alphabet ---------------------------------------------------------------------

namespace {

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// Length of the UTF-8 sequence starting with byte c (1 for invalid lead bytes, so any input makes progress).
size_t utf8_len(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c >> 5) == 0x6) return 2;
  if ((c >> 4) == 0xE) return 3;
  if ((c >> 3) == 0x1E) return 4;
  return 1;
}

const std::unordered_map<std::string, unsigned char>& unicode_to_byte() {
  static const std::unordered_map<std::string, unsigned char> table = [] {
    std::unordered_map<std::string, unsigned char> m;
    const auto& fwd = byte_to_unicode();
    for (int b = 0; b < 256; ++b) m[fwd[b]] = static_cast<unsigned char>(b);
    return m;
  }();
  return table;
}

// Character classes of the split pattern, on raw bytes: any byte >= 0x80 belongs to a non-ASCII code point,
// which counts as a letter (an approximation of \p{L} that keeps UTF-8 sequences whole).
bool is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
bool is_letter(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80; }
bool is_other(unsigned char c) { return !is_space(c) && !is_digit(c) && !is_letter(c); }

}  // namespace

const std::vector<std::string>& byte_to_unicode() {
  // GPT-2: printable bytes map to themselves; the other 68 bytes map to U+0100.. in byte order.
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
    int n = 0;
    for (int b = 0; b < 256; ++b) t[b] = printable(b) ? utf8(static_cast<uint32_t>(b)) : utf8(256 + n++);
    return t;
  }();
  return table;
}

// ---- BPE ---------------------------------------------------------------------------------------------------

namespace {

// Limits of what a tokenizer.json may hold (docs/reliability.md, "Inputs and the limits their readers enforce").
// Real files are far below them: Llama 3's tokenizer.json is 9 MB with 128,256 ids, Gemma 3's 33 MB with 262,144.
constexpr int64_t kMaxTokenizerBytes = 256 << 20;
constexpr int64_t kMaxTokenId = (1 << 24) - 1;  // ids size the model's embedding: 16.7 M rows is far beyond any vocab
constexpr int kMaxPreTokenizerDepth = 8;         // nested "Sequence" pre-tokenizers (real files: 1)

using nlohmann::json;

// Reads the fields of one tokenizer.json with their types checked; every error names the file, the field (its
// JSON path) and the rule, and never prints a value (a hostile value may be nested thousands of levels deep).
class FieldReader {
 public:
  explicit FieldReader(const std::string& source) : source_(source) {}
  [[noreturn]] void fail(const std::string& field, const std::string& rule) const {
    throw std::runtime_error("tokenizer " + source_ + ": " + field + ": " + rule);
  }
  [[noreturn]] void wrong_type(const std::string& field, const char* expected, const json& v) const {
    const std::string type = v.type_name();
    const bool vowel = type[0] == 'a' || type[0] == 'o';  // "an array", "an object"
    fail(field, std::string("expected ") + expected + ", got " + (v.is_null() ? "null" : (vowel ? "an " : "a ") + type));
  }
  // An optional string field: `fallback` when absent or null.
  std::string string_or(const json& parent, const char* key, const std::string& field, std::string fallback) const {
    if (!parent.contains(key) || parent[key].is_null()) return fallback;
    const json& v = parent[key];
    if (!v.is_string()) wrong_type(field, "a string", v);
    return v.get<std::string>();
  }
  bool bool_or(const json& parent, const char* key, const std::string& field, bool fallback) const {
    if (!parent.contains(key) || parent[key].is_null()) return fallback;
    const json& v = parent[key];
    if (!v.is_boolean()) wrong_type(field, "true or false", v);
    return v.get<bool>();
  }
  std::string string(const json& v, const std::string& field) const {
    if (!v.is_string()) wrong_type(field, "a string", v);
    return v.get<std::string>();
  }
  const json& array(const json& v, const std::string& field) const {
    if (!v.is_array()) wrong_type(field, "an array", v);
    return v;
  }
  // A token id: an integer in [0, kMaxTokenId] (a larger id would size the embedding table).
  uint32_t id(const json& v, const std::string& field) const {
    if (!v.is_number_integer()) wrong_type(field, "a non-negative integer id", v);
    if (!v.is_number_unsigned()) fail(field, "expected a non-negative integer id, got " + std::to_string(v.get<int64_t>()));
    const uint64_t id = v.get<uint64_t>();
    if (id > static_cast<uint64_t>(kMaxTokenId))
      fail(field, "id " + std::to_string(id) + " is above the limit " + std::to_string(kMaxTokenId) +
                      " (ids size the model's embedding table)");
    return static_cast<uint32_t>(id);
  }

 private:
  const std::string& source_;
};

}  // namespace

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_file(const std::string& path) {
  return from_json(read_bounded_file(path, kMaxTokenizerBytes, "model.tokenizer_path"), path);
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_json(std::string_view text, const std::string& source) {
  const FieldReader f(source);
  json j;
  try {
    j = json::parse(text);  // nlohmann's parser and destructor are iterative: any nesting depth is safe here
  } catch (const json::exception& e) {
    f.fail("the file", std::string("invalid JSON: ") + e.what());
  }
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  t->source_ = source;
  if (!j.is_object()) f.wrong_type("the file", "a JSON object", j);
  if (!j.contains("model") || !j["model"].is_object()) f.fail("model", "no \"model\" object");
  const json& model = j["model"];
  const std::string type = f.string_or(model, "type", "model.type", "BPE");
  if (type != "BPE") f.fail("model.type", "must be BPE, got " + type);
  if (!model.contains("vocab") || !model["vocab"].is_object()) f.fail("model.vocab", "must be an object");
  if (j.contains("normalizer") && !j["normalizer"].is_null()) f.fail("normalizer", "normalizers are not supported");
  int64_t max_id = -1;
  for (const auto& [tok, id] : model["vocab"].items()) {
    const uint32_t v = f.id(id, "model.vocab[\"" + tok + "\"]");
    t->vocab_[tok] = v;
    t->id_to_token_[v] = tok;
    max_id = std::max<int64_t>(max_id, v);
  }
  if (model.contains("merges") && !model["merges"].is_null()) {
    int64_t rank = 0;
    for (const auto& m : f.array(model["merges"], "model.merges")) {
      const std::string field = "model.merges[" + std::to_string(rank) + "]";
      std::string key;
      if (m.is_string()) {
        key = m.get<std::string>();
        if (key.find(' ') == std::string::npos) f.fail(field, "merge '" + key + "' is not \"a b\"");
      } else if (m.is_array() && m.size() == 2) {
        key = f.string(m[0], field + "[0]") + " " + f.string(m[1], field + "[1]");
      } else {
        f.fail(field, "merges must be \"a b\" strings or [a, b] pairs");
      }
      t->merge_rank_.emplace(key, rank++);  // first occurrence wins, as in HF
    }
  }
  t->ignore_merges_ = f.bool_or(model, "ignore_merges", "model.ignore_merges", false);
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    size_t k = 0;
    for (const auto& a : f.array(j["added_tokens"], "added_tokens")) {
      const std::string field = "added_tokens[" + std::to_string(k++) + "]";
      if (!a.is_object()) f.wrong_type(field, "an object", a);
      if (!a.contains("id")) f.fail(field + ".id", "missing");
      if (!a.contains("content")) f.fail(field + ".content", "missing");
      const uint32_t id = f.id(a["id"], field + ".id");
      const std::string content = f.string(a["content"], field + ".content");
      t->added_.emplace_back(content, id);
      t->added_by_id_[id] = content;
      max_id = std::max<int64_t>(max_id, id);
    }
    std::stable_sort(t->added_.begin(), t->added_.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  }
  // Pre-tokenizer: ByteLevel alone, or a Sequence of Split + ByteLevel. Sequences nest at most
  // kMaxPreTokenizerDepth levels: the visit recurses, and a file must not choose how deep.
  auto visit_pre = [&](const json& p, const std::string& field, int depth, auto& self) -> void {
    if (p.is_null()) return;
    if (!p.is_object()) f.wrong_type(field, "an object", p);
    const std::string kind = f.string_or(p, "type", field + ".type", "");
    if (kind == "ByteLevel") {
      t->add_prefix_space_ = f.bool_or(p, "add_prefix_space", field + ".add_prefix_space", false);
    } else if (kind == "Sequence") {
      if (depth >= kMaxPreTokenizerDepth)
        f.fail(field, "Sequence pre-tokenizers nested deeper than " + std::to_string(kMaxPreTokenizerDepth) + " levels");
      if (!p.contains("pretokenizers")) f.fail(field + ".pretokenizers", "missing");
      size_t k = 0;
      for (const auto& q : f.array(p["pretokenizers"], field + ".pretokenizers"))
        self(q, field + ".pretokenizers[" + std::to_string(k++) + "]", depth + 1, self);
    } else if (kind == "Split") {
      std::string re;
      if (p.contains("pattern") && !p["pattern"].is_null()) {
        if (!p["pattern"].is_object()) f.wrong_type(field + ".pattern", "an object", p["pattern"]);
        re = f.string_or(p["pattern"], "Regex", field + ".pattern.Regex", "");
      }
      t->split_digits_3_ = re.find("\\p{N}{1,3}") != std::string::npos;
    } else {
      f.fail(field + ".type", "pre_tokenizer type " + kind + " is not supported");
    }
  };
  if (j.contains("pre_tokenizer")) visit_pre(j["pre_tokenizer"], "pre_tokenizer", 0, visit_pre);
  t->vocab_size_ = max_id + 1;
  auto find_added = [&](std::initializer_list<const char*> names) -> std::optional<uint32_t> {
    for (const char* n : names)
      for (const auto& [content, id] : t->added_)
        if (content == n) return id;
    return std::nullopt;
  };
  t->bos_ = find_added({"<|begin_of_text|>", "<s>", "<|startoftext|>"});
  t->eos_ = find_added({"<|end_of_text|>", "</s>", "<|endoftext|>"});
  // Every byte must have a token, or some inputs could not be encoded.
  for (const auto& s : byte_to_unicode())
    if (!t->vocab_.count(s)) f.fail("model.vocab", "lacks the byte-level symbol '" + s + "'");
  return t;
}

std::string BpeTokenizer::describe() const {
  return "BPE tokenizer.json " + source_ + " (vocab " + std::to_string(vocab_size_) + ", " +
         std::to_string(merge_rank_.size()) + " merges)";
}

std::vector<std::string> BpeTokenizer::pre_tokenize(std::string_view text) const {
  // GPT-2's pattern, alternative by alternative, at each position (first alternative that matches wins).
  std::vector<std::string> out;
  const size_t n = text.size();
  auto u = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  size_t i = 0;
  while (i < n) {
    size_t end = i;
    // 1. contractions
    for (const char* c : {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d"}) {
      const std::string_view cv(c);
      if (text.substr(i, cv.size()) == cv) {
        end = i + cv.size();
        break;
      }
    }
    // 2-4. optional single space, then a run of one class
    if (end == i) {
      const size_t j = (u(i) == ' ' && i + 1 < n) ? i + 1 : i;
      for (auto cls : {is_letter, is_digit, is_other}) {
        if (j < n && cls(u(j))) {
          size_t k = j;
          if (cls == is_digit && split_digits_3_) {
            // Llama 3: \p{N}{1,3} has no leading space.
            if (j != i) break;
            while (k < n && k - j < 3 && is_digit(u(k))) ++k;
          } else {
            while (k < n && cls(u(k))) ++k;
          }
          end = k;
          break;
        }
      }
    }
    // 5-6. whitespace: a run not followed by a non-space keeps its last space for the next word.
    if (end == i && is_space(u(i))) {
      size_t k = i;
      while (k < n && is_space(u(k))) ++k;
      end = (k < n && k - i >= 2) ? k - 1 : k;
    }
    if (end == i) end = i + utf8_len(u(i));  // unreachable for valid classes; guarantees progress
    end = std::min(end, n);
    out.emplace_back(text.substr(i, end - i));
    i = end;
  }
  return out;
}

void BpeTokenizer::bpe(const std::string& word, std::vector<uint32_t>& out) const {
  const auto& b2u = byte_to_unicode();
  std::vector<std::string> symbols;
  std::string mapped;
  for (unsigned char c : word) {
    symbols.push_back(b2u[c]);
    mapped += b2u[c];
  }
  if (ignore_merges_) {
    if (auto it = vocab_.find(mapped); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // Repeatedly merge the adjacent pair with the lowest rank (all its occurrences, left to right).
  while (symbols.size() > 1) {
    int64_t best = std::numeric_limits<int64_t>::max();
    std::string best_a, best_b;
    for (size_t k = 0; k + 1 < symbols.size(); ++k) {
      auto it = merge_rank_.find(symbols[k] + " " + symbols[k + 1]);
      if (it != merge_rank_.end() && it->second < best) {
        best = it->second;
        best_a = symbols[k];
        best_b = symbols[k + 1];
      }
    }
    if (best == std::numeric_limits<int64_t>::max()) break;
    std::vector<std::string> merged;
    for (size_t k = 0; k < symbols.size(); ++k) {
      if (k + 1 < symbols.size() && symbols[k] == best_a && symbols[k + 1] == best_b) {
        merged.push_back(best_a + best_b);
        ++k;
      } else {
        merged.push_back(symbols[k]);
      }
    }
    symbols.swap(merged);
  }
  for (const auto& s : symbols) {
    auto it = vocab_.find(s);
    if (it == vocab_.end()) throw std::runtime_error("tokenizer " + source_ + ": merged symbol '" + s + "' is not in the vocab");
    out.push_back(it->second);
  }
}

std::vector<uint32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  std::string prefixed;
  if (add_prefix_space_ && !text.empty() && text[0] != ' ') {
    prefixed = " " + std::string(text);
    text = prefixed;
  }
  // Added (special) tokens are matched verbatim first; the text between them goes through split + BPE.
  size_t start = 0, i = 0;
  auto flush = [&](size_t end) {
    if (end > start)
      for (const auto& piece : pre_tokenize(text.substr(start, end - start))) bpe(piece, ids);
  };
  while (i < text.size()) {
    bool matched = false;
    for (const auto& [content, id] : added_) {
      if (!content.empty() && text.compare(i, content.size(), content) == 0) {
        flush(i);
        ids.push_back(id);
        i += content.size();
        start = i;
        matched = true;
        break;
      }
    }
    if (!matched) ++i;
  }
  flush(text.size());
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<uint32_t>& ids) const {
  const auto& u2b = unicode_to_byte();
  std::string out;
  for (uint32_t id : ids) {
    if (auto a = added_by_id_.find(id); a != added_by_id_.end()) {
      out += a->second;
      continue;
    }
    auto it = id_to_token_.find(id);
    if (it == id_to_token_.end()) throw std::runtime_error("tokenizer " + source_ + ": unknown id " + std::to_string(id));
    const std::string& tok = it->second;
    for (size_t k = 0; k < tok.size();) {
      const size_t len = utf8_len(static_cast<unsigned char>(tok[k]));
      auto b = u2b.find(tok.substr(k, len));
      if (b == u2b.end()) throw std::runtime_error("tokenizer " + source_ + ": token '" + tok + "' is not byte-level");
      out += static_cast<char>(b->second);
      k += len;
    }
  }
  return out;
}

std::shared_ptr<const Tokenizer> make_tokenizer(const std::string& path) {
  if (path.empty()) return std::make_shared<ByteTokenizer>();
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "tokenizer.json";
  if (!std::filesystem::exists(p)) throw std::runtime_error("model.tokenizer_path: '" + p.string() + "' does not exist");
  return std::shared_ptr<const Tokenizer>(BpeTokenizer::from_file(p.string()));
}

}  // namespace fsdp_train
