// Streaming token data for fsdp-train (see data.h).
#include "data.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>

namespace fsdp_train {
namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'T', 'O', 'K', '1'};
constexpr int64_t kHeaderBytes = 32;
constexpr int64_t kTextChunkBytes = 64 * 1024;      // text is tokenized this much at a time (cut at a newline)
constexpr int64_t kTokenChunkTokens = 1 << 20;      // token files are read this many tokens at a time

std::string extension(const std::string& path) { return fs::path(path).extension().string(); }

struct TokenFileInfo {
  int64_t data_offset = 0, width = 0, count = 0, vocab = 0;
};

TokenFileInfo token_file_info(const std::string& path) {
  TokenFileInfo info;
  const auto ext = extension(path);
  const auto size = static_cast<int64_t>(fs::file_size(path));
  if (ext == ".u16" || ext == ".u32") {
    info.width = ext == ".u16" ? 2 : 4;
    if (size % info.width != 0)
      throw std::runtime_error("token file '" + path + "': size " + std::to_string(size) + " is not a multiple of " +
                               std::to_string(info.width));
    info.count = size / info.width;
    return info;
  }
  std::ifstream in(path, std::ios::binary);
  unsigned char h[kHeaderBytes];
  if (!in.read(reinterpret_cast<char*>(h), kHeaderBytes) || std::memcmp(h, kMagic, 8) != 0)
    throw std::runtime_error("token file '" + path + "': missing the FSDPTOK1 header (see docs/trainer.md)");
  auto u32 = [&](int at) { return uint32_t(h[at]) | uint32_t(h[at + 1]) << 8 | uint32_t(h[at + 2]) << 16 | uint32_t(h[at + 3]) << 24; };
  auto u64 = [&](int at) { return uint64_t(u32(at)) | uint64_t(u32(at + 4)) << 32; };
  if (u32(8) != 1) throw std::runtime_error("token file '" + path + "': unsupported version " + std::to_string(u32(8)));
  info.width = u32(12);
  if (info.width != 2 && info.width != 4)
    throw std::runtime_error("token file '" + path + "': bytes_per_token must be 2 or 4, got " + std::to_string(info.width));
  const uint64_t count = u64(16);
  info.vocab = u32(24);
  info.data_offset = kHeaderBytes;
  // Compared in tokens, not bytes: a hostile count times the width would overflow (found by fuzzing).
  if (count > static_cast<uint64_t>((size - kHeaderBytes) / info.width))
    throw std::runtime_error("token file '" + path + "': header says " + std::to_string(count) + " tokens, file is too short");
  info.count = static_cast<int64_t>(count);
  return info;
}

void read_tokens(const std::string& path, const TokenFileInfo& info, int64_t first, int64_t n, int64_t* out) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(info.data_offset + first * info.width);
  std::vector<unsigned char> buf(static_cast<size_t>(n * info.width));
  if (!in.read(reinterpret_cast<char*>(buf.data()), static_cast<std::streamsize>(buf.size())))
    throw std::runtime_error("token file '" + path + "': short read at token " + std::to_string(first));
  for (int64_t i = 0; i < n; ++i) {
    const unsigned char* p = buf.data() + i * info.width;
    out[i] = info.width == 2 ? int64_t(p[0] | p[1] << 8)
                             : int64_t(uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24);
  }
}

// A saved-state field `key` of `s`: a JSON integer that fits int64 (not a float, a string, a bool), named in
// errors as <where>.<key>.
int64_t state_int(const nlohmann::json& s, const char* key, const std::string& where) {
  const auto it = s.find(key);
  if (it == s.end()) throw std::runtime_error(where + "." + key + ": missing");
  if (!it->is_number_integer())
    throw std::runtime_error(where + "." + key + ": must be an integer, is a " +
                             (it->is_number_float() ? std::string("floating-point number") : std::string(it->type_name())));
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    throw std::runtime_error(where + "." + key + " = " + std::to_string(it->get<uint64_t>()) + ": must fit 64-bit signed");
  return it->get<int64_t>();
}

// Throws "<where>.<key> = <value>: <rule>" unless `ok`.
void require(bool ok, const std::string& where, const char* key, int64_t value, const std::string& rule) {
  if (!ok) throw std::runtime_error(where + "." + key + " = " + std::to_string(value) + ": " + rule);
}

