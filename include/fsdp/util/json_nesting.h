#pragma once
// A utility, not part of the training API: the one bound on how deeply JSON text nests arrays and objects, checked
// on the bytes before any parser sees them. Bounding it first keeps every later recursion shallow (nlohmann's
// dump(), comparisons, a visitor): 100,000 levels of '[' crashed dump() with a stack overflow. The caller words
// the error (file, field, limit), so each reader keeps its own message.
#include <cstddef>
#include <string>
#include <string_view>

namespace fsdp::util {

// The byte offset of the '[' or '{' where the nesting of `text` first goes deeper than `limit` levels, or
// std::string::npos when it never does. One pass; strings (with their escapes) are skipped; the text need not
// be valid JSON (the parser reports that afterwards).
inline size_t json_nesting_beyond(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped character cannot end the string
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return i;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return std::string::npos;
}

}  // namespace fsdp::util
