// PyTorch DCP metadata and items (see dcp_format.h).
#include "checkpoint/dcp_format.h"

#include "checkpoint/format.h"
#include "checkpoint/pickle.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>

namespace fsdp::checkpoint::detail::dcp {
namespace {

using pickle::Kind;
using pickle::Node;
using pickle::Tree;

constexpr const char* kMd = "torch.distributed.checkpoint.metadata";
constexpr const char* kFs = "torch.distributed.checkpoint.filesystem";

struct DtypeName {
  const char* name;
  c10::ScalarType type;
};
// Canonical names first (what torch.dtype pickles as), then aliases.
const DtypeName kDtypes[] = {
    {"float32", c10::kFloat},        {"float64", c10::kDouble},          {"float16", c10::kHalf},
    {"bfloat16", c10::kBFloat16},    {"int64", c10::kLong},              {"int32", c10::kInt},
    {"int16", c10::kShort},          {"int8", c10::kChar},               {"uint8", c10::kByte},
    {"bool", c10::kBool},            {"complex64", c10::kComplexFloat},  {"complex128", c10::kComplexDouble},
    {"float8_e4m3fn", c10::ScalarType::Float8_e4m3fn},                   {"float8_e5m2", c10::ScalarType::Float8_e5m2},
    {"uint16", c10::ScalarType::UInt16}, {"uint32", c10::ScalarType::UInt32}, {"uint64", c10::ScalarType::UInt64},
    {"float", c10::kFloat},          {"double", c10::kDouble},           {"half", c10::kHalf},
    {"long", c10::kLong},            {"int", c10::kInt},                 {"short", c10::kShort},
};

bool is_dtype_name(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return true;
  }
  return false;
}

// Exactly the globals a torch 2.13 FileSystemWriter `.metadata` holds (reference section 2).
bool metadata_global(const std::string& module, const std::string& name) {
  static const std::set<std::string> md_classes = {"Metadata",         "TensorStorageMetadata", "BytesStorageMetadata",
                                                   "ChunkStorageMetadata", "TensorProperties",  "MetadataIndex",
                                                   "StorageMeta",      "_MEM_FORMAT_ENCODING"};
  if (module == kMd) return md_classes.count(name) > 0;
  if (module == kFs) return name == "_StorageInfo";
  if (module == "torch") return name == "Size" || is_dtype_name(name);
  if (module == "torch.serialization") return name == "_get_layout";
  // pathlib.PosixPath: FileSystemWriter's checkpoint_id (Python 3.13 defines the class in pathlib._local).
  if (module == "pathlib" || module == "pathlib._local") return name == "PosixPath";
  return false;
}

// Typed access to the decoded tree; every failure names the path inside the metadata and the byte offset.
class View {
 public:
  View(const Tree& t, std::string where) : t_(t), where_(std::move(where)) {}
  const Node& n(size_t i) const { return t_.at(i); }

