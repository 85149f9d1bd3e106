// Tokenizers: byte-level round trip; byte-level BPE on a tokenizer.json built here from a few merges, with the
// expected ids worked out by hand (comments show the merge sequence).
#include "tokenizer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

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
