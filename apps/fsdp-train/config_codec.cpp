// One codec per config field type (config_codec.h): the string-choice enums' names, and how each member type of
// JobConfig reads from TOML and from the command line, prints and is named.
#include "config_codec.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <sstream>
#include <type_traits>

namespace fsdp_train {
namespace {

// The spellings of each string-choice enum (config.h), in the order the errors and docs list them.
template <class E>
struct ChoiceName {
  E value;
  const char* text;
};
template <class E>
struct Choices;  // names: the table; case_insensitive: how a text is matched
struct ExactNames {  // the names match exactly (case included), as TorchTitan compares them
  static constexpr bool case_insensitive = false;
};
template <>
struct Choices<MoeScoreFunc> : ExactNames {
  static constexpr ChoiceName<MoeScoreFunc> names[] = {
      {MoeScoreFunc::FlavorDefault, ""}, {MoeScoreFunc::Softmax, "softmax"}, {MoeScoreFunc::Sigmoid, "sigmoid"}};
};
template <>
struct Choices<MoeRouteNorm> : ExactNames {
  static constexpr ChoiceName<MoeRouteNorm> names[] = {
      {MoeRouteNorm::FlavorDefault, ""}, {MoeRouteNorm::On, "true"}, {MoeRouteNorm::Off, "false"}};
};
template <>
struct Choices<OptimizerName> : ExactNames {
  static constexpr ChoiceName<OptimizerName> names[] = {{OptimizerName::AdamW, "AdamW"}, {OptimizerName::Adam, "Adam"}};
};
template <>
struct Choices<DecayType> : ExactNames {
  static constexpr ChoiceName<DecayType> names[] = {
      {DecayType::Linear, "linear"}, {DecayType::Sqrt, "sqrt"}, {DecayType::Cosine, "cosine"}};
};
template <>
struct Choices<Dataset> : ExactNames {
  static constexpr ChoiceName<Dataset> names[] = {{Dataset::CommonLicenses, "common_licenses"},
                                                  {Dataset::CommonLicensesValidation, "common_licenses_validation"},
                                                  {Dataset::Text, "text"},
                                                  {Dataset::Jsonl, "jsonl"},
                                                  {Dataset::Tokens, "tokens"}};
};
template <>
struct Choices<BadRecords> : ExactNames {
  static constexpr ChoiceName<BadRecords> names[] = {{BadRecords::Skip, "skip"}, {BadRecords::Error, "error"}};
};
template <>
struct Choices<MixedPrecision> : ExactNames {
  static constexpr ChoiceName<MixedPrecision> names[] = {{MixedPrecision::Float32, "float32"},
                                                         {MixedPrecision::BFloat16, "bfloat16"}};
};
template <>
struct Choices<ReshardAfterForward> : ExactNames {
  static constexpr ChoiceName<ReshardAfterForward> names[] = {{ReshardAfterForward::Default, "default"},
                                                              {ReshardAfterForward::Always, "always"},
                                                              {ReshardAfterForward::Never, "never"}};
};
template <>
struct Choices<PipelineSchedule> {
  static constexpr bool case_insensitive = true;  // torch's get_schedule_class lowercases the name
  static constexpr ChoiceName<PipelineSchedule> names[] = {{PipelineSchedule::GPipe, "GPipe"},
                                                           {PipelineSchedule::OneFOneB, "1F1B"},
                                                           {PipelineSchedule::LoopedBFS, "LoopedBFS"},
                                                           {PipelineSchedule::Interleaved1F1B, "Interleaved1F1B"},
                                                           {PipelineSchedule::InterleavedZeroBubble, "InterleavedZeroBubble"},
                                                           {PipelineSchedule::ZBVZeroBubble, "ZBVZeroBubble"},
                                                           {PipelineSchedule::DualPipeV, "DualPipeV"}};
};
template <>
struct Choices<ExportDtype> : ExactNames {
  static constexpr ChoiceName<ExportDtype> names[] = {
      {ExportDtype::Float32, "float32"}, {ExportDtype::BFloat16, "bfloat16"}, {ExportDtype::Float16, "float16"}};
};
template <>
struct Choices<AsyncMode> : ExactNames {
  static constexpr ChoiceName<AsyncMode> names[] = {{AsyncMode::Disabled, "disabled"},
                                                    {AsyncMode::Async, "async"},
                                                    {AsyncMode::AsyncWithPinnedMem, "async_with_pinned_mem"}};
};
template <>
struct Choices<CheckpointFormat> : ExactNames {
  static constexpr ChoiceName<CheckpointFormat> names[] = {{CheckpointFormat::Libfsdp, "libfsdp"},
                                                           {CheckpointFormat::Dcp, "dcp"}};
};
template <>
struct Choices<AcMode> : ExactNames {
  static constexpr ChoiceName<AcMode> names[] = {{AcMode::Selective, "selective"}, {AcMode::Full, "full"}, {AcMode::None, "none"}};
};
template <>
struct Choices<AttnMaskType> : ExactNames {
  static constexpr ChoiceName<AttnMaskType> names[] = {{AttnMaskType::Causal, "causal"},
                                                       {AttnMaskType::BlockCausal, "block_causal"}};
};
template <>
struct Choices<CpRotateMethod> : ExactNames {
  static constexpr ChoiceName<CpRotateMethod> names[] = {{CpRotateMethod::AllGather, "allgather"},
                                                         {CpRotateMethod::AllToAll, "alltoall"}};
};
template <>
struct Choices<CpLoadBalancer> : ExactNames {
  static constexpr ChoiceName<CpLoadBalancer> names[] = {{CpLoadBalancer::HeadTail, "headtail"},
                                                         {CpLoadBalancer::None, "none"}};
};
template <>
struct Choices<CheckpointPart> : ExactNames {
  static constexpr ChoiceName<CheckpointPart> names[] = {{CheckpointPart::Optimizer, "optimizer"},
                                                         {CheckpointPart::LrScheduler, "lr_scheduler"},
                                                         {CheckpointPart::Dataloader, "dataloader"},
                                                         {CheckpointPart::TrainState, "train_state"},
                                                         {CheckpointPart::Rng, "rng"}};
};

template <class E>
const char* name_of(E value) {
  for (const auto& n : Choices<E>::names)
    if (n.value == value) return n.text;
  // Unreachable for a value a config can hold: every enumerator is in its table (the schema test prints all),
  // except PipelineSchedule's Csv, which no config text parses to (a schedule file is its own key).
  return "?";
}

bool same_text(std::string_view a, std::string_view b, bool case_insensitive) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto x = static_cast<unsigned char>(a[i]), y = static_cast<unsigned char>(b[i]);
    if (case_insensitive ? std::tolower(x) != std::tolower(y) : x != y) return false;
  }
  return true;
}

