// The streaming loader against an independent reference: the token stream built here by hand (each file: BOS,
// its bytes, EOS; files in sorted order; repeated), cut into samples of seq_len + 1 tokens.
#include "data.h"
#include "expect_error.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
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

TEST(DataLoader, SeekStepSkipsToThatStepsSamplesAndNeverBack) {
  // What a healed replica group does (fault tolerance): from step 0 straight to step 5's batches.
  const Corpus c = make_corpus("seek");
  const int64_t S = 32, L = 2, A = 2, D = 3, G = L * A * D, r = 1;
  DataLoader loader(c.files, bytes(), 258, LoaderOptions{S, L, A, r, D});
  loader.next();  // step 0, micro-batch 0 only
  loader.seek_step(5);
  EXPECT_EQ(loader.step(), 5);
  for (int64_t m = 0; m < A; ++m) {
    const Batch b = loader.next();
    expect_batch_matches_reference(c, b, S);
    for (int64_t i = 0; i < L; ++i) EXPECT_EQ(b.sample_ids[static_cast<size_t>(i)], 5 * G + r * L * A + m * L + i);
  }
  EXPECT_EQ(loader.step(), 6);
  loader.seek_step(6);  // where it is: fine
  EXPECT_THROW(loader.seek_step(4), std::runtime_error);
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
  EXPECT_EQ(resolve_dataset_files(Dataset::Text, c.dir), c.files);
  EXPECT_EQ(resolve_dataset_files(Dataset::Text, c.files[2] + "," + c.files[0]), (std::vector<std::string>{c.files[2], c.files[0]}));
  EXPECT_THROW(resolve_dataset_files(Dataset::Tokens, c.files[0]), std::runtime_error);
  // The default dataset is present on every Debian system.
  const auto licenses = resolve_dataset_files(Dataset::CommonLicenses, "");
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

// ---- held-out split, JSON Lines, gzip, bad records ------------------------------------------------------------

TEST(DataLoader, CommonLicensesHoldsOutApache) {
  const auto train = resolve_dataset_files(Dataset::CommonLicenses, "");
  const auto held_out = resolve_dataset_files(Dataset::CommonLicensesValidation, "");
  ASSERT_EQ(held_out.size(), 1u);
  EXPECT_EQ(fs::path(held_out[0]).filename(), "Apache-2.0");
  for (const auto& f : train) EXPECT_NE(fs::path(f).filename(), "Apache-2.0");
  std::set<std::string> all;
  for (const auto& e : fs::directory_iterator("/usr/share/common-licenses"))
    if (!e.is_symlink() && e.is_regular_file()) all.insert(e.path().string());
  EXPECT_EQ(train.size() + 1, all.size());
  // Errors name the section's key.
  try {
    resolve_dataset_files(Dataset::Text, "/nonexistent/x.txt", "validation");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("validation.dataset_path"), std::string::npos) << e.what();
  }
}

namespace {
// A JSON Lines corpus (the HF datasets export shape) and its reference stream: per record BOS, bytes, EOS.
struct JsonlCorpus {
  std::string path;
  std::vector<int64_t> epoch_tokens;
};
JsonlCorpus make_jsonl(const std::string& name, int records) {
  JsonlCorpus c;
  const std::string dir = ::testing::TempDir() + "/fsdp_train_jsonl_" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  c.path = dir + "/data.jsonl";
  std::ofstream out(c.path, std::ios::binary);
  std::mt19937 rng(7);
  for (int i = 0; i < records; ++i) {
    std::string text = "record " + std::to_string(i) + ": \"quoted\" \xc3\xa9\n";
    const unsigned length = rng() % 400;
    for (unsigned k = 0; k < length; ++k) text += static_cast<char>('a' + rng() % 26);
    out << nlohmann::json({{"id", i}, {"content", text}, {"meta", {{"n", i}}}}).dump() << "\n";
    if (i % 50 == 7) out << "\n";  // blank lines are not records
    c.epoch_tokens.push_back(256);
    for (unsigned char ch : text) c.epoch_tokens.push_back(ch);
    c.epoch_tokens.push_back(257);
  }
  return c;
}
std::vector<int64_t> stream_tokens(const std::vector<std::string>& files, int64_t n, TextOptions text = {}) {
  TokenStream s(files, bytes(), 258, std::move(text));
  std::vector<int64_t> out(static_cast<size_t>(n));
  s.read(n, out.data());
  return out;
}
}  // namespace

