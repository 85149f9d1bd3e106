// Restricted pickle decoding and protocol-2 pickle writing (see pickle.h).
#include "checkpoint/pickle.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <sstream>
#include <unordered_map>

namespace fsdp::checkpoint::detail::pickle {
namespace {

constexpr size_t kMaxStack = size_t(1) << 22;
constexpr size_t kMaxMarks = size_t(1) << 16;
constexpr size_t kMaxMemo = size_t(1) << 24;
constexpr size_t kMaxGlobalName = 256;

// Every opcode of pickle protocols 0-5 (Lib/pickle.py), for messages naming what was refused.
const char* opcode_name(uint8_t op) {
  switch (op) {
    case '(': return "MARK";
    case '.': return "STOP";
    case '0': return "POP";
    case '1': return "POP_MARK";
    case '2': return "DUP";
    case 'F': return "FLOAT";
    case 'I': return "INT";
    case 'J': return "BININT";
    case 'K': return "BININT1";
    case 'L': return "LONG";
    case 'M': return "BININT2";
    case 'N': return "NONE";
    case 'P': return "PERSID";
    case 'Q': return "BINPERSID";
    case 'R': return "REDUCE";
    case 'S': return "STRING";
    case 'T': return "BINSTRING";
    case 'U': return "SHORT_BINSTRING";
    case 'V': return "UNICODE";
    case 'X': return "BINUNICODE";
    case 'a': return "APPEND";
    case 'b': return "BUILD";
    case 'c': return "GLOBAL";
    case 'd': return "DICT";
    case '}': return "EMPTY_DICT";
    case 'e': return "APPENDS";
    case 'g': return "GET";
    case 'h': return "BINGET";
    case 'i': return "INST";
    case 'j': return "LONG_BINGET";
    case 'l': return "LIST";
    case ']': return "EMPTY_LIST";
    case 'o': return "OBJ";
    case 'p': return "PUT";
    case 'q': return "BINPUT";
    case 'r': return "LONG_BINPUT";
    case 's': return "SETITEM";
    case 't': return "TUPLE";
    case ')': return "EMPTY_TUPLE";
    case 'u': return "SETITEMS";
    case 'G': return "BINFLOAT";
    case 0x80: return "PROTO";
    case 0x81: return "NEWOBJ";
    case 0x82: return "EXT1";
    case 0x83: return "EXT2";
    case 0x84: return "EXT4";
    case 0x85: return "TUPLE1";
    case 0x86: return "TUPLE2";
    case 0x87: return "TUPLE3";
    case 0x88: return "NEWTRUE";
    case 0x89: return "NEWFALSE";
    case 0x8a: return "LONG1";
    case 0x8b: return "LONG4";
    case 'B': return "BINBYTES";
    case 'C': return "SHORT_BINBYTES";
    case 0x8c: return "SHORT_BINUNICODE";
    case 0x8d: return "BINUNICODE8";
    case 0x8e: return "BINBYTES8";
    case 0x8f: return "EMPTY_SET";
    case 0x90: return "ADDITEMS";
    case 0x91: return "FROZENSET";
    case 0x92: return "NEWOBJ_EX";
    case 0x93: return "STACK_GLOBAL";
    case 0x94: return "MEMOIZE";
    case 0x95: return "FRAME";
    case 0x96: return "BYTEARRAY8";
    case 0x97: return "NEXT_BUFFER";
    case 0x98: return "READONLY_BUFFER";
    default: return nullptr;
  }
}

bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    size_t k = 0;  // continuation bytes
    if (c < 0x80) k = 0;
    else if ((c & 0xe0) == 0xc0) k = 1;
    else if ((c & 0xf0) == 0xe0) k = 2;
    else if ((c & 0xf8) == 0xf0) k = 3;
    else return false;
    if (k > n - i - 1) return false;
    for (size_t j = 1; j <= k; ++j) {
      if ((p[i + j] & 0xc0) != 0x80) return false;
    }
    i += k + 1;
  }
  return true;
}

class Decoder {
 public:
  Decoder(const void* data, size_t size, const GlobalFilter& allowed, const std::string& where)
      : p_(static_cast<const uint8_t*>(data)), n_(size), allowed_(allowed), where_(where) {}