// "one of a | b | c" for the errors ("" is shown as "\"\"").
template <class E>
std::string choice_list() {
  std::string list;
  for (const auto& n : Choices<E>::names) list += (list.empty() ? "" : " | ") + std::string(*n.text ? n.text : "\"\"");
  return "one of " + list + (Choices<E>::case_insensitive ? " (case-insensitive)" : "");
}

// A TOML basic string that parses back to `s`, written by toml++ itself: every control character escaped
// (a hand-written quote() missed "\r", so a config with one was accepted but its re-written config.toml was not;
// found by fuzzing), no multi-line form (format_flags::none), non-ASCII as \uXXXX escapes.
std::string quote(const std::string& s) {
  std::ostringstream os;
  os << toml::toml_formatter(toml::table{{"k", s}}, toml::format_flags::none);
  std::string line = os.str();  // k = "..."
  const size_t start = line.find('"');
  const size_t end = line.rfind('"');
  return line.substr(start, end - start + 1);
}

// "[a, b]": a list's TOML form, each item printed by `item`.
template <class List, class Print>
std::string print_list(const List& list, Print item) {
  std::string s = "[";
  for (size_t i = 0; i < list.size(); ++i) s += (i ? ", " : "") + item(list[i]);
  return s + "]";
}

// The comma-separated items of command-line text, empty items dropped (every list key's command-line form).
std::vector<std::string> split_items(const std::string& text, char separator = ',') {
  std::vector<std::string> items;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, separator))
    if (!item.empty()) items.push_back(item);
  return items;
}

// The refusals every codec gives: a TOML value of the wrong kind (the whole value's kind and place, also for a
// list with one bad item), and command-line text that is not a value of the type.
Refusal wrong_node(const char* type_name, const toml::node& node) {
  return {type_name, toml_type_name(node), where(node.source())};
}
Refusal wrong_text(const char* type_name, const std::string& text) { return {type_name, "'" + text + "'", ""}; }

