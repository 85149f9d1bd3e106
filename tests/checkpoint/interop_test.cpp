// Checkpoint interop with PyTorch and Hugging Face, against their own code in the venv (FSDP_TEST_PYTHON):
//   DcpRead.*   the restricted .metadata reader on real torch 2.13 dcp.save output, hostile pickles (a command
//               that must never run), truncated and mangled bytes
//   DcpInterop  PyTorch FSDP2 trains on 2 ranks and dcp.save()s; ours loads on 3 ranks (bit for bit) and continues
//               (losses equal to PyTorch continuing); ours saves and converts to DCP; PyTorch dcp.load()s on 2
//               ranks and gets our tensors
//   HfInterop   transformers' LlamaForCausalLM and our Llama give the same logits on Hugging Face files written
//               by either side
// The Python side is tests/checkpoint/interop/torch_side.py; the rank processes of ours are interop_worker.
#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/models/llama.h>

#include "checkpoint/dcp_format.h"
#include "checkpoint/pickle.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace fs = std::filesystem;
namespace ckpt = fsdp::checkpoint;
namespace st = fsdp::checkpoint::safetensors;
namespace dcp = fsdp::checkpoint::detail::dcp;

namespace {

const std::string kPython = FSDP_TEST_PYTHON;
const std::string kScript = std::string(FSDP_SOURCE_DIR) + "/tests/checkpoint/interop/torch_side.py";

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("fsdp_interop_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs a shell command with its output in `log`; prints both when it fails. Returns the exit status.
int run(const std::string& cmd, const fs::path& log) {
  const int rc = std::system((cmd + " > " + log.string() + " 2>&1").c_str());
  if (rc != 0) std::cerr << "---- " << cmd << " (status " << rc << ")\n" << slurp(log) << "\n";
  return rc;
}

std::string python(const std::string& args) { return "OMP_NUM_THREADS=1 " + kPython + " " + kScript + " " + args; }
std::string torchrun(int n, const std::string& args) {
  return "OMP_NUM_THREADS=1 " + kPython + " -m torch.distributed.run --standalone --nproc-per-node " +
         std::to_string(n) + " " + kScript + " " + args;
}
std::string ours(int n, const std::string& args) {
  return std::string("OMP_NUM_THREADS=1 ") + FSDPRUN + " --nproc-per-node " + std::to_string(n) + " --timeout 300 " +
         INTEROP_WORKER + " " + args;
}

bool python_has(const std::string& module) {
  return std::system((kPython + " -c 'import " + module + "' > /dev/null 2>&1").c_str()) == 0;
}

// ---- DCP .metadata reader ---------------------------------------------------------------------------------

// A real one-process dcp.save (every kind of entry), made once per test binary run.
const fs::path& fixture() {
  static fs::path dir;
  if (dir.empty()) {
    const fs::path d = fresh_dir("fixture");
    dir = d / "ckpt";
    EXPECT_EQ(run(python("dcp-fixture --out " + dir.string()), d / "fixture.log"), 0);
  }
  return dir;
}

TEST(DcpRead, RealMetadataReadsAsPyTorchSavedIt) {
  const fs::path dir = fixture();
  const auto s = ckpt::inspect(dir.string());
  EXPECT_EQ(s.format, ckpt::Format::PytorchDcp);
  // Tensors: the reference written by PyTorch next to the checkpoint (safetensors, independent of DCP).
  const auto ref = st::load_file(dir.string() + ".ref.safetensors");
  ASSERT_EQ(s.tensors.size(), ref.size());
  ckpt::Reader reader(dir.string());
  for (const auto& [name, want] : ref) {
    at::Tensor got = reader.read(name);
    EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
    EXPECT_TRUE(got.sizes() == want.sizes() && at::equal(got, want)) << name;
  }
  // Values: plain data as JSON, the pickled bytes reported (never loaded).
  const auto manifest = nlohmann::json::parse(slurp(dir.string() + ".manifest.json"));
  for (auto it = manifest["values"].begin(); it != manifest["values"].end(); ++it) {
    ASSERT_TRUE(s.values.count(it.key())) << it.key();
    EXPECT_EQ(nlohmann::json::parse(s.values.at(it.key())), it.value()) << it.key();
  }
  for (const auto& k : manifest["unreadable"]) {
    ASSERT_TRUE(s.unreadable_values.count(k.get<std::string>())) << k;
    EXPECT_NE(s.unreadable_values.at(k.get<std::string>()).find("bytes"), std::string::npos)
        << s.unreadable_values.at(k.get<std::string>());
  }
  EXPECT_TRUE(ckpt::verify(dir.string()).empty());
  // Loading a value that is not plain data is an error naming it.
  ckpt::StateDict sd;
  sd.values["dataloader.dp_rank_0"] = "null";
  ckpt::LoadOptions lo;
  lo.local_only = true;
  lo.strict = false;
  try {
    ckpt::load(sd, dir.string(), lo);
    ADD_FAILURE() << "loading pickled bytes did not fail";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("dataloader.dp_rank_0"), std::string::npos) << e.msg();
  }
}

// A DCP load goes through the same parallel piece reader as libfsdp's: every chunk archive a rank needs is a
// piece, decoded on up to read_threads threads. Against PyTorch's own reference tensors, with 1 and 4 threads.
TEST(DcpRead, LoadReadsChunksOnSeveralThreads) {
  const fs::path dir = fixture();
  const auto s = ckpt::inspect(dir.string());
  const auto ref = st::load_file(dir.string() + ".ref.safetensors");
  int64_t chunks = 0;
  for (const auto& t : s.tensors) chunks += t.chunks;
  ASSERT_GE(chunks, 4) << "the fixture needs several chunks for this test";
  for (int threads : {1, 4}) {
    ckpt::StateDict sd;
    for (const auto& [name, want] : ref) sd.full[name] = at::zeros_like(want);
    ckpt::LoadOptions lo;
    lo.local_only = true;
    lo.strict = false;  // the fixture's values are not requested
    lo.read_threads = threads;
    const auto res = ckpt::load(sd, dir.string(), lo);
    EXPECT_EQ(res.read_threads_used, threads) << chunks << " chunks";
    EXPECT_TRUE(res.missing.empty());
    EXPECT_GT(res.bytes_read, 0);
    int64_t nonzero = 0;
    for (const auto& [name, want] : ref) {
      EXPECT_TRUE(at::equal(sd.full.at(name), want)) << name << " (" << threads << " threads)";
      nonzero += want.numel() > 0 && !at::equal(want, at::zeros_like(want));
    }
    EXPECT_GT(nonzero, 0) << "the reference is all zeros (vacuous)";
  }
}

TEST(DcpRead, MaliciousMetadataIsRejectedAndNeverRuns) {
  const fs::path d = fresh_dir("malicious");
  const fs::path marker = d / "pwned";
  ASSERT_EQ(run(python("malicious --out " + (d / "files").string() + " --marker " + marker.string()), d / "make.log"), 0);
  for (const char* name : {"bare", "inside", "handwritten"}) {
    const fs::path ck = d / name;
    fs::create_directories(ck);
    fs::copy_file(d / "files" / (std::string(name) + ".metadata"), ck / ".metadata");
    std::string msg;
    try {
      ckpt::inspect(ck.string());
    } catch (const c10::Error& e) {
      msg = e.msg();
    }
    EXPECT_TRUE(msg.find("'posix.system' is not allowed") != std::string::npos ||
                msg.find("'os.system' is not allowed") != std::string::npos)
        << name << ": " << msg;
    EXPECT_NE(msg.find(".metadata"), std::string::npos) << msg;  // names the file
    EXPECT_FALSE(fs::exists(marker)) << name << ": the command ran";
  }
  // The payloads are real: Python's pickle.load (what torch's FileSystemReader calls) runs them.
  ASSERT_EQ(run(python("run-pickle " + (d / "files" / "inside.metadata").string()), d / "py.log"), 0);
  EXPECT_TRUE(fs::exists(marker)) << "the crafted .metadata did not run its command under pickle.load";
}

TEST(DcpRead, TruncatedMetadataIsAClearError) {
  const std::string bytes = slurp(fixture() / ".metadata");
  ASSERT_GT(bytes.size(), 1000u);
  EXPECT_NO_THROW(dcp::parse_metadata(bytes, "full"));
  // Python frames protocol-4 pickles (FRAME <length> first): without the frame every cut lands inside the
  // opcodes themselves.
  ASSERT_EQ(static_cast<unsigned char>(bytes[2]), 0x95);
  const std::string unframed = bytes.substr(0, 2) + bytes.substr(11);
  EXPECT_NO_THROW(dcp::parse_metadata(unframed, "unframed"));
  for (const std::string* b : {&bytes, &unframed}) {
    for (size_t n = 0; n < b->size(); ++n) {
      try {
        dcp::parse_metadata(b->substr(0, n), "cut");
        ADD_FAILURE() << "a .metadata cut at " << n << " bytes was accepted";
      } catch (const c10::Error& e) {
        ASSERT_NE(e.msg().find("truncated"), std::string::npos) << n << ": " << e.msg();
        ASSERT_EQ(e.msg().rfind("cut: ", 0), 0u) << e.msg();  // names the input
      }
    }
  }
}

// Bounded, deterministic mangling (libFuzzer-style mutations with a fixed seed): every input ends in success
// or a c10::Error, never a crash, a hang or another exception.
TEST(DcpRead, MangledMetadataNeverCrashes) {
  const std::string good = slurp(fixture() / ".metadata");
  std::mt19937_64 rng(20260914);
  int rejected = 0, accepted = 0;
  for (int i = 0; i < 4000; ++i) {
    std::string b = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % b.size();
      switch (rng() % 5) {
        case 0: b[at] = static_cast<char>(rng()); break;                              // random byte
        case 1: b[at] = static_cast<char>(b[at] ^ (1 << (rng() % 8))); break;       // bit flip
        case 2: b.erase(at, 1 + rng() % 8); break;                                   // deletion
        case 3: b.insert(at, b.substr(rng() % b.size(), 1 + rng() % 16)); break;     // duplication
        default: b[at] = "\x93\x81\x62\x52\x94\x68\x2e\x28\x75\x74"[rng() % 10]; break;  // opcodes
      }
      if (b.empty()) b = "\x80";
    }
    try {
      dcp::parse_metadata(b, "mangled");
      ++accepted;
    } catch (const c10::Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 3000) << accepted << " accepted";
  // The same for value items' pickles (plain data only) through the value reader.
  namespace pk = fsdp::checkpoint::detail::pickle;
  pk::Writer w;
  w.empty_dict();
  w.mark();
  w.str("a");
  w.real(0.5);
  w.str("b");
  w.empty_list();
  w.mark();
  w.integer(1);
  w.integer(-70000);
  w.str("x");
  w.appends();
  w.setitems();
  const std::string value = w.finish();
  for (int i = 0; i < 4000; ++i) {
    std::string b = value;
    b[rng() % b.size()] = static_cast<char>(rng());
    try {
      pk::parse(b.data(), b.size(), [](const std::string&, const std::string&) { return false; }, "value");
    } catch (const c10::Error&) {
    }
  }
}

TEST(DcpRead, WrittenMetadataReadsBack) {
  dcp::Metadata md;
  md.version = dcp::kVersion;
  md.tensors["w"] = {c10::kBFloat16, {4, 3}, {{{0, 0}, {2, 3}, {"__0_0.distcp", 0, 100}}, {{2, 0}, {2, 3}, {"__1_0.distcp", 0, 90}}}};
  md.tensors["s"] = {c10::kLong, {}, {{{}, {}, {"__0_0.distcp", 100, 50}}}};
  md.values["optimizer.param_groups.w.lr"] = {"__0_0.distcp", 150, 70};
  const dcp::Metadata back = dcp::parse_metadata(dcp::metadata_pickle(md, "/ckpt/x"), "written");
  ASSERT_EQ(back.tensors.size(), 2u);
  EXPECT_EQ(back.tensors.at("w").dtype, c10::kBFloat16);
  EXPECT_EQ(back.tensors.at("w").chunks.at(1).offsets, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(back.tensors.at("w").chunks.at(1).item.file, "__1_0.distcp");
  EXPECT_EQ(back.tensors.at("s").size, std::vector<int64_t>{});
  EXPECT_EQ(back.values.at("optimizer.param_groups.w.lr").offset, 150);
  EXPECT_EQ(back.version, "1.0.0");
}

// ---- PyTorch FSDP2 <-> ours ---------------------------------------------------------------------------------

fsdp::models::llama::LlamaArgs small_llama(bool tied, bool rope_scaling = false) {
  fsdp::models::llama::LlamaArgs a;
  a.dim = 64;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.vocab_size = 256;
  a.multiple_of = 32;
  a.rope_theta = 500000;
  a.tie_embeddings = tied;
  // Llama 3.1-style scaling with a short original context, so that it changes the 16-token logits.
  if (rope_scaling) a.rope_scaling = fsdp::models::llama::RopeScaling{8.0, 1.0, 4.0, 16};
  return a;
}

void write_args(const fsdp::models::llama::LlamaArgs& a, const fs::path& p) {
  nlohmann::json j = {{"dim", a.dim}, {"n_layers", a.n_layers}, {"n_heads", a.n_heads}, {"n_kv_heads", a.kv_heads()},
                      {"vocab_size", a.vocab_size}, {"multiple_of", a.multiple_of}, {"ffn_hidden_dim", a.ffn_hidden_dim()},
                      {"norm_eps", a.norm_eps}, {"rope_theta", a.rope_theta}, {"tie_embeddings", a.tie_embeddings ? 1 : 0}};
  j["ffn_dim_multiplier"] = a.ffn_dim_multiplier ? nlohmann::json(*a.ffn_dim_multiplier) : nlohmann::json(nullptr);
  j["rope_scaling"] = nullptr;
  if (a.rope_scaling) {
    j["rope_scaling"] = {{"factor", a.rope_scaling->factor},
                         {"low_freq_factor", a.rope_scaling->low_freq_factor},
                         {"high_freq_factor", a.rope_scaling->high_freq_factor},
                         {"original_max_position_embeddings", a.rope_scaling->original_max_position_embeddings}};
  }
  std::ofstream(p) << j.dump();
}

// Learnable tokens (as bench/vs_pytorch/run.py): runs of t[i+1] = (a t[i] + c) mod V with 20% random tokens.
void write_tokens(const fs::path& p, int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  at::Tensor t = at::empty({n}, at::kLong);
  auto* x = t.data_ptr<int64_t>();
  int64_t a = 1, c = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 17 == 0) {
      a = 1 + static_cast<int64_t>(rng() % 15);
      c = static_cast<int64_t>(rng() % vocab);
      x[i] = static_cast<int64_t>(rng() % vocab);
    } else {
      x[i] = (a * x[i - 1] + c) % vocab;
    }
    if (rng() % 5 == 0) x[i] = static_cast<int64_t>(rng() % vocab);
  }
  std::ofstream f(p, std::ios::binary);
  f.write(static_cast<const char*>(t.data_ptr()), n * 8);
}