  Tree run() {
    while (true) {
      TORCH_CHECK(pos_ < n_, where_, ": truncated pickle: ended at byte ", n_, " before its STOP opcode");
      op_at_ = static_cast<int64_t>(pos_);
      const uint8_t op = p_[pos_++];
      if (step(op)) break;
    }
    TORCH_CHECK(pos_ == n_, where_, ": ", n_ - pos_, " trailing byte(s) after the pickle's STOP at byte ", op_at_);
    return std::move(tree_);
  }

 private:
  [[noreturn]] void fail(const std::string& msg) const {
    TORCH_CHECK(false, where_, ": byte ", op_at_, ": ", msg);
    throw;  // unreachable
  }

  const uint8_t* take(size_t k) {
    if (k > n_ - pos_) {
      std::ostringstream os;
      os << "truncated pickle: " << (opcode_name(p_[op_at_]) ? opcode_name(p_[op_at_]) : "?") << " needs " << k
         << " more byte(s), " << n_ - pos_ << " left";
      fail(os.str());
    }
    const uint8_t* r = p_ + pos_;
    pos_ += k;
    return r;
  }
  uint64_t le(size_t k) {
    const uint8_t* b = take(k);
    uint64_t v = 0;
    for (size_t i = 0; i < k; ++i) v |= uint64_t(b[i]) << (8 * i);
    return v;
  }
  size_t length(size_t k) {
    const uint64_t len = le(k);
    if (len > n_ - pos_) {
      std::ostringstream os;
      os << "truncated pickle: " << opcode_name(p_[op_at_]) << " announces " << len << " bytes, " << n_ - pos_
         << " left";
      fail(os.str());
    }
    return static_cast<size_t>(len);
  }