int64_t mul_or_throw(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) throw std::runtime_error(what + ": overflows 64 bits");
  return r;
}

}  // namespace

bool is_token_file(const std::string& path) {
  const auto ext = extension(path);
  return ext == ".tok" || ext == ".u16" || ext == ".u32";
}

void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens, int64_t vocab_size) {
  const bool narrow = vocab_size <= 65536;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write token file '" + path + "'");
  unsigned char h[kHeaderBytes] = {};
  std::memcpy(h, kMagic, 8);
  auto put32 = [&](int at, uint32_t v) {
    for (int k = 0; k < 4; ++k) h[at + k] = static_cast<unsigned char>(v >> (8 * k));
  };
  put32(8, 1);
  put32(12, narrow ? 2 : 4);
  put32(16, static_cast<uint32_t>(tokens.size()));
  put32(20, static_cast<uint32_t>(static_cast<uint64_t>(tokens.size()) >> 32));
  put32(24, static_cast<uint32_t>(vocab_size));
  out.write(reinterpret_cast<const char*>(h), kHeaderBytes);
  std::vector<unsigned char> buf;
  buf.reserve(tokens.size() * (narrow ? 2 : 4));
  for (uint32_t t : tokens)
    for (int k = 0; k < (narrow ? 2 : 4); ++k) buf.push_back(static_cast<unsigned char>(t >> (8 * k)));
  out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
  if (!out) throw std::runtime_error("short write to token file '" + path + "'");
}

std::vector<uint32_t> read_token_file(const std::string& path) {
  const auto info = token_file_info(path);
  std::vector<int64_t> tmp(static_cast<size_t>(info.count));
  if (info.count) read_tokens(path, info, 0, info.count, tmp.data());
  return {tmp.begin(), tmp.end()};
}

std::vector<std::string> resolve_dataset_files(Dataset dataset, const std::string& path_in, const std::string& section) {
  const std::string key = section + ".dataset_path";
  const bool licenses = dataset == Dataset::CommonLicenses || dataset == Dataset::CommonLicensesValidation;
  std::string path = path_in;
  if (path.empty()) {
    if (licenses) path = "/usr/share/common-licenses";
    else throw std::runtime_error(key + ": required for " + section + ".dataset = '" + to_string(dataset) + "'");
  }
  std::vector<std::string> files;
  std::stringstream ss(path);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    if (!fs::exists(item)) throw std::runtime_error(key + ": '" + item + "' does not exist");
    if (fs::is_directory(item)) {
      std::vector<std::string> found;
      for (const auto& e : fs::recursive_directory_iterator(item))
        if (!e.is_symlink() && e.is_regular_file()) found.push_back(e.path().string());
      std::sort(found.begin(), found.end());
      if (found.empty()) throw std::runtime_error(key + ": directory '" + item + "' has no files");
      files.insert(files.end(), found.begin(), found.end());
    } else {
      files.push_back(item);
    }
  }
  if (files.empty()) throw std::runtime_error(key + ": no files in '" + path + "'");
  if (licenses) {
    // The held-out split: one license text the training split never sees.
    std::vector<std::string> train, held_out;
    for (const auto& f : files) (fs::path(f).filename() == kHeldOutLicense ? held_out : train).push_back(f);
    if (held_out.empty() || train.empty())
      throw std::runtime_error(key + ": '" + path + "' must hold " + kHeldOutLicense +
                               " (the held-out license of common_licenses_validation) and at least one other file");
    files = dataset == Dataset::CommonLicenses ? train : held_out;
  }
  for (const auto& f : files) {
    if (dataset == Dataset::Jsonl && !is_jsonl_file(f))
      throw std::runtime_error(key + ": '" + f + "' is not a JSON Lines file (*.jsonl, *.ndjson, optionally .gz) but " +
                               section + ".dataset = 'jsonl'");
    if (dataset == Dataset::Tokens && !is_token_file(f))
      throw std::runtime_error(key + ": '" + f + "' is not a token file (*.tok, *.u16, *.u32) but " + section +
                               ".dataset = 'tokens'");
  }
  return files;
}

