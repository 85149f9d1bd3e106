// Tokenizers: byte-level round trip; byte-level BPE on a tokenizer.json built here from a few merges, with the
// expected ids worked out by hand (comments show the merge sequence).
#include "tokenizer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <filesystem>
#include <functional>

using namespace fsdp_train;
using Ids = std::vector<uint32_t>;

TEST(ByteTokenizer, RoundTripsEveryByte) {
  ByteTokenizer t;
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  all += "hello \xc3\xa9 world\n";
  const Ids ids = t.encode(all);
  ASSERT_EQ(ids.size(), all.size());
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(ids[i], static_cast<unsigned char>(all[i]));
  EXPECT_EQ(t.decode(ids), all);
  EXPECT_EQ(t.vocab_size(), 258);
  EXPECT_EQ(*t.bos_id(), 256u);
  EXPECT_EQ(*t.eos_id(), 257u);
  EXPECT_EQ(t.decode({256, 'a', 257}), "a");  // BOS/EOS carry no text
}

TEST(ByteToUnicode, MatchesGpt2sKnownMapping) {
  const auto& m = byte_to_unicode();
  EXPECT_EQ(m[' '], "\xc4\xa0");   // U+0120 'Ġ'
  EXPECT_EQ(m['\n'], "\xc4\x8a");  // U+010A 'Ċ'
  EXPECT_EQ(m['a'], "a");
  EXPECT_EQ(m['!'], "!");
  EXPECT_EQ(m[0x00], "\xc4\x80");  // U+0100 'Ā'
  EXPECT_EQ(m[0xAD], "\xc5\x83");  // U+0143 'Ń' (the soft hyphen is not printable)
  EXPECT_EQ(m[0xE9], "\xc3\xa9");  // 'é' maps to itself
}

namespace {
// Vocabulary: byte b -> id b (symbols from the GPT-2 alphabet), then the merge results, then one special token.
std::string crafted_tokenizer_json(bool pair_merges) {
  nlohmann::json vocab = nlohmann::json::object();
  const auto& m = byte_to_unicode();
  for (int b = 0; b < 256; ++b) vocab[m[b]] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"\xc4\xa0", "w"}, {"o", "r"}, {"\xc4\xa0w", "or"},
      {"e", "l"}, {"1", "2"}, {"'", "s"}};
  uint32_t id = 256;
  nlohmann::json merge_list = nlohmann::json::array();
  for (const auto& [a, b] : merges) {
    vocab[a + b] = id++;  // he=256 ll=257 hell=258 hello=259 Ġw=260 or=261 Ġwor=262 el=263 12=264 's=265
    if (pair_merges) merge_list.push_back({a, b});
    else merge_list.push_back(a + " " + b);
  }
  nlohmann::json j = {
      {"version", "1.0"},
      {"added_tokens", {{{"id", 266}, {"content", "<|endoftext|>"}, {"special", true}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}},
  };
  return j.dump();
}
}  // namespace

TEST(BpeTokenizer, EncodesCraftedMergesAsWorkedOutByHand) {
  for (bool pair_merges : {false, true}) {
    auto t = BpeTokenizer::from_json(crafted_tokenizer_json(pair_merges), "crafted");
    EXPECT_EQ(t->vocab_size(), 267);
    EXPECT_FALSE(t->bos_id().has_value());
    EXPECT_EQ(*t->eos_id(), 266u);
    // "hello": (h,e)#0 -> he l l o; (l,l)#1 -> he ll o; (he,ll)#2 -> hell o; (hell,o)#3 -> hello = 259.
    // " world": Ġ w o r l d; (Ġ,w)#4 -> Ġw o r l d; (o,r)#5 -> Ġw or l d; (Ġw,or)#6 -> Ġwor l d = 262 108 100.
    EXPECT_EQ(t->encode("hello world"), (Ids{259, 262, 108, 100}));
    // Merge priority: in "yell" both (e,l)#7 and (l,l)#1 apply; the lower rank wins: y e ll.
    EXPECT_EQ(t->encode("yell"), (Ids{'y', 'e', 257}));
    // Contraction, digits with their leading space, punctuation: it | 's | " 123" | !
    EXPECT_EQ(t->encode("it's 123!"), (Ids{'i', 't', 265, ' ', 264, '3', '!'}));
    // Two spaces: the run keeps its last space for the next word: a | " " | " b".
    EXPECT_EQ(t->encode("a  b"), (Ids{'a', ' ', ' ', 'b'}));
    // Special tokens are matched verbatim.
    EXPECT_EQ(t->encode("x<|endoftext|>y"), (Ids{'x', 266, 'y'}));
    // Non-ASCII: the two UTF-8 bytes of é map to the symbols of bytes 0xC3 and 0xA9.
    EXPECT_EQ(t->encode("\xc3\xa9"), (Ids{0xC3, 0xA9}));
    EXPECT_EQ(t->encode("hi \n"), (Ids{'h', 'i', ' ', '\n'}));
  }
}

