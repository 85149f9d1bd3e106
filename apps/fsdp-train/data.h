#pragma once
// The streaming data loader of fsdp-train. No torch headers: batches are plain int64 vectors.
//
// The corpus is one endless token stream: the dataset's files in sorted order, each file a document (BOS, its
// tokens, EOS), repeated epoch after epoch. Sample k of the stream is tokens [k*(S+1), (k+1)*(S+1)) (inputs are
// the first S, labels the last S, as TorchTitan's packed text datasets).
//
// Global-batch invariance: step t consumes samples [t*G, (t+1)*G) of the stream, G = global batch size. Sample
// t*G + i goes to data-parallel rank i / (L*A) and, within that rank, to micro-batch (i % (L*A)) / L
// (L = local batch, A = gradient accumulation steps). So 1 rank with A = k sees exactly the union of what k ranks
// with A = 1 see in one step, in the same order. Each rank only reads its own samples: pre-tokenized files are
// addressed directly (a skip is arithmetic), text is tokenized chunk by chunk and skipped samples are never
// materialised as tensors.
//
// The position (state) is small and exact: a JSON object with the stream position (epoch, file, chunk offset,
// tokens consumed in the chunk) and the loader's sample/micro-batch counters; load_state() reproduces the next
// batch bit for bit, or — for another layout with the same global batch — the next step's samples.

#include "config.h"  // Dataset
#include "file_content.h"
#include "tokenizer.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_train {

// Pre-tokenized files. ".tok": a 32-byte little-endian header, then the tokens:
//   char magic[8] = "FSDPTOK1"; uint32 version = 1; uint32 bytes_per_token (2 or 4); uint64 num_tokens;
//   uint32 vocab_size; uint32 reserved = 0
// ".u16" / ".u32": raw little-endian tokens, no header (e.g. nanoGPT's train.bin renamed to .u16).
// Token files carry their own BOS/EOS (write_token_file stores exactly what it is given).
bool is_token_file(const std::string& path);
void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens, int64_t vocab_size);
std::vector<uint32_t> read_token_file(const std::string& path);  // whole file (tests, tools)

// Files of a dataset from the config: common_licenses (default path /usr/share/common-licenses, every file but
// the held-out license), common_licenses_validation (only the held-out license), text, jsonl (JSON Lines files
// only), tokens (token files only). Any text or JSON Lines file may be gzip-compressed (*.gz).
// `path` may be a file, a directory (its regular files, recursively, sorted; symlinks skipped so that aliases
// such as GPL -> GPL-3 are not read twice) or a comma-separated list. Throws naming <section>.dataset_path
// when something is missing.
inline constexpr const char* kHeldOutLicense = "Apache-2.0";
std::vector<std::string> resolve_dataset_files(Dataset dataset, const std::string& path,
                                               const std::string& section = "training");

// How text files are read. JSON Lines files (*.jsonl, *.ndjson, optionally .gz; the usual export of a Hugging
// Face dataset) hold one document per line: the string under `text_field` of each JSON object, each document
// framed by BOS/EOS. A bad record (not JSON, not an object, no such field, not a string) is reported with its
// file and line and skipped (and counted) or, with skip_bad_records = false, fatal. Blank lines are ignored.
struct TextOptions {
  std::string text_field = "text";
  bool skip_bad_records = true;
  bool report_bad_records = true;  // print each skipped record's file:line to stderr (rank 0)
};
bool is_jsonl_file(const std::string& path);  // *.jsonl, *.ndjson (+ .gz)

// The endless token stream over `files` (see above).
class TokenStream {
 public:
  TokenStream(std::vector<std::string> files, std::shared_ptr<const Tokenizer> tokenizer, int64_t vocab_limit,
              TextOptions text = {});
  // Distinct bad records met so far (skipped; each counted once however often its chunk is read).
  int64_t bad_records() const { return static_cast<int64_t>(bad_seen_.size()); }
  void read(int64_t n, int64_t* out);  // the next n tokens
  void skip(int64_t n);                // drop the next n tokens (arithmetic for token files)
  nlohmann::json state() const;
  // Restores a saved position after checking it as untrusted input (`where` names it in errors): the same files,
  // indices inside what they index, no negative counters, a chunk boundary of a token file, and — for a dataset
  // of token files, where it is arithmetic — that the position is token `expected_token` of the stream (the
  // loader's sample counter); for text, that it is not past it. Throws one line naming the field and the rule;
  // on error the stream keeps its position.
  void load_state(const nlohmann::json& state, const std::string& where, int64_t expected_token);
  int64_t epoch() const { return epoch_; }
  const std::vector<std::string>& files() const { return files_; }

