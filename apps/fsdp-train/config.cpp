// The config's entry points (config.h): a TOML file and command-line overrides read through the field table
// (config_fields.cpp), each value by its type's codec (config_codec.cpp); the effective config printed back as
// TOML; the rules in config_rules.cpp.
#include "config.h"

#include "config_codec.h"
#include "file_content.h"

#include <sstream>

namespace fsdp_train {
namespace {

std::string known_keys(const std::vector<Field>& fs, const std::string& section) {
  std::string s;
  for (const auto& f : fs)
    if (section == f.section) s += (s.empty() ? "" : ", ") + std::string(f.key);
  return s;
}

std::string known_sections(const std::vector<Field>& fs) {
  std::string s, last;
  for (const auto& f : fs) {
    if (last == f.section) continue;
    last = f.section;
    s += (s.empty() ? "" : ", ") + last;
  }
  return s;
}

Field* find_field(std::vector<Field>& fs, const std::string& section, const std::string& key) {
  for (auto& f : fs)
    if (section == f.section && key == f.key) return &f;
  return nullptr;
}

bool has_section(const std::vector<Field>& fs, const std::string& section) {
  for (const auto& f : fs)
    if (section == f.section) return true;
  return false;
}

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points above U+10FFFF), as TOML
// requires of a file; a command-line value must be too, or to_toml() would write an escape that reads back as
// other text (found by fuzzing: "/tmp/fu\xC7zz" came back as "/tmp/fu\u00C7zz").
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b >> 6) != 0x2) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    const uint32_t min_cp[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

// "config error: <section.key>: expected <type or choices>, got <value> (<where>)": every refused value.
[[noreturn]] void refuse(const Field& f, const Refusal& r) {
  throw ConfigError("config error: " + std::string(f.section) + "." + f.key + ": expected " + r.expected + ", got " +
                    r.got + " (" + r.where + ")");
}

void set_from_node(const Field& f, const toml::node& node) {
  if (auto refused = f.value.codec->from_toml(f.value.address, node)) refuse(f, *refused);
}

void set_from_text(const Field& f, const std::string& text, const std::string& origin) {
  if (!valid_utf8(text))
    throw ConfigError("config error: " + std::string(f.section) + "." + f.key + ": the value is not valid UTF-8 (" +
                      origin + ")");
  if (auto refused = f.value.codec->from_text(f.value.address, text)) {
    refused->where = origin;
    refuse(f, *refused);
  }
}

std::string value_text(const Field& f) { return f.value.codec->print(f.value.address); }

}  // namespace

std::vector<KeyInfo> config_schema() {
  JobConfig defaults;
  std::vector<KeyInfo> out;
  for (const auto& f : config_fields(defaults)) {
    std::string def = value_text(f);
    out.push_back({f.section, f.key, f.value.codec->type_name, def.empty() ? "(unset)" : def, f.help, f.implemented});
  }
  return out;
}

JobConfig parse_toml(std::string_view text, const std::string& source) {
  reject_non_ascii_outside_strings(text, source);
  JobConfig config;
  auto fs = config_fields(config);
  toml::table tbl;
  try {
    tbl = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw ConfigError("config error: invalid TOML: " + std::string(e.description()) + " (" + where(e.source()) + ")");
  }
  for (const auto& [section_key, section_node] : tbl) {
    const std::string section(section_key.str());
    if (!has_section(fs, section))
      throw ConfigError("config error: unknown section [" + section + "] (" + where(section_key.source()) +
                        "); known sections: " + known_sections(fs));
    if (!section_node.is_table())
      throw ConfigError("config error: " + section + ": expected a table [" + section + "], got " +
                        toml_type_name(section_node) + " (" + where(section_node.source()) + ")");
    for (const auto& [key, node] : *section_node.as_table()) {
      const std::string k(key.str());
      Field* f = find_field(fs, section, k);
      if (!f)
        throw ConfigError("config error: unknown key '" + section + "." + k + "' (" + where(key.source()) +
                          "); known keys in [" + section + "]: " + known_keys(fs, section));
      set_from_node(*f, node);
    }
  }
  return config;
}

void apply_overrides(JobConfig& config, const std::vector<std::string>& args) {
  auto fs = config_fields(config);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0)
      throw ConfigError("config error: unexpected argument '" + arg + "' (expected --section.key value)");
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (name == "config" || name == "job.config_file") {  // consumed by load_config
      if (!has_value) ++i;
      continue;
    }
    const auto dot = name.find('.');
    const std::string section = dot == std::string::npos ? name : name.substr(0, dot);
    const std::string key = dot == std::string::npos ? "" : name.substr(dot + 1);
    Field* f = find_field(fs, section, key);
    if (!f) {
      if (!has_section(fs, section))
        throw ConfigError("config error: unknown command-line option '--" + name + "'; known sections: " + known_sections(fs));
      throw ConfigError("config error: unknown key '" + name + "' (command line); known keys in [" + section +
                        "]: " + known_keys(fs, section));
    }
    if (!has_value) {
      const bool next_is_value = i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0;
      if (f->value.codec->bare_flag_is_true && !next_is_value) {
        value = "true";  // a bare boolean flag
      } else {
        if (i + 1 >= args.size())
          throw ConfigError("config error: --" + name + ": missing value (expected " + f->value.codec->type_name + ")");
        value = args[++i];
      }
    }
    set_from_text(*f, value, "command line --" + name);
  }
}

JobConfig load_config(const std::vector<std::string>& args) {
  std::string path;
  for (size_t i = 0; i < args.size(); ++i) {
    for (const std::string opt : {"--config", "--job.config_file"}) {
      if (args[i] == opt) {
        if (i + 1 >= args.size()) throw ConfigError("config error: " + opt + ": missing file name");
        path = args[i + 1];
      } else if (args[i].rfind(opt + "=", 0) == 0) {
        path = args[i].substr(opt.size() + 1);
      }
    }
  }
  JobConfig config;
  if (path.empty()) {
    config = parse_toml(embedded_default_config(), "<embedded configs/debug.toml>");
  } else {
    // Bounded (a job config is a few kB; --config /dev/zero must not fill the memory), and a directory is an
    // error, not an empty file that would train on the defaults.
    std::string text;
    try {
      text = read_bounded_file(path, kMaxConfigFileBytes, "--config");
    } catch (const std::runtime_error& e) {
      throw ConfigError(std::string("config error: ") + e.what());
    }
    config = parse_toml(text, path);
  }
  apply_overrides(config, args);
  validate(config);
  return config;
}

std::string to_toml(const JobConfig& config_in) {
  JobConfig config = config_in;  // config_fields() binds non-const pointers
  std::ostringstream os;
  std::string last;
  for (const auto& f : config_fields(config)) {
    if (last != f.section) {
      os << (last.empty() ? "" : "\n") << "[" << f.section << "]\n";
      last = f.section;
    }
    const std::string v = value_text(f);
    if (v.empty()) os << "# " << f.key << " = (unset)\n";
    else os << f.key << " = " << v << "\n";
  }
  return os.str();
}

}  // namespace fsdp_train
