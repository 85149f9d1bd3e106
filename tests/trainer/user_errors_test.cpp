// The command-line tools on bad input (issue 40): one line naming what was wrong, the key or file and the rule;
// no C++ stack dump (libtorch's backtrace: "Exception raised from ...", "frame #N"); nothing written before
// the input is known good. The binaries run as a user would run them, in a scratch working directory.
#include <gtest/gtest.h>

#include "loopback_port.h"

#include <fsdp/checkpoint/safetensors.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct Outcome {
  int status;
  std::string output;  // stderr and stdout
};

// Runs `command` in `cwd` (a fresh folder) with a bounded time.
Outcome run_in(const fs::path& cwd, const std::string& command) {
  const fs::path log = cwd.parent_path() / (cwd.filename().string() + ".log");
  const std::string cmd = "cd '" + cwd.string() + "' && timeout 120 " + command + " > '" + log.string() + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream f(log);
  std::stringstream ss;
  ss << f.rdbuf();
  fs::remove(log);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, ss.str()};
}

struct Scratch {
  fs::path root;
  Scratch() : root(fs::temp_directory_path() / ("fsdp_user_errors_" + std::to_string(::getpid()))) {
    fs::remove_all(root);
    fs::create_directories(root);
  }
  ~Scratch() { fs::remove_all(root); }
  // An empty working directory for one run.
  fs::path cwd(const std::string& name) const {
    const fs::path p = root / name;
    fs::create_directories(p);
    return p;
  }
};

bool empty_dir(const fs::path& p) { return fs::is_empty(p); }

void expect_one_clean_line(const Outcome& r, int status, std::initializer_list<std::string> needles) {
  EXPECT_EQ(r.status, status) << r.output;
  for (const auto& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << "'" << n << "' not in: " << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << "a C++ stack dump: " << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("std::bad_alloc"), std::string::npos) << r.output;
}

}  // namespace

TEST(UserErrors, FsdpTrainConfigErrorsWriteNothing) {
  Scratch s;
  const std::string train = FSDP_TRAIN;
  {
    const auto cwd = s.cwd("config_dir");
    const auto dir = s.cwd("a_folder");
    const Outcome r = run_in(cwd, train + " --config '" + dir.string() + "'");
    expect_one_clean_line(r, 2, {"fsdp-train: config error: --config: '" + dir.string() + "' is a directory"});
    EXPECT_TRUE(empty_dir(cwd));
  }
  {
    const auto cwd = s.cwd("dev_zero");
    const Outcome r = run_in(cwd, train + " --config /dev/zero");
    expect_one_clean_line(r, 2, {"--config: '/dev/zero' is larger than the 16777216-byte limit"});
    EXPECT_TRUE(empty_dir(cwd));
  }
  {
    // model.name is checked against the model registry (not the config parser): still one line, nothing written.
    const auto cwd = s.cwd("unknown_model");
    const Outcome r = run_in(cwd, train + " --model.name gpt2 --job.dump_folder out");
    expect_one_clean_line(r, 2, {"model.name = \"gpt2\" is not a registered model family (llama3, qwen3, deepseek_v3)"});
    EXPECT_TRUE(empty_dir(cwd));
  }
  {
    // Before: ./metrics.jsonl in the working directory, then a filesystem error naming nothing.
    const auto cwd = s.cwd("empty_dump_folder");
    const Outcome r = run_in(cwd, train + " --job.dump_folder ''");
    expect_one_clean_line(r, 2, {"job.dump_folder: expected a folder"});
    EXPECT_TRUE(empty_dir(cwd)) << fs::directory_iterator(cwd)->path();
  }
  {
    // Before: std::bad_alloc.
    const auto cwd = s.cwd("huge_seq_len");
    const Outcome r = run_in(cwd, train + " --training.seq_len 1000000000000 --job.dump_folder out");
    expect_one_clean_line(r, 2, {"training.seq_len: expected <= 16777216 tokens, got 1000000000000"});
    const Outcome b = run_in(cwd, train + " --training.local_batch_size 100000000000 --job.dump_folder out");
    expect_one_clean_line(b, 2, {"training.local_batch_size x training.seq_len: expected <= 268435456 tokens"});
    EXPECT_TRUE(empty_dir(cwd));
  }
}