TEST(DcpInterop, TorchTrainsOursResumesAndBack) {
  if (!python_has("torch.distributed.checkpoint")) GTEST_SKIP() << kPython << " has no torch";
  const fs::path d = fresh_dir("dcp");
  const auto args = small_llama(false);
  write_args(args, d / "args.json");
  const int64_t before = 3, after = 10, seq = 16, gb = 6;
  write_tokens(d / "tokens.bin", (before + after) * gb * (seq + 1), args.vocab_size, 7);
  const std::string lr = "0.002", wd = "0.1";

  // 1. PyTorch FSDP2 on 2 ranks: 3 steps, dcp.save (TorchTitan layout), the full tensors as a reference, 10 more.
  ASSERT_EQ(run(torchrun(2, "train-save --args " + (d / "args.json").string() + " --dir " + (d / "torch_dcp").string() +
                                " --ref " + (d / "torch_ref.safetensors").string() + " --tokens " +
                                (d / "tokens.bin").string() + " --losses " + (d / "torch_losses.json").string() +
                                " --local-batch 3 --seq 16 --steps-before 3 --steps-after 10 --lr " + lr +
                                " --weight-decay " + wd),
                d / "torch_train.log"),
            0);
  // 2. Ours on 3 ranks: load it, continue 10 steps, save (libfsdp and DCP).
  ASSERT_EQ(run(ours(3, "dcp-resume " + (d / "torch_dcp").string() + " " + (d / "args.json").string() + " " +
                            (d / "tokens.bin").string() + " 3 10 2 16 " + lr + " " + wd + " " + d.string()),
                d / "ours.log"),
            0);
  // Every tensor PyTorch saved, as ours loaded it on 3 ranks: bit for bit.
  const auto ref = st::load_file((d / "torch_ref.safetensors").string());
  ckpt::Reader loaded((d / "loaded").string());
  int compared = 0;
  for (const auto& [name, want] : ref) {
    at::Tensor got = loaded.read(name);
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".step") == 0) {
      EXPECT_EQ(got.item<double>(), want.item<double>()) << name;  // PyTorch: float step, ours: int64
    } else {
      EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
      EXPECT_TRUE(got.sizes() == want.sizes() && at::equal(got, want)) << name;
    }
    ++compared;
  }
  EXPECT_EQ(compared, 2 * 9 + 3 + 3 * (2 * 9 + 3));  // parameters + exp_avg, exp_avg_sq, step of each
  // Continued training equals PyTorch continuing from the same checkpoint.
  const auto theirs = nlohmann::json::parse(slurp(d / "torch_losses.json"))["after"].get<std::vector<double>>();
  const auto mine = nlohmann::json::parse(slurp(d / "ours_losses.json")).get<std::vector<double>>();
  ASSERT_EQ(theirs.size(), 10u);
  ASSERT_EQ(mine.size(), 10u);
  for (size_t i = 0; i < mine.size(); ++i) EXPECT_NEAR(mine[i], theirs[i], 1e-6 * theirs[i]) << "step " << i + 4;
  // Not vacuous: the optimizer moved the model (the losses change from step to step).
  EXPECT_GT(*std::max_element(theirs.begin(), theirs.end()) - *std::min_element(theirs.begin(), theirs.end()), 0.01);

  // 3. Ours -> PyTorch: the DCP ours saved on 3 ranks (SaveOptions::format) and the one `fsdp-ckpt convert
  //    --to dcp` makes of our libfsdp checkpoint, both loaded by PyTorch's dcp.load on 2 ranks; the reference
  //    is our libfsdp checkpoint as safetensors (fsdp-ckpt convert, no DCP involved).
  ASSERT_EQ(run(std::string(FSDP_CKPT) + " convert " + (d / "final").string() + " " + (d / "final_st").string(),
                d / "st.log"),
            0);
  ASSERT_EQ(run(std::string(FSDP_CKPT) + " convert " + (d / "final").string() + " " + (d / "final_conv").string() +
                    " --to dcp",
                d / "conv.log"),
            0);
  for (const char* which : {"final_dcp", "final_conv"}) {
    EXPECT_EQ(run(torchrun(2, "load-check --args " + (d / "args.json").string() + " --dir " + (d / which).string() +
                                  " --ref " + (d / "final_st" / "model.safetensors").string() + " --seed 5 --lr " + lr +
                                  " --weight-decay " + wd + " --expect-lr " + lr),
                  d / (std::string(which) + "_check.log")),
              0)
        << which;
  }
  // The converted directory keeps each rank's file; ours reads it back like the original.
  EXPECT_TRUE(fs::exists(d / "final_conv" / "__2_0.distcp"));
  EXPECT_TRUE(ckpt::verify((d / "final_conv").string()).empty());
  EXPECT_EQ(run(std::string(FSDP_CKPT) + " diff " + (d / "final").string() + " " + (d / "final_conv").string(),
                d / "diff.log"),
            0);
}

