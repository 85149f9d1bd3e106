#pragma once
// What the command-line tools (fsdp-train, fsdp-ckpt, fsdp-plan) share for reporting an error: one line that says
// what was wrong, never a C++ stack dump. Header-only; apps/common/ is on those tools' include path.
//
// libtorch appends a C++ backtrace (a dozen "frame #N: ..." lines) to every c10::Error's what(), including the
// errors a bad file or option raises through TORCH_CHECK, and a message that wraps another error's what() carries
// that backtrace inside its own text. PyTorch shows C++ stack traces only when TORCH_SHOW_CPP_STACKTRACES=1; the
// tools follow the same switch.
#include <c10/util/Exception.h>
#include <c10/util/Lazy.h>
#include <c10/util/Logging.h>

#include <cstdlib>
#include <exception>
#include <memory>
#include <sstream>
#include <string>

namespace fsdp_apps {

inline bool cpp_stacktraces_requested() {
  const char* v = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
  return v && std::string(v) == "1";
}

// Call first in main(): c10::Errors are then raised without collecting a backtrace (unless requested), so none
// can end up inside a message.
inline void hide_cpp_backtraces_unless_requested() {
  if (cpp_stacktraces_requested()) return;
  c10::SetStackTraceFetcher(
      []() -> c10::Backtrace { return std::make_shared<c10::PrecomputedLazyValue<std::string>>(std::string()); });
}

// The message of `e` for the user: a c10::Error's without its backtrace, and without the backtrace lines any
// wrapped error's text still carries ("Exception raised from f at file:line (most recent call first):",
// "frame #N: ..."), unless TORCH_SHOW_CPP_STACKTRACES=1.
inline std::string user_message(const std::exception& e) {
  const auto* ce = dynamic_cast<const c10::Error*>(&e);
  const bool show = cpp_stacktraces_requested();
  const std::string text = ce && !show ? ce->what_without_backtrace() : e.what();
  if (show) return text;
  std::istringstream lines(text);
  std::string out, line;
  while (std::getline(lines, line)) {
    if (line.rfind("Exception raised from ", 0) == 0 || line.rfind("frame #", 0) == 0) continue;
    if (!out.empty()) out += '\n';
    out += line;
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

}  // namespace fsdp_apps