  [[noreturn]] void fail(size_t i, const std::string& path, const std::string& expected) const {
    TORCH_CHECK(false, where_, ": ", path, " (byte ", n(i).offset, "): expected ", expected, ", found ",
                pickle::describe(t_, i));
    throw;
  }
  // An instance of `module.cls` made by NEWOBJ with no arguments (how dataclasses pickle); returns its state
  // (npos when it has none).
  size_t object(size_t i, const std::string& module, const std::string& cls, const std::string& path) const {
    const Node& o = n(i);
    const std::string full = module + "." + cls;
    if (o.kind != Kind::Call || n(o.callable).s != full) fail(i, path, "a " + full);
    if (!o.newobj || !n(o.args).items.empty()) fail(i, path, full + " made by NEWOBJ without arguments");
    return o.state;
  }
  bool is_object(size_t i, const std::string& full) const {
    return n(i).kind == Kind::Call && n(n(i).callable).s == full;
  }
  // A dict with str keys (a dataclass's state, or a str-keyed mapping); duplicate keys are an error.
  std::map<std::string, size_t> str_dict(size_t i, const std::string& path) const {
    const Node& d = n(i);
    if (d.kind != Kind::Dict) fail(i, path, "a dict");
    std::map<std::string, size_t> out;
    for (size_t k = 0; k < d.items.size(); k += 2) {
      if (n(d.items[k]).kind != Kind::Str) fail(d.items[k], path + " key", "a str");
      if (!out.emplace(n(d.items[k]).s, d.items[k + 1]).second) fail(d.items[k], path, "keys given once");
    }
    return out;
  }
  // Dataclass state: known fields only; `required` must be present.
  std::map<std::string, size_t> fields(size_t state, const std::string& path, const std::set<std::string>& known,
                                       const std::set<std::string>& required) const {
    if (state == Node::npos) {
      if (required.empty()) return {};
      TORCH_CHECK(false, where_, ": ", path, ": object without its state (no BUILD)");
    }
    auto f = str_dict(state, path);
    for (const auto& [k, v] : f) {
      if (!known.count(k)) fail(v, path + "." + k, "no field '" + k + "' (unknown to DCP 2.13)");
    }
    for (const auto& r : required) {
      TORCH_CHECK(f.count(r), where_, ": ", path, ": field '", r, "' is missing");
    }
    return f;
  }
  std::string str(size_t i, const std::string& path) const {
    if (n(i).kind != Kind::Str) fail(i, path, "a str");
    return n(i).s;
  }
  int64_t integer(size_t i, const std::string& path) const {
    if (n(i).kind != Kind::Int) fail(i, path, "an int");
    return n(i).i;
  }
  bool boolean(size_t i, const std::string& path) const {
    if (n(i).kind != Kind::Bool) fail(i, path, "a bool");
    return n(i).b;
  }
  // torch.Size((d0, d1, ...)).
  std::vector<int64_t> size(size_t i, const std::string& path) const {
    const Node& o = n(i);
    if (o.kind != Kind::Call || n(o.callable).s != "torch.Size" || o.newobj || o.state != Node::npos)
      fail(i, path, "torch.Size(...)");
    const Node& args = n(o.args);
    if (args.items.size() != 1 || n(args.items[0]).kind != Kind::Tuple) fail(i, path, "torch.Size(<tuple of ints>)");
    std::vector<int64_t> out;
    for (size_t d : n(args.items[0]).items) {
      const int64_t v = integer(d, path + " dim");
      if (v < 0) fail(d, path, "a non-negative size");
      out.push_back(v);
    }
    TORCH_CHECK(out.size() <= 64, where_, ": ", path, ": ", out.size(), " dims");
    return out;
  }
  c10::ScalarType dtype(size_t i, const std::string& path) const {
    const Node& g = n(i);
    if (g.kind == Kind::Global && g.s.rfind("torch.", 0) == 0) {
      const std::string name = g.s.substr(6);
      for (const auto& d : kDtypes) {
        if (name == d.name) return d.type;
      }
    }
    fail(i, path, "a torch dtype (torch.float32, torch.bfloat16, ...)");
  }
  // A REDUCE call of `callable` with exactly one argument of kind `arg`.
  size_t reduce1(size_t i, const std::string& callable, Kind arg, const std::string& path) const {
    const Node& o = n(i);
    if (o.kind != Kind::Call || o.newobj || n(o.callable).s != callable || o.state != Node::npos ||
        n(o.args).items.size() != 1 || n(n(o.args).items[0]).kind != arg) {
      fail(i, path, callable + "(<" + pickle::kind_name(arg) + ">)");
    }
    return n(o.args).items[0];
  }