// Whether a TOML value is an array of strings (every list-of-strings type's first check).
bool is_string_array(const toml::node& node) {
  if (!node.is_array()) return false;
  for (const auto& e : *node.as_array())
    if (!e.is_string()) return false;
  return true;
}

// ---- the codecs: one per member type of JobConfig ----
template <class T, class = void>
struct Codec;  // a member type with no codec: no codec_of<T> instance, so its table row does not link

template <>
struct Codec<bool> {
  static constexpr const char* type_name = "boolean";
  static std::optional<Refusal> from_toml(bool& v, const toml::node& n) {
    if (!n.is_boolean()) return wrong_node(type_name, n);
    v = n.as_boolean()->get();
    return std::nullopt;
  }
  static std::optional<Refusal> from_text(bool& v, const std::string& text) {
    if (text == "true" || text == "1") v = true;
    else if (text == "false" || text == "0") v = false;
    else return wrong_text(type_name, text);
    return std::nullopt;
  }
  static std::string print(const bool& v) { return v ? "true" : "false"; }
};

template <>
struct Codec<int64_t> {
  static constexpr const char* type_name = "integer";
  static std::optional<Refusal> from_toml(int64_t& v, const toml::node& n) {
    if (!n.is_integer()) return wrong_node(type_name, n);
    v = n.as_integer()->get();
    return std::nullopt;
  }
  static std::optional<Refusal> from_text(int64_t& v, const std::string& text) {
    char* end = nullptr;
    errno = 0;
    const long long x = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno == ERANGE) return wrong_text(type_name, text);
    v = x;
    return std::nullopt;
  }
  static std::string print(const int64_t& v) { return std::to_string(v); }
};

// A float key takes a TOML integer too (lr = 1 is 1.0).
template <>
struct Codec<double> {
  static constexpr const char* type_name = "float";
  static std::optional<Refusal> read(double& v, const toml::node& n, const char* name) {
    if (n.is_integer()) v = static_cast<double>(n.as_integer()->get());
    else if (n.is_floating_point()) v = n.as_floating_point()->get();
    else return wrong_node(name, n);
    return std::nullopt;
  }
  static std::optional<Refusal> read(double& v, const std::string& text, const char* name) {
    char* end = nullptr;
    const double x = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0') return wrong_text(name, text);
    v = x;
    return std::nullopt;
  }
  static std::optional<Refusal> from_toml(double& v, const toml::node& n) { return read(v, n, type_name); }
  static std::optional<Refusal> from_text(double& v, const std::string& text) { return read(v, text, type_name); }
  static std::string print(const double& v) { return format_double(v); }
};

// Unset in TOML by leaving the key out; on the command line by "", "none" or "None" (Python's spelling).
template <>
struct Codec<std::optional<double>> {
  static constexpr const char* type_name = "float (optional)";
  static std::optional<Refusal> from_toml(std::optional<double>& v, const toml::node& n) {
    double x = 0;
    if (auto refused = Codec<double>::read(x, n, type_name)) return refused;
    v = x;
    return std::nullopt;
  }
  static std::optional<Refusal> from_text(std::optional<double>& v, const std::string& text) {
    if (text.empty() || text == "none" || text == "None") {
      v.reset();
      return std::nullopt;
    }
    double x = 0;
    if (auto refused = Codec<double>::read(x, text, type_name)) return refused;
    v = x;
    return std::nullopt;
  }
  static std::string print(const std::optional<double>& v) { return v ? format_double(*v) : ""; }
};

template <>
struct Codec<std::string> {
  static constexpr const char* type_name = "string";
  static std::optional<Refusal> from_toml(std::string& v, const toml::node& n) {
    if (!n.is_string()) return wrong_node(type_name, n);
    v = n.as_string()->get();
    return std::nullopt;
  }
  static std::optional<Refusal> from_text(std::string& v, const std::string& text) {
    v = text;
    return std::nullopt;
  }
  static std::string print(const std::string& v) { return quote(v); }
};