std::vector<int64_t> read_one_epoch(const std::vector<std::string>& files, std::shared_ptr<const Tokenizer> tokenizer,
                                    int64_t vocab_limit, TextOptions text, int64_t* bad_records) {
  TokenStream stream(files, std::move(tokenizer), vocab_limit, std::move(text));
  std::vector<int64_t> tokens;
  int64_t tok = 0;
  while (true) {
    stream.read(1, &tok);
    if (stream.epoch() != 0) break;
    tokens.push_back(tok);
  }
  if (bad_records) *bad_records = stream.bad_records();
  return tokens;
}

// ---- TokenStream ---------------------------------------------------------------------------------------------

struct TokenStream::Chunk {
  int64_t length = 0;       // tokens in the chunk
  int64_t next_offset = 0;  // where the next chunk of the same file starts
  bool last_in_file = false;
  std::vector<int64_t> tokens;  // filled for text; for token files only when read
  bool loaded = false;
  TokenFileInfo info;
};

bool is_jsonl_file(const std::string& path) {
  const auto ext = extension(content_name(path));
  return ext == ".jsonl" || ext == ".ndjson";
}

TokenStream::TokenStream(std::vector<std::string> files, std::shared_ptr<const Tokenizer> tokenizer, int64_t vocab_limit,
                         TextOptions text)
    : files_(std::move(files)), text_(std::move(text)), tokenizer_(std::move(tokenizer)), vocab_limit_(vocab_limit) {
  if (files_.empty()) throw std::runtime_error("data: no input files");
  for (const auto& f : files_) {
    if (!fs::exists(f)) throw std::runtime_error("training.dataset_path: '" + f + "' does not exist");
    token_file_.push_back(is_token_file(f));
    jsonl_file_.push_back(is_jsonl_file(f));
    token_count_.push_back(0);
    if (token_file_.back()) {
      const auto info = token_file_info(f);  // validates the header early
      if (info.vocab > vocab_limit_)
        throw std::runtime_error("token file '" + f + "' was written for vocab " + std::to_string(info.vocab) +
                                 ", the model's vocab is " + std::to_string(vocab_limit_));
      token_count_.back() = info.count;
    }
  }
}

void TokenStream::ensure_chunk() {
  if (chunk_) return;
  auto c = std::make_shared<Chunk>();
  const std::string& path = files_[static_cast<size_t>(file_)];
  if (token_file_[static_cast<size_t>(file_)]) {
    c->info = token_file_info(path);
    c->length = std::min(kTokenChunkTokens, c->info.count - offset_);
    c->next_offset = offset_ + c->length;
    c->last_in_file = c->next_offset >= c->info.count;
  } else {
    bool at_end = false;
    std::string text = content_.read(path, offset_, kTextChunkBytes, &at_end);
    if (jsonl_file_[static_cast<size_t>(file_)]) {
      // Whole lines only: a line longer than a chunk extends the chunk.
      while (!at_end && text.find('\n') == std::string::npos) {
        bool end2 = false;
        text += content_.read(path, offset_ + static_cast<int64_t>(text.size()), kTextChunkBytes, &end2);
        at_end = end2;
      }
    }
    if (!at_end) {
      // Cut at the last newline so that words (and JSON lines) are not split between chunks.
      const auto nl = text.rfind('\n');
      if (nl != std::string::npos) text.resize(nl + 1);
    }
    c->next_offset = offset_ + static_cast<int64_t>(text.size());
    c->last_in_file = at_end;  // not cut: the chunk runs to the end of the content
    if (!jsonl_file_[static_cast<size_t>(file_)]) {
      if (offset_ == 0 && tokenizer_->bos_id()) c->tokens.push_back(*tokenizer_->bos_id());
      for (uint32_t t : tokenizer_->encode(text)) c->tokens.push_back(t);
      if (c->last_in_file && tokenizer_->eos_id()) c->tokens.push_back(*tokenizer_->eos_id());
    } else {
      int64_t line = line_at(file_, offset_);
      size_t begin = 0;
      while (begin < text.size()) {
        size_t end = text.find('\n', begin);
        if (end == std::string::npos) end = text.size();
        const std::string_view record(text.data() + begin, end - begin);
        if (record.find_first_not_of(" \t\r") != std::string_view::npos) {
          std::string problem;
          nlohmann::json j = nlohmann::json::parse(record, nullptr, /*allow_exceptions=*/false);
          if (j.is_discarded()) problem = "not valid JSON";
          else if (!j.is_object()) problem = "not a JSON object";
          else if (!j.contains(text_.text_field)) problem = "no field \"" + text_.text_field + "\"";
          else if (!j[text_.text_field].is_string())
            problem = "field \"" + text_.text_field + "\" is a " + std::string(j[text_.text_field].type_name()) + ", not a string";
          if (problem.empty()) {
            if (tokenizer_->bos_id()) c->tokens.push_back(*tokenizer_->bos_id());
            for (uint32_t t : tokenizer_->encode(j[text_.text_field].get_ref<const std::string&>())) c->tokens.push_back(t);
            if (tokenizer_->eos_id()) c->tokens.push_back(*tokenizer_->eos_id());
          } else {
            const std::string where = path + ":" + std::to_string(line);
            if (!text_.skip_bad_records)
              throw std::runtime_error("data: bad record at " + where + ": " + problem +
                                       " (training.bad_records = \"error\"; \"skip\" skips and counts such records)");
            if (bad_seen_.insert({file_, line}).second && text_.report_bad_records)
              std::cerr << "fsdp-train: skipping bad record at " << where << ": " << problem << "\n";
          }
        }
        ++line;
        begin = end + 1;
      }
      line_of_offset_[{file_, c->next_offset}] = line;
    }
    c->length = static_cast<int64_t>(c->tokens.size());
    c->loaded = true;
  }
  chunk_ = std::move(c);
}

