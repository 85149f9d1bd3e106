// safetensors: round trips of every supported dtype, lazy row reads (one FSDP shard), validation of malformed
// files, and interop both ways with an independent Python implementation (bench/vs_pytorch/st_io.py, written
// with struct + json only). Expected values are computed here from arange formulas, not read back from our
// own writer.
#include <fsdp/checkpoint/safetensors.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>

namespace st = fsdp::checkpoint::safetensors;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "fsdp_st_XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// The fixture of st_io.py, computed independently here.
std::map<std::string, at::Tensor> fixture() {
  std::map<std::string, at::Tensor> m;
  m["layers.0.weight"] = at::arange(12, at::kFloat).reshape({3, 4}) * 0.5 - 1.0;
  m["half"] = (at::arange(6, at::kDouble).reshape({2, 3}).to(at::kHalf) / 4);
  m["bf16"] = at::arange(5, at::kFloat).to(at::kBFloat16) * 2;
  m["ids"] = at::arange(7, at::kLong) - 3;
  m["scalar"] = at::scalar_tensor(3.25, at::kDouble);
  m["empty"] = at::zeros({0, 5}, at::kFloat);
  m["mask"] = at::tensor({1, 0, 1}, at::kInt).to(at::kBool);
  return m;
}

void expect_same(const at::Tensor& got, const at::Tensor& want, const std::string& name) {
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
  EXPECT_EQ(got.sizes(), want.sizes()) << name;
  EXPECT_TRUE(at::equal(got, want)) << name;
}

int run(const std::string& cmd) { return std::system(cmd.c_str()); }

// The interop tests need torch in FSDP_PYTHON (the project venv, as scripts/setup.sh configures it).
bool python_has_torch() {
  return run(std::string(FSDP_TEST_PYTHON) + " -c 'import torch' > /dev/null 2>&1") == 0;
}

void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  f << header << data;
}

}  // namespace