 private:
  const Tree& t_;
  std::string where_;
};

c10::ScalarType tensor_properties(const View& v, size_t i, const std::string& path) {
  const size_t state = v.object(i, kMd, "TensorProperties", path);
  TORCH_CHECK(state != Node::npos, path, ": TensorProperties without its state");
  const Node& s = v.n(state);
  if (s.kind == Kind::Tuple) {
    // (dtype, layout, requires_grad, memory_format, pin_memory), __getstate__ of torch 2.x.
    if (s.items.size() != 5) v.fail(state, path, "a 5-tuple (dtype, layout, requires_grad, memory_format, pin_memory)");
    const c10::ScalarType dt = v.dtype(s.items[0], path + ".dtype");
    const std::string layout = v.n(v.reduce1(s.items[1], "torch.serialization._get_layout", Kind::Str, path + ".layout")).s;
    if (layout != "torch.strided") v.fail(s.items[1], path + ".layout", "torch.strided (only dense tensors are read)");
    v.boolean(s.items[2], path + ".requires_grad");
    const int64_t mf = v.n(v.reduce1(s.items[3], std::string(kMd) + "._MEM_FORMAT_ENCODING", Kind::Int,
                                     path + ".memory_format")).i;
    if (mf < 0 || mf > 2) v.fail(s.items[3], path + ".memory_format", "_MEM_FORMAT_ENCODING 0, 1 or 2");
    v.boolean(s.items[4], path + ".pin_memory");
    return dt;
  }
  // Dict state (dataclass default): only dtype matters.
  auto f = v.fields(state, path, {"dtype", "layout", "requires_grad", "memory_format", "pin_memory"}, {"dtype"});
  return v.dtype(f.at("dtype"), path + ".dtype");
}

struct IndexKey {
  std::string fqn;
  bool has_offset = false;
  std::vector<int64_t> offset;
  bool operator<(const IndexKey& o) const {
    return std::tie(fqn, has_offset, offset) < std::tie(o.fqn, o.has_offset, o.offset);
  }
};

std::string key_text(const IndexKey& k) {
  std::string s = "'" + k.fqn + "'";
  if (k.has_offset) {
    s += " at offset (";
    for (size_t i = 0; i < k.offset.size(); ++i) s += (i ? ", " : "") + std::to_string(k.offset[i]);
    s += ")";
  }
  return s;
}

// ---- torch.save archives in memory ------------------------------------------------------------------------

class MemoryReadAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  MemoryReadAdapter(const void* data, size_t n) : p_(static_cast<const char*>(data)), n_(n) {}
  size_t size() const override { return n_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* what) const override {
    if (pos >= n_) return 0;
    const size_t k = std::min<size_t>(n, n_ - static_cast<size_t>(pos));
    std::memcpy(buf, p_ + pos, k);
    return k;
  }

 private:
  const char* p_;
  size_t n_;
};

// The data.pkl record of a torch.save archive.
std::string archive_pickle(const void* data, size_t n, const std::string& where) {
  try {
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<MemoryReadAdapter>(data, n));
    TORCH_CHECK(reader.hasRecord("data.pkl"), "no data.pkl record");
    auto [ptr, size] = reader.getRecord("data.pkl");
    return std::string(static_cast<const char*>(ptr.get()), size);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, ": not a readable torch.save archive: ", e.msg());
  }
}

nlohmann::json to_json(const Tree& t, size_t i, int depth, const std::string& where) {
  if (depth > 64) throw ValueNotPlainData(where + ": nested deeper than 64 levels (or cyclic)");
  const Node& n = t.at(i);
  switch (n.kind) {
    case Kind::None: return nullptr;
    case Kind::Bool: return n.b;
    case Kind::Int: return n.i;
    case Kind::Float:
      if (!std::isfinite(n.f)) throw ValueNotPlainData(where + ": holds a non-finite float (not representable in JSON)");
      return n.f;
    case Kind::Str: return n.s;
    case Kind::Tuple:
    case Kind::List: {
      nlohmann::json a = nlohmann::json::array();
      for (size_t k : n.items) a.push_back(to_json(t, k, depth + 1, where));
      return a;
    }
    case Kind::Dict: {
      nlohmann::json o = nlohmann::json::object();
      for (size_t k = 0; k < n.items.size(); k += 2) {
        if (t.at(n.items[k]).kind != Kind::Str)
          throw ValueNotPlainData(where + ": a dict key is a " + pickle::kind_name(t.at(n.items[k]).kind) + ", not a str");
        o[t.at(n.items[k]).s] = to_json(t, n.items[k + 1], depth + 1, where);
      }
      return o;
    }
    case Kind::Bytes: throw ValueNotPlainData(where + ": holds a bytes object (" + std::to_string(n.s.size()) + " bytes)");
    case Kind::Global:
    case Kind::Call: throw ValueNotPlainData(where + ": holds a Python object (" + pickle::describe(t, i) + ")");
  }
  throw ValueNotPlainData(where + ": unreadable value");
}

