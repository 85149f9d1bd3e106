// Fuzz target: the data loader's saved state (the "dataloader.dp_rank_N" value of a checkpoint, restored on a
// resume by DataLoader::load_state). The input is the state's JSON text ("@DATA@" stands for the dataset folder);
// a loader over two small fixed token files (one .tok, one raw .u16; 2 data-parallel ranks, 2 accumulation steps)
// loads it and delivers three micro-batches. A refused state is the expected outcome for most inputs; an accepted
// one must deliver batches whose tokens come from the files (ids below the vocabulary) without a crash or
// sanitizer report.
#include "data.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_input.h"

namespace {

constexpr int64_t kVocab = 300;

// The two dataset files, written once per process: tokens 0..kVocab-1 repeated (the .tok file) and a short raw
// .u16 file, so that file, offset and epoch positions all mean something.
const std::vector<std::string>& dataset_files() {
  static const std::vector<std::string> files = [] {
    std::vector<uint32_t> tokens;
    for (int i = 0; i < 1000; ++i) tokens.push_back(static_cast<uint32_t>((i * 7) % kVocab));
    const std::string tok = fsdp_fuzz::scratch_dir() + "/a.tok";
    fsdp_train::write_token_file(tok, tokens, kVocab);
    std::vector<uint8_t> raw;
    for (int i = 0; i < 123; ++i) {
      const uint16_t t = static_cast<uint16_t>((i * 13) % kVocab);
      raw.push_back(static_cast<uint8_t>(t & 0xff));
      raw.push_back(static_cast<uint8_t>(t >> 8));
    }
    const std::string u16 = fsdp_fuzz::write_scratch("b.u16", raw.data(), raw.size());
    return std::vector<std::string>{tok, u16};
  }();
  return files;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // "@DATA@" in the input stands for the folder of the dataset files (a per-process scratch folder), so that the
  // seeds' file names can match.
  std::string text(reinterpret_cast<const char*>(data), size);
  for (size_t at = text.find("@DATA@"); at != std::string::npos; at = text.find("@DATA@", at + 1))
    text.replace(at, 6, fsdp_fuzz::scratch_dir());
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(text);
  } catch (const std::exception&) {
    return 0;
  }
  fsdp_train::LoaderOptions options;
  options.seq_len = 5;
  options.local_batch_size = 2;
  options.grad_accum_steps = 2;
  options.dp_rank = 1;
  options.dp_degree = 2;
  fsdp_train::DataLoader loader(dataset_files(), std::make_shared<fsdp_train::ByteTokenizer>(), kVocab, options);
  try {
    loader.load_state(state);
  } catch (const std::exception&) {
    return 0;  // refused: the expected outcome for a state that does not fit this run
  }
  try {
    for (int i = 0; i < 3; ++i) {
      const auto batch = loader.next();
      for (int64_t id : batch.inputs)
        if (id < 0 || id >= kVocab) __builtin_trap();  // a token that is in no file: the state pointed elsewhere
    }
  } catch (const std::exception&) {
  }
  return 0;
}