TEST(Safetensors, RoundTripAllDtypes) {
  TempDir dir;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (auto dtype : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kShort, at::kChar,
                     at::kByte, at::kBool}) {
    tensors.emplace_back(st::dtype_name(dtype), (at::arange(24, at::kDouble).reshape({2, 3, 4}).remainder(7)).to(dtype));
  }
  // Non-contiguous input is written as its logical (row-major) values.
  tensors.emplace_back("transposed", at::arange(6, at::kFloat).reshape({2, 3}).t());
  st::save_file(dir.file("a.safetensors"), tensors, {{"step", "7"}});

  st::Reader r(dir.file("a.safetensors"));
  EXPECT_EQ(r.names().size(), tensors.size());
  EXPECT_EQ(r.metadata().at("step"), "7");
  for (const auto& [name, t] : tensors) expect_same(r.read(name), t.contiguous(), name);
  expect_same(r.read("transposed"), at::tensor({0.f, 3.f, 1.f, 4.f, 2.f, 5.f}).reshape({3, 2}), "transposed values");
  // The data section starts 8-byte aligned.
  std::ifstream f(dir.file("a.safetensors"), std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST(Safetensors, ReadRowsAndReadInto) {
  TempDir dir;
  at::Tensor w = at::arange(10 * 3, at::kFloat).reshape({10, 3});
  st::save_file(dir.file("w.safetensors"), {{"w", w}});
  st::Reader r(dir.file("w.safetensors"));
  // Shards of torch.chunk(w, 4): rows [0,3), [3,6), [6,9), [9,10).
  expect_same(r.read_rows("w", 3, 3), at::arange(9, 18, at::kFloat).reshape({3, 3}), "rows 3..6");
  expect_same(r.read_rows("w", 9, 1), at::tensor({27.f, 28.f, 29.f}).reshape({1, 3}), "last row");
  EXPECT_EQ(r.read_rows("w", 10, 0).size(0), 0);
  EXPECT_THROW(r.read_rows("w", 8, 3), c10::Error);

  at::Tensor dst = at::zeros({10, 3}, at::kDouble);
  r.read_into("w", dst);
  EXPECT_TRUE(at::equal(dst, at::arange(30, at::kDouble).reshape({10, 3})));
  at::Tensor wrong = at::zeros({3, 10});
  EXPECT_THROW(r.read_into("w", wrong), c10::Error);
  try {
    r.read("nope");
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor 'nope'"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, RejectsMalformedFiles) {
  TempDir dir;
  const std::string data(16, '\0');
  auto expect_error = [&](const std::string& header, const std::string& payload, const std::string& needle) {
    write_raw(dir.file("bad"), header, payload);
    try {
      st::Reader r(dir.file("bad"));
      ADD_FAILURE() << "accepted: " << header;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
               std::string(12, '\0'), "overlap or gap");
  expect_error(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0'), "shape x dtype");
  expect_error(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, '\0'), "outside");
  expect_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data, "cover");
  expect_error(R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0'), "unsupported dtype");
  expect_error(R"([1,2])", "", "does not start");
  expect_error(R"({"a": )", "", "not valid JSON");
  // Header length beyond the file.
  {
    std::ofstream f(dir.file("bad"), std::ios::binary);
    uint64_t n = 1000;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << "{}";
  }
  EXPECT_THROW(st::Reader r(dir.file("bad")), c10::Error);
  EXPECT_THROW(st::Reader r(dir.file("missing")), c10::Error);
  EXPECT_THROW(st::save_file(dir.file("dup"), {{"x", at::ones(1)}, {"x", at::ones(1)}}), c10::Error);
}

TEST(Safetensors, ReadsFileWrittenByIndependentPythonWriter) {
  if (!python_has_torch()) GTEST_SKIP() << FSDP_TEST_PYTHON << " has no torch (configure with the project venv)";
  TempDir dir;
  const std::string path = dir.file("py.safetensors");
  ASSERT_EQ(run(std::string(FSDP_TEST_PYTHON) + " " + FSDP_TEST_ST_IO + " write-fixture " + path), 0);
  st::Reader r(path);
  const auto want = fixture();
  ASSERT_EQ(r.names().size(), want.size());
  for (const auto& [name, t] : want) expect_same(r.read(name), t, name);
  EXPECT_EQ(r.metadata().at("writer"), "st_io.py");
}

TEST(Safetensors, IndependentPythonReaderReadsOurFile) {
  if (!python_has_torch()) GTEST_SKIP() << FSDP_TEST_PYTHON << " has no torch (configure with the project venv)";
  TempDir dir;
  const std::string path = dir.file("cpp.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : fixture()) tensors.emplace_back(name, t);
  st::save_file(path, tensors, {{"format", "pt"}, {"writer", "st_io.py"}});
  EXPECT_EQ(run(std::string(FSDP_TEST_PYTHON) + " " + FSDP_TEST_ST_IO + " check-fixture " + path), 0);
}

TEST(Safetensors, IndexOfShardedSet) {
  TempDir dir;
  const std::string index = dir.file("model.safetensors.index.json");
  st::save_index(index, {{"a.weight", "model-00001-of-00002.safetensors"}, {"b.weight", "model-00002-of-00002.safetensors"}},
                 1234);
  // The layout Hugging Face writes, checked on the text.
  std::ifstream f(index);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"total_size\": 1234"), std::string::npos) << text;
  const auto map = st::read_index(index);
  ASSERT_EQ(map.size(), 2u);
  EXPECT_EQ(map.at("b.weight"), "model-00002-of-00002.safetensors");
  {
    std::ofstream bad(dir.file("bad.json"));
    bad << R"({"metadata": {}})";
  }
  EXPECT_THROW(st::read_index(dir.file("bad.json")), c10::Error);
}

// The writer goes through fsdp::util::AtomicFile: a producer that throws half way leaves the previous file
// (read back by the reader, equal to the fixture) and no temporary beside it.
TEST(Safetensors, FailedStreamedSaveKeepsThePreviousFileAndNoTemporary) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const auto want = fixture();
  st::save_file(path, std::vector<std::pair<std::string, at::Tensor>>(want.begin(), want.end()));
  const std::vector<st::TensorSpec> specs = {{"a", at::kFloat, {1000}}, {"b", at::kFloat, {1000}}};
  int produced = 0;
  EXPECT_THROW(st::save_file_streamed(path, specs,
                                      [&](size_t i) {
                                        if (i == 1) throw std::runtime_error("producer failed");
                                        ++produced;
                                        return at::ones({1000}, at::kFloat);
                                      }),
               std::runtime_error);
  EXPECT_EQ(produced, 1) << "the failure did not come mid-write";
  const auto got = st::load_file(path);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) expect_same(got.at(name), t, name);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"model.safetensors"});
}

