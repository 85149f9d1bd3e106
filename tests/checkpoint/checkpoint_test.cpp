// Distributed checkpoint format on one process: round trip of every entry kind, atomic replacement, purge,
// resharding arithmetic, and one test per class of bad input (missing, truncated or altered files, mangled or
// hostile metadata, keys and shapes that do not match). Every failure must be a clear error naming the tensor
// and/or file — never a crash, an out-of-bounds read or a silently wrong tensor.
#include "comm/dist_env.h"

#include <fsdp/checkpoint/async_save.h>
#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/device_mesh.h>

#include "checkpoint/format.h"
#include "checkpoint/planning.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <future>

namespace fs = std::filesystem;
namespace ckpt = fsdp::checkpoint;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("fsdp_ckpt_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR_HAS(msg, ...)                                                   \
  do {                                                                               \
    const std::string _m = (msg);                                                    \
    EXPECT_FALSE(_m.empty()) << "no error";                                          \
    for (const char* _s : {__VA_ARGS__}) EXPECT_NE(_m.find(_s), std::string::npos) << "'" << _s << "' not in: " << _m; \
  } while (0)

// A small state: a sharded 2-D tensor on a 1-rank mesh, whole tensors of several dtypes, a scalar, values.
struct Sample {
  ckpt::StateDict sd;
  Sample(uint64_t seed) {
    fsdp_test::test_world();
    auto mesh = fsdp::init_device_mesh("cpu", {1}, {"shard"});
    torch::manual_seed(seed);
    sd.tensors["w"] = fsdp::ShardedTensor::from_local(torch::randn({37, 11}), mesh, {fsdp::Shard(0)}, {37, 11});
    sd.full["b"] = torch::randn({300}).to(torch::kBFloat16);
    sd.full["ids"] = torch::randint(0, 1000, {5, 2}, torch::kLong);
    sd.full["step"] = torch::scalar_tensor(static_cast<int64_t>(seed), torch::kLong);
    sd.full["empty"] = torch::empty({0, 4});
    sd.values["lr"] = "0.001";
    sd.values["betas"] = "[0.9, 0.95]";
  }
  // The same keys and shapes, other values.
  static ckpt::StateDict blank_like(const ckpt::StateDict& src) {
    ckpt::StateDict out;
    for (const auto& [k, t] : src.tensors)
      out.tensors[k] = fsdp::ShardedTensor::from_local(torch::zeros_like(t.local()), t.mesh(), t.placements(), t.sizes());
    for (const auto& [k, t] : src.full) out.full[k] = torch::zeros_like(t);
    for (const auto& [k, v] : src.values) out.values[k] = "null";
    return out;
  }
};

std::string save_sample(const fs::path& dir, uint64_t seed = 1, int64_t block_bytes = 128) {
  Sample s(seed);
  ckpt::SaveOptions o;
  o.block_bytes = block_bytes;
  const std::string path = (dir / "step-1").string();
  ckpt::save(s.sd, path, o);
  return path;
}

nlohmann::json read_md(const std::string& path) {
  std::ifstream f(fs::path(path) / "metadata.json");
  return nlohmann::json::parse(f);
}
void write_md(const std::string& path, const nlohmann::json& j) { std::ofstream(fs::path(path) / "metadata.json") << j.dump(); }

std::string load_error(const std::string& path) {
  Sample s(1);
  auto blank = Sample::blank_like(s.sd);
  return error_of([&] { ckpt::load(blank, path); });
}

}  // namespace