  size_t add(Node n) {
    n.offset = op_at_;
    tree_.nodes.push_back(std::move(n));
    return tree_.nodes.size() - 1;
  }
  void push(size_t node) {
    if (stack_.size() >= kMaxStack) fail("pickle stack deeper than " + std::to_string(kMaxStack));
    stack_.push_back(node);
  }
  size_t base() const { return marks_.empty() ? 0 : marks_.back(); }
  size_t pop() {
    if (stack_.size() <= base()) fail(std::string(opcode_name(p_[op_at_])) + " on an empty stack (or across a MARK)");
    const size_t v = stack_.back();
    stack_.pop_back();
    return v;
  }
  size_t top() {
    if (stack_.size() <= base()) fail(std::string(opcode_name(p_[op_at_])) + " on an empty stack (or across a MARK)");
    return stack_.back();
  }
  std::vector<size_t> pop_mark() {
    if (marks_.empty()) fail(std::string(opcode_name(p_[op_at_])) + " without a MARK");
    const size_t b = marks_.back();
    marks_.pop_back();
    std::vector<size_t> items(stack_.begin() + static_cast<std::ptrdiff_t>(b), stack_.end());
    stack_.resize(b);
    return items;
  }
  Node& node(size_t i) { return tree_.nodes[i]; }
  void expect(size_t i, Kind k, const char* what) {
    if (node(i).kind != k) {
      fail(std::string(opcode_name(p_[op_at_])) + ": " + what + " is a " + kind_name(node(i).kind) + ", not a " +
           kind_name(k));
    }
  }
  void memo_put(uint64_t idx) {
    if (stack_.size() <= base()) fail("memo store of an empty stack");
    if (memo_.size() >= kMaxMemo && !memo_.count(idx)) fail("more than " + std::to_string(kMaxMemo) + " memo entries");
    memo_[idx] = stack_.back();
  }
  void memo_get(uint64_t idx) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) fail("memo entry " + std::to_string(idx) + " read before it was stored");
    push(it->second);
  }
  size_t string_node(Kind kind, size_t len) {
    Node n;
    n.kind = kind;
    n.s.assign(reinterpret_cast<const char*>(take(len)), len);
    if (kind == Kind::Str && !valid_utf8(n.s)) fail("string is not valid UTF-8");
    return add(std::move(n));
  }
  size_t int_node(int64_t v) {
    Node n;
    n.kind = Kind::Int;
    n.i = v;
    return add(std::move(n));
  }
  size_t long_node(size_t len) {
    if (len > 8) fail("integer of " + std::to_string(len) + " bytes (more than 64 bits)");
    const uint8_t* b = take(len);
    uint64_t v = 0;
    for (size_t i = 0; i < len; ++i) v |= uint64_t(b[i]) << (8 * i);
    if (len > 0 && len < 8 && (b[len - 1] & 0x80)) v |= ~uint64_t(0) << (8 * len);  // sign-extend
    return int_node(static_cast<int64_t>(v));
  }
  size_t seq_node(Kind kind, std::vector<size_t> items) {
    Node n;
    n.kind = kind;
    n.items = std::move(items);
    return add(std::move(n));
  }
  void global(const std::string& module, const std::string& name) {
    if (module.size() > kMaxGlobalName || name.size() > kMaxGlobalName) fail("global name longer than 256 bytes");
    if (!allowed_(module, name)) {
      fail("global '" + module + "." + name +
           "' is not allowed (only the classes of PyTorch DCP metadata and the torch/pathlib names it uses are "
           "admitted; nothing is imported or called)");
    }
    Node n;
    n.kind = Kind::Global;
    n.s = module + "." + name;
    push(add(std::move(n)));
  }
  std::string line() {
    const size_t start = pos_;
    while (pos_ < n_ && p_[pos_] != '\n') {
      if (pos_ - start > kMaxGlobalName) fail("GLOBAL name longer than 256 bytes");
      ++pos_;
    }
    if (pos_ >= n_) fail("truncated pickle: GLOBAL name without its newline");
    std::string s(reinterpret_cast<const char*>(p_ + start), pos_ - start);
    ++pos_;
    return s;
  }
  void call(bool newobj) {
    const size_t args = pop();
    const size_t callable = pop();
    expect(callable, Kind::Global, newobj ? "the class" : "the callable");
    expect(args, Kind::Tuple, "the argument");
    Node n;
    n.kind = Kind::Call;
    n.callable = callable;
    n.args = args;
    n.newobj = newobj;
    push(add(std::move(n)));
  }
  void setitems(size_t dict, const std::vector<size_t>& kv) {
    expect(dict, Kind::Dict, "the target");
    if (kv.size() % 2) fail("SETITEMS with an odd number of items");
    auto& items = node(dict).items;
    items.insert(items.end(), kv.begin(), kv.end());
  }

  // Executes one opcode; true at STOP.
  bool step(uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        const uint64_t v = le(1);
        if (v < 2 || v > 5) fail("pickle protocol " + std::to_string(v) + " (2 to 5 are read)");
        return false;
      }
      case 0x95: (void)length(8); return false;  // FRAME: a hint, the bytes follow inline
      case '.': {                                 // STOP
        if (!marks_.empty()) fail("STOP with an open MARK");
        if (stack_.size() != 1) fail("STOP with " + std::to_string(stack_.size()) + " values on the stack (1 expected)");
        tree_.root = stack_.back();
        return true;
      }
      case '(':
        if (marks_.size() >= kMaxMarks) fail("more than " + std::to_string(kMaxMarks) + " nested MARKs");
        marks_.push_back(stack_.size());
        return false;
      case '0':  // POP (of a mark when the stack above it is empty, as Python's)
        if (!marks_.empty() && stack_.size() == marks_.back()) marks_.pop_back();
        else pop();
        return false;
      case '1': (void)pop_mark(); return false;
      case '2': push(top()); return false;
      case 'N': push(add(Node{})); return false;
      case 0x88:
      case 0x89: {
        Node n;
        n.kind = Kind::Bool;
        n.b = op == 0x88;
        push(add(std::move(n)));
        return false;
      }
      case 'J': push(int_node(static_cast<int32_t>(static_cast<uint32_t>(le(4))))); return false;
      case 'K': push(int_node(static_cast<int64_t>(le(1)))); return false;
      case 'M': push(int_node(static_cast<int64_t>(le(2)))); return false;
      case 0x8a: push(long_node(static_cast<size_t>(le(1)))); return false;
      case 0x8b: {
        const uint64_t len = le(4);
        if (len > 8) fail("integer of " + std::to_string(len) + " bytes (more than 64 bits)");
        push(long_node(static_cast<size_t>(len)));
        return false;
      }
      case 'G': {
        const uint8_t* b = take(8);
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | b[i];  // big-endian
        Node n;
        n.kind = Kind::Float;
        std::memcpy(&n.f, &bits, 8);
        push(add(std::move(n)));
        return false;
      }
      case 0x8c: push(string_node(Kind::Str, length(1))); return false;
      case 'X': push(string_node(Kind::Str, length(4))); return false;
      case 0x8d: push(string_node(Kind::Str, length(8))); return false;
      case 'C': push(string_node(Kind::Bytes, length(1))); return false;
      case 'B': push(string_node(Kind::Bytes, length(4))); return false;
      case 0x8e: push(string_node(Kind::Bytes, length(8))); return false;
      case ')': push(seq_node(Kind::Tuple, {})); return false;
      case 't': push(seq_node(Kind::Tuple, pop_mark())); return false;
      case 0x85:
      case 0x86:
      case 0x87: {
        const size_t k = static_cast<size_t>(op - 0x84);
        std::vector<size_t> items(k);
        for (size_t i = k; i-- > 0;) items[i] = pop();
        push(seq_node(Kind::Tuple, std::move(items)));
        return false;
      }
      case ']': push(seq_node(Kind::List, {})); return false;
      case 'l': push(seq_node(Kind::List, pop_mark())); return false;
      case 'a': {
        const size_t v = pop();
        const size_t list = top();
        expect(list, Kind::List, "the target");
        node(list).items.push_back(v);
        return false;
      }
      case 'e': {
        auto items = pop_mark();
        const size_t list = top();
        expect(list, Kind::List, "the target");
        auto& dst = node(list).items;
        dst.insert(dst.end(), items.begin(), items.end());
        return false;
      }
      case '}': push(seq_node(Kind::Dict, {})); return false;
      case 'd': {
        auto kv = pop_mark();
        if (kv.size() % 2) fail("DICT with an odd number of items");
        push(seq_node(Kind::Dict, std::move(kv)));
        return false;
      }
      case 's': {
        const size_t v = pop();
        const size_t k = pop();
        setitems(top(), {k, v});
        return false;
      }
      case 'u': {
        auto kv = pop_mark();
        setitems(top(), kv);
        return false;
      }
      case 'c': {
        const std::string module = line();
        const std::string name = line();
        global(module, name);
        return false;
      }
      case 0x93: {
        const size_t name = pop();
        const size_t module = pop();
        expect(name, Kind::Str, "the name");
        expect(module, Kind::Str, "the module");
        global(node(module).s, node(name).s);
        return false;
      }
      case 'R': call(false); return false;
      case 0x81: call(true); return false;
      case 'b': {
        const size_t state = pop();
        const size_t obj = top();
        expect(obj, Kind::Call, "the object");
        if (node(obj).state != Node::npos) fail("BUILD of an object that already has its state");
        node(obj).state = state;
        return false;
      }
      case 0x94: memo_put(memo_.size()); return false;
      case 'q': memo_put(le(1)); return false;
      case 'r': memo_put(le(4)); return false;
      case 'h': memo_get(le(1)); return false;
      case 'j': memo_get(le(4)); return false;
      default: {
        const char* name = opcode_name(op);
        std::ostringstream os;
        if (name) os << "opcode " << name << " is not allowed (it is not part of the DCP metadata subset)";
        else os << "unknown opcode 0x" << std::hex << int(op);
        fail(os.str());
      }
    }
  }

  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  int64_t op_at_ = 0;
  const GlobalFilter& allowed_;
  const std::string& where_;
  Tree tree_;
  std::vector<size_t> stack_, marks_;
  std::unordered_map<uint64_t, size_t> memo_;
};

