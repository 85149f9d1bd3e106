// See file_content.h.
#include "file_content.h"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace fsdp_train {

bool is_gzip_file(const std::string& path) {
  return path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0;
}

std::string read_bounded_file(const std::string& path, int64_t max_bytes, const std::string& what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw std::runtime_error(what + ": '" + path + "' is a directory, not a file");
  const auto too_large = [&] {
    return std::runtime_error(what + ": '" + path + "' is larger than the " + std::to_string(max_bytes) +
                              "-byte limit for this file (not the file meant?)");
  };
  // A regular file is measured first; a device or a pipe (/dev/zero, <(...)) is read up to the limit.
  if (std::filesystem::is_regular_file(path, ec)) {
    const auto size = std::filesystem::file_size(path, ec);
    if (!ec && size > static_cast<uintmax_t>(max_bytes)) throw too_large();
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(what + ": cannot open '" + path + "': " + std::strerror(errno));
  std::string out;
  char buf[1 << 16];
  while (in) {
    in.read(buf, sizeof buf);
    out.append(buf, static_cast<size_t>(in.gcount()));
    if (static_cast<int64_t>(out.size()) > max_bytes) throw too_large();
  }
  if (in.bad()) throw std::runtime_error(what + ": reading '" + path + "' failed");
  return out;
}

std::string content_name(const std::string& path) { return is_gzip_file(path) ? path.substr(0, path.size() - 3) : path; }

struct FileContent::Gz {
  std::string path;
  gzFile file = nullptr;
  int64_t position = 0;  // in decompressed bytes
  bool eof = false;
  ~Gz() {
    if (file) gzclose(file);
  }
  std::string error_text() const {
    int code = 0;
    const char* msg = file ? gzerror(file, &code) : "cannot open";
    return "gzip file '" + path + "' at content byte " + std::to_string(position) + ": " + (msg ? msg : "error");
  }
  // Reads up to n bytes into out (fewer at the end of the content).
  int64_t read(char* out, int64_t n) {
    int64_t done = 0;
    while (done < n && !eof) {
      const int got = gzread(file, out + done, static_cast<unsigned>(std::min<int64_t>(n - done, 1 << 30)));
      if (got < 0) throw std::runtime_error(error_text());
      if (got == 0) {
        int code = 0;
        gzerror(file, &code);
        if (code != Z_OK && code != Z_BUF_ERROR) throw std::runtime_error(error_text());
        // zlib reports a truncated stream as a short read with Z_BUF_ERROR: not a clean end of the content.
        if (code == Z_BUF_ERROR) throw std::runtime_error(error_text() + " (truncated)");
        eof = true;
      }
      done += got;
      position += got;
    }
    return done;
  }
};

FileContent::FileContent() = default;
FileContent::~FileContent() = default;
FileContent::FileContent(FileContent&&) noexcept = default;
FileContent& FileContent::operator=(FileContent&&) noexcept = default;

std::string FileContent::read(const std::string& path, int64_t offset, int64_t max_bytes, bool* at_end) {
  std::string out;
  if (!is_gzip_file(path)) {
    const auto size = static_cast<int64_t>(std::filesystem::file_size(path));
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read '" + path + "'");
    in.seekg(offset);
    out.resize(static_cast<size_t>(std::max<int64_t>(0, std::min(max_bytes, size - offset))));
    if (!in.read(out.data(), static_cast<std::streamsize>(out.size())))
      throw std::runtime_error("short read of '" + path + "' at byte " + std::to_string(offset));
    *at_end = offset + static_cast<int64_t>(out.size()) >= size;
    return out;
  }
  if (!gz_ || gz_->path != path || gz_->position > offset) {  // (re)open: another file, or a jump backwards
    gz_ = std::make_unique<Gz>();
    gz_->path = path;
    gz_->file = gzopen(path.c_str(), "rb");
    if (!gz_->file) throw std::runtime_error("cannot open gzip file '" + path + "'");
    gzbuffer(gz_->file, 1 << 17);
  }
  std::string skip(1 << 16, '\0');
  while (gz_->position < offset && !gz_->eof)  // forward to the offset, decompressing
    gz_->read(skip.data(), std::min<int64_t>(static_cast<int64_t>(skip.size()), offset - gz_->position));
  out.resize(static_cast<size_t>(max_bytes));
  out.resize(static_cast<size_t>(gz_->read(out.data(), max_bytes)));
  if (!gz_->eof) {  // exactly at the end? peek one byte
    char c;
    const int got = gzread(gz_->file, &c, 1);
    if (got < 0) throw std::runtime_error(gz_->error_text());
    if (got == 0) {
      int code = 0;
      gzerror(gz_->file, &code);
      if (code == Z_BUF_ERROR) throw std::runtime_error(gz_->error_text() + " (truncated)");
      gz_->eof = true;
    } else {
      gzungetc(c, gz_->file);
    }
  }
  *at_end = gz_->eof;
  return out;
}

}  // namespace fsdp_train