TEST(Checkpoint, SaveLoadEveryEntryKind) {
  const auto dir = fresh_dir("roundtrip");
  const std::string path = save_sample(dir, 7);
  EXPECT_FALSE(fs::exists(path + ".partial"));
  Sample ref(7);
  auto got = Sample::blank_like(ref.sd);
  ASSERT_FALSE(torch::equal(got.tensors.at("w").local(), ref.sd.tensors.at("w").local()));  // non-trivial
  auto res = ckpt::load(got, path);
  EXPECT_TRUE(res.missing.empty() && res.unexpected.empty());
  EXPECT_TRUE(torch::equal(got.tensors.at("w").local(), ref.sd.tensors.at("w").local()));
  for (const auto& [k, t] : ref.sd.full) EXPECT_TRUE(torch::equal(got.full.at(k), t)) << k;
  EXPECT_EQ(got.values.at("lr"), "0.001");
  EXPECT_EQ(nlohmann::json::parse(got.values.at("betas")), nlohmann::json::parse("[0.9, 0.95]"));
  EXPECT_EQ(ckpt::verify(path), std::vector<std::string>{});
  EXPECT_TRUE(torch::equal(ckpt::read_tensor(path, "b"), ref.sd.full.at("b")));
  auto md = read_md(path);
  EXPECT_EQ(md["format"], "libfsdp-checkpoint");
  EXPECT_EQ(md["version"], 1);
  fs::remove_all(dir);
}

// Reader::read_rows of rows that start past the first checksum blocks, aligned to a block (the direct read
// path), and unaligned: the rows equal the saved tensor's, read from a single-piece plan.
TEST(Checkpoint, ReaderReadsRowsPastTheFirstBlocks) {
  const auto dir = fresh_dir("read_rows");
  fsdp_test::test_world();
  auto mesh = fsdp::init_device_mesh("cpu", {1}, {"shard"});
  const at::Tensor w = torch::arange(64 * 32, torch::kFloat).reshape({64, 32});  // 128-byte rows
  ckpt::StateDict sd;
  sd.tensors["w"] = fsdp::ShardedTensor::from_local(w.clone(), mesh, {fsdp::Shard(0)}, {64, 32});
  ckpt::SaveOptions o;
  o.block_bytes = 256;  // two rows a block
  const std::string path = (dir / "step-1").string();
  ckpt::save(sd, path, o);
  ckpt::Reader r(path);
  EXPECT_TRUE(torch::equal(r.read_rows("w", 8, 8), w.narrow(0, 8, 8)));    // bytes [1024, 2048): whole blocks
  EXPECT_TRUE(torch::equal(r.read_rows("w", 33, 5), w.narrow(0, 33, 5)));  // starts mid-block
  EXPECT_TRUE(torch::equal(r.read_rows("w", 62, 2), w.narrow(0, 62, 2)));  // the last block
  fs::remove_all(dir);
}

TEST(Checkpoint, LoadCastsToTheDestinationDtype) {
  const auto dir = fresh_dir("cast");
  const std::string path = save_sample(dir, 3);
  Sample ref(3);
  auto got = Sample::blank_like(ref.sd);
  got.full["b"] = torch::zeros({300}, torch::kFloat);
  ckpt::load(got, path);
  EXPECT_TRUE(torch::equal(got.full.at("b"), ref.sd.full.at("b").to(torch::kFloat)));
  fs::remove_all(dir);
}

TEST(Checkpoint, ReplacingACheckpointIsAtomicAndAFailedSaveKeepsTheOldOne) {
  const auto dir = fresh_dir("replace");
  save_sample(dir, 1);
  const std::string path = save_sample(dir, 2);  // same path: swapped in with one rename
  Sample two(2);
  auto got = Sample::blank_like(two.sd);
  ckpt::load(got, path);
  EXPECT_TRUE(torch::equal(got.full.at("step"), two.sd.full.at("step")));
  // A save that fails (a Partial placement cannot be saved) leaves the previous checkpoint in place.
  Sample bad(3);
  auto mesh = fsdp::init_device_mesh("cpu", {1}, {"shard"});
  bad.sd.tensors["p"] = fsdp::ShardedTensor::from_local(torch::ones({2}), mesh, {fsdp::Partial()}, {2});
  EXPECT_ERROR_HAS(error_of([&] { ckpt::save(bad.sd, path); }), "'p'", "Partial");
  EXPECT_FALSE(fs::exists(path + ".partial"));
  got = Sample::blank_like(two.sd);
  ckpt::load(got, path);
  EXPECT_TRUE(torch::equal(got.full.at("step"), two.sd.full.at("step")));
  fs::remove_all(dir);
}