// Context parallelism (issue 38): a sequence length the cp layout cannot cut is one line naming the rule, before
// any rank is launched or anything written; so is an unknown rotate method or load balancer.
TEST(UserErrors, FsdpTrainContextParallelSeqLenNamesTheRule) {
  Scratch s;
  const std::string train = FSDP_TRAIN;
  const auto cwd = s.cwd("cp_seq_len");
  const Outcome r = run_in(cwd, train + " --model.flavor cpu_tiny --training.seq_len 30 "
                                        "--parallelism.context_parallel_degree 2 --job.dump_folder out");
  expect_one_clean_line(r, 2, {"training.seq_len (30) must be divisible by 2 x parallelism.context_parallel_degree = 4",
                               "headtail"});
  const Outcome none = run_in(cwd, train + " --model.flavor cpu_tiny --training.seq_len 30 "
                                           "--parallelism.context_parallel_degree 4 "
                                           "--parallelism.context_parallel_load_balancer none --job.dump_folder out");
  expect_one_clean_line(none, 2, {"training.seq_len (30) must be divisible by parallelism.context_parallel_degree = 4"});
  const Outcome method = run_in(cwd, train + " --parallelism.context_parallel_rotate_method ring --job.dump_folder out");
  expect_one_clean_line(method, 2, {"parallelism.context_parallel_rotate_method", "allgather", "alltoall"});
  EXPECT_TRUE(empty_dir(cwd));
}

// Every rule before any process group (issue 39): a layout the model family refuses — including the pipeline
// split (stages, schedule), which used to be cut only in parallelize, after the rendezvous — block_causal without
// an EOS, [fault_tolerance] without a coordinator and a missing data file are one line, before a process group.
// The proof: rank 0 of a 2-rank world launched alone, with no rank 1 and nothing listening. A check after
// init_process_group would wait there for its peer (comm.init_timeout_seconds = 30, then a rendezvous error
// instead of the line); the unfixed binary did so in every case here but "family" (checked before it already).
// The same configs under fsdprun on 2 ranks: the ranks print the line, fsdprun exits 2.
namespace {

struct RefusedLayout {
  const char* name;
  std::string args;
  std::string line;  // the one line fsdp-train prints
  int status = 2;    // 2: a ConfigError; 1: a missing input file
};

std::vector<RefusedLayout> refused_layouts(const fs::path& root) {
  // A Hugging Face tokenizer.json with no EOS token: byte-level BPE, the 256 byte symbols (GPT-2's byte alphabet:
  // printable Latin-1 bytes as themselves, the others as U+0100 + n in byte order), no merges, no added tokens.
  std::string vocab;
  for (int b = 0, shifted = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    char symbol[8];
    std::snprintf(symbol, sizeof symbol, "\\u%04X", printable ? b : 256 + shifted++);
    vocab += (b ? ", \"" : "\"") + std::string(symbol) + "\": " + std::to_string(b);
  }
  const fs::path no_eos = root / "no_eos_tokenizer.json";
  std::ofstream(no_eos) << R"({"added_tokens": [], "pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE", )"
                        << R"("merges": [], "vocab": {)" << vocab << "}}}";
  const std::string pp2 = " --model.flavor cpu_small --parallelism.pipeline_parallel_degree 2";
  return {
      {"fqns", pp2 + " --parallelism.module_fqns_per_model_part 'tok_embeddings,layers.0;layers.1,layers.2;layers.3,norm,output'",
       "config error: parallelism.module_fqns_per_model_part lists 3 stages, not a multiple of "
       "pipeline_parallel_degree = 2"},
      {"layers_per_stage", pp2 + " --parallelism.pipeline_parallel_layers_per_stage 2",
       "config error: parallelism.pipeline_parallel_layers_per_stage = 2 gives 3 stages for 4 layers, not a "
       "multiple of pipeline_parallel_degree = 2"},
      {"schedule", pp2 + " --parallelism.pipeline_parallel_schedule ZBVZeroBubble "
                         "--parallelism.pipeline_parallel_layers_per_stage 3",
       "config error: parallelism: ZBVZeroBubble requires exactly 2 stages per rank (the V), got 1"},
      {"family", " --model.flavor cpu_tiny --parallelism.expert_parallel_degree 2",
       "config error: parallelism.expert_parallel_degree = 2 but llama3 cpu_tiny has no MoE layers"},
      {"eos", " --model.flavor cpu_tiny --model.attn_mask_type block_causal --model.tokenizer_path '" +
                  no_eos.string() + "'",
       "config error: model.attn_mask_type = \"block_causal\" splits packed samples into documents at the "
       "tokenizer's EOS, but the tokenizer (BPE tokenizer.json " + no_eos.string() + " (vocab 256, 0 merges)) has "
       "no EOS token"},
      {"coordinator", " --model.flavor cpu_tiny --fault_tolerance.enable --fault_tolerance.group_size 2",
       "config error: fault_tolerance.enable needs the coordinator"},
      {"dataset", " --model.flavor cpu_tiny --training.dataset text --training.dataset_path '" +
                      (root / "no_such_corpus").string() + "'",
       "training.dataset_path: '" + (root / "no_such_corpus").string() + "' does not exist", 1},
      {"validation_dataset", " --model.flavor cpu_tiny --validation.enable --validation.dataset jsonl "
                             "--validation.dataset_path '" + no_eos.string() + "'",
       "validation.dataset_path: '" + no_eos.string() + "' is not a JSON Lines file", 1},
  };
}

}  // namespace