int64_t TokenStream::line_at(int64_t file, int64_t offset) {
  if (offset == 0) return 1;
  auto it = line_of_offset_.find({file, offset});
  if (it != line_of_offset_.end()) return it->second;
  // A position not reached chunk by chunk (a resumed run): count the newlines before it once.
  int64_t line = 1, at = 0;
  FileContent reader;
  while (at < offset) {
    bool end = false;
    const std::string part = reader.read(files_[static_cast<size_t>(file)], at, std::min<int64_t>(1 << 20, offset - at), &end);
    if (part.empty()) break;
    line += std::count(part.begin(), part.end(), '\n');
    at += static_cast<int64_t>(part.size());
  }
  line_of_offset_[{file, offset}] = line;
  return line;
}

int64_t TokenStream::chunk_remaining() {
  ensure_chunk();
  return chunk_->length - consumed_;
}

void TokenStream::advance_chunk() {
  ensure_chunk();
  const bool last = chunk_->last_in_file;
  offset_ = chunk_->next_offset;
  consumed_ = 0;
  chunk_.reset();
  if (last) {
    offset_ = 0;
    if (++file_ == static_cast<int64_t>(files_.size())) {
      file_ = 0;
      ++epoch_;
    }
  }
}

void TokenStream::read(int64_t n, int64_t* out) {
  int64_t guard = 0;  // a corpus with no tokens at all would loop forever
  while (n > 0) {
    const int64_t r = chunk_remaining();
    if (r == 0) {
      advance_chunk();
      if (++guard > static_cast<int64_t>(files_.size()) + 1)
        throw std::runtime_error("data: the dataset yields no tokens");
      continue;
    }
    guard = 0;
    const int64_t take = std::min(n, r);
    if (!chunk_->loaded) {
      chunk_->tokens.resize(static_cast<size_t>(chunk_->length));
      read_tokens(files_[static_cast<size_t>(file_)], chunk_->info, offset_, chunk_->length, chunk_->tokens.data());
      chunk_->loaded = true;
    }
    const int64_t* src = chunk_->tokens.data() + consumed_;
    for (int64_t i = 0; i < take; ++i) {
      if (src[i] < 0 || src[i] >= vocab_limit_)
        throw std::runtime_error("data: token id " + std::to_string(src[i]) + " in '" + files_[static_cast<size_t>(file_)] +
                                 "' is outside the model's vocab of " + std::to_string(vocab_limit_));
      out[i] = src[i];
    }
    out += take;
    n -= take;
    consumed_ += take;
  }
}

void TokenStream::skip(int64_t n) {
  while (n > 0) {
    const int64_t r = chunk_remaining();  // token files: metadata only, nothing is read
    if (r == 0) {
      advance_chunk();
      continue;
    }
    const int64_t take = std::min(n, r);
    consumed_ += take;
    n -= take;
  }
}

nlohmann::json TokenStream::state() const {
  return {{"epoch", epoch_}, {"file", file_}, {"offset", offset_}, {"consumed", consumed_},
          {"num_files", static_cast<int64_t>(files_.size())},
          {"file_name", files_[static_cast<size_t>(file_)]}};
}

