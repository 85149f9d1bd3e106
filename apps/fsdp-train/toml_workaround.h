#pragma once
// toml++ for fsdp-train's config parser, with a workaround for a bug of toml++ 3.3 (the version Debian ships).
//
// The bug: toml++ marks "impossible" branches with TOML_UNREACHABLE (= __builtin_unreachable()), and its generated
// character classifier is_non_ascii_horizontal_whitespace() does reach one for some non-ASCII characters outside
// strings (e.g. U+FEFE in a bare key; found by fuzzing, tests/fuzz/corpus/toml_config/regression_*). Reaching
// __builtin_unreachable() is undefined behaviour: in practice a crash or a wrong parse, never an error message.
//
// The workaround has two halves, both here so that no other file includes toml++ without them:
//   1. this header redefines TOML_UNREACHABLE as std::abort() before toml++ is included, so the bug, if still
//      reached, is a defined abort rather than undefined behaviour (toml++ is header-only: the parser is compiled
//      in the file that includes this header, with this definition);
//   2. reject_non_ascii_outside_strings() scans the text before toml++ sees it and rejects what could reach the
//      faulty classifier with a ConfigError naming file:line:col. Non-ASCII characters outside strings and
//      comments are not valid TOML anyway, so no valid config is refused.
// Drop both only when the toml++ in use no longer has the bug (the toml_config fuzzer's regression inputs show it).

#include <cstdlib>
#include <string>
#include <string_view>

#include <toml++/impl/preprocessor.h>
#undef TOML_UNREACHABLE
#define TOML_UNREACHABLE ::std::abort()
#include <toml++/toml.h>

namespace fsdp_train {

// Throws ConfigError ("invalid TOML: ... (source:line:col)") for a non-ASCII character where toml++ 3.3 would
// classify it: outside strings and comments, inside a bare (unquoted) value, or right after a backslash in a
// multi-line basic string. `source` names the text in the error (a path or "<embedded ...>").
void reject_non_ascii_outside_strings(std::string_view text, const std::string& source);

}  // namespace fsdp_train
