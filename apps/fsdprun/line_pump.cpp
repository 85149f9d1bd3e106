#include "line_pump.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>

namespace fsdprun {

void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n > 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      // Our stdout may be a non-blocking file description shared with a terminal; wait until it drains.
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 1000);
    } else {
      return;  // reader gone: drop the output, keep supervising
    }
  }
}

void LinePrefixer::feed(std::string_view data) {
  std::string out;
  while (!data.empty()) {
    const std::size_t nl = data.find('\n');
    if (nl == std::string_view::npos) {
      partial_.append(data);
      if (partial_.size() >= kMaxLine) {
        out += prefix_;
        out += partial_;
        out += '\n';
        partial_.clear();
      }
      break;
    }
    out += prefix_;
    out += partial_;
    out.append(data.substr(0, nl + 1));
    partial_.clear();
    data.remove_prefix(nl + 1);
  }
  write_all(out_fd_, out);
}

void LinePrefixer::flush() {
  if (partial_.empty()) return;
  write_all(out_fd_, prefix_ + partial_ + "\n");
  partial_.clear();
}

StreamPump::StreamPump(UniqueFd source, std::string prefix, int out_fd)
    : source_(std::move(source)), prefixer_(std::move(prefix), out_fd) {
  set_nonblocking(source_.get());
}

void StreamPump::pump() {
  char buf[65536];
  while (source_.valid()) {
    const ssize_t n = ::read(source_.get(), buf, sizeof buf);
    if (n > 0) {
      prefixer_.feed(std::string_view(buf, static_cast<std::size_t>(n)));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      return;
    } else {
      finish();  // EOF or a read error: nothing more will come
    }
  }
}

void StreamPump::finish() {
  prefixer_.flush();
  source_.reset();
}

}  // namespace fsdprun