// On the command line: comma-separated, empty items dropped.
template <>
struct Codec<std::vector<std::string>> {
  static constexpr const char* type_name = "array of strings";
  static std::optional<Refusal> from_toml(std::vector<std::string>& v, const toml::node& n) {
    if (!is_string_array(n)) return wrong_node(type_name, n);
    v.clear();
    for (const auto& e : *n.as_array()) v.push_back(e.as_string()->get());
    return std::nullopt;
  }
  static std::optional<Refusal> from_text(std::vector<std::string>& v, const std::string& text) {
    v = split_items(text);
    return std::nullopt;
  }
  static std::string print(const std::vector<std::string>& v) { return print_list(v, quote); }
};

// On the command line: groups separated by ';', items by ',' ("tok_embeddings,layers.0;layers.1,norm").
template <>
struct Codec<std::vector<std::vector<std::string>>> {
  static constexpr const char* type_name = "array of arrays of strings";
  static std::optional<Refusal> from_toml(std::vector<std::vector<std::string>>& v, const toml::node& n) {
    if (!n.is_array()) return wrong_node(type_name, n);
    v.clear();
    for (const auto& row : *n.as_array()) {
      if (!is_string_array(row)) return wrong_node(type_name, n);
      v.emplace_back();
      for (const auto& e : *row.as_array()) v.back().push_back(e.as_string()->get());
    }
    return std::nullopt;
  }
  static std::optional<Refusal> from_text(std::vector<std::vector<std::string>>& v, const std::string& text) {
    v.clear();
    std::stringstream groups(text);
    std::string group;
    while (std::getline(groups, group, ';')) v.push_back(split_items(group));
    return std::nullopt;
  }
  static std::string print(const std::vector<std::vector<std::string>>& v) {
    return print_list(v, [](const std::vector<std::string>& row) { return print_list(row, quote); });
  }
};

// A string-choice enum: its TOML value is one of the names in Choices<E>; a name not among them is refused with
// the choices, the text and the place.
template <class E>
struct Codec<E, std::enable_if_t<std::is_enum_v<E>>> {
  static constexpr const char* type_name = "string";
  static std::optional<Refusal> parse(E& v, const std::string& text, std::string where_written) {
    const auto value = parse_choice<E>(text);
    if (!value) return Refusal{choice_list<E>(), "'" + text + "'", std::move(where_written)};
    v = *value;
    return std::nullopt;
  }
  static std::optional<Refusal> from_toml(E& v, const toml::node& n) {
    if (!n.is_string()) return wrong_node(type_name, n);
    return parse(v, n.as_string()->get(), where(n.source()));
  }
  static std::optional<Refusal> from_text(E& v, const std::string& text) { return parse(v, text, ""); }
  static std::string print(const E& v) { return quote(name_of(v)); }
};

// A list of string-choice enums (checkpoint.exclude_from_loading); on the command line comma-separated.
template <class E>
struct Codec<std::vector<E>, std::enable_if_t<std::is_enum_v<E>>> {
  static constexpr const char* type_name = "array of strings";
  static std::optional<Refusal> from_toml(std::vector<E>& v, const toml::node& n) {
    if (!is_string_array(n)) return wrong_node(type_name, n);
    v.clear();
    for (const auto& e : *n.as_array())
      if (auto refused = Codec<E>::parse(v.emplace_back(), e.as_string()->get(), where(e.source()))) return refused;
    return std::nullopt;
  }
  static std::optional<Refusal> from_text(std::vector<E>& v, const std::string& text) {
    v.clear();
    for (const auto& item : split_items(text))
      if (auto refused = Codec<E>::parse(v.emplace_back(), item, "")) return refused;
    return std::nullopt;
  }
  static std::string print(const std::vector<E>& v) {
    return print_list(v, [](E e) { return quote(name_of(e)); });
  }
};

// "op" or an integer k, kept as written otherwise: validate() refuses unparsed text only in selective mode.
template <>
struct Codec<SelectiveAcOption> {
  static constexpr const char* type_name = "string";
  static std::optional<Refusal> from_toml(SelectiveAcOption& v, const toml::node& n) {
    if (!n.is_string()) return wrong_node(type_name, n);
    v = SelectiveAcOption::parse(n.as_string()->get());
    return std::nullopt;
  }
  static std::optional<Refusal> from_text(SelectiveAcOption& v, const std::string& text) {
    v = SelectiveAcOption::parse(text);
    return std::nullopt;
  }
  static std::string print(const SelectiveAcOption& v) { return quote(v.to_string()); }
};

}  // namespace