void json_to_pickle(const nlohmann::json& j, pickle::Writer& w) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: w.none(); return;
    case nlohmann::json::value_t::boolean: w.boolean(j.get<bool>()); return;
    case nlohmann::json::value_t::number_integer: w.integer(j.get<int64_t>()); return;
    case nlohmann::json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      TORCH_CHECK(u <= static_cast<uint64_t>(INT64_MAX), "checkpoint: value ", u, " does not fit 64-bit signed");
      w.integer(static_cast<int64_t>(u));
      return;
    }
    case nlohmann::json::value_t::number_float: w.real(j.get<double>()); return;
    case nlohmann::json::value_t::string: w.str(j.get<std::string>()); return;
    case nlohmann::json::value_t::array:
      w.empty_list();
      w.mark();
      for (const auto& e : j) json_to_pickle(e, w);
      w.appends();
      return;
    case nlohmann::json::value_t::object:
      w.empty_dict();
      w.mark();
      for (auto it = j.begin(); it != j.end(); ++it) {
        w.str(it.key());
        json_to_pickle(it.value(), w);
      }
      w.setitems();
      return;
    default: TORCH_CHECK(false, "checkpoint: value ", j.dump(), " cannot be written as a DCP item");
  }
}

// Python's pickle of torch.Size(tuple(v)).
void write_size(pickle::Writer& w, const std::vector<int64_t>& v) {
  w.global("torch", "Size");
  w.mark();
  w.mark();
  for (int64_t x : v) w.integer(x);
  w.tuple();
  w.tuple();
  w.reduce();
}
void begin_object(pickle::Writer& w, const char* module, const char* cls) {
  w.global(module, cls);
  w.empty_tuple();
  w.newobj();
}

// Where dcp.load's flattening of a TorchTitan state dict puts a flat key: the stateful parts are nested dicts.
std::vector<std::string> planner_path(const std::string& key) {
  for (const char* top : {"optimizer", "train_state", "lr_scheduler", "dataloader", "rng"}) {
    const std::string p = std::string(top) + ".";
    if (key.compare(0, p.size(), p) == 0) return {top, key.substr(p.size())};
  }
  return {key};
}

}  // namespace

std::string torch_dtype_name(c10::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.type == t) return std::string("torch.") + d.name;
  }
  TORCH_CHECK(false, "checkpoint: dtype ", t, " has no PyTorch DCP name");
}