// Issue 40: a header whose shape product overflows int64 used to be accepted (the product wrapped, to 0 for
// [2^62, 4] of U8 = 2^64 bytes, matching an empty byte range) and failed later naming no file or tensor.
// Every product and conversion is checked now; the error names the file, the tensor and the rule.
TEST(Safetensors, ShapeProductOverflowIsRefusedNamingFileAndTensor) {
  TempDir dir;
  const std::string path = dir.file("overflow.safetensors");
  auto expect_error = [&](const std::string& header, const std::string& payload,
                          std::initializer_list<std::string> needles) {
    write_raw(path, header, payload);
    try {
      st::Reader r(path);
      ADD_FAILURE() << "accepted: " << header;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("safetensors: " + path + ": tensor 'w': "), std::string::npos) << msg;
      for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    }
  };
  // 2^62 x 4 elements of 1 byte: the element count itself overflows.
  expect_error(R"({"w":{"dtype":"U8","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", "",
               {"shape [4611686018427387904, 4] x U8 overflows 64-bit element or byte counts"});
  // 2^61 elements fit, 2^61 x 8 bytes do not.
  expect_error(R"({"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", "",
               {"shape [2305843009213693952] x F64 overflows"});
  // Checked left to right as the reference implementation does: a later 0 does not excuse the overflow.
  expect_error(R"({"w":{"dtype":"F32","shape":[1099511627776,1099511627776,0],"data_offsets":[0,0]}})", "",
               {"overflows 64-bit element or byte counts"});
  // Dimensions and offsets above 2^63 (they used to wrap to negative int64) and non-integers.
  expect_error(R"({"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,0]}})", "",
               {"shape: every dimension must be an integer in [0, 2^63)"});
  expect_error(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,4]}})", std::string(4, '\0'),
               {"data_offsets must be integers in [0, 2^63)"});
  expect_error(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4.5e300]}})", std::string(4, '\0'),
               {"data_offsets must be integers in [0, 2^63)"});
  // Wrong types name the field instead of a bare nlohmann type_error.
  expect_error(R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0'),
               {"\"dtype\" is not a string"});
  expect_error(R"({"w":{"dtype":"F32","shape":"[1]","data_offsets":[0,4]}})", std::string(4, '\0'),
               {"\"shape\" is not an array"});
  expect_error(R"({"w":[1,2]})", "", {"entry is not an object"});
  // The largest shape that fits is still read correctly (the check is exact, not a cap): a [2^20, 0] tensor.
  write_raw(path, R"({"w":{"dtype":"F32","shape":[1048576,0],"data_offsets":[0,0]}})", "");
  EXPECT_EQ(st::Reader(path).read("w").sizes(), at::IntArrayRef({1048576, 0}));
}

TEST(Safetensors, SizesOfTheWriterAndThePlannerAreCheckedToo) {
  // plan_files / nbytes see shapes from another checkpoint's metadata: an overflowing one is named.
  const st::TensorSpec huge{"huge", at::kFloat, {int64_t(1) << 62, 2}};
  try {
    (void)st::nbytes(huge);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'huge': shape [4611686018427387904, 2] x F32 overflows"),
              std::string::npos) << e.what();
  }
  // Two tensors of 2^62 bytes each: 2^63 bytes do not fit one file's int64 byte count (before, the sum wrapped
  // negative and both went into one file); the planner gives each its own file.
  const st::TensorSpec a{"a", at::kByte, {int64_t(1) << 62}};
  const st::TensorSpec b{"b", at::kByte, {int64_t(1) << 62}};
  const auto files = st::plan_files({a, b}, std::numeric_limits<int64_t>::max());
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].bytes, int64_t(1) << 62);
  EXPECT_EQ(files[1].bytes, int64_t(1) << 62);
}

TEST(Safetensors, IndexIsBoundedAndMustBeAFile) {
  TempDir dir;
  EXPECT_THROW(st::read_index(dir.path.string()), c10::Error);  // a directory
  const std::string big = dir.file("model.safetensors.index.json");
  { std::ofstream(big) << "{}"; }
  fs::resize_file(big, 100 << 20);  // sparse
  try {
    (void)st::read_index(big);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is 104857600 bytes (limit 67108864)"), std::string::npos) << e.what();
  }
}