TEST(UserErrors, FsdpTrainRefusesLayoutsBeforeAnyProcessGroup) {
  Scratch s;
  for (const auto& c : refused_layouts(s.root)) {
    SCOPED_TRACE(c.name);
    const auto cwd = s.cwd(std::string("alone_") + c.name);
    const std::string env = "env -u FSDP_LIGHTHOUSE RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 "
                            "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(fsdp_test::free_loopback_port()) + " ";
    const auto t0 = std::chrono::steady_clock::now();
    const Outcome r = run_in(cwd, env + FSDP_TRAIN + c.args + " --comm.init_timeout_seconds 30 --job.dump_folder out");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    expect_one_clean_line(r, c.status, {"fsdp-train: " + c.line});
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_LT(seconds, 30) << "waited for a rendezvous: " << r.output;
    EXPECT_TRUE(empty_dir(cwd));
  }
}

#ifdef FSDPRUN
TEST(UserErrors, FsdpTrainRefusesLayoutsBeforeAnyProcessGroupUnderFsdprun) {
  Scratch s;
  for (const auto& c : refused_layouts(s.root)) {
    if (std::string(c.name) != "fqns" && std::string(c.name) != "coordinator") continue;  // one of each kind
    SCOPED_TRACE(c.name);
    const auto cwd = s.cwd(std::string("fsdprun_") + c.name);
    const Outcome r = run_in(cwd, std::string("env -u FSDP_LIGHTHOUSE ") + FSDPRUN + " --nproc-per-node 2 --timeout 100 " +
                                      FSDP_TRAIN + c.args + " --comm.init_timeout_seconds 30 --job.dump_folder out");
    expect_one_clean_line(r, c.status, {"fsdp-train: " + c.line});
    // Each rank that reached its check printed the line (fsdprun may stop the other first, as torchrun does).
    EXPECT_NE(r.output.find("] fsdp-train: " + c.line), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("rendezvous"), std::string::npos) << r.output;
    EXPECT_TRUE(empty_dir(cwd));
  }
}
#endif

