#pragma once
// What the tests that compare with transformers in the venv share (qwen3_hf_test.cpp, hf_config_test.cpp): a
// scratch folder of this process removed when the test binary ends, the Python side run with its output kept,
// and whether the venv has transformers. Needs FSDP_TEST_PYTHON (the venv's python).

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fsdp_test::hf_side {

inline std::filesystem::path scratch_root() {
  return std::filesystem::temp_directory_path() / ("fsdp_hf_" + std::to_string(::getpid()));
}

// Removes this run's files (models, logits, the python log) when the test binary ends.
class ScratchCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(scratch_root(), ec);
    std::filesystem::remove(scratch_root().string() + ".log", ec);
  }
};
inline const auto* const kCleanup = ::testing::AddGlobalTestEnvironment(new ScratchCleanup);  // gtest owns it

// An empty folder `name` under the scratch root.
inline std::filesystem::path scratch(const std::string& name) {
  std::filesystem::path d = scratch_root() / name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

struct PythonRun {
  int rc = 0;
  std::string command, output;
};
// `script args` with the venv's python (one thread), its stdout and stderr collected.
inline PythonRun run_python(const std::string& script, const std::string& args) {
  PythonRun r;
  const std::string log = scratch_root().string() + ".log";
  r.command = std::string("OMP_NUM_THREADS=1 ") + FSDP_TEST_PYTHON + " " + script + " " + args;
  r.rc = std::system((r.command + " > " + log + " 2>&1").c_str());
  std::ifstream f(log);
  std::stringstream out;
  out << f.rdbuf();
  r.output = out.str();
  return r;
}

inline bool have_transformers() {
  return std::system((std::string(FSDP_TEST_PYTHON) + " -c 'import transformers' > /dev/null 2>&1").c_str()) == 0;
}

}  // namespace fsdp_test::hf_side
