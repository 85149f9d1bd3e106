#pragma once
// Helpers shared by the fuzz harnesses: parsers that take a path get the fuzz input through a scratch file.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>

namespace fsdp_fuzz {

// A per-process scratch directory (on /dev/shm when present: one file write per execution) removed at exit.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp");
    std::string templ = std::string(base) + "/fsdp-fuzz-XXXXXX";
    if (!mkdtemp(templ.data())) throw std::runtime_error("fuzz: cannot create a scratch directory in " + std::string(base));
    static std::string cleanup;
    cleanup = templ;
    std::atexit([] { std::string cmd = "rm -rf '" + cleanup + "'"; if (std::system(cmd.c_str())) {} });
    return templ;
  }();
  return dir;
}

// Writes `data` to <scratch>/<name> (replacing it) and returns the path.
inline std::string write_scratch(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) throw std::runtime_error("fuzz: cannot write " + path);
  return path;
}

}  // namespace fsdp_fuzz