TEST(UserErrors, FsdpTrainLibraryErrorsCarryNoStackDump) {
  // A Hugging Face config.json of 100 MB (sparse): refused by the library's size check (a TORCH_CHECK whose
  // message wraps another c10::Error's) — the message used to be followed by a 12-frame C++ stack dump.
  Scratch s;
  const auto hf = s.cwd("hf");
  { std::ofstream(hf / "config.json") << "{"; }
  fs::resize_file(hf / "config.json", 100 << 20);
  const auto cwd = s.cwd("run");
  const Outcome r = run_in(cwd, std::string(FSDP_TRAIN) +
                                " --model.flavor cpu_tiny --training.steps 1 --training.seq_len 16 "
                                "--metrics.peak_tflops 1 --checkpoint.enable --checkpoint.initial_load_in_hf "
                                "--checkpoint.initial_load_path '" + hf.string() + "' --job.dump_folder out");
  expect_one_clean_line(r, 1, {"config.json"});
  // The error is the last line: no backtrace lines follow it.
  std::string last = r.output;
  while (!last.empty() && last.back() == '\n') last.pop_back();
  last = last.substr(last.rfind('\n') + 1);
  EXPECT_EQ(last.rfind("fsdp-train: ", 0), 0u) << r.output;
  EXPECT_NE(last.find("config.json"), std::string::npos) << r.output;
  // TORCH_SHOW_CPP_STACKTRACES=1 (PyTorch's switch) brings the stack back for whoever debugs.
  const Outcome debug = run_in(s.cwd("run_debug"), "env TORCH_SHOW_CPP_STACKTRACES=1 " + std::string(FSDP_TRAIN) +
                                                   " --model.flavor cpu_tiny --training.steps 1 --training.seq_len 16 "
                                                   "--metrics.peak_tflops 1 --checkpoint.enable "
                                                   "--checkpoint.initial_load_in_hf --checkpoint.initial_load_path '" +
                                                   hf.string() + "' --job.dump_folder out");
  EXPECT_EQ(debug.status, 1);
  EXPECT_NE(debug.output.find("frame #"), std::string::npos) << debug.output;
}

#ifdef FSDP_PLAN
TEST(UserErrors, FsdpPlanBadReshardNamesTheOption) {
  Scratch s;
  const Outcome r = run_in(s.cwd("plan"), std::string(FSDP_PLAN) + " --flavor cpu_tiny --reshard abc");
  expect_one_clean_line(r, 1, {"fsdp-plan: --reshard: expected true, false or a number of ranks, got 'abc'"});
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
}
#endif

#ifdef FSDP_LIGHTHOUSE
// Found by the store_wire fuzzer: a client that sends commands and closes before reading the replies made the
// store's server write() to a closed socket; SIGPIPE killed fsdp-lighthouse silently (the unfixed binary died
// within 2-33 rounds of these 7 connections; checked against it when this test was written).
TEST(UserErrors, FsdpLighthouseSurvivesClientsThatLeaveBeforeTheirReply) {
  Scratch s;
  const fs::path out = s.root / "lighthouse.out";
  const std::string cmd = std::string(FSDP_LIGHTHOUSE) + " --port 0 > '" + out.string() + "' 2>&1 & echo $!";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  long pid = 0;
  ASSERT_EQ(std::fscanf(p, "%ld", &pid), 1);
  ::pclose(p);
  struct Stop {  // whatever the test's outcome, no lighthouse is left behind
    long pid;
    ~Stop() {
      ::kill(static_cast<pid_t>(pid), SIGKILL);
    }
  } stop{pid};
  int port = 0;
  for (int i = 0; i < 200 && port == 0; ++i) {  // "fsdp-lighthouse: serving on HOST:PORT"
    std::ifstream f(out);
    std::string line;
    if (std::getline(f, line) && line.rfind("fsdp-lighthouse: serving on ", 0) == 0) port = std::stoi(line.substr(line.rfind(':') + 1));
    else ::usleep(50000);
  }
  ASSERT_GT(port, 0) << "the lighthouse did not start";
  auto le64 = [](uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); };
  auto key = [&](const std::string& k) { return le64(k.size()) + k; };
  const uint32_t magic = 0x3C85F7CE, nonce = 7;
  const std::string validate = std::string(1, '\0') + std::string(reinterpret_cast<const char*>(&magic), 4);
  const std::string ping = std::string(1, '\x0d') + std::string(reinterpret_cast<const char*>(&nonce), 4);
  std::string many_pings;
  for (int i = 0; i < 3000; ++i) many_pings += ping;
  // PING, 3000 PINGs, GET of a missing key, SET + GET, WAIT on a missing key, GETNUMKEYS, LIST_KEYS.
  const std::string streams[] = {validate + ping,
                                 validate + many_pings,
                                 validate + "\x03" + key("nokey"),
                                 validate + "\x01" + key("k") + key("v") + "\x03" + key("k"),
                                 validate + "\x06" + le64(1) + key("never"),
                                 validate + "\x07",
                                 validate + "\x11"};
  for (int round = 0; round < 60; ++round) {
    for (const auto& bytes : streams) {
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(port));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0)
          << "round " << round << ": the lighthouse no longer accepts connections";
      (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      ::shutdown(fd, SHUT_WR);
      ::close(fd);  // gone before any reply
      ::usleep(2000);  // the server's replies race the close; a little time lets them meet a closed socket
    }
  }
  ::usleep(300000);
  EXPECT_EQ(::kill(static_cast<pid_t>(pid), 0), 0) << "fsdp-lighthouse died";
  ::kill(static_cast<pid_t>(pid), SIGTERM);
  for (int i = 0; i < 100 && ::kill(static_cast<pid_t>(pid), 0) == 0; ++i) ::usleep(50000);
}
#endif

