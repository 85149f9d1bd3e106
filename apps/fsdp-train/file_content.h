#pragma once
// Byte ranges of a dataset file's content, gzip-compressed or not: `x.gz` is read through zlib as the bytes it
// decompresses to, so every text format (plain text, JSON Lines) also works compressed. Positions are offsets in
// the (decompressed) content. A gzip stream is read forward; the reader keeps it open, so consecutive chunks of
// the same file cost one pass; a jump backwards (a restarted epoch, a resumed checkpoint) reopens the file and
// skips forward. No torch headers.

#include <cstdint>
#include <memory>
#include <string>

namespace fsdp_train {

bool is_gzip_file(const std::string& path);  // by name: ends in ".gz"

// The whole of a small input file (a config, a tokenizer.json), read with a bound: at most `max_bytes`, so that
// /dev/zero or a huge file is refused after max_bytes + 1 bytes instead of filling the memory. A directory is
// refused (reading one succeeds with no bytes on Linux, which would look like an empty file). Errors name `what`
// (the key or option the path came from) and the path.
std::string read_bounded_file(const std::string& path, int64_t max_bytes, const std::string& what);
// The name without ".gz" (what the content is: "a.jsonl.gz" -> "a.jsonl").
std::string content_name(const std::string& path);

class FileContent {
 public:
  FileContent();
  ~FileContent();
  FileContent(FileContent&&) noexcept;
  FileContent& operator=(FileContent&&) noexcept;
  // Up to `max_bytes` bytes of `path`'s content from `offset`; *at_end = the content ends within them.
  std::string read(const std::string& path, int64_t offset, int64_t max_bytes, bool* at_end);

 private:
  struct Gz;
  std::unique_ptr<Gz> gz_;  // the open gzip stream and its position
};

}  // namespace fsdp_train