void TokenStream::load_state(const nlohmann::json& s, const std::string& where, int64_t expected_token) {
  if (!s.is_object()) throw std::runtime_error(where + ": must be a JSON object, is a " + std::string(s.type_name()));
  const auto n = static_cast<int64_t>(files_.size());
  const int64_t num_files = state_int(s, "num_files", where);
  require(num_files == n, where, "num_files", num_files,
          "this run's dataset has " + std::to_string(n) + " files (the saved position is in another set of files)");
  const int64_t epoch = state_int(s, "epoch", where), file = state_int(s, "file", where);
  const int64_t offset = state_int(s, "offset", where), consumed = state_int(s, "consumed", where);
  require(file >= 0 && file < n, where, "file", file, "must be in [0, " + std::to_string(n) + ") (an index into the dataset's files)");
  const auto name = s.find("file_name");
  if (name == s.end() || !name->is_string()) throw std::runtime_error(where + ".file_name: missing or not a string");
  const std::string& path = files_[static_cast<size_t>(file)];
  if (name->get_ref<const std::string&>() != path)
    throw std::runtime_error(where + ".file_name: the saved position is in '" + name->get_ref<const std::string&>() +
                             "', this run's file " + std::to_string(file) + " is '" + path + "' (another set of files)");
  require(epoch >= 0, where, "epoch", epoch, "must be >= 0");
  require(offset >= 0, where, "offset", offset, "must be >= 0");
  require(consumed >= 0, where, "consumed", consumed, "must be >= 0 (tokens used of the chunk at offset)");
  const bool tokens = token_file_[static_cast<size_t>(file)];
  if (tokens) {
    // Chunks of a token file start at multiples of the chunk size, each inside the file.
    const int64_t count = token_count_[static_cast<size_t>(file)];
    require(offset % kTokenChunkTokens == 0 && (offset < count || offset == 0), where, "offset", offset,
            "must be a chunk start (a multiple of " + std::to_string(kTokenChunkTokens) + ") inside '" + path +
                "' of " + std::to_string(count) + " tokens");
    const int64_t length = std::min(kTokenChunkTokens, count - offset);
    require(consumed <= length, where, "consumed", consumed,
            "must be <= " + std::to_string(length) + ", the tokens of the chunk at offset " + std::to_string(offset));
  } else if (offset > 0 && !is_gzip_file(path)) {
    // A text chunk after the first starts where an earlier one was cut, before the end of the content (checked
    // here for plain files by their size; for gzip files once the chunk is read, below).
    std::error_code ec;
    const auto size = static_cast<int64_t>(fs::file_size(path, ec));
    require(!ec && offset < size, where, "offset", offset,
            "must be inside '" + path + "' (" + std::to_string(size) + " bytes; inside the content)");
  }
  if (std::all_of(token_file_.begin(), token_file_.end(), [](bool t) { return t; })) {
    // All token files: the position is arithmetic, and must be exactly where the loader's sample counter says.
    int64_t total = 0, before = 0;
    for (int64_t i = 0; i < n; ++i) {
      total += token_count_[static_cast<size_t>(i)];
      if (i < file) before += token_count_[static_cast<size_t>(i)];
    }
    int64_t at = 0;
    const bool overflow = __builtin_mul_overflow(epoch, total, &at) || __builtin_add_overflow(at, before + offset, &at) ||
                          __builtin_add_overflow(at, consumed, &at);
    if (total > 0 && (overflow || at != expected_token))
      throw std::runtime_error(where + ": the position (epoch " + std::to_string(epoch) + ", file " + std::to_string(file) +
                               ", offset " + std::to_string(offset) + ", consumed " + std::to_string(consumed) +
                               ") is not token " + std::to_string(expected_token) +
                               " of the stream, where the saved sample counter puts it");
  } else {
    // Text: every finished epoch yielded at least one token (an empty corpus is an error), so the epoch cannot
    // exceed the tokens read.
    require(epoch <= expected_token, where, "epoch", epoch,
            "must be <= " + std::to_string(expected_token) + ", the tokens the saved sample counter says were read");
  }
  const int64_t old_epoch = epoch_, old_file = file_, old_offset = offset_, old_consumed = consumed_;
  epoch_ = epoch;
  file_ = file;
  offset_ = offset;
  consumed_ = consumed;
  chunk_.reset();
  if (tokens) return;
  // A text chunk's token count is known once it is tokenized (what the next read does anyway).
  auto restore = [&] {
    epoch_ = old_epoch, file_ = old_file, offset_ = old_offset, consumed_ = old_consumed;
    chunk_.reset();
  };
  try {
    ensure_chunk();
  } catch (...) {
    restore();
    throw;
  }
  // A chunk after the first starts where an earlier one was cut, before the end of the content.
  if (offset > 0 && chunk_->next_offset == offset) {
    restore();
    require(false, where, "offset", offset, "must be inside the content of '" + path + "'");
  }
  if (consumed > chunk_->length) {
    const int64_t length = chunk_->length;
    restore();
    require(false, where, "consumed", consumed,
            "must be <= " + std::to_string(length) + ", the tokens of the chunk at offset " + std::to_string(offset));
  }
}

