// Fuzz target: pre-tokenized token files. The first input byte picks the kind (.tok with its FSDPTOK1 header, raw
// .u16 or .u32); the rest is the file, read whole (read_token_file) and through the data loader's stream
// (TokenStream: header check, vocab check, chunked positioned reads, skip arithmetic).
#include "data.h"

#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const char* kNames[] = {"tokens.tok", "tokens.u16", "tokens.u32"};
  const std::string path = fsdp_fuzz::write_scratch(kNames[data[0] % 3], data + 1, size - 1);
  try {
    (void)fsdp_train::read_token_file(path);
  } catch (const std::exception&) {
  }
  try {
    auto tokenizer = std::make_shared<fsdp_train::ByteTokenizer>();
    fsdp_train::TokenStream stream({path}, tokenizer, /*vocab_limit=*/70000);
    int64_t out[64];
    stream.read(7, out);
    stream.skip(5);
    stream.read(64, out);
  } catch (const std::exception&) {
  }
  return 0;
}