std::string format_double(double v) {
  std::string s;
  for (int prec = 6; prec <= 17; ++prec) {
    std::ostringstream os;
    os.precision(prec);
    os << v;
    s = os.str();
    if (std::strtod(s.c_str(), nullptr) == v) break;
  }
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

std::string where(const toml::source_region& src) {
  std::ostringstream os;
  os << (src.path ? *src.path : std::string("<config>")) << ":" << src.begin.line << ":" << src.begin.column;
  return os.str();
}

const char* toml_type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    default: return "a date/time";
  }
}

template <class T>
const FieldCodec& codec_of() {
  static const FieldCodec codec = {
      Codec<T>::type_name,
      [](void* member, const toml::node& node) { return Codec<T>::from_toml(*static_cast<T*>(member), node); },
      [](void* member, const std::string& text) { return Codec<T>::from_text(*static_cast<T*>(member), text); },
      [](const void* member) { return Codec<T>::print(*static_cast<const T*>(member)); },
      std::is_same_v<T, bool>};
  return codec;
}

template const FieldCodec& codec_of<bool>();
template const FieldCodec& codec_of<int64_t>();
template const FieldCodec& codec_of<double>();
template const FieldCodec& codec_of<std::optional<double>>();
template const FieldCodec& codec_of<std::string>();
template const FieldCodec& codec_of<std::vector<std::string>>();
template const FieldCodec& codec_of<std::vector<std::vector<std::string>>>();
template const FieldCodec& codec_of<SelectiveAcOption>();

template <class E>
std::optional<E> parse_choice(std::string_view text) {
  for (const auto& n : Choices<E>::names)
    if (same_text(text, n.text, Choices<E>::case_insensitive)) return n.value;
  return std::nullopt;
}

// Per string-choice enum: its to_string, parse_choice and codecs (as a member and as a list of members).
#define FSDP_TRAIN_CHOICE_ENUM(E)                                      \
  const char* to_string(E v) { return name_of(v); }                  \
  template std::optional<E> parse_choice<E>(std::string_view text);  \
  template const FieldCodec& codec_of<E>();                          \
  template const FieldCodec& codec_of<std::vector<E>>();
FSDP_TRAIN_CHOICE_ENUM(MoeScoreFunc)
FSDP_TRAIN_CHOICE_ENUM(MoeRouteNorm)
FSDP_TRAIN_CHOICE_ENUM(OptimizerName)
FSDP_TRAIN_CHOICE_ENUM(DecayType)
FSDP_TRAIN_CHOICE_ENUM(Dataset)
FSDP_TRAIN_CHOICE_ENUM(BadRecords)
FSDP_TRAIN_CHOICE_ENUM(MixedPrecision)
FSDP_TRAIN_CHOICE_ENUM(ReshardAfterForward)
FSDP_TRAIN_CHOICE_ENUM(PipelineSchedule)
FSDP_TRAIN_CHOICE_ENUM(ExportDtype)
FSDP_TRAIN_CHOICE_ENUM(AsyncMode)
FSDP_TRAIN_CHOICE_ENUM(CheckpointFormat)
FSDP_TRAIN_CHOICE_ENUM(AcMode)
FSDP_TRAIN_CHOICE_ENUM(AttnMaskType)
FSDP_TRAIN_CHOICE_ENUM(CpRotateMethod)
FSDP_TRAIN_CHOICE_ENUM(CpLoadBalancer)
FSDP_TRAIN_CHOICE_ENUM(CheckpointPart)
#undef FSDP_TRAIN_CHOICE_ENUM

SelectiveAcOption SelectiveAcOption::parse(const std::string& text) {
  if (text == "op") return op();
  // At most 9 digits: any k fits int64_t (and no real model has more blocks).
  const bool every_k = !text.empty() && text.size() <= 9 &&
                       std::all_of(text.begin(), text.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  if (every_k) return every_kth(std::stoll(text));
  return {Kind::Unparsed, 0, text};
}

std::string SelectiveAcOption::to_string() const {
  switch (kind) {
    case Kind::Op: return "op";
    case Kind::EveryKth: return std::to_string(k);
    default: return unparsed;
  }
}

}  // namespace fsdp_train
