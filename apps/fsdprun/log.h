// The launcher's own one-line messages on stderr ("fsdprun: ..."), written unbuffered so they interleave
// correctly with the ranks' prefixed output.
#pragma once

#include <unistd.h>

#include <string>

#include "line_pump.h"

namespace fsdprun {

inline void say(const std::string& message) { write_all(STDERR_FILENO, "fsdprun: " + message + "\n"); }

}  // namespace fsdprun