TEST(DataLoader, JsonLinesRecordsAreDocumentsOfTheConfiguredField) {
  const JsonlCorpus c = make_jsonl("plain", 600);  // > 64 KiB: records cross chunk cuts
  ASSERT_GT(fs::file_size(c.path), 128u * 1024u);
  TextOptions opt;
  opt.text_field = "content";
  const int64_t n = static_cast<int64_t>(c.epoch_tokens.size());
  const auto got = stream_tokens({c.path}, 2 * n + 5, opt);  // beyond one epoch
  for (int64_t i = 0; i < 2 * n + 5; ++i) ASSERT_EQ(got[static_cast<size_t>(i)], c.epoch_tokens[static_cast<size_t>(i % n)]) << i;
  EXPECT_EQ(resolve_dataset_files(Dataset::Jsonl, c.path), std::vector<std::string>{c.path});
  EXPECT_THROW(resolve_dataset_files(Dataset::Jsonl, fs::path(c.path).parent_path().string() + "/../fsdp_train_data_plain_missing"),
               std::runtime_error);
  // The loader's saved position inside a JSON Lines file reproduces the next batch (line numbers recomputed).
  DataLoader a({c.path}, bytes(), 258, {500, 2, 1, 0, 1}, opt);
  for (int i = 0; i < 40; ++i) a.next();
  DataLoader b({c.path}, bytes(), 258, {500, 2, 1, 0, 1}, opt);
  b.load_state(a.state());
  for (int i = 0; i < 5; ++i) ASSERT_EQ(a.next().inputs, b.next().inputs);
}

TEST(DataLoader, GzipInputsGiveTheSameStreamAsTheirContent) {
  // Compressed by the gzip tool (an independent implementation), text and JSON Lines.
  const Corpus text = make_corpus("gz");
  const JsonlCorpus jsonl = make_jsonl("gz", 300);
  for (const auto& f : {text.files[1], jsonl.path})
    ASSERT_EQ(std::system(("gzip -k -f '" + f + "'").c_str()), 0);
  TextOptions opt;
  opt.text_field = "content";
  const int64_t n = 3 * static_cast<int64_t>(jsonl.epoch_tokens.size()) + 11;
  EXPECT_EQ(stream_tokens({jsonl.path + ".gz"}, n, opt), stream_tokens({jsonl.path}, n, opt));
  const std::vector<std::string> gz_files = {text.files[0], text.files[1] + ".gz", text.files[2]};
  const int64_t m = 2 * static_cast<int64_t>(text.epoch_tokens.size()) + 3;
  const auto got = stream_tokens(gz_files, m);
  for (int64_t i = 0; i < m; ++i) ASSERT_EQ(got[static_cast<size_t>(i)], ref_token(text, i)) << i;
  EXPECT_TRUE(is_jsonl_file(jsonl.path + ".gz"));
  // A saved position inside the compressed file: resuming decompresses forward to it.
  DataLoader a(gz_files, bytes(), 258, {700, 2, 1, 0, 1});
  for (int i = 0; i < 30; ++i) a.next();
  DataLoader b(gz_files, bytes(), 258, {700, 2, 1, 0, 1});
  b.load_state(a.state());
  for (int i = 0; i < 5; ++i) ASSERT_EQ(a.next().inputs, b.next().inputs);
  // A truncated gzip file is an error naming the file (never silently short data).
  const std::string cut = ::testing::TempDir() + "/fsdp_train_cut.txt.gz";
  {
    std::ifstream in(text.files[1] + ".gz", std::ios::binary);
    std::string bytes_in((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(cut, std::ios::binary) << bytes_in.substr(0, bytes_in.size() / 2);
  }
  try {
    stream_tokens({cut}, m);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(cut), std::string::npos) << e.what();
  }
}

TEST(DataLoader, BadJsonLinesRecordsAreSkippedAndCountedOrFatalWithFileAndLine) {
  const std::string path = ::testing::TempDir() + "/fsdp_train_bad.jsonl";
  std::ofstream(path) << "{\"text\": \"ok one\"}\n"
                      << "{\"text\": \"broken\"\n"        // line 2: not JSON
                      << "[1, 2]\n"                        // line 3: not an object
                      << "{\"body\": \"x\"}\n"            // line 4: no field
                      << "{\"text\": 5}\n"                 // line 5: not a string
                      << "\n"
                      << "{\"text\": \"ok two\"}\n";
  std::vector<int64_t> expect;
  for (const std::string t : {"ok one", "ok two"}) {
    expect.push_back(256);
    for (unsigned char ch : t) expect.push_back(ch);
    expect.push_back(257);
  }
  TextOptions skip;
  skip.report_bad_records = false;
  TokenStream s({path}, bytes(), 258, skip);
  std::vector<int64_t> got(expect.size() * 3);
  s.read(static_cast<int64_t>(got.size()), got.data());  // three epochs: each bad record counted once
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], expect[i % expect.size()]) << i;
  EXPECT_EQ(s.bad_records(), 4);
  int64_t bad = 0;
  EXPECT_EQ(read_one_epoch({path}, bytes(), 258, skip, &bad), expect);
  EXPECT_EQ(bad, 4);
  TextOptions fatal;
  fatal.skip_bad_records = false;
  try {
    stream_tokens({path}, 10, fatal);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ":2: not valid JSON"), std::string::npos) << e.what();
  }
}