TEST(BpeTokenizer, PreTokenizerFollowsGpt2Pattern) {
  auto t = BpeTokenizer::from_json(crafted_tokenizer_json(false), "crafted");
  EXPECT_EQ(t->pre_tokenize("it's 123!"), (std::vector<std::string>{"it", "'s", " 123", "!"}));
  EXPECT_EQ(t->pre_tokenize("a  b"), (std::vector<std::string>{"a", " ", " b"}));
  // \s+(?!\S) backs off one character before "Next", and the lone "\n" left is matched by \s+.
  EXPECT_EQ(t->pre_tokenize("Hello, world.\n\nNext"),
            (std::vector<std::string>{"Hello", ",", " world", ".", "\n", "\n", "Next"}));
  EXPECT_EQ(t->pre_tokenize("a\n\n"), (std::vector<std::string>{"a", "\n\n"}));
  EXPECT_EQ(t->pre_tokenize("x  \n"), (std::vector<std::string>{"x", "  \n"}));
}

TEST(BpeTokenizer, DecodeInvertsEncode) {
  auto t = BpeTokenizer::from_json(crafted_tokenizer_json(false), "crafted");
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  for (const std::string s : {std::string("hello world, it's 123!\n"), std::string("\xc3\xa9t\xc3\xa9  <|endoftext|> yell"), all})
    EXPECT_EQ(t->decode(t->encode(s)), s);
}

TEST(BpeTokenizer, RejectsIncompleteFiles) {
  EXPECT_THROW(BpeTokenizer::from_json("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}}", "small"), std::runtime_error);
  EXPECT_THROW(BpeTokenizer::from_json("not json", "bad"), std::runtime_error);
  EXPECT_THROW(make_tokenizer("/nonexistent/tokenizer.json"), std::runtime_error);
}

// Issue 40: hostile tokenizer.json files get one error naming the file, the field and the rule; none crashes.
namespace {
// Runs from_json on `text`, expects an error whose message contains every fragment.
void expect_tokenizer_error(const std::string& text, std::initializer_list<std::string> fragments) {
  try {
    BpeTokenizer::from_json(text, "t.json");
    ADD_FAILURE() << "no error; expected one mentioning '" << *fragments.begin() << "'";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
    EXPECT_EQ(msg.find("[json.exception"), std::string::npos) << "a bare nlohmann error: " << msg;
  }
}
nlohmann::json crafted() { return nlohmann::json::parse(crafted_tokenizer_json(false)); }
}  // namespace

TEST(BpeTokenizer, DeeplyNestedPreTokenizerSequenceIsRefusedNotACrash) {
  // 100,000 nested Sequence pre-tokenizers (the input): the visitor used to recurse into each level and
  // overflow the stack (SIGSEGV). Built as text: nlohmann's own dump() of such a value would recurse too.
  std::string text = crafted_tokenizer_json(false);
  const std::string inner = "{\"type\": \"ByteLevel\", \"add_prefix_space\": false}";
  std::string nested;
  const int depth = 100000;
  nested.reserve(depth * 45 + inner.size());
  for (int i = 0; i < depth; ++i) nested += "{\"type\": \"Sequence\", \"pretokenizers\": [";
  nested += inner;
  for (int i = 0; i < depth; ++i) nested += "]}";
  const std::string field = "\"pre_tokenizer\":";
  const size_t at = text.find(field);
  ASSERT_NE(at, std::string::npos);
  const size_t end = text.find('}', at) + 1;  // the crafted pre_tokenizer object has no nested braces
  text.replace(at + field.size(), end - at - field.size(), nested);
  expect_tokenizer_error(text, {"tokenizer t.json: pre_tokenizer", ".pretokenizers[0]",
                                "nested deeper than 8 levels"});
  // Within the limit, a nested Sequence is fine (the reference: the same file with ByteLevel at the top level).
  nlohmann::json j = crafted();
  nlohmann::json p = j["pre_tokenizer"];
  for (int i = 0; i < 8; ++i) p = {{"type", "Sequence"}, {"pretokenizers", {p}}};
  j["pre_tokenizer"] = p;
  const auto nested_ok = BpeTokenizer::from_json(j.dump(), "t.json");
  const auto flat = BpeTokenizer::from_json(crafted_tokenizer_json(false), "t.json");
  EXPECT_EQ(nested_ok->encode("hello world"), flat->encode("hello world"));
  // 100,000 levels of '[' in a field the reader ignores: parsed and freed without recursion.
  std::string deep_array = crafted_tokenizer_json(false);
  deep_array.insert(1, "\"unused\": " + std::string(depth, '[') + std::string(depth, ']') + ", ");
  EXPECT_EQ(BpeTokenizer::from_json(deep_array, "t.json")->encode("hello"), flat->encode("hello"));
}

