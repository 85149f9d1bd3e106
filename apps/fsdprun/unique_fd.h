// Owning file descriptor (RAII) and pipe creation for the launcher.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <utility>

namespace fsdprun {

// Closes the descriptor it owns on destruction; move-only, like std::unique_ptr.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

struct Pipe {
  UniqueFd read;
  UniqueFd write;
};

// Both ends are close-on-exec so that no rank inherits another rank's pipes; `flags` may add O_NONBLOCK.
inline Pipe make_pipe(int flags = 0) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | flags) != 0) throw std::system_error(errno, std::generic_category(), "pipe2");
  return Pipe{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

inline void set_nonblocking(int fd) {
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0)
    throw std::system_error(errno, std::generic_category(), "fcntl(O_NONBLOCK)");
}

}  // namespace fsdprun
