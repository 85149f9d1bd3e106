// The streaming loader against an independent reference: the token stream built here by hand (each file: BOS,
// its bytes, EOS; files in sorted order; repeated), cut into samples of seq_len + 1 tokens.
#include "data.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>

using namespace fsdp_train;
namespace fs = std::filesystem;

namespace {

struct Corpus {
  std::string dir;
  std::vector<std::string> files;     // sorted
  std::vector<int64_t> epoch_tokens;  // reference stream of one epoch
};

// Three text files; the middle one is larger than the loader's 64 KiB text chunk so chunk boundaries are crossed.
Corpus make_corpus(const std::string& name) {
  Corpus c;
  c.dir = ::testing::TempDir() + "/fsdp_train_data_" + name;
  fs::remove_all(c.dir);
  fs::create_directories(c.dir);
  std::mt19937 rng(1234);
  const std::vector<std::string> words = {"the", "license", "software", "free", "copy", "you", "may", "of", "and", "to"};
  std::vector<std::string> texts = {"short file\nwith two lines\n", "", "last: \xc3\xa9t\xc3\xa9 no newline at end"};
  for (int i = 0; i < 30000; ++i) texts[1] += words[rng() % words.size()] + ((rng() % 9 == 0) ? "\n" : " ");
  const std::vector<std::string> names = {"a.txt", "b.txt", "c.txt"};
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string path = c.dir + "/" + names[i];
    std::ofstream(path, std::ios::binary) << texts[i];
    c.files.push_back(path);
    c.epoch_tokens.push_back(256);
    for (unsigned char ch : texts[i]) c.epoch_tokens.push_back(ch);
    c.epoch_tokens.push_back(257);
  }
  return c;
}

int64_t ref_token(const Corpus& c, int64_t pos) { return c.epoch_tokens[static_cast<size_t>(pos) % c.epoch_tokens.size()]; }

void expect_batch_matches_reference(const Corpus& c, const Batch& b, int64_t S) {
  for (int64_t r = 0; r < b.batch; ++r) {
    const int64_t k = b.sample_ids[static_cast<size_t>(r)];
    for (int64_t j = 0; j < S; ++j) {
      ASSERT_EQ(b.inputs[static_cast<size_t>(r * S + j)], ref_token(c, k * (S + 1) + j)) << "sample " << k << " pos " << j;
      ASSERT_EQ(b.labels[static_cast<size_t>(r * S + j)], ref_token(c, k * (S + 1) + j + 1)) << "sample " << k << " pos " << j;
    }
  }
}

std::shared_ptr<const Tokenizer> bytes() { return std::make_shared<ByteTokenizer>(); }

}  // namespace

TEST(DataLoader, BatchesAreTheReferenceStreamSamples) {
  const Corpus c = make_corpus("ref");
  const int64_t S = 1000;  // an epoch is ~190k tokens: 40 steps of 5 samples wrap into the second epoch
  DataLoader loader(c.files, bytes(), 258, {S, 5, 1, 0, 1});
  for (int i = 0; i < 45; ++i) {
    const Batch b = loader.next();
    ASSERT_EQ(b.sample_ids.front(), i * 5);
    expect_batch_matches_reference(c, b, S);
  }
  EXPECT_GE(loader.epoch(), 1);
}

TEST(DataLoader, DeterministicAcrossInstances) {
  const Corpus c = make_corpus("det");
  DataLoader a(c.files, bytes(), 258, {64, 3, 2, 1, 2}), b(c.files, bytes(), 258, {64, 3, 2, 1, 2});
  for (int i = 0; i < 20; ++i) {
    const Batch x = a.next(), y = b.next();
    EXPECT_EQ(x.inputs, y.inputs);
    EXPECT_EQ(x.labels, y.labels);
  }
}

TEST(DataLoader, RanksPartitionEachGlobalBatchDisjointlyAndCompletely) {
  const Corpus c = make_corpus("part");
  const int64_t S = 32, L = 2, A = 2, D = 3, G = L * A * D;
  std::vector<DataLoader> ranks;
  for (int64_t r = 0; r < D; ++r) ranks.emplace_back(c.files, bytes(), 258, LoaderOptions{S, L, A, r, D});
  for (int64_t step = 0; step < 6; ++step) {
    std::multiset<int64_t> seen;
    for (int64_t r = 0; r < D; ++r)
      for (int64_t m = 0; m < A; ++m) {
        const Batch b = ranks[static_cast<size_t>(r)].next();
        expect_batch_matches_reference(c, b, S);
        for (size_t i = 0; i < b.sample_ids.size(); ++i) {
          const int64_t id = b.sample_ids[i];
          seen.insert(id);
          // sample t*G + i goes to rank i / (L*A), micro-batch (i % (L*A)) / L
          EXPECT_EQ((id - step * G) / (L * A), r);
          EXPECT_EQ(((id - step * G) % (L * A)) / L, m);
        }
      }
    ASSERT_EQ(seen.size(), static_cast<size_t>(G));
    int64_t expect = step * G;
    for (int64_t id : seen) EXPECT_EQ(id, expect++);  // disjoint and covering [t*G, (t+1)*G)
  }
}

