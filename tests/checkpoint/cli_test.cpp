// fsdp-ckpt: inspect, verify, convert (one file and sharded with an index) and diff on checkpoints saved here.
#include "comm/dist_env.h"

#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/device_mesh.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;
namespace ckpt = fsdp::checkpoint;
namespace st = fsdp::checkpoint::safetensors;

namespace {

struct Run {
  int status;
  std::string output;
};
Run run(const std::string& args, const fs::path& dir) {
  const fs::path log = dir / "cli.log";
  const std::string cmd = std::string(FSDP_CKPT) + " " + args + " > " + log.string() + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream f(log);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WEXITSTATUS(rc), ss.str()};
}

std::map<std::string, torch::Tensor> sample_tensors(uint64_t seed) {
  torch::manual_seed(seed);
  return {{"layers.0.w", torch::randn({40, 30})},
          {"layers.1.w", torch::randn({40, 30})},
          {"norm.weight", torch::randn({30})},
          {"optimizer.state.norm.weight.exp_avg", torch::randn({30})}};
}

std::string save(const fs::path& dir, const std::string& name, const std::map<std::string, torch::Tensor>& tensors) {
  fsdp_test::test_world();
  auto mesh = fsdp::init_device_mesh("cpu", {1}, {"shard"});
  ckpt::StateDict sd;
  for (const auto& [k, t] : tensors) {
    sd.tensors[k] = fsdp::ShardedTensor::from_local(t, mesh, {fsdp::Shard(0)}, t.sizes().vec());
  }
  sd.values["train_state.step"] = "12";
  const std::string path = (dir / name).string();
  ckpt::save(sd, path);
  return path;
}

}  // namespace

TEST(FsdpCkpt, InspectVerifyConvertDiff) {
  const fs::path dir = fs::temp_directory_path() / ("fsdp_ckpt_cli_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto tensors = sample_tensors(1);
  const std::string a = save(dir, "a", tensors);

  auto r = run("inspect " + a, dir);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("train_state.step = 12"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("layers.0.w"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[40, 30]"), std::string::npos) << r.output;

  r = run("verify " + a, dir);
  EXPECT_EQ(r.status, 0) << r.output;

  // One file.
  r = run("convert " + a + " " + (dir / "st1").string(), dir);
  ASSERT_EQ(r.status, 0) << r.output;
  auto one = st::load_file((dir / "st1" / "model.safetensors").string());
  ASSERT_EQ(one.size(), tensors.size());
  for (const auto& [k, t] : tensors) EXPECT_TRUE(torch::equal(one.at(k), t)) << k;

  // Sharded with an index, model only, bf16.
  r = run("convert " + a + " " + (dir / "st2").string() + " --max-shard-size 3kB --model-only --dtype bf16", dir);
  ASSERT_EQ(r.status, 0) << r.output;
  auto index = st::read_index((dir / "st2" / "model.safetensors.index.json").string());
  EXPECT_EQ(index.size(), 3u);
  EXPECT_FALSE(index.count("optimizer.state.norm.weight.exp_avg"));
  std::set<std::string> files;
  for (const auto& [k, f] : index) {
    files.insert(f);
    st::Reader reader((dir / "st2" / f).string());
    EXPECT_TRUE(torch::equal(reader.read(k), tensors.at(k).to(torch::kBFloat16))) << k;
  }
  EXPECT_GE(files.size(), 2u);

  // diff: identical, then one tensor changed.
  r = run("diff " + a + " " + a, dir);
  EXPECT_EQ(r.status, 0) << r.output;
  auto changed = tensors;
  changed["norm.weight"] = tensors.at("norm.weight") + 0.5;
  const std::string b = save(dir, "b", changed);
  r = run("diff " + a + " " + b, dir);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("* norm.weight"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("5.000e-01"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1 entries differ"), std::string::npos) << r.output;

  // verify finds a corrupted byte and names the tensor.
  {
    std::fstream f(fs::path(b) / "rank-00000.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  r = run("verify " + b, dir);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("checksum mismatch"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// Issue 40: bad option values get one line naming the option (std::stod used to answer "stod"), nothing is
// written before the input is known good, and no error carries libtorch's C++ backtrace.
TEST(FsdpCkpt, BadOptionValuesGetOneLineNamingTheOption) {
  const fs::path dir = fs::temp_directory_path() / ("fsdp_ckpt_cli_bad_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path out = dir / "out";
  auto expect_refused = [&](const std::string& args, const std::string& needle) {
    const auto r = run(args, dir);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << "'" << needle << "' not in: " << r.output;
    EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "not one line: " << r.output;
    EXPECT_FALSE(fs::exists(out)) << args << " wrote " << out;
  };
  const std::string convert = "convert " + (dir / "ckpt").string() + " " + out.string() + " --max-shard-size ";
  expect_refused(convert + "abc", "fsdp-ckpt: --max-shard-size: not a number, got 'abc' (expected a positive size");
  expect_refused(convert + "5XB", "--max-shard-size: unknown unit 'XB', got '5XB'");
  expect_refused(convert + "0", "--max-shard-size: must be at least 1 byte, got '0'");
  expect_refused(convert + "-5GB", "--max-shard-size: not a number, got '-5GB'");
  expect_refused(convert + "1.2.3MB", "--max-shard-size: not a number");
  expect_refused(convert + "99999999999999999999GB", "--max-shard-size: too large");
  // A TORCH_CHECK inside the library (no such checkpoint): its message, without the C++ stack.
  expect_refused("inspect " + (dir / "missing").string(), (dir / "missing").string());
  fs::remove_all(dir);
}
