// fsdp-train: a TorchTitan-style trainer for Llama 3 models on libfsdp.
//   fsdp-train [--config FILE] [--section.key value ...]      train (the embedded default config without --config)
//   fsdp-train --print-config [...]                             the effective config as TOML
//   fsdp-train plot <metrics.jsonl> <out.png>                   loss / throughput / lr charts
//   fsdp-train tokenize [--tokenizer PATH] --out FILE.tok IN... pre-tokenize text into a token file
// Multi-process: start it with fsdprun (or torchrun-compatible variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
#include "config.h"
#include "data.h"
#include "plot.h"
#include "trainer.h"

#include <fsdp/process_group.h>

#include <c10/util/Exception.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr const char* kUsage =
    "usage: fsdp-train [--config FILE] [--section.key value ...]\n"
    "       fsdp-train --print-config [--config FILE] [--section.key value ...]\n"
    "       fsdp-train plot <metrics.jsonl> <out.png>\n"
    "       fsdp-train tokenize [--tokenizer tokenizer.json] --out FILE.tok INPUT...\n"
    "Keys and defaults: docs/trainer.md (TorchTitan's names: job, model, optimizer, lr_scheduler, training,\n"
    "parallelism, checkpoint, activation_checkpoint, metrics, comm, debug).\n";

int plot_main(const std::vector<std::string>& args) {
  if (args.size() != 2) {
    std::cerr << "usage: fsdp-train plot <metrics.jsonl> <out.png>\n";
    return 2;
  }
  const int n = fsdp_train::plot_metrics(args[0], args[1]);
  std::cout << "wrote " << args[1] << " (" << n << " records)\n";
  return 0;
}

int tokenize_main(const std::vector<std::string>& args) {
  std::string tokenizer_path, out;
  std::vector<std::string> inputs;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--tokenizer" && i + 1 < args.size()) tokenizer_path = args[++i];
    else if (args[i] == "--out" && i + 1 < args.size()) out = args[++i];
    else inputs.push_back(args[i]);
  }
  if (out.empty() || inputs.empty()) {
    std::cerr << "usage: fsdp-train tokenize [--tokenizer tokenizer.json] --out FILE.tok INPUT...\n";
    return 2;
  }
  auto tokenizer = fsdp_train::make_tokenizer(tokenizer_path);
  std::vector<std::string> files;
  for (const auto& in : inputs)
    for (const auto& f : fsdp_train::resolve_dataset_files("text", in)) files.push_back(f);
  // Exactly one epoch of the stream the trainer would read from these text files (BOS/EOS per file).
  fsdp_train::TokenStream stream(files, tokenizer, tokenizer->vocab_size());
  std::vector<uint32_t> tokens;
  int64_t tok = 0;
  while (true) {
    stream.read(1, &tok);
    if (stream.epoch() != 0) break;
    tokens.push_back(static_cast<uint32_t>(tok));
  }
  fsdp_train::write_token_file(out, tokens, tokenizer->vocab_size());
  std::cout << "wrote " << out << ": " << tokens.size() << " tokens from " << files.size() << " files ("
            << tokenizer->describe() << ")\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (!args.empty() && args[0] == "plot") return plot_main({args.begin() + 1, args.end()});
    if (!args.empty() && args[0] == "tokenize") return tokenize_main({args.begin() + 1, args.end()});
    for (const auto& a : args)
      if (a == "--help" || a == "-h") {
        std::cout << kUsage;
        return 0;
      }
    bool print_only = false;
    std::vector<std::string> rest;
    for (const auto& a : args) {
      if (a == "--print-config") print_only = true;
      else rest.push_back(a);
    }
    const auto config = fsdp_train::load_config(rest);
    if (print_only) {
      std::cout << fsdp_train::to_toml(config);
      return 0;
    }
    auto env = fsdp_train::init_distributed(config);
    const auto summary = fsdp_train::run_training(config, env);
    if (env.rank == 0) {
      std::printf("done: %zu steps in %.1f s; %.0f tokens/s per rank, MFU %.1f%% (after the first log window)\n",
                  summary.losses.size(), summary.seconds, summary.mean_tps, summary.mean_mfu);
      std::printf("final loss (mean of the last 10 steps): %.4f nats/token\n", summary.final_loss);
      std::printf("unigram entropy of the training stream:  %.4f nats/token (%lld tokens per epoch)\n",
                  summary.unigram_entropy, static_cast<long long>(summary.epoch_tokens));
      std::printf("loss / unigram entropy = %.2f\n", summary.final_loss / summary.unigram_entropy);
    }
    if (env.group) fsdp::destroy_process_group();
    return 0;
  } catch (const fsdp_train::ConfigError& e) {
    std::cerr << "fsdp-train: " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "fsdp-train: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-train: " << e.what() << "\n";
    return 1;
  }
}