TEST(DataLoader, OneRankWithAccumulationSeesTheUnionOfTwoRanks) {
  const Corpus c = make_corpus("union");
  const int64_t S = 48, L = 4;
  DataLoader one(c.files, bytes(), 258, {S, L, 2, 0, 1});
  DataLoader r0(c.files, bytes(), 258, {S, L, 1, 0, 2}), r1(c.files, bytes(), 258, {S, L, 1, 1, 2});
  for (int step = 0; step < 8; ++step) {
    std::vector<int64_t> a, b;
    for (int m = 0; m < 2; ++m) {
      const Batch x = one.next();
      a.insert(a.end(), x.inputs.begin(), x.inputs.end());
      a.insert(a.end(), x.labels.begin(), x.labels.end());
    }
    for (DataLoader* r : {&r0, &r1}) {
      const Batch x = r->next();
      b.insert(b.end(), x.inputs.begin(), x.inputs.end());
      b.insert(b.end(), x.labels.begin(), x.labels.end());
    }
    ASSERT_EQ(a, b) << "step " << step;
  }
}

TEST(DataLoader, SavedStateReproducesTheNextBatchExactly) {
  const Corpus c = make_corpus("state");
  for (int64_t stop : {1, 7, 23}) {  // positions inside the first chunk, the big file, and across its chunk cut
    DataLoader a(c.files, bytes(), 258, {700, 4, 2, 1, 2});
    for (int64_t i = 0; i < stop; ++i) a.next();
    const std::string saved = a.state().dump();
    DataLoader b(c.files, bytes(), 258, {700, 4, 2, 1, 2});
    b.load_state(nlohmann::json::parse(saved));
    for (int i = 0; i < 5; ++i) {
      const Batch x = a.next(), y = b.next();
      ASSERT_EQ(x.inputs, y.inputs) << "stop " << stop << " +" << i;
      ASSERT_EQ(x.labels, y.labels);
      ASSERT_EQ(x.sample_ids, y.sample_ids);
    }
  }
  // A state from other options is refused with the reason.
  DataLoader a(c.files, bytes(), 258, {700, 4, 2, 1, 2});
  DataLoader other(c.files, bytes(), 258, {512, 4, 2, 1, 2});
  try {
    other.load_state(a.state());
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("seq_len"), std::string::npos) << e.what();
  }
}

TEST(DataLoader, TokenFilesGiveTheSameBatchesAsText) {
  const Corpus c = make_corpus("tok");
  std::vector<uint32_t> tokens(c.epoch_tokens.begin(), c.epoch_tokens.end());
  const std::string tok = c.dir + "/corpus.tok", u16 = c.dir + "/corpus.u16";
  write_token_file(tok, tokens, 258);
  {
    std::ofstream out(u16, std::ios::binary);
    for (uint32_t t : tokens) {
      const unsigned char le[2] = {static_cast<unsigned char>(t & 0xFF), static_cast<unsigned char>(t >> 8)};
      out.write(reinterpret_cast<const char*>(le), 2);
    }
  }
  EXPECT_EQ(read_token_file(tok), tokens);
  EXPECT_EQ(read_token_file(u16), tokens);
  const int64_t S = 300;
  DataLoader text(c.files, bytes(), 258, {S, 3, 1, 1, 2});
  DataLoader t1({tok}, bytes(), 258, {S, 3, 1, 1, 2}), t2({u16}, bytes(), 258, {S, 3, 1, 1, 2});
  for (int i = 0; i < 80; ++i) {  // beyond one epoch
    const Batch a = text.next(), b = t1.next(), d = t2.next();
    ASSERT_EQ(a.inputs, b.inputs) << i;
    ASSERT_EQ(a.inputs, d.inputs) << i;
    ASSERT_EQ(a.labels, b.labels) << i;
  }
  // Token ids beyond the model's vocab are refused with the file's name.
  write_token_file(c.dir + "/big.tok", {1, 2, 70000}, 70001);
  EXPECT_THROW(DataLoader({c.dir + "/big.tok"}, bytes(), 258, {2, 1, 1, 0, 1}), std::runtime_error);
}

TEST(DataLoader, ResolvesDirectoriesSortedWithoutSymlinks) {
  const Corpus c = make_corpus("resolve");
  fs::create_symlink(c.files[0], c.dir + "/alias.txt");
  EXPECT_EQ(resolve_dataset_files("text", c.dir), c.files);
  EXPECT_EQ(resolve_dataset_files("text", c.files[2] + "," + c.files[0]), (std::vector<std::string>{c.files[2], c.files[0]}));
  EXPECT_THROW(resolve_dataset_files("tokens", c.files[0]), std::runtime_error);
  // The default dataset is present on every Debian system.
  const auto licenses = resolve_dataset_files("common_licenses", "");
  EXPECT_GE(licenses.size(), 5u);
}

TEST(UnigramEntropy, MatchesTheHandComputedValue) {
  const std::string dir = ::testing::TempDir() + "/fsdp_train_entropy";
  fs::create_directories(dir);
  std::ofstream(dir + "/x.txt") << "abab";
  // Tokens of one epoch: BOS a b a b EOS -> p = 1/6, 2/6, 2/6, 1/6.
  const double expect = -(2 * (1.0 / 6) * std::log(1.0 / 6) + 2 * (2.0 / 6) * std::log(2.0 / 6));
  int64_t n = 0;
  EXPECT_NEAR(unigram_entropy_nats({dir + "/x.txt"}, bytes(), 258, &n), expect, 1e-12);
  EXPECT_EQ(n, 6);
}