using fsdp_test::error_of;
using fsdp_test::expect_message_has;

// Resuming with another split of the same global batch (issue: a pp2 run with local batch 4 and two micro-batches
// accumulated, resumed on one rank with local batch 8): the saved state of any rank, taken at a step boundary,
// repositions every rank of the new layout at the saved step, and each then delivers exactly the samples the
// hand-built stream and the sample-assignment rule give for that layout (t*G + r*L*A + m*L + i).
TEST(DataLoader, StateResumesAtAnotherLayoutOfTheSameGlobalBatch) {
  const Corpus c = make_corpus("relayout");
  const int64_t S = 200, G = 8, steps_done = 3;
  struct Layout {
    int64_t L, A, D;
  };
  const std::vector<Layout> layouts = {{4, 2, 1}, {8, 1, 1}, {2, 2, 2}, {4, 1, 2}, {1, 2, 4}, {2, 4, 1}};
  for (const Layout& from : layouts) {
    for (int64_t saved_rank = 0; saved_rank < from.D; ++saved_rank) {
      DataLoader saver(c.files, bytes(), 258, {S, from.L, from.A, saved_rank, from.D});
      for (int64_t m = 0; m < steps_done * from.A; ++m) saver.next();
      const nlohmann::json saved = saver.state();
      for (const Layout& to : layouts) {
        for (int64_t r = 0; r < to.D; ++r) {
          DataLoader resumed(c.files, bytes(), 258, {S, to.L, to.A, r, to.D});
          resumed.load_state(saved);
          EXPECT_EQ(resumed.step(), steps_done);
          for (int64_t step = steps_done; step < steps_done + 2; ++step) {
            for (int64_t m = 0; m < to.A; ++m) {
              const Batch b = resumed.next();
              expect_batch_matches_reference(c, b, S);
              for (int64_t i = 0; i < to.L; ++i)
                ASSERT_EQ(b.sample_ids[static_cast<size_t>(i)], step * G + r * to.L * to.A + m * to.L + i)
                    << "from " << from.L << "x" << from.A << "x" << from.D << " rank " << saved_rank << " to " << to.L
                    << "x" << to.A << "x" << to.D << " rank " << r << " step " << step << " micro " << m;
            }
          }
        }
      }
    }
  }
  // A state saved inside a step (1 of 2 micro-batches) is exact only for its own layout.
  DataLoader mid(c.files, bytes(), 258, {S, 4, 2, 0, 1});
  mid.next();
  DataLoader same(c.files, bytes(), 258, {S, 4, 2, 0, 1}), other(c.files, bytes(), 258, {S, 8, 1, 0, 1});
  same.load_state(mid.state());
  EXPECT_EQ(same.next().sample_ids, mid.next().sample_ids);
  DataLoader mid2(c.files, bytes(), 258, {S, 4, 2, 0, 1});
  mid2.next();
  expect_message_has(error_of([&] { other.load_state(mid2.state()); }), {"micro = 1", "inside a step"});
  // Another global batch is refused naming both.
  DataLoader g16(c.files, bytes(), 258, {S, 8, 2, 0, 1});
  expect_message_has(error_of([&] { g16.load_state(same.state()); }),
                     {"global batch of 8", "this run has 16", "global_batch_size"});
}

