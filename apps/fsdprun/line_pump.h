// Copies a rank's stdout or stderr to the launcher's, one whole line at a time, with a "[rank N] " prefix.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "unique_fd.h"

namespace fsdprun {

// Writes everything, retrying on EINTR and waiting on EAGAIN. If the destination is gone (EPIPE, ...) the
// data is dropped: the launcher keeps supervising its ranks even when nobody reads its output.
void write_all(int fd, std::string_view data);

// Splits a byte stream into lines and writes each as prefix + line + '\n'. Complete lines of one chunk go out
// in a single write, so lines of different ranks never interleave mid-line. A partial line is held until its
// newline arrives, flush() is called, or it grows beyond kMaxLine (then it is written as a line of its own).
class LinePrefixer {
 public:
  static constexpr std::size_t kMaxLine = 1 << 20;

  LinePrefixer(std::string prefix, int out_fd) : prefix_(std::move(prefix)), out_fd_(out_fd) {}
  void feed(std::string_view data);
  // Writes a pending partial line, newline-terminated so the next rank's line starts on its own line.
  void flush();

 private:
  std::string prefix_;
  int out_fd_;
  std::string partial_;
};

// A non-blocking pipe from one rank's stream, feeding a LinePrefixer.
class StreamPump {
 public:
  StreamPump(UniqueFd source, std::string prefix, int out_fd);

  int fd() const { return source_.get(); }
  bool open() const { return source_.valid(); }
  // Reads what is available now. At EOF flushes the partial line and closes the pipe.
  void pump();
  // Stops reading: flushes the partial line and closes the pipe (used when the drain time is up).
  void finish();

 private:
  UniqueFd source_;
  LinePrefixer prefixer_;
};

}  // namespace fsdprun