Metadata parse_metadata(const std::string& bytes, const std::string& where) {
  const Tree tree = pickle::parse(bytes.data(), bytes.size(), metadata_global, where);
  const View v(tree, where);
  const size_t root_state = v.object(tree.root, kMd, "Metadata", "Metadata");
  auto root = v.fields(root_state, "Metadata",
                       {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"},
                       {"state_dict_metadata", "storage_data"});
  Metadata md;
  if (root.count("version") && v.n(root["version"]).kind != Kind::None) md.version = v.str(root["version"], "Metadata.version");
  if (root.count("storage_meta") && v.n(root["storage_meta"]).kind != Kind::None) {
    const size_t sm = v.object(root["storage_meta"], kMd, "StorageMeta", "Metadata.storage_meta");
    auto f = v.fields(sm, "Metadata.storage_meta", {"checkpoint_id", "save_id", "load_id", "modules"}, {});
    if (f.count("checkpoint_id")) {
      const size_t id = f["checkpoint_id"];
      const Node& n = v.n(id);
      const bool ok = n.kind == Kind::None || n.kind == Kind::Str ||
                      (n.kind == Kind::Call && !n.newobj && n.state == Node::npos &&
                       (v.n(n.callable).s == "pathlib.PosixPath" || v.n(n.callable).s == "pathlib._local.PosixPath") &&
                       [&] {
                         for (size_t a : v.n(n.args).items) {
                           if (v.n(a).kind != Kind::Str) return false;
                         }
                         return true;
                       }());
      if (!ok) v.fail(id, "Metadata.storage_meta.checkpoint_id", "None, a str or pathlib.PosixPath(<str>...)");
    }
  }
  // planner_data: {flat key: path tuple}; read only for its shape (we flatten keys ourselves).
  if (root.count("planner_data") && v.n(root["planner_data"]).kind != Kind::None) {
    v.str_dict(root["planner_data"], "Metadata.planner_data");
  }

  // storage_data: {MetadataIndex: _StorageInfo}.
  std::map<IndexKey, Item> storage;
  {
    const size_t sd = root["storage_data"];
    const Node& d = v.n(sd);
    if (d.kind != Kind::Dict) v.fail(sd, "Metadata.storage_data", "a dict");
    for (size_t k = 0; k < d.items.size(); k += 2) {
      const std::string path = "Metadata.storage_data[" + std::to_string(k / 2) + "]";
      auto idx = v.fields(v.object(d.items[k], kMd, "MetadataIndex", path + " key"), path + " key",
                          {"fqn", "offset", "index"}, {"fqn"});
      IndexKey key;
      key.fqn = v.str(idx["fqn"], path + ".fqn");
      if (idx.count("offset") && v.n(idx["offset"]).kind != Kind::None) {
        key.has_offset = true;
        key.offset = v.size(idx["offset"], path + ".offset");
      }
      if (idx.count("index") && v.n(idx["index"]).kind != Kind::None) v.integer(idx["index"], path + ".index");
      auto info = v.fields(v.object(d.items[k + 1], kFs, "_StorageInfo", path + " value"), path + " value",
                           {"relative_path", "offset", "length", "transform_descriptors"},
                           {"relative_path", "offset", "length"});
      if (info.count("transform_descriptors") && v.n(info["transform_descriptors"]).kind != Kind::None) {
        v.fail(info["transform_descriptors"], path + ".transform_descriptors",
               "None (items written with stream transforms such as zstd compression are not supported)");
      }
      Item item;
      item.file = v.str(info["relative_path"], path + ".relative_path");
      TORCH_CHECK(is_plain_file_name(item.file), where, ": ", path, ": file '", item.file,
                  "' is not a plain file name inside the checkpoint directory");
      item.offset = v.integer(info["offset"], path + ".offset");
      item.length = v.integer(info["length"], path + ".length");
      TORCH_CHECK(item.offset >= 0 && item.length > 0, where, ": ", path, ": byte range offset ", item.offset,
                  " length ", item.length, " is invalid");
      TORCH_CHECK(storage.emplace(key, item).second, where, ": ", path, ": ", key_text(key), " stored twice");
    }
  }

  auto sdm = v.str_dict(root["state_dict_metadata"], "Metadata.state_dict_metadata");
  std::set<IndexKey> used;
  for (const auto& [fqn, entry] : sdm) {
    const std::string path = "Metadata.state_dict_metadata['" + fqn + "']";
    TORCH_CHECK(!fqn.empty(), where, ": an empty key in state_dict_metadata");
    if (v.is_object(entry, std::string(kMd) + ".BytesStorageMetadata")) {
      v.fields(v.object(entry, kMd, "BytesStorageMetadata", path), path, {}, {});
      auto it = storage.find(IndexKey{fqn, false, {}});
      TORCH_CHECK(it != storage.end(), where, ": ", path, ": value has no storage record");
      used.insert(it->first);
      md.values.emplace(fqn, it->second);
      continue;
    }
    auto f = v.fields(v.object(entry, kMd, "TensorStorageMetadata", path), path, {"properties", "size", "chunks"},
                      {"properties", "size", "chunks"});
    TensorEntry t;
    t.dtype = tensor_properties(v, f["properties"], path + ".properties");
    t.size = v.size(f["size"], path + ".size");
    const Node& chunks = v.n(f["chunks"]);
    if (chunks.kind != Kind::List) v.fail(f["chunks"], path + ".chunks", "a list");
    TORCH_CHECK(chunks.items.size() <= (size_t(1) << 20), where, ": ", path, ": ", chunks.items.size(), " chunks");
    for (size_t c = 0; c < chunks.items.size(); ++c) {
      const std::string cp = path + ".chunks[" + std::to_string(c) + "]";
      auto cf = v.fields(v.object(chunks.items[c], kMd, "ChunkStorageMetadata", cp), cp, {"offsets", "sizes"},
                         {"offsets", "sizes"});
      Chunk ch;
      ch.offsets = v.size(cf["offsets"], cp + ".offsets");
      ch.sizes = v.size(cf["sizes"], cp + ".sizes");
      TORCH_CHECK(ch.offsets.size() == t.size.size() && ch.sizes.size() == t.size.size(), where, ": ", cp,
                  ": offsets/sizes have ", ch.offsets.size(), "/", ch.sizes.size(), " dims, the tensor ", t.size.size());
      const IndexKey key{fqn, true, ch.offsets};
      auto it = storage.find(key);
      TORCH_CHECK(it != storage.end(), where, ": ", cp, ": no storage record for ", key_text(key));
      used.insert(key);
      ch.item = it->second;
      t.chunks.push_back(std::move(ch));
    }
    md.tensors.emplace(fqn, std::move(t));
  }
  for (const auto& [key, item] : storage) {
    TORCH_CHECK(used.count(key), where, ": storage_data holds ", key_text(key),
                ", which no entry of state_dict_metadata uses");
  }
  return md;
}

std::string metadata_pickle(const Metadata& md, const std::string& checkpoint_id) {
  pickle::Writer w;
  begin_object(w, kMd, "Metadata");
  w.empty_dict();
  w.mark();
  // state_dict_metadata
  w.str("state_dict_metadata");
  w.empty_dict();
  w.mark();
  for (const auto& [fqn, t] : md.tensors) {
    w.str(fqn);
    begin_object(w, kMd, "TensorStorageMetadata");
    w.empty_dict();
    w.mark();
    w.str("properties");
    begin_object(w, kMd, "TensorProperties");
    w.mark();
    const std::string dt = torch_dtype_name(t.dtype);
    w.global("torch", dt.substr(6));
    w.global("torch.serialization", "_get_layout");
    w.mark();
    w.str("torch.strided");
    w.tuple();
    w.reduce();
    w.boolean(false);
    w.global(kMd, "_MEM_FORMAT_ENCODING");
    w.mark();
    w.integer(0);  // TORCH_CONTIGUOUS_FORMAT
    w.tuple();
    w.reduce();
    w.boolean(false);
    w.tuple();
    w.build();
    w.str("size");
    write_size(w, t.size);
    w.str("chunks");
    w.empty_list();
    w.mark();
    for (const auto& c : t.chunks) {
      begin_object(w, kMd, "ChunkStorageMetadata");
      w.empty_dict();
      w.mark();
      w.str("offsets");
      write_size(w, c.offsets);
      w.str("sizes");
      write_size(w, c.sizes);
      w.setitems();
      w.build();
    }
    w.appends();
    w.setitems();
    w.build();
  }
  for (const auto& [fqn, item] : md.values) {
    w.str(fqn);
    begin_object(w, kMd, "BytesStorageMetadata");
  }
  w.setitems();
  // planner_data
  w.str("planner_data");
  w.empty_dict();
  w.mark();
  auto path_entry = [&](const std::string& key) {
    w.str(key);
    w.mark();
    for (const auto& p : planner_path(key)) w.str(p);
    w.tuple();
  };
  for (const auto& [fqn, t] : md.tensors) path_entry(fqn);
  for (const auto& [fqn, item] : md.values) path_entry(fqn);
  w.setitems();
  // storage_data
  w.str("storage_data");
  w.empty_dict();
  w.mark();
  auto storage_entry = [&](const std::string& fqn, const std::vector<int64_t>* offset, int64_t index, const Item& it) {
    begin_object(w, kMd, "MetadataIndex");
    w.empty_dict();
    w.mark();
    w.str("fqn");
    w.str(fqn);
    if (offset) {
      w.str("offset");
      write_size(w, *offset);
      w.str("index");
      w.integer(index);
    } else {
      w.str("index");
      w.none();
    }
    w.setitems();
    w.build();
    begin_object(w, kFs, "_StorageInfo");
    w.empty_dict();
    w.mark();
    w.str("relative_path");
    w.str(it.file);
    w.str("offset");
    w.integer(it.offset);
    w.str("length");
    w.integer(it.length);
    w.setitems();
    w.build();
  };
  for (const auto& [fqn, t] : md.tensors) {
    for (size_t c = 0; c < t.chunks.size(); ++c) storage_entry(fqn, &t.chunks[c].offsets, static_cast<int64_t>(c), t.chunks[c].item);
  }
  for (const auto& [fqn, item] : md.values) storage_entry(fqn, nullptr, 0, item);
  w.setitems();
  // storage_meta
  w.str("storage_meta");
  begin_object(w, kMd, "StorageMeta");
  w.empty_dict();
  w.mark();
  w.str("checkpoint_id");
  w.global("pathlib", "PosixPath");
  w.mark();
  w.str(checkpoint_id);
  w.tuple();
  w.reduce();
  w.str("save_id");
  {
    // A fresh id per save (uuid4 text form, as FileSystemWriter records).
    static const char* hexd = "0123456789abcdef";
    std::string id;
    // (not from torch's generator: saving must not move the training RNG)
    std::random_device rd;
    for (int i = 0; i < 32; ++i) {
      if (i == 8 || i == 12 || i == 16 || i == 20) id += '-';
      id += hexd[rd() & 15];
    }
    w.str(id);
  }
  w.str("load_id");
  w.none();
  w.str("modules");
  w.empty_list();
  w.setitems();
  w.build();
  w.str("version");
  w.str(md.version.empty() ? kVersion : md.version);
  w.setitems();
  w.build();
  return w.finish();
}

at::Tensor read_tensor_item(const void* data, size_t n, const std::string& where) {
  c10::IValue v;
  try {
    const auto* p = static_cast<const char*>(data);
    v = torch::jit::pickle_load(std::vector<char>(p, p + n));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, ": not a readable torch.save tensor archive: ", e.msg());
  }
  TORCH_CHECK(v.isTensor(), where, ": the torch.save archive holds a ", v.tagKind(), ", not a tensor");
  return v.toTensor();
}