// A saved loader state is untrusted input: every field is checked before the loader moves, and refused with one
// line naming the field and the rule (before: file = 1e8 crashed, consumed = -1000 read out of bounds, micro = -5
// and next_sample = 4e18 were accepted and training went on with other data).
TEST(DataLoader, HostileSavedStatesAreRefusedNamingFieldAndRule) {
  const Corpus c = make_corpus("hostile");
  const int64_t S = 100;
  DataLoader a(c.files, bytes(), 258, {S, 2, 2, 1, 2});
  for (int i = 0; i < 6; ++i) a.next();
  const nlohmann::json good = a.state();
  auto refused = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json s = good;
    edit(s);
    DataLoader b(c.files, bytes(), 258, {S, 2, 2, 1, 2});
    return error_of([&] { b.load_state(s, "ckpt/metadata.json: dataloader.dp_rank_1"); });
  };
  EXPECT_EQ(refused([](nlohmann::json&) {}), "");
  expect_message_has(refused([](auto& s) { s["stream"]["file"] = 100000000; }),
                     {"ckpt/metadata.json: dataloader.dp_rank_1.stream.file = 100000000", "[0, 3)"});
  expect_message_has(refused([](auto& s) { s["stream"]["file"] = -1; }), {"stream.file = -1"});
  expect_message_has(refused([](auto& s) { s["stream"]["consumed"] = -1000; }), {"stream.consumed = -1000", ">= 0"});
  expect_message_has(refused([](auto& s) { s["stream"]["consumed"] = 1000000; }), {"stream.consumed = 1000000", "<="});
  expect_message_has(refused([](auto& s) { s["stream"]["offset"] = 1 << 30; }),
                     {"stream.offset", "inside the content"});
  expect_message_has(refused([](auto& s) { s["stream"]["offset"] = -3; }), {"stream.offset = -3"});
  expect_message_has(refused([](auto& s) { s["stream"]["epoch"] = int64_t(1) << 50; }), {"stream.epoch"});
  expect_message_has(refused([](auto& s) { s["stream"]["num_files"] = 4; }), {"stream.num_files = 4", "3 files"});
  expect_message_has(refused([](auto& s) { s["stream"]["file_name"] = "/etc/passwd"; }),
                     {"stream.file_name", "/etc/passwd"});
  expect_message_has(refused([](auto& s) { s["micro"] = -5; }), {"dataloader.dp_rank_1.micro = -5", ">= 0"});
  expect_message_has(refused([](auto& s) { s["micro"] = int64_t(1) << 61; }), {"micro", "overflows"});
  expect_message_has(refused([](auto& s) { s["micro"] = 8; }), {"next_sample", "must be"});  // counters disagree
  expect_message_has(refused([](auto& s) { s["next_sample"] = 4e18; }),
                     {"next_sample: must be an integer", "floating-point"});
  expect_message_has(refused([](auto& s) { s["next_sample"] = int64_t(4000000000000000000); }),
                     {"next_sample = 4000000000000000000"});
  expect_message_has(refused([](auto& s) { s["next_sample"] = "12"; }),
                     {"next_sample: must be an integer, is a string"});
  expect_message_has(refused([](auto& s) { s["dp_rank"] = 2; }), {"dp_rank = 2"});
  expect_message_has(refused([](auto& s) { s["dp_degree"] = 0; }), {"dp_degree = 0"});
  expect_message_has(refused([](auto& s) { s["local_batch_size"] = int64_t(1) << 40; s["dp_degree"] = int64_t(1) << 40; }),
                     {"overflows"});
  expect_message_has(refused([](auto& s) { s.erase("stream"); }), {"stream: missing"});
  expect_message_has(refused([](auto& s) { s["stream"] = 7; }), {"stream: must be a JSON object"});
  expect_message_has(refused([](auto& s) { s = nlohmann::json::array(); }), {"must be a JSON object"});
  expect_message_has(refused([](auto& s) { s["seq_len"] = 64; }), {"seq_len = 64", "training.seq_len = 100"});

  // Token files: the position is arithmetic, so a stream position that the sample counter does not put there is
  // refused too (text can only be bounded: re-tokenizing the corpus to check would cost a pass over it).
  std::vector<uint32_t> tokens(c.epoch_tokens.begin(), c.epoch_tokens.end());
  const std::string tok = c.dir + "/corpus.tok";
  write_token_file(tok, tokens, 258);
  DataLoader t({tok}, bytes(), 258, {S, 2, 1, 0, 1});
  for (int i = 0; i < 5; ++i) t.next();
  nlohmann::json ts = t.state();
  DataLoader u({tok}, bytes(), 258, {S, 2, 1, 0, 1});
  u.load_state(ts);
  EXPECT_EQ(u.next().sample_ids, t.next().sample_ids);
  ts["stream"]["consumed"] = ts["stream"]["consumed"].get<int64_t>() + 1;
  expect_message_has(error_of([&] { DataLoader({tok}, bytes(), 258, {S, 2, 1, 0, 1}).load_state(ts); }),
                     {"is not token", "sample counter"});
  ts = t.state();
  ts["stream"]["offset"] = 5;
  expect_message_has(error_of([&] { DataLoader({tok}, bytes(), 258, {S, 2, 1, 0, 1}).load_state(ts); }),
                     {"stream.offset = 5", "chunk start"});
  // A refused state leaves the loader where it was.
  DataLoader keep(c.files, bytes(), 258, {S, 2, 2, 1, 2}), fresh(c.files, bytes(), 258, {S, 2, 2, 1, 2});
  nlohmann::json bad = good;
  bad["stream"]["consumed"] = 1000000;
  EXPECT_FALSE(error_of([&] { keep.load_state(bad); }).empty());
  EXPECT_EQ(keep.next().inputs, fresh.next().inputs);
}
