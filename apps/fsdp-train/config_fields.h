#pragma once
// The config's field table (config_fields.cpp): one row per key — section, key, the JobConfig member it sets, the
// codec of that member's type, help. Private to the config's files (config*.cpp); tools read config_schema().
//
// A row holds no parsing of its own: the codec of its member's C++ type (config_codec.h) reads it from TOML and
// from the command line, prints it and names its type, the same for every key of that type. Adding a key is a
// member in config.h and a row in config_fields.cpp (docs/trainer.md, "Adding a key"); a member of a type with no
// codec does not build (codec_of<T> is defined only for the types config_codec.cpp lists).

#include "config.h"

#include <string>
#include <vector>

namespace fsdp_train {

struct FieldCodec;  // config_codec.h: what a value of one C++ type reads, prints and is called
// The codec of type T (defined in config_codec.cpp for every type a JobConfig member has).
template <class T>
const FieldCodec& codec_of();

// A JobConfig member as the table holds it: its address and its type's codec.
struct FieldValue {
  template <class T>
  FieldValue(T* member) : address(member), codec(&codec_of<T>()) {}  // NOLINT: rows write the bare &member
  void* address;
  const FieldCodec* codec;
};

struct Field {
  const char* section;
  const char* key;
  FieldValue value;
  const char* help;
  bool implemented = true;
};

// The schema: every key the trainer accepts, bound to one JobConfig instance. Section order = TOML/doc order.
std::vector<Field> config_fields(JobConfig& config);

// Shortest text that reads back to the same double, always with a '.' or exponent (a TOML float); the printed
// config's and the errors' form of a float.
std::string format_double(double value);

}  // namespace fsdp_train