TEST(Checkpoint, PurgeKeepsTheNewestAndInFlightSaves) {
  const auto dir = fresh_dir("purge");
  Sample s(1);
  for (int step : {1, 2, 3, 4, 5}) ckpt::save(s.sd, ckpt::step_path(dir.string(), step));
  fs::create_directories(dir / "step-2.partial");  // an interrupted old save
  fs::create_directories(dir / "step-6.partial");  // a save in flight
  fs::create_directories(dir / "step-7");          // no metadata: not complete
  EXPECT_EQ(ckpt::complete_steps(dir.string()), (std::vector<int64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(ckpt::purge(dir.string(), 2).size(), 4u);
  EXPECT_EQ(ckpt::complete_steps(dir.string()), (std::vector<int64_t>{4, 5}));
  EXPECT_FALSE(fs::exists(dir / "step-2.partial"));
  EXPECT_TRUE(fs::exists(dir / "step-6.partial"));
  ckpt::purge(dir.string(), 0);  // never deletes the newest complete checkpoint
  EXPECT_EQ(ckpt::latest_step(dir.string()), std::optional<int64_t>(5));
  fs::remove_all(dir);
}

// One format detection for loads, detect_format and complete_steps: real saves of both formats, then the
// marker files alone (metadata.json wins; a marker that is not a regular file does not count).
TEST(Checkpoint, FormatDetection) {
  const auto dir = fresh_dir("detect");
  Sample s(1);
  ckpt::save(s.sd, ckpt::step_path(dir.string(), 1));
  ckpt::SaveOptions dcp;
  dcp.format = ckpt::Format::PytorchDcp;
  ckpt::save(s.sd, ckpt::step_path(dir.string(), 2), dcp);
  EXPECT_EQ(ckpt::checkpoint_format(ckpt::step_path(dir.string(), 1)), ckpt::Format::Libfsdp);
  EXPECT_EQ(ckpt::checkpoint_format(ckpt::step_path(dir.string(), 2)), ckpt::Format::PytorchDcp);
  EXPECT_EQ(ckpt::inspect(ckpt::step_path(dir.string(), 2)).format, ckpt::Format::PytorchDcp);
  const fs::path both = dir / "step-3", dir_named = dir / "step-4", none = dir / "step-5";
  fs::create_directories(both);
  std::ofstream(both / "metadata.json") << "{}";
  std::ofstream(both / ".metadata") << "x";
  fs::create_directories(dir_named / "metadata.json");  // a directory, not the file
  std::ofstream(dir_named / ".metadata") << "x";
  fs::create_directories(none);
  EXPECT_EQ(ckpt::checkpoint_format(both.string()), ckpt::Format::Libfsdp);
  EXPECT_EQ(ckpt::checkpoint_format(dir_named.string()), ckpt::Format::PytorchDcp);
  EXPECT_EQ(ckpt::checkpoint_format(none.string()), std::nullopt);
  EXPECT_ERROR_HAS(error_of([&] { ckpt::detect_format(none.string()); }), "neither", "metadata.json", ".metadata");
  EXPECT_EQ(ckpt::complete_steps(dir.string()), (std::vector<int64_t>{1, 2, 3, 4}));
  fs::remove_all(dir);
}

// The library's async save: the state is snapshotted before save() returns (changing it afterwards does not
// change the checkpoint), the write runs on another thread (held open here by blocking its `after` callback),
// and the checkpoint equals the state at the call.
TEST(CheckpointAsync, SnapshotThenBackgroundWrite) {
  const auto dir = fresh_dir("async");
  const std::string path = (dir / "step-1").string();
  Sample live(7);
  ckpt::AsyncSaver saver(nullptr, ckpt::AsyncMode::Async);
  std::promise<void> release;
  auto released = release.get_future().share();
  bool after_ran = false;
  const auto started = saver.save(live.sd, path, {}, [&](const ckpt::SaveResult&) {
    released.wait();
    after_ran = true;
  });
  EXPECT_TRUE(started.background);
  EXPECT_TRUE(saver.in_flight());
  // Training goes on: the live state changes while the save is in flight.
  live.sd.tensors.at("w").local().zero_();
  live.sd.full.at("b").fill_(0);
  release.set_value();
  const auto result = saver.wait();
  ASSERT_TRUE(result.has_value());
  EXPECT_TRUE(after_ran);
  EXPECT_FALSE(saver.in_flight());
  Sample ref(7);
  auto got = Sample::blank_like(ref.sd);
  ckpt::load(got, path);
  EXPECT_TRUE(torch::equal(got.tensors.at("w").local(), ref.sd.tensors.at("w").local()));
  EXPECT_TRUE(torch::equal(got.full.at("b"), ref.sd.full.at("b")));
  EXPECT_FALSE(torch::equal(got.full.at("b"), live.sd.full.at("b")));  // the snapshot, not the changed state
  fs::remove_all(dir);
}

// Background staging: save() returns before the snapshot is taken; values are copied at the call; after
// wait_staged() the state may change without changing the checkpoint.
TEST(CheckpointAsync, BackgroundStagingSnapshotsBeforeWaitStagedReturns) {
  const auto dir = fresh_dir("async_staging");
  const std::string path = (dir / "step-1").string();
  Sample live(9);
  ckpt::AsyncSaver saver(nullptr, ckpt::AsyncMode::Async, ckpt::Staging::Background);
  EXPECT_TRUE(saver.save(live.sd, path).background);
  live.sd.values["lr"] = "0.5";  // values were copied by save()
  saver.wait_staged();
  live.sd.tensors.at("w").local().zero_();  // the optimizer step, after the snapshot
  live.sd.full.at("b").fill_(0);
  saver.wait();
  Sample ref(9);
  auto got = Sample::blank_like(ref.sd);
  ckpt::load(got, path);
  EXPECT_TRUE(torch::equal(got.tensors.at("w").local(), ref.sd.tensors.at("w").local()));
  EXPECT_TRUE(torch::equal(got.full.at("b"), ref.sd.full.at("b")));
  EXPECT_EQ(got.values.at("lr"), "0.001");
  EXPECT_EQ(saver.wait_staged(), 0.0);  // nothing staged any more
  fs::remove_all(dir);
}

// A background save's error is raised by the next save(), wait() or check(), never dropped; the save that
// raised it did not start; the saver works again afterwards.
TEST(CheckpointAsync, BackgroundErrorSurfacesAtTheNextCall) {
  const auto dir = fresh_dir("async_err");
  std::ofstream(dir / "a_file") << "x";
  const std::string bad = (dir / "a_file" / "step-1").string();  // its parent is a regular file
  Sample s(3);
  ckpt::AsyncSaver saver(nullptr, ckpt::AsyncMode::Async);
  EXPECT_TRUE(saver.save(s.sd, bad).background);
  const std::string good = (dir / "step-2").string();
  EXPECT_ERROR_HAS(error_of([&] { saver.save(s.sd, good); }), "a_file");
  EXPECT_FALSE(fs::exists(good));
  saver.save(s.sd, bad);
  EXPECT_ERROR_HAS(error_of([&] { saver.wait(); }), "a_file");
  saver.save(s.sd, bad);
  while (saver.in_flight()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_ERROR_HAS(error_of([&] { saver.check(); }), "a_file");
  EXPECT_EQ(error_of([&] { saver.check(); }), "");  // raised once
  saver.save(s.sd, good);
  saver.wait();
  EXPECT_EQ(ckpt::verify(good), std::vector<std::string>{});
  fs::remove_all(dir);
}

// Staging buffers are kept between saves: the second and third saves of the same state allocate nothing, yet
// each checkpoint holds the state as it was at its own save (the buffers are refilled, not stale); a tensor
// whose shape changed gets a new buffer. Both staging kinds; the reference is a clone taken at each call.
TEST(CheckpointAsync, StagingBuffersAreReusedAndRefilled) {
  for (const auto staging : {ckpt::Staging::Blocking, ckpt::Staging::Background}) {
    const auto dir = fresh_dir("async_reuse");
    Sample live(11);
    int64_t state_bytes = 0;
    for (const auto& [k, t] : live.sd.tensors) state_bytes += t.local().numel() * t.local().element_size();
    for (const auto& [k, t] : live.sd.full) state_bytes += t.numel() * t.element_size();
    ckpt::AsyncSaverOptions o;
    o.staging = staging;
    ckpt::AsyncSaver saver(nullptr, o);
    std::vector<std::pair<std::string, ckpt::StateDict>> expected;
    for (int step = 1; step <= 3; ++step) {
      const std::string path = ckpt::step_path(dir.string(), step);
      expected.push_back({path, ckpt::snapshot(live.sd)});  // the state at this save
      saver.save(live.sd, path);
      saver.wait_staged();
      live.sd.tensors.at("w").local().add_(1.0);  // the optimizer step
      live.sd.full.at("b").mul_(2);
      live.sd.full.at("step").add_(1);
      if (step == 1) EXPECT_EQ(saver.staging_bytes_allocated(), state_bytes);
    }
    saver.wait();
    EXPECT_EQ(saver.staging_bytes_allocated(), state_bytes) << "saves 2 and 3 reused the buffers";
    for (const auto& [path, want] : expected) {
      auto got = Sample::blank_like(want);
      ckpt::load(got, path);
      EXPECT_TRUE(torch::equal(got.tensors.at("w").local(), want.tensors.at("w").local())) << path;
      EXPECT_TRUE(torch::equal(got.full.at("b"), want.full.at("b"))) << path;
      EXPECT_TRUE(torch::equal(got.full.at("step"), want.full.at("step"))) << path;
    }
    EXPECT_FALSE(torch::equal(expected[0].second.full.at("b"), expected[2].second.full.at("b")));  // it moved
    live.sd.full["b"] = torch::randn({301}).to(torch::kBFloat16);  // a new shape: a new buffer for it only
    saver.save(live.sd, ckpt::step_path(dir.string(), 4));
    saver.wait();
    EXPECT_EQ(saver.staging_bytes_allocated(), state_bytes + 301 * 2);
    fs::remove_all(dir);
  }
}

TEST(CheckpointAsync, DisabledIsSynchronousAndModesParse) {
  const auto dir = fresh_dir("async_off");
  const std::string path = (dir / "step-1").string();
  Sample s(4);
  ckpt::AsyncSaver saver(nullptr, ckpt::parse_async_mode("disabled"));
  EXPECT_FALSE(saver.save(s.sd, path).background);
  EXPECT_EQ(ckpt::verify(path), std::vector<std::string>{});  // complete when save() returned
  EXPECT_EQ(ckpt::parse_async_mode("async_with_pinned_mem"), ckpt::AsyncMode::AsyncWithPinnedMem);
  EXPECT_ERROR_HAS(error_of([] { ckpt::parse_async_mode("sometimes"); }), "sometimes", "async_with_pinned_mem");
  fs::remove_all(dir);
}

TEST(Checkpoint, ReshardingArithmetic) {
  using fsdp::checkpoint::detail::Box;
  const Box saved{{4, 0}, {4, 6}}, dest{{6, 2}, {5, 3}};
  auto o = fsdp::checkpoint::detail::intersect(saved, dest);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->offsets, (std::vector<int64_t>{6, 2}));
  EXPECT_EQ(o->sizes, (std::vector<int64_t>{2, 3}));
  // Rows 2..3 of the saved chunk, columns 2..4: elements 14 .. 22 of its row-major bytes.
  EXPECT_EQ(fsdp::checkpoint::detail::element_span(saved, *o), (std::pair<int64_t, int64_t>{14, 22}));
  EXPECT_FALSE(fsdp::checkpoint::detail::intersect(saved, Box{{8, 0}, {1, 6}}).has_value());
}

// ---- bad input: one test per class ------------------------------------------------------------------------

TEST(CheckpointBadInput, MissingMetadataIsAnIncompleteCheckpoint) {
  const auto dir = fresh_dir("nometa");
  const std::string path = save_sample(dir);
  fs::remove(fs::path(path) / "metadata.json");
  EXPECT_ERROR_HAS(load_error(path), "metadata.json", "missing");
  EXPECT_ERROR_HAS(load_error((dir / "nothing").string()), "does not exist");
  EXPECT_EQ(ckpt::complete_steps(dir.string()), std::vector<int64_t>{});
  fs::remove_all(dir);
}

TEST(CheckpointBadInput, MissingDataFile) {
  const auto dir = fresh_dir("nofile");
  const std::string path = save_sample(dir);
  fs::remove(fs::path(path) / "rank-00000.bin");
  EXPECT_ERROR_HAS(load_error(path), "rank-00000.bin", "tensor '");
  EXPECT_FALSE(ckpt::verify(path).empty());
  fs::remove_all(dir);
}

TEST(CheckpointBadInput, TruncatedDataFile) {
  const auto dir = fresh_dir("trunc");
  const std::string path = save_sample(dir);
  const auto file = fs::path(path) / "rank-00000.bin";
  fs::resize_file(file, fs::file_size(file) - 10);
  EXPECT_ERROR_HAS(load_error(path), "rank-00000.bin", "truncated", "tensor '");
  EXPECT_FALSE(ckpt::verify(path).empty());
  fs::remove_all(dir);
}

TEST(CheckpointBadInput, AlteredByteFailsItsChecksum) {
  const auto dir = fresh_dir("flip");
  const std::string path = save_sample(dir);
  auto md = read_md(path);
  const auto& c = md["tensors"]["w"]["chunks"][0];
  const int64_t at = c["offset"].get<int64_t>() + c["length"].get<int64_t>() / 2;
  {
    std::fstream f(fs::path(path) / "rank-00000.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char b = 0;
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x10);
    f.seekp(at);
    f.write(&b, 1);
  }
  EXPECT_ERROR_HAS(load_error(path), "tensor 'w'", "checksum mismatch", "rank-00000.bin");
  auto problems = ckpt::verify(path);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("'w'"), std::string::npos);
  fs::remove_all(dir);
}

TEST(CheckpointBadInput, MangledMetadata) {
  const auto dir = fresh_dir("mangled");
  const std::string path = save_sample(dir);
  const std::string md = read_md(path).dump();
  std::ofstream(fs::path(path) / "metadata.json") << md.substr(0, md.size() / 2);
  EXPECT_ERROR_HAS(load_error(path), "not valid JSON");
  std::ofstream(fs::path(path) / "metadata.json") << "[1, 2, 3]";
  EXPECT_ERROR_HAS(load_error(path), "not a JSON object");
  auto j = nlohmann::json::parse(md);
  j["version"] = 99;
  write_md(path, j);
  EXPECT_ERROR_HAS(load_error(path), "format version 99");
  j = nlohmann::json::parse(md);
  j["tensors"]["w"].erase("chunks");
  write_md(path, j);
  EXPECT_ERROR_HAS(load_error(path), "tensor 'w'");
  j = nlohmann::json::parse(md);
  j["tensors"]["w"]["dtype"] = "F99";
  write_md(path, j);
  EXPECT_ERROR_HAS(load_error(path), "tensor 'w'", "F99");
  j = nlohmann::json::parse(md);
  j["tensors"]["w"]["chunks"][0]["hashes"][0] = "zz";
  write_md(path, j);
  EXPECT_ERROR_HAS(load_error(path), "tensor 'w'", "hash");
  fs::remove_all(dir);
}

TEST(CheckpointBadInput, HostileMetadata) {
  const auto dir = fresh_dir("hostile");
  const std::string path = save_sample(dir);
  const auto md = read_md(path);
  auto with = [&](auto&& edit) {
    auto j = md;
    edit(j);
    write_md(path, j);
    return load_error(path);
  };
  // Huge sizes: no allocation is attempted, the sizes are rejected.
  EXPECT_ERROR_HAS(with([](auto& j) { j["tensors"]["w"]["shape"] = {int64_t(1) << 40, int64_t(1) << 40}; }), "tensor 'w'");
  EXPECT_ERROR_HAS(with([](auto& j) { j["tensors"]["w"]["chunks"][0]["length"] = int64_t(1) << 62; }), "tensor 'w'");
  EXPECT_ERROR_HAS(with([](auto& j) { j["files"]["rank-00000.bin"]["size"] = int64_t(1) << 62; }), "rank-00000.bin");
  // Negative offsets (box and bytes).
  EXPECT_ERROR_HAS(with([](auto& j) { j["tensors"]["w"]["chunks"][0]["offsets"] = {-1, 0}; }), "tensor 'w'", "outside");
  EXPECT_ERROR_HAS(with([](auto& j) { j["tensors"]["w"]["chunks"][0]["offset"] = -8; }), "tensor 'w'", "outside");
  // Overlapping chunks: the same box twice (with another byte range) and two tensors sharing bytes.
  EXPECT_ERROR_HAS(with([](auto& j) {
                     auto c = j["tensors"]["w"]["chunks"][0];
                     j["tensors"]["w"]["chunks"].push_back(c);
                   }),
                   "tensor 'w'");
  EXPECT_ERROR_HAS(with([](auto& j) {
                     j["tensors"]["step"]["chunks"][0]["offset"] = j["tensors"]["ids"]["chunks"][0]["offset"];
                   }),
                   "overlap");
  // Paths escaping the directory.
  for (const char* bad : {"../../etc/passwd", "/etc/passwd", "..", "a/b"}) {
    EXPECT_ERROR_HAS(with([&](auto& j) {
                       j["files"][bad] = j["files"]["rank-00000.bin"];
                       j["tensors"]["w"]["chunks"][0]["file"] = bad;
                     }),
                     "not a plain name");
  }
  // A chunk missing: the tensor would be partly uninitialised.
  EXPECT_ERROR_HAS(with([](auto& j) { j["tensors"]["w"]["chunks"][0]["sizes"] = {20, 11}; }), "tensor 'w'");
  fs::remove_all(dir);
}

// Bounded work per metadata file: nesting is counted on the bytes before parsing (100,000 levels of '[' in a value
// overflowed the stack in dump() and killed inspect, verify and every resume), and the disjointness proof makes a
// bounded number of box comparisons — linear for row or column shards, a refusal for a file built to need more.
TEST(CheckpointBadInput, DeeplyNestedMetadataAndOverlapBudget) {
  namespace detail = fsdp::checkpoint::detail;
  const auto dir = fresh_dir("deep");
  const std::string path = save_sample(dir);
  const std::string md = read_md(path).dump();
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  for (const std::string& at : {std::string("\"values\":{"), std::string("\"tensors\":{")}) {
    std::string text = md;
    const auto pos = text.find(at);
    ASSERT_NE(pos, std::string::npos) << at;
    text.insert(pos + at.size(), "\"deep\":" + deep + ",");
    std::ofstream(fs::path(path) / "metadata.json") << text;
    EXPECT_ERROR_HAS(load_error(path), "metadata.json", "nested deeper than 64 levels");
    EXPECT_ERROR_HAS(error_of([&] { ckpt::inspect(path); }), "nested deeper than 64 levels");
  }
  // Brackets inside strings are text, not nesting; 64 levels are fine.
  auto j = nlohmann::json::parse(md);
  j["values"]["text"] = std::string(1000, '[');
  j["values"]["nested"] = nlohmann::json::parse(std::string(60, '[') + std::string(60, ']'));
  write_md(path, j);
  EXPECT_EQ(error_of([&] { ckpt::inspect(path); }), "");
  EXPECT_EQ(ckpt::read_value(path, "text"), nlohmann::json(std::string(1000, '[')).dump());

  // Metadata of one byte-sized tensor split into `n` chunks of the given boxes (no data file is read).
  auto metadata = [](std::vector<int64_t> shape, int64_t n, const std::function<nlohmann::json(int64_t)>& box,
                     int64_t chunk_bytes) {
    nlohmann::json chunks = nlohmann::json::array();
    for (int64_t i = 0; i < n; ++i) {
      nlohmann::json c = box(i);
      c["file"] = "rank-00000.bin";
      c["offset"] = i * chunk_bytes;
      c["length"] = chunk_bytes;
      c["hashes"] = {"0000000000000000"};
      chunks.push_back(std::move(c));
    }
    nlohmann::json m = {{"format", "libfsdp-checkpoint"}, {"version", 1}, {"hash", "xxh3-64"},
                        {"block_bytes", int64_t(1) << 32}, {"world_size", 1},
                        {"files", {{"rank-00000.bin", {{"size", n * chunk_bytes}}}}},
                        {"tensors", {{"t", {{"dtype", "U8"}, {"shape", shape}, {"chunks", chunks}}}}}};
    return m.dump();
  };
  // 20,000 column shards of a [2, 20000] tensor: the sweep runs along dim 1 (one comparison each), accepted.
  const int64_t cols = 20000;
  const auto column_shards = metadata({2, cols}, cols, [](int64_t i) {
    return nlohmann::json{{"offsets", {0, i}}, {"sizes", {2, 1}}};
  }, 2);
  EXPECT_NO_THROW(detail::parse_metadata(column_shards, "columns/metadata.json"));
  // A staircase of 12,000 one-column chunks whose row ranges all intersect: disjoint, but a proof by pairs would
  // need 72 million comparisons; refused by the budget with the tensor's name.
  const int64_t n = 12000;
  const auto staircase = metadata({2 * n, n}, n, [n](int64_t i) {
    return nlohmann::json{{"offsets", {i, i}}, {"sizes", {n, 1}}};
  }, n);
  EXPECT_ERROR_HAS(error_of([&] { detail::parse_metadata(staircase, "stairs/metadata.json"); }), "stairs/metadata.json",
                   "tensor 't'", "box comparisons");
  fs::remove_all(dir);
}

TEST(CheckpointBadInput, KeysNotMatchingStrictAndNonStrict) {
  const auto dir = fresh_dir("keys");
  const std::string path = save_sample(dir, 4);
  Sample ref(4);
  auto got = Sample::blank_like(ref.sd);
  got.full["extra.weight"] = torch::zeros({3});
  got.full.erase("ids");
  EXPECT_ERROR_HAS(error_of([&] { ckpt::load(got, path); }), "'extra.weight'", "'ids'", "missing", "unexpected");
  EXPECT_FALSE(torch::equal(got.full.at("b"), ref.sd.full.at("b")));  // a failed strict load loads nothing
  ckpt::LoadOptions o;
  o.strict = false;
  auto res = ckpt::load(got, path, o);
  EXPECT_EQ(res.missing, std::vector<std::string>{"extra.weight"});
  EXPECT_EQ(res.unexpected, std::vector<std::string>{"ids"});
  EXPECT_TRUE(torch::equal(got.full.at("b"), ref.sd.full.at("b")));
  EXPECT_TRUE(torch::equal(got.full.at("extra.weight"), torch::zeros({3})));
  // Excluded keys are neither required nor loaded.
  auto ex = Sample::blank_like(ref.sd);
  ex.full.erase("ids");
  o.strict = true;
  o.exclude_prefixes = {"ids", "b"};
  ckpt::load(ex, path, o);
  EXPECT_TRUE(torch::equal(ex.full.at("b"), torch::zeros({300}, torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(ex.full.at("step"), ref.sd.full.at("step")));
  fs::remove_all(dir);
}

TEST(CheckpointBadInput, ShapesNotMatching) {
  const auto dir = fresh_dir("shapes");
  const std::string path = save_sample(dir);
  Sample ref(1);
  auto got = Sample::blank_like(ref.sd);
  got.full["b"] = torch::zeros({301}, torch::kBFloat16);
  for (bool strict : {true, false}) {
    ckpt::LoadOptions o;
    o.strict = strict;
    EXPECT_ERROR_HAS(error_of([&] { ckpt::load(got, path, o); }), "'b'", "[300]", "[301]");
  }
  fs::remove_all(dir);
}