// ---- DataLoader ----------------------------------------------------------------------------------------------

DataLoader::DataLoader(std::vector<std::string> files, std::shared_ptr<const Tokenizer> tokenizer, int64_t vocab_limit,
                       LoaderOptions options, TextOptions text)
    : opt_(options), stream_(std::move(files), std::move(tokenizer), vocab_limit, std::move(text)) {
  if (opt_.seq_len <= 0 || opt_.local_batch_size <= 0 || opt_.grad_accum_steps <= 0 || opt_.dp_degree <= 0 ||
      opt_.dp_rank < 0 || opt_.dp_rank >= opt_.dp_degree)
    throw std::runtime_error("data: invalid loader options");
}

Batch DataLoader::next() {
  const int64_t L = opt_.local_batch_size, A = opt_.grad_accum_steps, S = opt_.seq_len;
  const int64_t G = L * A * opt_.dp_degree;
  const int64_t step = micro_ / A, m = micro_ % A;
  const int64_t first = step * G + opt_.dp_rank * L * A + m * L;
  stream_.skip((first - next_sample_) * (S + 1));  // other ranks' samples
  std::vector<int64_t> buf(static_cast<size_t>(L * (S + 1)));
  stream_.read(L * (S + 1), buf.data());
  next_sample_ = first + L;
  ++micro_;
  Batch b;
  b.batch = L;
  b.seq_len = S;
  b.inputs.resize(static_cast<size_t>(L * S));
  b.labels.resize(static_cast<size_t>(L * S));
  for (int64_t r = 0; r < L; ++r) {
    std::copy_n(buf.begin() + r * (S + 1), S, b.inputs.begin() + r * S);
    std::copy_n(buf.begin() + r * (S + 1) + 1, S, b.labels.begin() + r * S);
    b.sample_ids.push_back(first + r);
  }
  return b;
}

void DataLoader::seek_step(int64_t step) {
  const int64_t target = step * opt_.grad_accum_steps;
  if (target < micro_)
    throw std::runtime_error("data: cannot seek back to step " + std::to_string(step) + " (the loader has delivered " +
                             std::to_string(micro_) + " micro-batches, " + std::to_string(opt_.grad_accum_steps) +
                             " per step)");
  micro_ = target;  // next() skips the samples in between (arithmetic for token files)
}

nlohmann::json DataLoader::state() const {
  return {{"stream", stream_.state()},
          {"next_sample", next_sample_},
          {"micro", micro_},
          {"seq_len", opt_.seq_len},
          {"local_batch_size", opt_.local_batch_size},
          {"grad_accum_steps", opt_.grad_accum_steps},
          {"dp_rank", opt_.dp_rank},
          {"dp_degree", opt_.dp_degree}};
}