std::string tensor_item(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  // libtorch's writer stores the whole storage: a view of a larger one is copied first (as torch.save's DCP use).
  if (c.storage_offset() != 0 || c.storage().nbytes() != c.nbytes()) c = c.clone();
  const std::vector<char> bytes = torch::jit::pickle_save(c);
  return std::string(bytes.begin(), bytes.end());
}

std::string read_value_item(const void* data, size_t n, const std::string& where) {
  const std::string pkl = archive_pickle(data, n, where);
  Tree tree;
  try {
    tree = pickle::parse(pkl.data(), pkl.size(), [](const std::string&, const std::string&) { return false; },
                         where + " data.pkl");
  } catch (const c10::Error& e) {
    std::string msg = e.msg();
    if (msg.find("'_codecs.encode'") != std::string::npos) msg += " (a bytes object)";
    throw ValueNotPlainData("not plain data: " + msg);
  }
  return to_json(tree, tree.root, 0, where).dump();
}

std::string value_item(const std::string& json_text) {
  pickle::Writer w;
  json_to_pickle(nlohmann::json::parse(json_text), w);
  const std::string pkl = w.finish();
  std::string out;
  {
    caffe2::serialize::PyTorchStreamWriter zip([&](const void* buf, size_t k) -> size_t {
      out.append(static_cast<const char*>(buf), k);
      return k;
    });
    zip.writeRecord("data.pkl", pkl.data(), pkl.size());
    const char order[] = "little";
    zip.writeRecord("byteorder", order, sizeof order - 1);
    zip.writeEndOfFile();
  }
  return out;
}

}  // namespace fsdp::checkpoint::detail::dcp
