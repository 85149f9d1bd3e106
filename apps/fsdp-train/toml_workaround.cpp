// The scanning half of the toml++ 3.3 workaround; see toml_workaround.h for the bug.
#include "toml_workaround.h"

#include "config.h"  // ConfigError

#include <cstdint>

namespace fsdp_train {

// TOML allows non-ASCII characters only inside strings and comments. Checked before toml++ sees the text, with a
// clear error, because toml++ 3.3 misclassifies some of them as whitespace candidates (see toml_workaround.h).
// Where a string really starts matters: toml++ reads a value that does not start with a quote as one bare token up
// to a value terminator (whitespace, newline, ']', '}', ',', '#'), quotes included, classifying every character
// on the way. So in `interval = 500[g"§"` the '"' opens no string, and the '§' reaches the faulty classifier
// (found by fuzzing: tests/fuzz/corpus/toml_config/regression_quote_in_bare_value.toml). The scan therefore
// tracks where a value is expected (after '=', and after '[' or ',' inside an array) and treats such bare tokens
// as toml++ does. In a multi-line basic string, a non-ASCII character right after a backslash, or after a
// line-ending backslash and the whitespace it trims, is rejected too (tests/fuzz/corpus/toml_config/
// regression_backslash_nonascii.toml).
void reject_non_ascii_outside_strings(std::string_view t, const std::string& source) {
  enum class S { kNormal, kComment, kBasic, kLiteral, kMlBasic, kMlLiteral, kBareValue } st = S::kNormal;
  std::string nesting;        // open '[' (array values) and '{' (inline tables), innermost last
  bool expect_value = false;  // the next non-blank character starts a value
  int64_t line = 1, col = 1;
  size_t i = t.substr(0, 3) == "\xEF\xBB\xBF" ? 3 : 0;  // a leading UTF-8 byte order mark is fine
  auto fail = [&](const char* what) {
    throw ConfigError("config error: invalid TOML: " + std::string(what) + " (" + source + ":" + std::to_string(line) +
                      ":" + std::to_string(col) + ")");
  };
  auto starts = [&](const char* s) { return t.substr(i, std::char_traits<char>::length(s)) == s; };
  auto advance = [&](size_t n) {
    for (size_t k = 0; k < n && i < t.size(); ++k, ++i) {
      if (t[i] == '\n') { ++line; col = 1; } else if ((static_cast<unsigned char>(t[i]) & 0xC0) != 0x80) { ++col; }
    }
  };
  auto ends_bare_value = [](unsigned char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == ']' || c == '}' || c == ',' || c == '#';
  };
  while (i < t.size()) {
    const unsigned char c = static_cast<unsigned char>(t[i]);
    switch (st) {
      case S::kNormal:
        if (c >= 0x80) fail("a non-ASCII character outside a string or comment");
        if (c == '#') { st = S::kComment; break; }
        if (c == ' ' || c == '\t' || c == '\r') break;
        if (c == '\n') {
          if (nesting.empty()) expect_value = false;
          break;
        }
        if (starts("\"\"\"")) { st = S::kMlBasic; expect_value = false; advance(3); continue; }
        if (starts("'''")) { st = S::kMlLiteral; expect_value = false; advance(3); continue; }
        if (c == '"') { st = S::kBasic; expect_value = false; break; }
        if (c == '\'') { st = S::kLiteral; expect_value = false; break; }
        if (c == '[' && (expect_value || !nesting.empty())) {
          nesting.push_back('[');  // an array value (a '[' at a line's start is a table header)
          expect_value = true;
          break;
        }
        if (c == '{') {
          nesting.push_back('{');
          expect_value = false;  // a key comes first
          break;
        }
        if (c == ']' || c == '}') {
          if (!nesting.empty()) nesting.pop_back();
          expect_value = false;
          break;
        }
        if (c == ',') {
          expect_value = !nesting.empty() && nesting.back() == '[';
          break;
        }
        if (c == '=') {
          expect_value = true;
          break;
        }
        if (expect_value) {
          st = S::kBareValue;  // a number, boolean, date...: one token up to a value terminator
          expect_value = false;
        }
        break;
      case S::kBareValue:
        if (c >= 0x80) fail("a non-ASCII character in a value that is not a quoted string");
        if (ends_bare_value(c)) {
          st = S::kNormal;
          continue;  // the terminator is read again, as structure
        }
        break;
      case S::kComment:
        if (c == '\n') { st = S::kNormal; continue; }
        break;
      case S::kBasic:
        if (c == '\\') { advance(2); continue; }
        if (c == '"' || c == '\n') st = S::kNormal;
        break;
      case S::kLiteral:
        if (c == '\'' || c == '\n') st = S::kNormal;
        break;
      case S::kMlBasic:
        if (starts("\"\"\"")) { st = S::kNormal; advance(3); continue; }
        if (c == '\\') {
          // toml++ asks whether the character after a backslash is whitespace (a line-ending backslash), and
          // after one, whether the next line starts with whitespace: neither may be a non-ASCII character.
          size_t j = i + 1;
          while (j < t.size() && (t[j] == ' ' || t[j] == '\t' || t[j] == '\r' || t[j] == '\n')) ++j;
          if (j < t.size() && static_cast<unsigned char>(t[j]) >= 0x80) {
            advance(j - i);
            fail("a non-ASCII character right after a backslash in a multi-line string (not supported by toml++ 3.3)");
          }
          advance(2);
          continue;
        }
        break;
      case S::kMlLiteral:
        if (starts("'''")) { st = S::kNormal; advance(3); continue; }
        break;
    }
    advance(1);
  }
}

}  // namespace fsdp_train
