#pragma once
// One codec per config field type (config_codec.cpp): how a value of that C++ type is read from a TOML node and
// from command-line text, printed as TOML, and named in errors. The field table's rows point to them
// (config_fields.h); parse_toml, apply_overrides, to_toml and config_schema (config.cpp) call only these, so every
// key of a type reads, prints and fails the same way.

#include "config_fields.h"
#include "toml_workaround.h"  // toml++ itself, with the workaround for its 3.3 bug

#include <optional>
#include <string>

namespace fsdp_train {

// Why a value was refused: "expected <expected>, got <got> (<where>)", the key's name put in front by the caller.
// `where` is the TOML node's file:line:col; for command-line text the caller gives the origin.
struct Refusal {
  std::string expected;  // the type's name, or the choices ("one of a | b")
  std::string got;       // the TOML node's kind ("a string"), or the text as written ('x')
  std::string where;
};

// A TOML value's place (file:line:col) and kind ("a string"), as the errors name them.
std::string where(const toml::source_region& source);
const char* toml_type_name(const toml::node& node);

struct FieldCodec {
  const char* type_name;  // "integer", "array of strings", ... (errors and the schema)
  // Sets the member from a TOML value; a Refusal leaves it unspecified (the caller throws).
  std::optional<Refusal> (*from_toml)(void* member, const toml::node& node);
  // Sets the member from command-line text (valid UTF-8, checked by the caller).
  std::optional<Refusal> (*from_text)(void* member, const std::string& text);
  // The member as a TOML value; "" for an unset optional (printed as "# key = (unset)").
  std::string (*print)(const void* member);
  // A bare `--section.key` (no value after it) sets the member to true: booleans only.
  bool bare_flag_is_true;
};

}  // namespace fsdp_train