void DataLoader::load_state(const nlohmann::json& s, const std::string& where) {
  if (!s.is_object()) throw std::runtime_error(where + ": must be a JSON object, is a " + std::string(s.type_name()));
  const int64_t S = state_int(s, "seq_len", where);
  require(S == opt_.seq_len, where, "seq_len", S,
          "this run has training.seq_len = " + std::to_string(opt_.seq_len) +
              " (other samples: resuming needs the same seq_len)");
  // The saved layout, then the global batch it implies: the sample stream is the same for any layout of the same
  // global batch (sample t*G + i is in step t whatever the split), so only G and seq_len must match.
  const int64_t L = state_int(s, "local_batch_size", where), A = state_int(s, "grad_accum_steps", where);
  const int64_t D = state_int(s, "dp_degree", where), R = state_int(s, "dp_rank", where);
  require(L >= 1, where, "local_batch_size", L, "must be >= 1");
  require(A >= 1, where, "grad_accum_steps", A, "must be >= 1");
  require(D >= 1, where, "dp_degree", D, "must be >= 1");
  require(R >= 0 && R < D, where, "dp_rank", R, "must be in [0, dp_degree = " + std::to_string(D) + ")");
  const int64_t G = mul_or_throw(mul_or_throw(L, A, where + ": local_batch_size x grad_accum_steps"), D,
                                 where + ": the global batch (local_batch_size x grad_accum_steps x dp_degree)");
  const int64_t my_L = opt_.local_batch_size, my_A = opt_.grad_accum_steps, my_D = opt_.dp_degree;
  const int64_t my_G = my_L * my_A * my_D;
  if (G != my_G)
    throw std::runtime_error(where + ": saved with a global batch of " + std::to_string(G) + " samples (local_batch_size " +
                             std::to_string(L) + " x grad_accum_steps " + std::to_string(A) + " x " + std::to_string(D) +
                             " data-parallel ranks), this run has " + std::to_string(my_G) + " (" + std::to_string(my_L) +
                             " x " + std::to_string(my_A) + " x " + std::to_string(my_D) +
                             "): resuming needs the same training.global_batch_size");
  // Counters: micro-batches delivered, and the sample after the last of them (what next() leaves), which is
  // fixed by the micro count and the layout — a file cannot move one without the other.
  const int64_t micro = state_int(s, "micro", where), next = state_int(s, "next_sample", where);
  require(micro >= 0, where, "micro", micro, "must be >= 0 (micro-batches delivered)");
  // Bounded so that every sample position of the next step, in tokens, fits 64 bits.
  (void)mul_or_throw(mul_or_throw(micro / A + 2, G, where + ".micro"), S + 1, where + ".micro (its position in tokens)");
  const int64_t expected = micro == 0 ? 0 : (micro - 1) / A * G + R * L * A + (micro - 1) % A * L + L;
  require(next == expected, where, "next_sample", next,
          "must be " + std::to_string(expected) + ", the sample after the last of micro = " + std::to_string(micro) +
              " micro-batches of " + std::to_string(L) + " samples on data rank " + std::to_string(R) + " of " +
              std::to_string(D) + " (" + std::to_string(A) + " per step)");
  const bool same_layout = L == my_L && A == my_A && D == my_D && R == opt_.dp_rank;
  if (!same_layout)
    require(micro % A == 0, where, "micro", micro,
            "is inside a step (" + std::to_string(A) +
                " micro-batches per step): another local batch, accumulation or data-parallel layout resumes only "
                "from a step boundary");
  const auto stream = s.find("stream");
  if (stream == s.end()) throw std::runtime_error(where + ".stream: missing");
  stream_.load_state(*stream, where + ".stream", next * (S + 1));
  next_sample_ = next;
  // Another layout: the same step, this layout's first micro-batch of it. The saved stream position is at or
  // before every sample of that step (any rank's is: its samples of the step before end no later than the step),
  // and next() skips forward to this rank's.
  micro_ = same_layout ? micro : micro / A * my_A;
}

double unigram_entropy_nats(const std::vector<std::string>& files, std::shared_ptr<const Tokenizer> tokenizer,
                            int64_t vocab_limit, int64_t* num_tokens, TextOptions text) {
  text.report_bad_records = false;  // the loader reports them
  TokenStream stream(files, std::move(tokenizer), vocab_limit, std::move(text));
  std::vector<int64_t> counts(static_cast<size_t>(vocab_limit), 0);
  int64_t total = 0, tok = 0;
  while (true) {
    stream.read(1, &tok);
    if (stream.epoch() != 0) break;  // that token opened the second epoch
    ++counts[static_cast<size_t>(tok)];
    ++total;
  }
  double h = 0;
  for (int64_t c : counts)
    if (c > 0) {
      const double p = static_cast<double>(c) / static_cast<double>(total);
      h -= p * std::log(p);
    }
  if (num_tokens) *num_tokens = total;
  return h;
}

}  // namespace fsdp_train