// DeepSeek-V3 (issue 37, a new user's audit): its config errors are one line each, exit 2, before any process
// group and before anything is written — the MoE keys included, which the MoE layer used to refuse only when the
// model was built, after the rendezvous (exit 1, "moe: num_expert_groups ...", no key named). As above: rank 0 of
// a world launched alone, nothing listening on its port.
TEST(UserErrors, FsdpTrainDeepSeekV3ConfigErrorsBeforeAnyProcessGroup) {
  Scratch s;
  struct Case {
    const char* name;
    int world;
    std::string args, line;
  };
  const std::string ds = " --model.name deepseek_v3 --model.flavor cpu_tiny";
  const std::vector<Case> cases = {
      {"flavor", 2, " --model.name deepseek_v3 --model.flavor cpu_huge",
       "config error: model.flavor: unknown deepseek_v3 flavor 'cpu_huge' (known: cpu_tiny, debugmodel, 16B, "
       "236B, 671B)"},
      {"tp_heads", 3, ds + " --parallelism.tensor_parallel_degree 3 --training.seq_len 126 --validation.enable false",
       "config error: parallelism.tensor_parallel_degree = 3 does not divide the 4 attention heads of deepseek_v3 "
       "cpu_tiny"},
      {"ep_experts", 3, ds + " --parallelism.expert_parallel_degree 3 --training.global_batch_size 24",
       "config error: parallelism.expert_parallel_degree = 3 does not divide the 8 experts of deepseek_v3 cpu_tiny"},
      {"groups", 2, ds + " --model.moe_num_expert_groups 3",
       "config error: model.moe_num_expert_groups = 3 must divide the 8 routed experts into groups of at least 2 "
       "experts"},
      {"limited", 2, ds + " --model.moe_num_expert_groups 4 --model.moe_num_limited_groups 5",
       "config error: model.moe_num_limited_groups = 5 must be in [1, model.moe_num_expert_groups = 4]"},
      {"limited_alone", 2, ds + " --model.moe_num_limited_groups 2",
       "config error: model.moe_num_limited_groups = 2 needs model.moe_num_expert_groups"},
      {"groups_negative", 2, ds + " --model.moe_num_expert_groups -2",
       "config error: model.moe_num_expert_groups: expected >= 0 (0 = no group-limited routing), got -2"},
      {"route_scale", 2, ds + " --model.moe_route_scale -1",
       "config error: model.moe_route_scale: expected > 0 (or 0 = the flavor's), got -1.0"},
      {"balance_coeff", 2, ds + " --model.moe_load_balance_coeff -5",
       "config error: model.moe_load_balance_coeff: expected >= 0 (0 = off) or -1 = the flavor's, got -5.0"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto cwd = s.cwd(std::string("ds_") + c.name);
    const std::string w = std::to_string(c.world);
    const std::string env = "env -u FSDP_LIGHTHOUSE RANK=0 LOCAL_RANK=0 WORLD_SIZE=" + w + " LOCAL_WORLD_SIZE=" + w +
                            " MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                            std::to_string(fsdp_test::free_loopback_port()) + " ";
    const auto t0 = std::chrono::steady_clock::now();
    const Outcome r = run_in(cwd, env + FSDP_TRAIN + c.args + " --comm.init_timeout_seconds 30 --job.dump_folder out");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    expect_one_clean_line(r, 2, {"fsdp-train: " + c.line});
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_LT(seconds, 30) << "waited for a rendezvous: " << r.output;
    EXPECT_TRUE(empty_dir(cwd));
  }
}

// DeepSeek-V3's Hugging Face import (checkpoint.initial_load_in_hf) on hostile files, on 1 rank (the whole-model
// path) and on 2 (the sharded path: each rank reads its own rows): a malformed config.json (wrong type, missing
// key, odd RoPE head dim, n_group not dividing the experts, topk_group > n_group, a negative kv_lora_rank), a
// safetensors file truncated or whose header points past its data, a tensor of the wrong shape or of an integer
// dtype, an expert tensor missing or of the wrong shape in the hub's per-expert layout. Each is one line naming
// the file, the field or tensor and the rule, exit 1, and the job writes nothing (its dump folder is not created:
// the files are read and checked before config.toml and metrics.jsonl). The untouched export, in both layouts,
// loads (so the refusals are the edits'). Before: config.toml and metrics.jsonl were written first; an int32 weight
// was converted silently; a per-expert tensor of the wrong shape gave at::stack's message naming no file.
namespace {

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_bytes(const fs::path& p, const std::string& bytes) { std::ofstream(p, std::ios::binary) << bytes; }

// A safetensors file's header (the JSON after the 8-byte length) and its data section.
struct SafetensorsBytes {
  nlohmann::json header;
  std::string data;
  explicit SafetensorsBytes(const fs::path& p) {
    const std::string b = read_bytes(p);
    uint64_t n = 0;
    std::memcpy(&n, b.data(), 8);
    header = nlohmann::json::parse(b.substr(8, n));
    data = b.substr(8 + n);
  }
  void write(const fs::path& p) const {
    std::string h = header.dump();
    h.append((8 - h.size() % 8) % 8, ' ');
    const uint64_t n = h.size();
    write_bytes(p, std::string(reinterpret_cast<const char*>(&n), 8) + h + data);
  }
};

}  // namespace

TEST(UserErrors, FsdpTrainDeepSeekV3BadHuggingFaceFilesAreOneLineAndWriteNothing) {
  namespace st = fsdp::checkpoint::safetensors;
  Scratch s;
  const std::string job = " --model.name deepseek_v3 --model.flavor cpu_tiny --training.seq_len 16 "
                          "--training.local_batch_size 2 --training.global_batch_size 4 --training.steps 1 "
                          "--validation.enable false --metrics.peak_tflops 1 --checkpoint.enable";
  // The export every case edits: a 1-step job's Hugging Face last save (config.json + model.safetensors).
  const Outcome made =
      run_in(s.cwd("export"), FSDP_TRAIN + job + " --checkpoint.last_save_in_hf --job.dump_folder out");
  ASSERT_EQ(made.status, 0) << made.output;
  const fs::path good = s.root / "export" / "out" / "checkpoint" / "step-1";
  ASSERT_TRUE(fs::exists(good / "model.safetensors")) << made.output;
  const nlohmann::json config = nlohmann::json::parse(read_bytes(good / "config.json"));

  // A folder holding `tensors` (as given) and `cfg`.
  auto folder = [&](const std::string& name, const nlohmann::json& cfg) {
    const fs::path d = s.root / "hf" / name;
    fs::create_directories(d);
    write_bytes(d / "config.json", cfg.dump(1));
    return d;
  };
  auto with_config = [&](const std::string& name, const std::string& field, const nlohmann::json& value) {
    nlohmann::json c = config;
    if (value.is_discarded()) c.erase(field);
    else c[field] = value;
    const fs::path d = folder(name, c);
    fs::copy_file(good / "model.safetensors", d / "model.safetensors");
    return d;
  };
  auto with_tensors = [&](const std::string& name, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
    const fs::path d = folder(name, config);
    st::save_file((d / "model.safetensors").string(), tensors);
    return d;
  };
  const std::map<std::string, at::Tensor> weights = st::load_file((good / "model.safetensors").string());
  auto edited = [&](const std::map<std::string, at::Tensor>& base, const std::string& key, const at::Tensor& t) {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& [k, v] : base) {
      if (k != key) out.emplace_back(k, v);
      else if (t.defined()) out.emplace_back(k, t);
    }
    return out;
  };
  // The hub's per-expert layout of the same weights (what save_pretrained writes).
  std::map<std::string, at::Tensor> per_expert;
  for (const auto& [k, v] : weights) {
    const auto stacked = k.find("mlp.experts.");
    if (stacked == std::string::npos) {
      per_expert.emplace(k, v);
      continue;
    }
    const std::string prefix = k.substr(0, stacked + 12);
    for (int64_t j = 0; j < v.size(0); ++j) {
      const std::string p = prefix + std::to_string(j) + ".";
      if (k.size() > 12 && k.compare(k.size() - 12, 12, "gate_up_proj") == 0) {
        const int64_t F = v.size(1) / 2;
        per_expert.emplace(p + "gate_proj.weight", v[j].narrow(0, 0, F).clone());
        per_expert.emplace(p + "up_proj.weight", v[j].narrow(0, F, F).clone());
      } else {
        per_expert.emplace(p + "down_proj.weight", v[j].clone());
      }
    }
  }
  const std::string up5 = "model.layers.2.mlp.experts.5.up_proj.weight";
  ASSERT_TRUE(per_expert.count(up5)) << "the per-expert layout was not built";

  struct Case {
    std::string name;
    fs::path dir;
    std::vector<std::string> needles;  // besides the folder's path
    std::vector<std::string> sharded;  // on 2 ranks, when their words differ (else `needles`)
  };
  const std::string gate = "model.layers.1.mlp.gate.weight", kv_b = "model.layers.0.self_attn.kv_b_proj.weight";
  std::vector<Case> cases = {
      {"hidden_size_string", with_config("hidden_size_string", "hidden_size", "64"),
       {"config.json: field 'hidden_size' must be an integer, got a string \"64\""}},
      {"vocab_size_missing",
       with_config("vocab_size_missing", "vocab_size", nlohmann::json(nlohmann::json::value_t::discarded)),
       {"config.json: field 'vocab_size' is missing"}},
      {"rope_head_dim_odd", with_config("rope_head_dim_odd", "qk_rope_head_dim", 7),
       {"config.json: field 'qk_rope_head_dim' must be even"}},
      {"n_group", with_config("n_group", "n_group", 3),
       {"config.json: field 'n_group' = 3 must divide n_routed_experts = 8 into groups of at least 2 experts"}},
      {"topk_group", with_config("topk_group", "topk_group", 5),
       {"config.json: field 'topk_group' = 5 exceeds n_group"}},
      {"kv_lora_rank", with_config("kv_lora_rank", "kv_lora_rank", -32),
       {"config.json: field 'kv_lora_rank' = -32 must be positive"}},
      {"wrong_shape", with_tensors("wrong_shape", edited(weights, kv_b, weights.at(kv_b).t().contiguous())),
       {"'" + kv_b + "' in ",
        "model.safetensors has shape [32, 128] but the model's 'layers.0.attention.wkv_b.weight' is [128, 32]"}},
      {"int_dtype", with_tensors("int_dtype", edited(weights, gate, weights.at(gate).to(at::kInt))),
       {"'" + gate + "' in ",
        "model.safetensors has dtype Int but the model's 'layers.1.moe.router.gate.weight' is Float"}},
      {"expert_missing", with_tensors("expert_missing", edited(per_expert, up5, at::Tensor())),
       {"'" + up5 + "' (expert 5 of 8 for 'layers.2.moe.experts') is missing"},
       {"Missing from the files: ['" + up5 + "']"}},
      {"expert_wrong_shape",
       with_tensors("expert_wrong_shape", edited(per_expert, up5, per_expert.at(up5).narrow(0, 0, 16).clone())),
       {"'" + up5 + "' in ", "model.safetensors has shape [16, 64] but is", "expected [32, 64]"}},
  };
  {
    const fs::path d = with_config("truncated", "model_type", config["model_type"]);  // config.json as exported
    const std::string b = read_bytes(d / "model.safetensors");
    write_bytes(d / "model.safetensors", b.substr(0, b.size() / 2));
    cases.push_back({"truncated", d, {"model.safetensors: tensor '", "outside the", "data section"}});
  }
  {
    const fs::path d = with_config("offsets_past_end", "model_type", config["model_type"]);
    SafetensorsBytes f(d / "model.safetensors");
    const int64_t end = static_cast<int64_t>(f.data.size());
    f.header["model.norm.weight"]["data_offsets"] = {end - 100, end + 156};
    f.write(d / "model.safetensors");
    cases.push_back(
        {"offsets_past_end", d, {"model.safetensors: tensor 'model.norm.weight': data_offsets", "outside the"}});
  }
  // The untouched export loads, in both layouts (the cases' refusals are their edits').
  const fs::path stacked_ok = with_tensors("stacked_ok", edited(weights, "", at::Tensor()));
  const fs::path per_expert_ok = with_tensors("per_expert_ok", edited(per_expert, "", at::Tensor()));
  for (const int nproc : {1, 2}) {
    const std::string launch = nproc == 1 ? std::string(FSDP_TRAIN)
                                          : std::string("env -u FSDP_LIGHTHOUSE ") + FSDPRUN +
                                                " --nproc-per-node 2 --timeout 100 " + FSDP_TRAIN;
    for (const fs::path& ok : {stacked_ok, per_expert_ok}) {
      const Outcome r = run_in(s.cwd("ok_" + std::to_string(nproc) + ok.filename().string()),
                               launch + job + " --checkpoint.initial_load_in_hf --checkpoint.initial_load_path '" +
                                   ok.string() + "' --job.dump_folder out");
      EXPECT_EQ(r.status, 0) << r.output;
      EXPECT_NE(r.output.find("checkpoint: loaded Hugging Face weights " + ok.string()), std::string::npos) << r.output;
    }
    for (const auto& c : cases) {
      SCOPED_TRACE(c.name + " on " + std::to_string(nproc) + " rank(s)");
      const auto cwd = s.cwd("bad_" + std::to_string(nproc) + "_" + c.name);
      const Outcome r = run_in(cwd, launch + job + " --checkpoint.initial_load_in_hf --checkpoint.initial_load_path '" +
                                        c.dir.string() + "' --job.dump_folder out");
      EXPECT_EQ(r.status, 1) << r.output;
      for (const auto& n : nproc == 2 && !c.sharded.empty() ? c.sharded : c.needles)
        EXPECT_NE(r.output.find(n), std::string::npos) << "'" << n << "' not in: " << r.output;
      EXPECT_NE(r.output.find(c.dir.string()), std::string::npos) << "the file is not named: " << r.output;
      EXPECT_EQ(r.output.find("frame #"), std::string::npos) << "a C++ stack dump: " << r.output;
      EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
      // One line per rank (fsdprun adds its own line naming the rank that exited).
      const auto errors = std::count(r.output.begin(), r.output.end(), '\n') - (nproc == 2 ? 1 : 0);
      EXPECT_LE(errors, nproc) << r.output;
      EXPECT_TRUE(empty_dir(cwd)) << "written before the input was known good: " << fs::directory_iterator(cwd)->path();
    }
  }
}

