#pragma once
// A restricted pickle reader and a small pickle writer, for PyTorch DCP's `.metadata` and the non-tensor items
// of its data files. Python's pickle is a program for a stack machine whose GLOBAL/REDUCE/NEWOBJ/BUILD opcodes
// import and call arbitrary code; PyTorch reads DCP metadata with plain pickle.load (pytorch#189308). This
// reader executes nothing: it decodes the opcodes into a tree of data (numbers, strings, tuples, lists,
// dicts) in which a global is only a name and a call is only a record "callable(args)" with its BUILD state.
// Globals are admitted by an allowlist (anything else is an error naming it and its byte offset); what the
// records mean is decided by the caller (dcp_format.cpp), which checks every shape it relies on.
//
// Limits against hostile input: binary opcodes of protocols 2-5 only (no text protocol 0/1 forms, no
// persistent ids, sets, extensions or out-of-band buffers), integers of at most 64 bits, every length
// checked against the bytes left, a bounded stack and memo. The tree lives in one arena (indices, no owning
// pointers), so cycles built through the memo cannot leak or recurse; readers of the tree bound their depth.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail::pickle {

enum class Kind { None, Bool, Int, Float, Str, Bytes, Tuple, List, Dict, Global, Call };

struct Node {
  Kind kind = Kind::None;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;              // Str, Bytes; Global: "module.name"
  std::vector<size_t> items;  // Tuple, List; Dict: key0, value0, key1, value1, ... (in insertion order)
  // Call: callable (a Global node), args (a Tuple node), how it was made, and its BUILD state (npos: none).
  size_t callable = npos, args = npos, state = npos;
  bool newobj = false;        // NEWOBJ (cls.__new__(cls, *args)) rather than REDUCE (callable(*args))
  int64_t offset = 0;         // byte offset of the opcode that made the node (for errors)
  static constexpr size_t npos = static_cast<size_t>(-1);
};

struct Tree {
  std::vector<Node> nodes;
  size_t root = Node::npos;
  const Node& at(size_t i) const { return nodes.at(i); }
};

// Which globals ("module", "name") may appear. Everything else is refused while decoding.
using GlobalFilter = std::function<bool(const std::string& module, const std::string& name)>;

// Decodes one pickle (up to its STOP; trailing bytes are an error). `where` names the input in errors, which
// read "<where>: byte <offset>: ...".
Tree parse(const void* data, size_t size, const GlobalFilter& allowed, const std::string& where);

// Python-like rendering of a node for error messages (depth- and length-bounded).
std::string describe(const Tree& t, size_t node);
const char* kind_name(Kind k);

// Writes a protocol-2 pickle (what torch.save and Python's pickle.load read); the caller emits the opcodes
// in stack order: e.g. global + mark + items + tuple + reduce.
class Writer {
 public:
  Writer();  // PROTO 2
  void none();
  void boolean(bool v);
  void integer(int64_t v);
  void real(double v);
  void str(const std::string& v);
  void global(const std::string& module, const std::string& name);
  void mark();
  void tuple();  // from the last mark
  void empty_tuple();
  void empty_list();
  void empty_dict();
  void appends();   // from the last mark into the list below it
  void setitems();  // from the last mark into the dict below it
  void reduce();
  void newobj();
  void build();
  std::string finish();  // STOP; returns the bytes

 private:
  std::string out_;
};

}  // namespace fsdp::checkpoint::detail::pickle
