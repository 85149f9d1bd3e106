// fsdp-train: a TorchTitan-style trainer for Llama 3 models on libfsdp.
//   fsdp-train [--config FILE] [--section.key value ...]      train (the embedded default config without --config)
//   fsdp-train --print-config [...]                             the effective config as TOML
//   fsdp-train plot <metrics.jsonl> <out.png|.svg>              loss, lr, tokens/s, memory (and MoE load) panels
//   fsdp-train plot-trace <trace.json>... <out.png|.svg>        per-rank timeline of Chrome traces (compute vs comm)
//   fsdp-train merge-traces <trace.json|folder>... <out.json>  one Chrome trace of every rank's [profiling] files
//   fsdp-train generate --checkpoint DIR --prompt TEXT [...]    sample text from a trained checkpoint (KV cache)
//   fsdp-train tokenize [--tokenizer PATH] --out FILE.tok IN... pre-tokenize text / JSON Lines (.gz too) into a token file
// Multi-process: start it with fsdprun (or torchrun-compatible variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
#include "config.h"
#include "data.h"
#include "generate.h"
#include "metrics.h"
#include "model_spec.h"
#include "plot.h"
#include "trace_merge.h"
#include "trainer.h"
#include "user_errors.h"

#include <fsdp/process_group.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <new>
#include <string>
#include <vector>