void render(const Tree& t, size_t i, int depth, std::string& out) {
  if (out.size() > 200) return;
  const Node& n = t.at(i);
  switch (n.kind) {
    case Kind::None: out += "None"; return;
    case Kind::Bool: out += n.b ? "True" : "False"; return;
    case Kind::Int: out += std::to_string(n.i); return;
    case Kind::Float: {
      std::ostringstream os;
      os << n.f;
      out += os.str();
      return;
    }
    case Kind::Str: out += "'" + n.s.substr(0, 80) + (n.s.size() > 80 ? "...'" : "'"); return;
    case Kind::Bytes: out += "<" + std::to_string(n.s.size()) + " bytes>"; return;
    case Kind::Global: out += n.s; return;
    case Kind::Call:
      render(t, n.callable, depth, out);
      if (depth > 2) {
        out += "(...)";
        return;
      }
      render(t, n.args, depth + 1, out);
      return;
    case Kind::Tuple:
    case Kind::List:
    case Kind::Dict: {
      const char* open = n.kind == Kind::Tuple ? "(" : n.kind == Kind::List ? "[" : "{";
      const char* close = n.kind == Kind::Tuple ? ")" : n.kind == Kind::List ? "]" : "}";
      out += open;
      if (depth > 2) {
        out += n.items.empty() ? "" : "...";
      } else {
        for (size_t k = 0; k < n.items.size() && out.size() < 200; ++k) {
          if (k) out += n.kind == Kind::Dict && k % 2 ? ": " : ", ";
          render(t, n.items[k], depth + 1, out);
        }
      }
      out += close;
      return;
    }
  }
}