 private:
  struct Chunk;
  void ensure_chunk();  // load the chunk at the current position if not loaded
  void advance_chunk();
  int64_t chunk_remaining();

  int64_t line_at(int64_t file, int64_t offset);  // 1-based line number of a content offset (JSON Lines)

  std::vector<std::string> files_;
  std::vector<bool> token_file_, jsonl_file_;
  std::vector<int64_t> token_count_;  // tokens of each token file (from its header; 0 for text files)
  TextOptions text_;
  FileContent content_;  // keeps a gzip stream open between chunks
  std::map<std::pair<int64_t, int64_t>, int64_t> line_of_offset_;  // (file, chunk offset) -> line (cache)
  std::set<std::pair<int64_t, int64_t>> bad_seen_;                 // (file, line) of bad records
  std::shared_ptr<const Tokenizer> tokenizer_;
  int64_t vocab_limit_;
  // Position: file_ in epoch_, the chunk starting at offset_ (bytes for text, tokens for token files), of which
  // consumed_ tokens are used.
  int64_t epoch_ = 0, file_ = 0, offset_ = 0, consumed_ = 0;
  std::shared_ptr<Chunk> chunk_;  // the loaded chunk (cache; not part of the state)
};

struct LoaderOptions {
  int64_t seq_len = 0;
  int64_t local_batch_size = 1;
  int64_t grad_accum_steps = 1;
  int64_t dp_rank = 0;
  int64_t dp_degree = 1;
};

// A micro-batch: tokens of shape [local_batch, seq_len] (row-major) and labels of the same shape.
struct Batch {
  int64_t batch = 0, seq_len = 0;
  std::vector<int64_t> inputs, labels;
  std::vector<int64_t> sample_ids;  // global sample index of each row (for tests and debugging)
  // block_causal under context parallelism: the document ids of these tokens, computed on the whole rows before
  // they were cut into this rank's chunks (same shape as inputs); empty = derived from the inputs.
  std::vector<int64_t> document_ids;
};

class DataLoader {
 public:
  DataLoader(std::vector<std::string> files, std::shared_ptr<const Tokenizer> tokenizer, int64_t vocab_limit,
             LoaderOptions options, TextOptions text = {});
  int64_t bad_records() const { return stream_.bad_records(); }
  Batch next();  // the next micro-batch of this rank (grad_accum_steps of them per optimizer step)
  // Moves forward to the first micro-batch of optimizer step `step` (0-based: the batches step `step` + 1 of the
  // trainer reads). Throws when that is behind what was already delivered (a stream only moves forward).
  void seek_step(int64_t step);
  int64_t step() const { return micro_ / opt_.grad_accum_steps; }  // the step of the next micro-batch
  int64_t micro_batches() const { return micro_; }                   // delivered so far (or skipped by a seek)
  nlohmann::json state() const;
  // Restores a state() saved by a loader over the same files and seq_len, checked as untrusted input (`where`
  // names it in errors: one line with the field and the rule). The saved layout may differ from this one (local
  // batch, accumulation, data-parallel degree and rank) as long as the global batch is the same: the stream of
  // samples is the same, and the loader is repositioned at the saved step's global sample position (which needs a
  // state saved at a step boundary). A changed global batch or seq_len is refused naming both values.
  void load_state(const nlohmann::json& state, const std::string& where = "saved loader state");
  const LoaderOptions& options() const { return opt_; }
  int64_t epoch() const { return stream_.epoch(); }

 private:
  LoaderOptions opt_;
  TokenStream stream_;
  int64_t next_sample_ = 0;  // stream position in samples
  int64_t micro_ = 0;        // micro-batches delivered so far
};

// Exactly one epoch of the stream over `files` (each file: BOS, its tokens, EOS), in memory. For held-out data
// (validation) and `fsdp-train tokenize`.
std::vector<int64_t> read_one_epoch(const std::vector<std::string>& files, std::shared_ptr<const Tokenizer> tokenizer,
                                    int64_t vocab_limit, TextOptions text = {}, int64_t* bad_records = nullptr);

// Shannon entropy (nats) of the unigram distribution of one epoch of the stream: the loss of the best model
// that ignores context. A trained model must get well below it.
double unigram_entropy_nats(const std::vector<std::string>& files, std::shared_ptr<const Tokenizer> tokenizer,
                            int64_t vocab_limit, int64_t* num_tokens = nullptr, TextOptions text = {});

}  // namespace fsdp_train