// ---- Hugging Face ---------------------------------------------------------------------------------------------

void expect_logits_equal(const fs::path& a, const fs::path& b) {
  at::Tensor x = st::load_file(a.string()).at("logits"), y = st::load_file(b.string()).at("logits");
  ASSERT_EQ(x.sizes(), y.sizes());
  const double diff = (x - y).abs().max().item<double>();
  EXPECT_LE(diff, 1e-5 * std::max(1.0, y.abs().max().item<double>())) << a << " vs " << b;
  EXPECT_GT(y.std().item<double>(), 0.05);  // not a degenerate model
  std::cout << "max |logits diff| " << diff << " (max |logit| " << y.abs().max().item<double>() << ")\n";
}

TEST(HfInterop, LogitsMatchTransformersBothWays) {
  if (!python_has("transformers")) GTEST_SKIP() << kPython << " has no transformers (scripts/setup.sh installs it)";
  const fs::path d = fresh_dir("hf");
  write_tokens(d / "tokens.bin", 2 * 16, 256, 11);
  const std::string tok = " " + (d / "tokens.bin").string() + " 2 16 ";
  // Hugging Face -> ours: save_pretrained (sharded + index) of a Llama 3.1-style config (RoPE scaling),
  // imported on 2 ranks (own rows only).
  write_args(small_llama(false, true), d / "args.json");
  ASSERT_EQ(run(python("hf-make --args " + (d / "args.json").string() + " --out " + (d / "hf_made").string() +
                       " --tokens " + (d / "tokens.bin").string() + " --logits " + (d / "hf_made_logits.st").string()),
                d / "make.log"),
            0);
  ASSERT_TRUE(fs::exists(d / "hf_made" / "model.safetensors.index.json"));
  ASSERT_EQ(run(ours(2, "hf-import " + (d / "args.json").string() + " " + (d / "hf_made").string() + tok +
                            (d / "ours_import_logits.st").string()),
                d / "import.log"),
            0);
  expect_logits_equal(d / "ours_import_logits.st", d / "hf_made_logits.st");
  // Ours -> Hugging Face: a tied-embeddings Llama 3.1-style model exported on 2 ranks (config.json carries the
  // scaling), loaded by from_pretrained.
  write_args(small_llama(true, true), d / "args_tied.json");
  ASSERT_EQ(run(ours(2, "hf-export " + (d / "args_tied.json").string() + " 3 " + (d / "hf_ours").string() + tok +
                            (d / "ours_export_logits.st").string()),
                d / "export.log"),
            0);
  ASSERT_TRUE(fs::exists(d / "hf_ours" / "model.safetensors.index.json"));
  ASSERT_EQ(run(python("hf-logits --dir " + (d / "hf_ours").string() + " --tokens " + (d / "tokens.bin").string() +
                       " --logits " + (d / "hf_ours_logits.st").string()),
                d / "logits.log"),
            0);
  expect_logits_equal(d / "ours_export_logits.st", d / "hf_ours_logits.st");
}

}  // namespace