TEST(BpeTokenizer, WrongTypesNameTheFileTheFieldAndTheRule) {
  auto with = [](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = crafted();
    edit(j);
    return j.dump();
  };
  expect_tokenizer_error(with([](auto& j) { j["pre_tokenizer"]["add_prefix_space"] = "yes"; }),
                         {"tokenizer t.json: pre_tokenizer.add_prefix_space: expected true or false, got a string"});
  expect_tokenizer_error(with([](auto& j) { j["added_tokens"][0]["id"] = "266"; }),
                         {"tokenizer t.json: added_tokens[0].id: expected a non-negative integer id, got a string"});
  expect_tokenizer_error(with([](auto& j) { j["added_tokens"][0]["content"] = 5; }),
                         {"added_tokens[0].content: expected a string, got a number"});
  expect_tokenizer_error(with([](auto& j) { j["added_tokens"][0]["id"] = -3; }),
                         {"added_tokens[0].id: expected a non-negative integer id, got -3"});
  expect_tokenizer_error(with([](auto& j) { j["model"]["merges"][1] = {"l", 5}; }),
                         {"model.merges[1][1]: expected a string, got a number"});
  expect_tokenizer_error(with([](auto& j) { j["model"]["merges"] = "h e"; }),
                         {"model.merges: expected an array, got a string"});
  expect_tokenizer_error(with([](auto& j) { j["model"]["type"] = 7; }), {"model.type: expected a string, got a number"});
  expect_tokenizer_error(with([](auto& j) { j["model"]["ignore_merges"] = 1; }),
                         {"model.ignore_merges: expected true or false, got a number"});
  expect_tokenizer_error(with([](auto& j) { j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", 3}}; }),
                         {"pre_tokenizer.pretokenizers: expected an array, got a number"});
  expect_tokenizer_error(with([](auto& j) { j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", "x"}}; }),
                         {"pre_tokenizer.pattern: expected an object, got a string"});
  expect_tokenizer_error(with([](auto& j) { j["model"]["vocab"]["a"] = 4.5; }),
                         {"model.vocab[\"a\"]: expected a non-negative integer id, got a number"});
  // An id sizes the model's embedding table: 2^32 + 5 used to wrap to 5, 2^31 to ask for a 2^31-row table.
  expect_tokenizer_error(with([](auto& j) { j["added_tokens"][0]["id"] = (uint64_t(1) << 32) + 5; }),
                         {"added_tokens[0].id: id 4294967301 is above the limit 16777215"});
  expect_tokenizer_error("[1, 2]", {"tokenizer t.json: the file: expected a JSON object, got an array"});
}

TEST(BpeTokenizer, TokenizerPathThatIsNotAFileIsRefusedWithABound) {
  const std::string dir = ::testing::TempDir() + "/tok_dir_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir + "/tokenizer.json");  // a directory named like the file
  try {
    make_tokenizer(dir);
    ADD_FAILURE() << "no error for a directory";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("model.tokenizer_path: '" + dir + "/tokenizer.json' is a directory"),
              std::string::npos) << e.what();
  }
  // /dev/zero never ends: the read stops after the limit instead of filling the memory.
  try {
    make_tokenizer("/dev/zero");
    ADD_FAILURE() << "no error for /dev/zero";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("'/dev/zero' is larger than the 268435456-byte limit"), std::string::npos)
        << e.what();
  }
  std::filesystem::remove_all(dir);
}