void put_le(std::string& out, uint64_t v, int k) {
  for (int i = 0; i < k; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::None: return "None";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::Str: return "str";
    case Kind::Bytes: return "bytes";
    case Kind::Tuple: return "tuple";
    case Kind::List: return "list";
    case Kind::Dict: return "dict";
    case Kind::Global: return "global";
    case Kind::Call: return "object";
  }
  return "?";
}

Tree parse(const void* data, size_t size, const GlobalFilter& allowed, const std::string& where) {
  return Decoder(data, size, allowed, where).run();
}

std::string describe(const Tree& t, size_t node) {
  std::string out;
  render(t, node, 0, out);
  if (out.size() > 200) out = out.substr(0, 200) + "...";
  return out;
}

Writer::Writer() { out_ = "\x80\x02"; }
void Writer::none() { out_ += 'N'; }
void Writer::boolean(bool v) { out_ += static_cast<char>(v ? 0x88 : 0x89); }
void Writer::integer(int64_t v) {
  if (v >= 0 && v < 256) {
    out_ += 'K';
    put_le(out_, static_cast<uint64_t>(v), 1);
  } else if (v >= 0 && v < 65536) {
    out_ += 'M';
    put_le(out_, static_cast<uint64_t>(v), 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_ += 'J';
    put_le(out_, static_cast<uint64_t>(static_cast<uint32_t>(static_cast<int32_t>(v))), 4);
  } else {
    out_ += static_cast<char>(0x8a);
    out_ += static_cast<char>(8);
    put_le(out_, static_cast<uint64_t>(v), 8);
  }
}
void Writer::real(double v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, 8);
  out_ += 'G';
  for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
}
void Writer::str(const std::string& v) {
  out_ += 'X';
  put_le(out_, v.size(), 4);
  out_ += v;
}
void Writer::global(const std::string& module, const std::string& name) { out_ += "c" + module + "\n" + name + "\n"; }
void Writer::mark() { out_ += '('; }
void Writer::tuple() { out_ += 't'; }
void Writer::empty_tuple() { out_ += ')'; }
void Writer::empty_list() { out_ += ']'; }
void Writer::empty_dict() { out_ += '}'; }
void Writer::appends() { out_ += 'e'; }
void Writer::setitems() { out_ += 'u'; }
void Writer::reduce() { out_ += 'R'; }
void Writer::newobj() { out_ += static_cast<char>(0x81); }
void Writer::build() { out_ += 'b'; }
std::string Writer::finish() {
  out_ += '.';
  return std::move(out_);
}

}  // namespace fsdp::checkpoint::detail::pickle