namespace {

constexpr const char* kUsage =
    "usage: fsdp-train [--config FILE] [--section.key value ...]\n"
    "       fsdp-train --print-config [--config FILE] [--section.key value ...]\n"
    "       fsdp-train plot <metrics.jsonl> <out.png|out.svg>\n"
    "       fsdp-train plot-trace <trace.json>... <out.png|out.svg>\n"
    "       fsdp-train merge-traces <trace.json|folder>... <out.json>\n"
    "       fsdp-train generate --checkpoint DIR --prompt TEXT [--max_new_tokens N --temperature T --top_k K --seed S]\n"
    "       fsdp-train tokenize [--tokenizer tokenizer.json] [--text-field F] [--bad-records skip|error] --out FILE.tok INPUT...\n"
    "Keys and defaults: docs/trainer.md (TorchTitan's names: job, model, optimizer, lr_scheduler, training,\n"
    "parallelism, checkpoint, activation_checkpoint, metrics, comm, debug).\n";

int plot_main(const std::vector<std::string>& args) {
  if (args.size() != 2) {
    std::cerr << "usage: fsdp-train plot <metrics.jsonl> <out.png|out.svg>\n";
    return 2;
  }
  const auto figure = fsdp_train::plot_metrics(args[0], args[1]);
  std::cout << "wrote " << args[1] << " (" << figure.width << "x" << figure.height << ", " << figure.records
            << " records; panels:";
  for (const auto& p : figure.panels) std::cout << " " << p.title << (p.has_data() ? "" : " (no data)") << ";";
  std::cout << ")\n";
  return 0;
}

int merge_traces_main(const std::vector<std::string>& args) {
  if (args.size() < 2) {
    std::cerr << "usage: fsdp-train merge-traces <trace.json|folder>... <out.json>\n"
                 "  e.g. fsdp-train merge-traces outputs/profile_traces/iteration_10 "
                 "outputs/memory_snapshot/iteration_10 merged.json\n";
    return 2;
  }
  const auto merged = fsdp_train::merge_traces({args.begin(), args.end() - 1}, args.back());
  std::cout << "wrote " << args.back() << " (" << merged.events << " events from " << merged.files << " files; ranks";
  for (int r : merged.ranks) std::cout << " " << r;
  std::cout << ")\n";
  return 0;
}

int plot_trace_main(const std::vector<std::string>& args) {
  if (args.size() < 2) {
    std::cerr << "usage: fsdp-train plot-trace <trace.json>... <out.png|out.svg>\n"
                 "  Chrome trace JSON (PyTorch profiler, Perfetto); several files (one per rank) share the time axis.\n";
    return 2;
  }
  const auto figure = fsdp_train::plot_trace({args.begin(), args.end() - 1}, args.back());
  std::cout << "wrote " << args.back() << " (" << figure.width << "x" << figure.height << ", " << figure.records
            << " events on " << figure.panels.size() << " rows)\n";
  return 0;
}

int tokenize_main(const std::vector<std::string>& args) {
  constexpr const char* usage =
      "usage: fsdp-train tokenize [--tokenizer tokenizer.json] [--text-field text] [--bad-records skip|error]\n"
      "                           --out FILE.tok INPUT...\n"
      "INPUT: text, JSON Lines (*.jsonl, *.ndjson) or either gzip-compressed (*.gz); a file, directory or list.\n";
  std::string tokenizer_path, out;
  fsdp_train::TextOptions text;
  std::vector<std::string> inputs;
  for (size_t i = 0; i < args.size(); ++i) {
    const bool has_value = i + 1 < args.size();
    if (args[i] == "--tokenizer" && has_value) tokenizer_path = args[++i];
    else if (args[i] == "--out" && has_value) out = args[++i];
    else if (args[i] == "--text-field" && has_value) text.text_field = args[++i];
    else if (args[i] == "--bad-records" && has_value) {
      const std::string v = args[++i];
      const auto bad_records = fsdp_train::parse_choice<fsdp_train::BadRecords>(v);  // training.bad_records' names
      if (!bad_records) {
        std::cerr << "fsdp-train tokenize: --bad-records expects skip or error, got '" << v << "'\n" << usage;
        return 2;
      }
      text.skip_bad_records = *bad_records == fsdp_train::BadRecords::Skip;
    } else if (args[i].rfind("--", 0) == 0) {
      std::cerr << "fsdp-train tokenize: unknown option '" << args[i] << "'\n" << usage;
      return 2;
    } else {
      inputs.push_back(args[i]);
    }
  }
  if (out.empty() || inputs.empty()) {
    std::cerr << usage;
    return 2;
  }
  auto tokenizer = fsdp_train::make_tokenizer(tokenizer_path);
  std::vector<std::string> files;
  for (const auto& in : inputs)
    for (const auto& f : fsdp_train::resolve_dataset_files(fsdp_train::Dataset::Text, in)) files.push_back(f);
  // Exactly one epoch of the stream the trainer would read from these files (BOS/EOS per text file or record).
  int64_t bad = 0;
  const auto epoch = fsdp_train::read_one_epoch(files, tokenizer, tokenizer->vocab_size(), text, &bad);
  const std::vector<uint32_t> tokens(epoch.begin(), epoch.end());
  fsdp_train::write_token_file(out, tokens, tokenizer->vocab_size());
  std::cout << "wrote " << out << ": " << tokens.size() << " tokens from " << files.size() << " files ("
            << tokenizer->describe() << ")";
  if (bad > 0) std::cout << "; " << bad << " bad records skipped";
  std::cout << "\n";
  return 0;
}

// The final summary: what was learned, how fast, and where every output went.
void print_summary(const fsdp_train::JobConfig& config, const fsdp_train::TrainSummary& s) {
  std::printf("\n== summary ==\n");
  std::printf("steps:            %zu (%s wall time)\n", s.losses.size(), fsdp_train::format_duration(s.seconds).c_str());
  std::printf("tokens seen:      %lld\n", static_cast<long long>(s.tokens_seen));
  std::printf("throughput:       %.0f tokens/s per rank, MFU %.1f%% (mean after the first log window)\n", s.mean_tps,
              s.mean_mfu);
  std::printf("final loss:       %.4f nats/token (mean of the last 10 steps)\n", s.final_loss);
  if (!s.validation_losses.empty()) {
    const auto best = std::min_element(s.validation_losses.begin(), s.validation_losses.end()) - s.validation_losses.begin();
    std::printf("validation loss:  %.4f (perplexity %.2f) at the last validation, step %lld; best %.4f at step %lld\n",
                s.validation_losses.back(), std::exp(s.validation_losses.back()),
                static_cast<long long>(s.validation_steps.back()), s.validation_losses[static_cast<size_t>(best)],
                static_cast<long long>(s.validation_steps[static_cast<size_t>(best)]));
  }
  if (s.unigram_entropy > 0) {
    std::printf("unigram entropy:  %.4f nats/token of the training stream (%lld tokens per epoch); loss / entropy = %.2f\n",
                s.unigram_entropy, static_cast<long long>(s.epoch_tokens), s.final_loss / s.unigram_entropy);
  }
  if (s.bad_records > 0 || s.validation_bad_records > 0)
    std::printf("bad records:      %lld skipped in the training data, %lld in the validation data (reported above)\n",
                static_cast<long long>(s.bad_records), static_cast<long long>(s.validation_bad_records));
  std::printf("outputs:\n");
  for (const auto& [what, where] : s.outputs) std::printf("  %-22s %s\n", what.c_str(), where.c_str());
  std::printf("  %-22s fsdp-train plot %s/metrics.jsonl metrics.png\n", "plot with", s.dump_folder.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  fsdp_apps::hide_cpp_backtraces_unless_requested();
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (!args.empty() && args[0] == "plot") return plot_main({args.begin() + 1, args.end()});
    if (!args.empty() && args[0] == "plot-trace") return plot_trace_main({args.begin() + 1, args.end()});
    if (!args.empty() && args[0] == "merge-traces") return merge_traces_main({args.begin() + 1, args.end()});
    if (!args.empty() && args[0] == "tokenize") return tokenize_main({args.begin() + 1, args.end()});
    if (!args.empty() && args[0] == "generate") return fsdp_train::generate_main({args.begin() + 1, args.end()});
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
      // The family and its flavor, fsdp-train's first model checks, hold here too (another family's model.name alone
      // printed the default family's flavor, which the run then refuses); the layout needs the world size: not here.
      const std::vector<std::string>& flavors = fsdp_train::train_spec(config.model.name).flavors;
      if (std::find(flavors.begin(), flavors.end(), config.model.flavor) == flavors.end()) {
        std::string known;
        for (const auto& f : flavors) known += (known.empty() ? "" : ", ") + f;
        throw fsdp_train::ConfigError("config error: model.flavor: unknown " + config.model.name + " flavor '" +
                                      config.model.flavor + "' (known: " + known + ")");
      }
      std::cout << fsdp_train::to_toml(config);
      return 0;
    }
    // A write to a connection its peer closed — a replica group that moved on without this one, a rank gone — must
    // fail with EPIPE, which Gloo reports as an error of that collective (under [fault_tolerance] the step is then
    // discarded and the group heals), not kill the rank: Gloo's TCP transport writes with writev, which cannot ask
    // for MSG_NOSIGNAL. Python, where PyTorch normally runs, ignores SIGPIPE from its start alike. (A rank of a
    // replica group resumed after a SIGSTOP died of it in 2 of 6 stops of fault_ft_stop_test.)
    std::signal(SIGPIPE, SIG_IGN);
    // The model family's layouts, before any process group exists (a refused layout is one line, no rendezvous);
    // the Trainer then does not check them again.
    auto env = fsdp_train::check_and_init_distributed(config);
    const auto summary = fsdp_train::run_training(config, env);
    if (env.rank == 0) print_summary(config, summary);
    if (env.group) fsdp::destroy_process_group();
    return 0;
  } catch (const fsdp_train::ConfigError& e) {
    std::cerr << "fsdp-train: " << e.what() << "\n";
    return 2;
  } catch (const std::bad_alloc&) {
    // The config's sizes passed validate()'s limits but this machine has not the memory for them.
    std::cerr << "fsdp-train: out of memory (std::bad_alloc): the model or the batch (model.flavor, "
                 "training.local_batch_size x training.seq_len) is too large for this machine\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-train: " << fsdp_apps::user_message(e) << "\n";
    return 1;
  }
}