// --print-config names a flavor the model family does not have, as the run would: `--model.name deepseek_v3`
// alone printed llama3's default flavor (cpu_small) with exit 0, and the run with that config was then refused.
TEST(UserErrors, FsdpTrainPrintConfigRefusesAFlavorTheFamilyLacks) {
  Scratch s;
  const auto cwd = s.cwd("print_config");
  const Outcome bad = run_in(cwd, std::string(FSDP_TRAIN) + " --model.name deepseek_v3 --print-config");
  expect_one_clean_line(bad, 2, {"fsdp-train: config error: model.flavor: unknown deepseek_v3 flavor 'cpu_small' "
                                 "(known: cpu_tiny, debugmodel, 16B, 236B, 671B)"});
  EXPECT_EQ(std::count(bad.output.begin(), bad.output.end(), '\n'), 1) << bad.output;
  const Outcome run = run_in(cwd, std::string(FSDP_TRAIN) + " --model.name deepseek_v3 --job.dump_folder out");
  EXPECT_NE(run.output.find("model.flavor: unknown deepseek_v3 flavor 'cpu_small'"), std::string::npos)
      << "the run's words differ: " << run.output;
  const Outcome family = run_in(cwd, std::string(FSDP_TRAIN) + " --model.name gpt2 --print-config");
  expect_one_clean_line(family, 2, {"model.name = \"gpt2\" is not a registered model family"});
  const Outcome good =
      run_in(cwd, std::string(FSDP_TRAIN) + " --model.name deepseek_v3 --model.flavor cpu_tiny --print-config");
  EXPECT_EQ(good.status, 0) << good.output;
  EXPECT_NE(good.output.find("name = \"deepseek_v3\"\nflavor = \"cpu_tiny\""), std::string::npos) << good.output;
  EXPECT_TRUE(empty_dir(cwd));
}
