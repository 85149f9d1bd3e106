// Pipeline schedules (include/fsdp/pipeline/schedule.h) against torch 2.13 itself: the venv's torch prints its compute-only
// and lowered action lists (tests/pipeline/schedule_golden.py), and for GPipe / 1F1B the order in which their
// hand-written runtime loops compute and issue P2P ops, recorded by running those loops. Plus hand-written orders,
// validation of broken lists, and the simulator against the reference note's measured bubble fractions.
//
// The script and the python come from FSDP_TEST_PYTHON / FSDP_TEST_SCHEDULE_GOLDEN (compile definitions or
// environment variables of the same name; the environment wins).

#include <fsdp/pipeline/schedule.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace fsdp::pipeline {
namespace {

// gtest only (no gmock in the build): "text contains part", printing the text when it does not.
::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected to contain \"" << part << "\", got:\n" << text;
}

std::string setting(const char* name, const char* compiled_default) {
  if (const char* env = std::getenv(name)) return env;
  return compiled_default;
}

#ifndef FSDP_TEST_PYTHON
#define FSDP_TEST_PYTHON "python3"
#endif
#ifndef FSDP_TEST_SCHEDULE_GOLDEN
#define FSDP_TEST_SCHEDULE_GOLDEN "tests/pipeline/schedule_golden.py"
#endif

// One case of the golden output.
struct GoldenCase {
  std::string name;
  int pp = 0, stages_per_rank = 0, microbatches = 0;
  std::string error;                                     // torch refused the case
  std::vector<std::vector<std::string>> compute, comms;  // per rank, "-" for idle
  std::vector<std::vector<std::string>> runtime;         // GPipe / 1F1B runtime loop order
};

std::vector<std::string> split_words(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

std::string golden_command() {
  return setting("FSDP_TEST_PYTHON", FSDP_TEST_PYTHON) + " " +
         setting("FSDP_TEST_SCHEDULE_GOLDEN", FSDP_TEST_SCHEDULE_GOLDEN);
}

// The golden script's stdout for these arguments (none: the default cases).
std::string run_golden(const std::string& args) {
  const std::string cmd = golden_command() + (args.empty() ? "" : " " + args);
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  if (!pipe) throw std::runtime_error("cannot run " + cmd);
  std::string text;
  std::array<char, 4096> buffer{};
  while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe.get())) text.append(buffer.data(), n);
  return text;
}

// Runs the golden script once per process (about 5 s) and parses its output.
const std::vector<GoldenCase>& golden() {
  static const std::vector<GoldenCase> cases = [] {
    const std::string text = run_golden("");
    std::vector<GoldenCase> parsed;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      auto words = split_words(line);
      if (words.empty()) continue;
      if (words[0] == "CASE" || words[0] == "CSVCASE") {
        GoldenCase c;
        c.name = words.at(1);
        c.pp = std::stoi(words.at(2));
        c.stages_per_rank = std::stoi(words.at(3));
        c.microbatches = std::stoi(words.at(4));
        parsed.push_back(c);
      } else if (words[0] == "ERROR") {
        parsed.back().error = line.substr(6);
      } else if (words[0] == "COMPUTE" || words[0] == "COMMS" || words[0] == "RUNTIME") {
        auto& target = words[0] == "COMPUTE" ? parsed.back().compute
                       : words[0] == "COMMS" ? parsed.back().comms
                                             : parsed.back().runtime;
        target.emplace_back(words.begin() + 2, words.end());
      }
    }
    return parsed;
  }();
  return cases;
}

std::vector<std::string> to_strings(const std::vector<std::optional<Action>>& list) {
  std::vector<std::string> out;
  for (const auto& a : list) out.push_back(a ? a->str() : "-");
  return out;
}
std::vector<std::string> to_strings(const std::vector<Action>& list) {
  std::vector<std::string> out;
  for (const auto& a : list) out.push_back(a.str());
  return out;
}
// The list without idle steps and without actions of the given types.
std::vector<std::string> without(const std::vector<std::string>& list, const std::vector<ActionType>& types) {
  std::vector<std::string> out;
  for (const auto& s : list)
    if (s != "-" && std::find(types.begin(), types.end(), Action::parse(s).type) == types.end()) out.push_back(s);
  return out;
}
ComputeGrid parse_grid(const std::vector<std::vector<std::string>>& words) {
  ComputeGrid grid(words.size());
  for (size_t r = 0; r < words.size(); ++r)
    for (const auto& w : words[r]) grid[r].push_back(w == "-" ? std::nullopt : std::optional<Action>(Action::parse(w)));
  return grid;
}
ActionLists parse_lists(const std::vector<std::vector<std::string>>& words) {
  ActionLists lists(words.size());
  for (size_t r = 0; r < words.size(); ++r)
    for (const auto& w : words[r]) lists[r].push_back(Action::parse(w));
  return lists;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

// ---------------------------------------------------------------------------------------------------------------

TEST(Action, StringRoundTrip) {
  for (const char* text : {"2F0", "0B15", "3I2", "1W7", "1UNSHARD", "12RESHARD", "0REDUCE_GRAD", "3SEND_F1",
                           "4RECV_F0", "2SEND_B3", "0RECV_B9"}) {
    const Action a = Action::parse(text);
    EXPECT_EQ(a.str(), text);
    EXPECT_EQ(Action::parse(a.str()), a);
  }
  EXPECT_EQ(Action::parse("3SEND_F1"), (Action{3, ActionType::SendF, 1}));
  EXPECT_EQ(Action::parse("1UNSHARD"), (Action{1, ActionType::Unshard, -1}));
  EXPECT_EQ(Action::parse("0REDUCE_GRAD"), (Action{0, ActionType::ReduceGrad, -1}));
  EXPECT_EQ(Action::parse("2B0").type, ActionType::Backward);
}

// DualPipeV's overlapped pair, in torch's spelling.
TEST(Action, OverlapRoundTrip) {
  const Action pair = Action::parse("(0F3;3B1)OVERLAP_F_B");
  EXPECT_EQ(pair.type, ActionType::OverlapFB);
  EXPECT_EQ(pair.sub_actions, (std::vector<Action>{{0, ActionType::Forward, 3}, {3, ActionType::Backward, 1}}));
  EXPECT_EQ(pair.str(), "(0F3;3B1)OVERLAP_F_B");
  EXPECT_EQ(pair, Action::overlap({0, ActionType::Forward, 3}, {3, ActionType::Backward, 1}));
  EXPECT_EQ(pair.leaves(), pair.sub_actions);
  EXPECT_EQ(Action::parse("2F0").leaves(), (std::vector<Action>{{2, ActionType::Forward, 0}}));
  EXPECT_TRUE(is_compute(ActionType::OverlapFB));
  EXPECT_TRUE(Contains(error_of([] { Action::parse("(0F3;3B1"); }), "no closing parenthesis"));
  EXPECT_TRUE(Contains(error_of([] { Action::parse("(0F3;3B1)F"); }), "only OVERLAP_F_B groups actions"));
  EXPECT_TRUE(Contains(error_of([] { Action::parse("(0F3;3SEND_F1)OVERLAP_F_B"); }), "must be one F, B, I or W"));
  EXPECT_TRUE(Contains(error_of([] { Action::parse("(0F3;)OVERLAP_F_B"); }), "must be one F, B, I or W"));
  EXPECT_TRUE(Contains(error_of([] { Action::parse("0OVERLAP_F_B1"); }), "is written (<action>;<action>)"));
}

TEST(Action, ParseErrorsSayWhatIsWrong) {
  EXPECT_TRUE(Contains(error_of([] { Action::parse(""); }), "does not start with a stage number"));
  EXPECT_TRUE(Contains(error_of([] { Action::parse("F0"); }), "\"F0\""));
  EXPECT_TRUE(Contains(error_of([] { Action::parse("2X0"); }), "unknown action type"));
  EXPECT_TRUE(Contains(error_of([] { Action::parse("2F"); }), "needs a microbatch"));
  EXPECT_TRUE(Contains(error_of([] { Action::parse("1UNSHARD3"); }), "takes no microbatch"));
  EXPECT_TRUE(Contains(error_of([] { Action::parse("2F0x"); }), "not a number"));
}

TEST(ScheduleNames, TorchAndTitanNamesCaseInsensitive) {
  EXPECT_EQ(parse_schedule_name("1f1b"), ScheduleKind::OneFOneB);
  EXPECT_EQ(parse_schedule_name("dualpipev"), ScheduleKind::DualPipeV);
  EXPECT_EQ(parse_schedule_name("GPIPE"), ScheduleKind::GPipe);
  EXPECT_EQ(parse_schedule_name("interleaved1f1b"), ScheduleKind::Interleaved1F1B);
  EXPECT_EQ(parse_schedule_name("LoopedBFS"), ScheduleKind::LoopedBFS);
  EXPECT_EQ(parse_schedule_name("InterleavedZeroBubble"), ScheduleKind::InterleavedZeroBubble);
  EXPECT_EQ(parse_schedule_name("zbvzerobubble"), ScheduleKind::ZBVZeroBubble);
  for (auto kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::LoopedBFS,
                    ScheduleKind::Interleaved1F1B, ScheduleKind::InterleavedZeroBubble, ScheduleKind::ZBVZeroBubble})
    EXPECT_EQ(parse_schedule_name(schedule_name(kind)), kind);
  const std::string err = error_of([] { parse_schedule_name("DualPipe"); });
  EXPECT_TRUE(Contains(err, "\"DualPipe\""));
  EXPECT_TRUE(Contains(err, "Interleaved1F1B"));
  EXPECT_TRUE(Contains(err, "ZBVZeroBubble"));
  EXPECT_EQ(default_stages_per_rank(ScheduleKind::GPipe), 1);
  EXPECT_EQ(default_stages_per_rank(ScheduleKind::OneFOneB), 1);
  EXPECT_EQ(default_stages_per_rank(ScheduleKind::ZBVZeroBubble), 2);
  EXPECT_EQ(default_stages_per_rank(ScheduleKind::Interleaved1F1B), 2);
}

TEST(StageMaps, LoopAndV) {
  EXPECT_EQ(loop_stage_to_rank(2, 4), (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(v_stage_to_rank(2, 4), (std::vector<int>{0, 1, 1, 0}));  // torch's generate_stage_to_rank_mapping(2,4,"v")
  EXPECT_EQ(v_stage_to_rank(4, 8), (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0}));
  const auto zbv = build_schedule({ScheduleKind::ZBVZeroBubble, 4, 2, 8});
  EXPECT_EQ(zbv.stages_of_rank(0), (std::vector<int>{0, 7}));
  EXPECT_EQ(zbv.stages_of_rank(3), (std::vector<int>{3, 4}));
}

// The four runtime schedules, compute-only and lowered, against torch's lists at several (pp, v, m).
TEST(TorchGolden, RuntimeSchedulesMatchTorch) {
  ASSERT_FALSE(golden().empty()) << "no output from the golden script: " << golden_command();
  int compared = 0, refused = 0;
  std::map<std::string, int> per_kind;
  for (const auto& g : golden()) {
    const ScheduleKind kind = parse_schedule_name(g.name);
    if (is_single_stage_kind(kind)) continue;
    SCOPED_TRACE(g.name + " pp=" + std::to_string(g.pp) + " v=" + std::to_string(g.stages_per_rank) +
                 " m=" + std::to_string(g.microbatches));
    const ScheduleSpec spec{kind, g.pp, g.stages_per_rank, g.microbatches};
    if (!g.error.empty()) {  // torch refuses: so do we, for the same reason
      const char* reason = kind == ScheduleKind::DualPipeV ? "at least as many microbatches as stages"
                                                           : "multiple of the number of rounds";
      EXPECT_TRUE(Contains(g.error, reason)) << g.error;
      EXPECT_TRUE(Contains(error_of([&] { build_schedule(spec); }), reason)) << g.error;
      ++refused;
      continue;
    }
    const PipelineSchedule ours = build_schedule(spec);
    ASSERT_EQ(static_cast<int>(g.compute.size()), g.pp);
    ASSERT_EQ(static_cast<int>(g.comms.size()), g.pp);
    for (int r = 0; r < g.pp; ++r) {
      EXPECT_EQ(to_strings(ours.compute[r]), g.compute[r]) << "compute, rank " << r;
      EXPECT_EQ(to_strings(ours.actions[r]), g.comms[r]) << "lowered, rank " << r;
    }
    // Our validator accepts torch's own lowered lists, and the stage map torch implies is ours.
    EXPECT_NO_THROW(validate_lowered(parse_lists(g.comms), ours.stage_to_rank, g.microbatches));
    EXPECT_EQ(validate_compute(parse_grid(g.compute), g.pp, ours.num_stages, g.microbatches), ours.stage_to_rank);
    ++compared;
    ++per_kind[g.name];
  }
  EXPECT_GE(compared, 30);  // the test is not vacuous: every kind, several shapes
  EXPECT_GE(refused, 2);
  for (const char* name : {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})
    EXPECT_GE(per_kind[name], 6) << name;
}

// GPipe and 1F1B: torch runs hand-written loops. The golden script ran them against a recording stage; our lowered
// lists must be exactly that order (plus the UNSHARD/RESHARD the loop leaves to FSDP's hooks).
TEST(TorchGolden, SingleStageSchedulesMatchTorchRuntimeLoops) {
  ASSERT_FALSE(golden().empty()) << "no output from the golden script: " << golden_command();
  int compared = 0, refused = 0;
  for (const auto& g : golden()) {
    const ScheduleKind kind = parse_schedule_name(g.name);
    if (!is_single_stage_kind(kind)) continue;
    SCOPED_TRACE(g.name + " pp=" + std::to_string(g.pp) + " m=" + std::to_string(g.microbatches));
    const ScheduleSpec spec{kind, g.pp, 1, g.microbatches};
    if (!g.error.empty()) {
      EXPECT_TRUE(Contains(error_of([&] { build_schedule(spec); }), "at least as many microbatches as stages"))
          << g.error;
      ++refused;
      continue;
    }
    const PipelineSchedule ours = build_schedule(spec);
    ASSERT_EQ(static_cast<int>(g.runtime.size()), g.pp);
    for (int r = 0; r < g.pp; ++r) {
      const auto lowered = to_strings(ours.actions[r]);
      EXPECT_EQ(lowered.front(), std::to_string(r) + "UNSHARD");
      EXPECT_EQ(lowered.back(), std::to_string(r) + "RESHARD");
      EXPECT_EQ(without(lowered, {ActionType::Unshard, ActionType::Reshard}), g.runtime[r]) << "rank " << r;
      EXPECT_EQ(without(to_strings(ours.compute[r]), {}), without(g.runtime[r], {ActionType::SendF, ActionType::RecvF,
                                                                                 ActionType::SendB, ActionType::RecvB,
                                                                                 ActionType::ReduceGrad}));
      if (kind == ScheduleKind::GPipe) {  // GPipe's pipeline_order IR is right: same compute order
        EXPECT_EQ(without(to_strings(ours.compute[r]), {}), without(g.compute[r], {ActionType::ReduceGrad}));
      }
    }
    if (kind == ScheduleKind::OneFOneB && g.pp > 1) {
      // torch's Schedule1F1B._get_pipeline_order is off by one on the last rank (F0 missing, F<m> out of range);
      // ours is not, and our validator rejects torch's IR.
      const int last = g.pp - 1;
      EXPECT_NE(without(to_strings(ours.compute[last]), {}), without(g.compute[last], {ActionType::ReduceGrad}));
      EXPECT_EQ(g.compute[last].front(), std::to_string(last) + "F1");
      EXPECT_EQ(ours.compute[last][last]->str(), std::to_string(last) + "F0");
      ComputeGrid torch_ir = parse_grid(g.compute);
      for (auto& list : torch_ir)
        list.erase(std::remove_if(list.begin(), list.end(),
                                  [](const auto& a) { return a && a->type == ActionType::ReduceGrad; }),
                   list.end());
      EXPECT_TRUE(Contains(error_of([&] { validate_compute(torch_ir, g.pp, g.pp, g.microbatches); }),
                           "rank " + std::to_string(last) + ", step 1 (" + std::to_string(last) +
                               "B0): Full Backward without first running Forward"));
    }
    ++compared;
  }
  EXPECT_GE(compared, 12);
  EXPECT_GE(refused, 1);
}

// Written out by hand from Schedule1F1B._step_microbatches / ScheduleGPipe._step_microbatches (independently of
// both the generator and the golden script).
TEST(HandWritten, OneFOneBRuntimeOrderPp2M4) {
  const auto s = build_schedule({ScheduleKind::OneFOneB, 2, 1, 4});
  // Stage 0: warm-up min(m, p - 0) = 2 forwards; the last warm-up send is issued together with the first
  // backward receive (send first).
  EXPECT_EQ(to_strings(s.actions[0]),
            (std::vector<std::string>{"0UNSHARD", "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0F2",
                                      "0SEND_F2", "0RECV_B1", "0B1", "0F3", "0SEND_F3", "0RECV_B2", "0B2", "0RECV_B3",
                                      "0B3", "0REDUCE_GRAD", "0RESHARD"}));
  // Stage 1 (last): one warm-up forward, then B/F pairs; a backward's send goes with the next forward's receive.
  EXPECT_EQ(to_strings(s.actions[1]),
            (std::vector<std::string>{"1UNSHARD", "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1",
                                      "1SEND_B1", "1RECV_F2", "1F2", "1B2", "1SEND_B2", "1RECV_F3", "1F3", "1B3",
                                      "1SEND_B3", "1REDUCE_GRAD", "1RESHARD"}));
}

TEST(HandWritten, GPipeRuntimeOrderPp3M2) {
  const auto s = build_schedule({ScheduleKind::GPipe, 3, 1, 2});
  EXPECT_EQ(to_strings(s.actions[1]),
            (std::vector<std::string>{"1UNSHARD", "1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1", "1SEND_F1",
                                      "1RECV_B0", "1B0", "1SEND_B0", "1RECV_B1", "1B1", "1SEND_B1", "1REDUCE_GRAD",
                                      "1RESHARD"}));
  // Compute grid: idle steps where the fill and drain leave a rank waiting.
  EXPECT_EQ(to_strings(s.compute[2]), (std::vector<std::string>{"-", "-", "2F0", "2F1", "2B0", "2B1"}));
}

TEST(HandWritten, LoweredZbvNeedsNoP2PBetweenTheVsLocalStages) {
  const auto s = build_schedule({ScheduleKind::ZBVZeroBubble, 2, 2, 4});
  // Rank 1 holds stages 1 and 2 (the bottom of the V): 1 -> 2 stays on the rank.
  for (const Action& a : s.actions[1]) {
    EXPECT_FALSE(a.stage == 1 && a.type == ActionType::SendF) << a.str();
    EXPECT_FALSE(a.stage == 2 && a.type == ActionType::SendB) << a.str();
  }
}

std::string build_error(ScheduleKind kind, int pp, int stages_per_rank, int microbatches) {
  return error_of([&] { build_schedule({kind, pp, stages_per_rank, microbatches}); });
}

TEST(BadSpecs, RefusedWithTheReason) {
  EXPECT_TRUE(Contains(build_error(ScheduleKind::OneFOneB, 4, 1, 3),
                       "at least as many microbatches as stages: got 3 microbatches for 4 stages"));
  EXPECT_TRUE(Contains(build_error(ScheduleKind::GPipe, 4, 2, 8), "exactly one stage per rank"));
  EXPECT_TRUE(Contains(build_error(ScheduleKind::ZBVZeroBubble, 4, 3, 8), "exactly 2 stages per rank"));
  EXPECT_TRUE(Contains(build_error(ScheduleKind::Interleaved1F1B, 4, 2, 9),
                       "multiple of the number of rounds (max(1, m / pp) = 2), got m=9"));
  EXPECT_TRUE(Contains(build_error(ScheduleKind::InterleavedZeroBubble, 4, 2, 14), "multiple of the number of rounds"));
  EXPECT_TRUE(Contains(build_error(ScheduleKind::LoopedBFS, 0, 2, 8), "pp (pipeline ranks) must be >= 1, got 0"));
  EXPECT_TRUE(Contains(build_error(ScheduleKind::LoopedBFS, 2, 2, 0), "microbatches must be >= 1, got 0"));
  EXPECT_TRUE(Contains(build_error(ScheduleKind::LoopedBFS, 2, 0, 4), "stages_per_rank must be >= 1"));
  EXPECT_TRUE(Contains(build_error(ScheduleKind::GPipe, 100000, 1, 100000), "implausibly large"));
}

// validate_compute's error for a 2-rank, 2-stage, 2-microbatch grid.
std::string compute_error(const std::vector<std::vector<std::string>>& words) {
  return error_of([&] { validate_compute(parse_grid(words), 2, 2, 2); });
}

TEST(ValidateCompute, RejectsBrokenLists) {
  // Two ranks, two stages, two microbatches: the good one first.
  EXPECT_EQ(validate_compute(parse_grid({{"0F0", "0F1", "-", "0B0", "0B1"}, {"-", "1F0", "1F1", "1B0", "1B1"}}), 2,
                             2, 2),
            (std::vector<int>{0, 1}));

  const std::string b_before_f = compute_error({{"0F0", "0B1", "0F1", "0B0"}, {"1F0", "1F1", "1B0", "1B1"}});
  EXPECT_TRUE(Contains(b_before_f, "rank 0, step 1 (0B1): Full Backward without first running Forward"));
  EXPECT_TRUE(Contains(b_before_f, "Step 1: 0B1    1F1    <-- ERROR HERE"));  // the whole grid, the bad row marked
  EXPECT_TRUE(Contains(b_before_f, "Rank 1"));

  EXPECT_TRUE(Contains(compute_error({{"0F0", "0F1", "0I0", "0W0", "0I1"}, {"1F0", "1F1", "1B0", "1B1"}}),
                       "stage 0 (rank 0), microbatch 1 has a Backward Input but no Backward Weight"));
  EXPECT_TRUE(Contains(compute_error({{"0F0", "0F1", "0W0", "0B1"}, {"1F0", "1F1", "1B0", "1B1"}}),
                       "Backward Weight without first running Backward Input"));
  EXPECT_TRUE(Contains(compute_error({{"0F0", "0F1", "0B0", "0B1", "1F0"}, {"1F0", "1F1", "1B0", "1B1"}}),
                       "stage 1 is assigned to both rank 1 and rank 0"));
  EXPECT_TRUE(Contains(compute_error({{"0F0", "0F1", "0B0", "0B1"}}), "has 1 rank lists, expected pp=2"));
  // torch's sets would let a duplicate through.
  EXPECT_TRUE(Contains(compute_error({{"0F0", "0F0", "0B0", "0B1"}, {"1F0", "1F1", "1B0", "1B1"}}),
                       "a second Forward"));
  EXPECT_TRUE(Contains(compute_error({{"0F0", "0F1", "0B0", "0B1"}, {"1F0", "1F1", "1B0", "1F2"}}),
                       "microbatch out of range"));
  EXPECT_TRUE(Contains(compute_error({{"0F0", "0F1", "0B0", "0B1"}, {"1F0", "1F1", "1B0"}}),
                       "stage 1 (rank 1), microbatch 1 has no backward"));
  EXPECT_TRUE(Contains(compute_error({{"0F0", "0SEND_F0", "0F1", "0B0", "0B1"}, {"1F0", "1F1", "1B0", "1B1"}}),
                       "not a compute action"));
}

std::vector<Action> erase_first(std::vector<Action> list, const std::string& text) {
  auto it = std::find(list.begin(), list.end(), Action::parse(text));
  EXPECT_NE(it, list.end()) << text;
  if (it != list.end()) list.erase(it);
  return list;
}

void swap_actions(std::vector<Action>& list, const std::string& a, const std::string& b) {
  auto first = std::find(list.begin(), list.end(), Action::parse(a));
  auto second = std::find(list.begin(), list.end(), Action::parse(b));
  ASSERT_TRUE(first != list.end() && second != list.end()) << a << " / " << b;
  std::iter_swap(first, second);
}

TEST(ValidateLowered, RejectsMissingRecvDeadlockAndFsdpMistakes) {
  const auto s = build_schedule({ScheduleKind::OneFOneB, 2, 1, 2});
  EXPECT_NO_THROW(validate_lowered(s.actions, s.stage_to_rank, 2));
  auto lowered_error = [&](const ActionLists& lists) {
    return error_of([&] { validate_lowered(lists, s.stage_to_rank, 2); });
  };

  ActionLists missing_recv = s.actions;
  missing_recv[1] = erase_first(missing_recv[1], "1RECV_F1");
  EXPECT_TRUE(Contains(lowered_error(missing_recv), "(0SEND_F1): no matching 1RECV_F1 on rank 1"));

  // Rank 0 waits for stage 1's first gradient before it sends stage 1 its first activation: a cycle.
  ActionLists deadlock = s.actions;
  deadlock[0] = erase_first(deadlock[0], "0RECV_B0");
  deadlock[0].insert(deadlock[0].begin() + 1, Action::parse("0RECV_B0"));
  const std::string err = lowered_error(deadlock);
  EXPECT_TRUE(Contains(err, "deadlocks"));
  EXPECT_TRUE(Contains(err, "rank 0 step 1: 0RECV_B0 waits for 1SEND_B0 on rank 1"));
  EXPECT_TRUE(Contains(err, "rank 1 step 1: 1RECV_F0 waits for 0SEND_F0 on rank 0"));

  // Receives posted in a different order than the peer sends them.
  ActionLists swapped = s.actions;
  swap_actions(swapped[1], "1RECV_F0", "1RECV_F1");
  EXPECT_TRUE(Contains(lowered_error(swapped), "different order"));

  ActionLists no_unshard = s.actions;
  no_unshard[0] = erase_first(no_unshard[0], "0UNSHARD");
  EXPECT_TRUE(Contains(lowered_error(no_unshard), "computes on a sharded stage"));

  ActionLists early_reduce = s.actions;
  early_reduce[0] = erase_first(early_reduce[0], "0REDUCE_GRAD");
  early_reduce[0].insert(early_reduce[0].begin() + 1, Action::parse("0REDUCE_GRAD"));
  EXPECT_TRUE(Contains(lowered_error(early_reduce), "REDUCE_GRAD after 0 of 2 weight-gradient backwards"));

  ActionLists no_reduce = s.actions;
  no_reduce[1] = erase_first(no_reduce[1], "1REDUCE_GRAD");
  EXPECT_TRUE(Contains(lowered_error(no_reduce), "stage 1 has no REDUCE_GRAD"));

  ActionLists compute_before_recv = s.actions;
  swap_actions(compute_before_recv[1], "1RECV_F0", "1F0");
  EXPECT_TRUE(Contains(lowered_error(compute_before_recv), "(1F0): computes before its input is received"));

  // SEND/RECV between the V's same-rank stages is refused.
  const auto v = build_schedule({ScheduleKind::ZBVZeroBubble, 2, 2, 4});
  ActionLists local_p2p = v.actions;
  local_p2p[1].insert(local_p2p[1].begin() + 3, Action::parse("1SEND_F0"));
  EXPECT_TRUE(Contains(error_of([&] { validate_lowered(local_p2p, v.stage_to_rank, 4); }), "same rank"));
}

// One bad list per rule of validate_compute / validate_lowered (src/pipeline/schedule_validate.cpp: one function per
// rule), each refused with that rule's message; the cases above cover the others.
TEST(ValidateRules, EachRuleRefusesItsOwnBadList) {
  // validate_compute: rule_stage_in_range, rule_every_stage_placed.
  EXPECT_TRUE(Contains(compute_error({{"0F0", "0F1", "0B0", "0B1"}, {"1F0", "1F1", "1B0", "1B1", "2F0"}}),
                       "rank 1, step 4 (2F0): stage out of range [0, 2)"));
  EXPECT_TRUE(Contains(compute_error({{"0F0", "0F1", "0B0", "0B1"}, {}}), "stage 1 appears on no rank"));
  // rule_overlap_parts, and the rules applied to an OVERLAP_F_B's parts (the part is named).
  ComputeGrid bad_pair = parse_grid({{"0F0", "0F1", "0B0", "0B1"}, {"1F0", "1F1", "1B0", "1B1"}});
  bad_pair[1][2] = Action::overlap({1, ActionType::SendF, 0}, {1, ActionType::Backward, 0});
  EXPECT_TRUE(Contains(error_of([&] { validate_compute(bad_pair, 2, 2, 2); }),
                       "must be one F, B, I or W action, got 1SEND_F0"));
  EXPECT_TRUE(Contains(compute_error({{"0F0", "0F1", "0B0", "0B1"}, {"(1B0;1F0)OVERLAP_F_B", "1F1", "1B1"}}),
                       "rank 1, step 0 (1B0): Full Backward without first running Forward"));

  const auto s = build_schedule({ScheduleKind::OneFOneB, 2, 1, 2});
  auto lowered_error = [&](const ActionLists& lists, std::vector<int> stage_to_rank = {0, 1}) {
    return error_of([&] { validate_lowered(lists, stage_to_rank, 2); });
  };
  auto with = [&](int rank, const std::function<void(std::vector<Action>&)>& edit) {
    ActionLists lists = s.actions;
    edit(lists[rank]);
    return lists;
  };
  auto insert_at = [](size_t pos, const std::string& text) {
    return [=](std::vector<Action>& list) { list.insert(list.begin() + static_cast<long>(pos), Action::parse(text)); };
  };
  // rule_actions_owned
  EXPECT_TRUE(Contains(lowered_error(with(0, insert_at(1, "1F0"))), "(1F0): stage 1 lives on rank 1"));
  EXPECT_TRUE(Contains(lowered_error(with(0, insert_at(1, "0F5"))), "(0F5): microbatch out of range"));
  // rule_p2p_between_ranks: no neighbour upstream of stage 0.
  EXPECT_TRUE(Contains(lowered_error(with(0, insert_at(1, "0RECV_F0"))), "there is no neighbour stage to talk to"));
  // rule_compute_actions_valid: the lists are fine but the map given says otherwise.
  const auto one_rank = build_schedule({ScheduleKind::GPipe, 1, 1, 2});
  EXPECT_TRUE(Contains(error_of([&] { validate_lowered(one_rank.actions, {0}, 3); }),
                       "stage 0 (rank 0), microbatch 2 has no Forward"));
  // rule_transfers_unique
  EXPECT_TRUE(Contains(lowered_error(with(0, [](std::vector<Action>& l) {
                         auto it = std::find(l.begin(), l.end(), Action::parse("0SEND_F0"));
                         l.insert(it + 1, Action::parse("0SEND_F0"));
                       })),
                       "(0SEND_F0): the same transfer appears twice"));
  // rule_every_recv_sent
  EXPECT_TRUE(Contains(lowered_error(with(0, [](std::vector<Action>& l) { l = erase_first(l, "0SEND_F1"); })),
                       "(1RECV_F1): no matching 0SEND_F1 on rank 0"));
  // rule_compute_while_unsharded: double UNSHARD, RESHARD without UNSHARD, unused UNSHARD, open at the end.
  EXPECT_TRUE(Contains(lowered_error(with(0, insert_at(1, "0UNSHARD"))), "UNSHARD of a stage that is already"));
  EXPECT_TRUE(Contains(lowered_error(with(0, insert_at(0, "0RESHARD"))), "RESHARD of a stage that is not unsharded"));
  EXPECT_TRUE(Contains(lowered_error(with(0, [](std::vector<Action>& l) {
                         l.insert(l.begin() + 1, Action::parse("0RESHARD"));
                       })),
                       "did not compute since its UNSHARD"));
  EXPECT_TRUE(Contains(lowered_error(with(1, [](std::vector<Action>& l) { l = erase_first(l, "1RESHARD"); })),
                       "stage 1 is still unsharded at the end"));
  // rule_reduce_grad_once_after_last_backward: a second REDUCE_GRAD, one while resharded.
  EXPECT_TRUE(Contains(lowered_error(with(1, [](std::vector<Action>& l) {
                         auto it = std::find(l.begin(), l.end(), Action::parse("1REDUCE_GRAD"));
                         l.insert(it + 1, Action::parse("1REDUCE_GRAD"));
                       })),
                       "a second REDUCE_GRAD for the stage"));
  EXPECT_TRUE(Contains(lowered_error(with(1, [](std::vector<Action>& l) {
                         l = erase_first(l, "1REDUCE_GRAD");
                         l.push_back(Action::parse("1REDUCE_GRAD"));
                       })),
                       "REDUCE_GRAD while the stage is resharded"));
}

// CSV schedules: files that torch itself wrote (_dump_csv(format="compute_only")) load into the compute lists torch
// built and lower to exactly the lists torch's _load_csv lowers them to; bad files are refused with one line naming
// the file, row, column and rule.
TEST(CsvSchedule, TorchsOwnCsvLoadsAsTorchLoadsIt) {
  const std::string dir = ::testing::TempDir() + "fsdp_csv_" + std::to_string(getpid());
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  struct Case {
    std::string name;
    int pp, m;
  };
  const std::vector<Case> cases = {{"DualPipeV", 2, 4},       {"DualPipeV", 4, 8},    {"Interleaved1F1B", 2, 4},
                                   {"InterleavedZeroBubble", 4, 8}, {"ZBVZeroBubble", 2, 4}, {"LoopedBFS", 2, 3}};
  std::string args;
  for (const Case& c : cases)
    args += " CSV:" + c.name + ":" + std::to_string(c.pp) + ":2:" + std::to_string(c.m) + ":" + dir + "/" + c.name +
            std::to_string(c.pp) + ".csv";
  args += " CSV_COMMS:DualPipeV:2:2:4:" + dir + "/lowered.csv";
  const std::string out = run_golden(args);
  std::vector<GoldenCase> parsed;
  std::vector<std::string> paths;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    auto words = split_words(line);
    if (words.empty()) continue;
    if (words[0] == "CSVCASE") {
      parsed.push_back(GoldenCase{words.at(1), std::stoi(words.at(2)), std::stoi(words.at(3)), std::stoi(words.at(4))});
      paths.push_back(words.at(5));
    } else if (words[0] == "COMMS") {
      parsed.back().comms.emplace_back(words.begin() + 2, words.end());
    }
  }
  ASSERT_EQ(parsed.size(), cases.size() + 1) << out;
  for (size_t i = 0; i < cases.size(); ++i) {
    const GoldenCase& g = parsed[i];
    SCOPED_TRACE(g.name + " pp=" + std::to_string(g.pp) + " m=" + std::to_string(g.microbatches));
    const PipelineSchedule loaded = load_schedule_csv(paths[i], g.pp, 2 * g.pp, g.microbatches);
    const PipelineSchedule built = build_schedule({parse_schedule_name(g.name), g.pp, 2, g.microbatches});
    EXPECT_EQ(loaded.spec.kind, ScheduleKind::Csv);
    EXPECT_EQ(loaded.stage_to_rank, built.stage_to_rank);  // inferred from the file: loop or V
    ASSERT_EQ(static_cast<int>(g.comms.size()), g.pp);
    for (int r = 0; r < g.pp; ++r) {
      EXPECT_EQ(to_strings(loaded.compute[r]), to_strings(built.compute[r])) << "compute, rank " << r;
      EXPECT_EQ(to_strings(loaded.actions[r]), g.comms[r]) << "lowered, rank " << r;
    }
  }

  // Refused, each with its rule. A file torch wrote in its lowered format (its default for _dump_csv):
  EXPECT_TRUE(Contains(error_of([&] { load_schedule_csv(paths.back(), 2, 4, 4); }),
                       paths.back() + ": row 1, column 1 ('0UNSHARD'): not a compute action"));
  EXPECT_TRUE(Contains(error_of([&] { load_schedule_csv(paths.back(), 2, 4, 4); }), "compute_only"));
  EXPECT_TRUE(Contains(error_of([&] { load_schedule_csv(dir + "/missing.csv", 2, 4, 4); }),
                       dir + "/missing.csv: cannot open"));
  auto csv_error = [](const std::string& text, int pp = 2, int stages = 2, int m = 2) {
    return error_of([&] { parse_schedule_csv(text, "s.csv", pp, stages, m); });
  };
  const std::string good = "0F0,0F1,,0B0,0B1\r\n,1F0,1F1,1B0,1B1\r\n";
  EXPECT_NO_THROW(parse_schedule_csv(good, "s.csv", 2, 2, 2));
  EXPECT_TRUE(Contains(csv_error("0F0,0X1,,0B0,0B1\n,1F0,1F1,1B0,1B1\n"),
                       "s.csv: row 1, column 2 ('0X1'): not an action: unknown action type"));
  EXPECT_TRUE(Contains(csv_error("0F0,0F1,,0B0,0B1\n"), "s.csv: 1 rows, expected one per pipeline rank (2)"));
  EXPECT_TRUE(Contains(csv_error("0F0,0F1,,0B0,0B1\n,1F0,1F1,1B0,1B2\n"),
                       "s.csv: row 2, column 5 ('1B2'): microbatch out of range [0, 2)"));
  EXPECT_TRUE(Contains(csv_error("0F0,0F1,,0B0,0B1\n,1F0,1F1,1B1,1B0,0F0\n"),
                       "row 2, column 6 ('0F0'): stage 0 is assigned to both rank 1 and rank 0"));
  EXPECT_TRUE(Contains(csv_error("0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1\n"),
                       "s.csv: stage 1 (rank 1), microbatch 1 has no backward"));
  // Every rank's order is locally fine, but rank 0 waits for stage 1's gradient before it sends the activation
  // that stage 1 needs: the file deadlocks, and the error points at each waiting cell.
  EXPECT_TRUE(Contains(csv_error("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n"),
                       "s.csv: the schedule deadlocks: every unfinished rank waits for an input that no rank produces "
                       "before it (s.csv: row 1, column 2 ('0B0'); s.csv: row 2, column 1 ('1F1'))"));
}

// Thousands of microbatches: every pass is near-linear (the ctest timeout bounds this; it takes well under a second).
TEST(Scale, LargeSchedulesBuildAndValidate) {
  const auto looped = build_schedule({ScheduleKind::LoopedBFS, 8, 1, 4096});
  EXPECT_EQ(looped.actions[0].front().str(), "0UNSHARD");
  const auto interleaved = build_schedule({ScheduleKind::Interleaved1F1B, 8, 4, 1024});
  EXPECT_NEAR(simulate(interleaved, SimCosts{}).bubble_fraction, 7.0 / (4 * 1024 + 7), 1e-9);
}

TEST(Format, GridWithOneColumnPerRank) {
  const auto s = build_schedule({ScheduleKind::Interleaved1F1B, 2, 2, 4});
  const std::string compute = format_schedule(s, false);
  const std::string lowered = format_schedule(s, true);
  EXPECT_TRUE(Contains(compute, "Interleaved1F1B pp=2 stages_per_rank=2 microbatches=4 (compute)"));
  EXPECT_TRUE(Contains(compute, "Rank 0"));
  EXPECT_TRUE(Contains(compute, "Step 00: 0F0"));
  EXPECT_TRUE(Contains(lowered, "Step 00: 0UNSHARD     1UNSHARD"));
  EXPECT_TRUE(Contains(lowered, "0REDUCE_GRAD"));
}

// The reference note's table (measured with torch 2.13's orders, unit costs: F=1, B=2 or I=W=1, no latency),
// and its closed forms.
TEST(Simulate, BubbleFractionsOfTheReferenceTable) {
  struct Row {
    ScheduleKind kind;
    int pp, m;
    double expected;
  };
  const std::vector<Row> rows = {
      {ScheduleKind::GPipe, 4, 8, 0.273},           {ScheduleKind::GPipe, 4, 16, 0.158},
      {ScheduleKind::GPipe, 8, 16, 0.304},          {ScheduleKind::OneFOneB, 4, 8, 0.273},
      {ScheduleKind::OneFOneB, 4, 16, 0.158},       {ScheduleKind::OneFOneB, 8, 16, 0.304},
      {ScheduleKind::LoopedBFS, 4, 8, 0.158},       {ScheduleKind::LoopedBFS, 4, 16, 0.086},
      {ScheduleKind::LoopedBFS, 8, 16, 0.179},      {ScheduleKind::Interleaved1F1B, 4, 8, 0.158},
      {ScheduleKind::Interleaved1F1B, 4, 16, 0.086}, {ScheduleKind::Interleaved1F1B, 8, 16, 0.179},
      {ScheduleKind::InterleavedZeroBubble, 4, 8, 0.059}, {ScheduleKind::InterleavedZeroBubble, 4, 16, 0.030},
      {ScheduleKind::InterleavedZeroBubble, 8, 16, 0.068}, {ScheduleKind::ZBVZeroBubble, 4, 8, 0.059},
      {ScheduleKind::ZBVZeroBubble, 4, 16, 0.030},  {ScheduleKind::ZBVZeroBubble, 8, 16, 0.068},
  };
  for (const Row& row : rows) {
    const auto s = build_schedule({row.kind, row.pp, default_stages_per_rank(row.kind), row.m});
    const SimResult r = simulate(s, SimCosts{});
    SCOPED_TRACE(schedule_name(row.kind) + " pp=" + std::to_string(row.pp) + " m=" + std::to_string(row.m));
    EXPECT_NEAR(r.bubble_fraction, row.expected, 1e-3);
    const double p = row.pp, m = row.m, v = s.spec.stages_per_rank;
    const bool zero_bubble = row.kind == ScheduleKind::InterleavedZeroBubble || row.kind == ScheduleKind::ZBVZeroBubble;
    const double closed_form = zero_bubble ? (p - 1) / (3 * v * m + p - 1) : (p - 1) / (v * m + p - 1);
    EXPECT_NEAR(r.bubble_fraction, closed_form, 1e-9);
    // Work is conserved: every rank is busy 3 units per microbatch per local stage.
    for (double busy : r.busy) EXPECT_DOUBLE_EQ(busy, 3 * v * m);
    EXPECT_EQ(r.spans.size(), static_cast<size_t>(row.pp));
    EXPECT_EQ(r.spans[0].size(), s.actions[0].size());
  }
}

// DualPipeV: an OVERLAP_F_B costs its F plus its B, so each rank is still busy 3 units per microbatch per stage;
// its bubble sits between ZBV's and Interleaved1F1B's (the reference numbers of bench/RESULTS.md).
TEST(Simulate, DualPipeVConservesWorkAndBubblesBetweenZbvAndInterleaved) {
  for (const auto& [pp, m] : std::vector<std::pair<int, int>>{{2, 8}, {4, 8}, {4, 16}, {8, 16}}) {
    SCOPED_TRACE("pp=" + std::to_string(pp) + " m=" + std::to_string(m));
    const auto dual = build_schedule({ScheduleKind::DualPipeV, pp, 2, m});
    const SimResult r = simulate(dual, SimCosts{});
    for (double busy : r.busy) EXPECT_DOUBLE_EQ(busy, 3 * 2 * m);
    const double zbv = simulate(build_schedule({ScheduleKind::ZBVZeroBubble, pp, 2, m}), SimCosts{}).bubble_fraction;
    const double interleaved =
        simulate(build_schedule({ScheduleKind::Interleaved1F1B, pp, 2, m}), SimCosts{}).bubble_fraction;
    EXPECT_GE(r.bubble_fraction, zbv - 1e-9);
    EXPECT_LT(r.bubble_fraction, interleaved);
    // The pairs are there and cost F + B.
    size_t pairs = 0;
    for (const auto& list : dual.actions)
      for (const Action& a : list) pairs += a.type == ActionType::OverlapFB ? 1 : 0;
    EXPECT_GT(pairs, 0u);
    EXPECT_DOUBLE_EQ(SimCosts{}.cost_of(Action::parse("(0F3;3B1)OVERLAP_F_B")), 3.0);
  }
}

TEST(Simulate, ZeroBubbleIdlesLessThanOneFOneB) {
  const auto one_f_one_b = simulate(build_schedule({ScheduleKind::OneFOneB, 4, 1, 8}), SimCosts{});
  const auto zb = simulate(build_schedule({ScheduleKind::InterleavedZeroBubble, 4, 2, 8}), SimCosts{});
  const auto zbv = simulate(build_schedule({ScheduleKind::ZBVZeroBubble, 4, 2, 8}), SimCosts{});
  // Same work per rank once the stage costs are halved for the two-stage schedules.
  SimCosts half;
  half.forward = 0.5;
  half.backward_input = 0.5;
  half.backward_weight = 0.5;
  const auto zb_half = simulate(build_schedule({ScheduleKind::InterleavedZeroBubble, 4, 2, 8}), half);
  EXPECT_LT(zb.bubble_fraction, one_f_one_b.bubble_fraction);
  EXPECT_LT(zbv.bubble_fraction, one_f_one_b.bubble_fraction);
  EXPECT_DOUBLE_EQ(zb_half.busy[0], one_f_one_b.busy[0]);
  EXPECT_LT(zb_half.idle[0], one_f_one_b.idle[0]);
  EXPECT_LT(zb_half.makespan, one_f_one_b.makespan);
}

// Why the runtime must wait for a RECV at its consumer, not where the list posts it: torch's lowering posts
// receives early (to overlap), and stalling there throws most of the interleaving away. 1F1B's receives sit right
// before their consumers, so it does not care.
TEST(Simulate, WaitingAtTheRecvItselfCostsTheInterleavedSchedules) {
  SimCosts in_place;
  in_place.recv_waits_in_place = true;
  const auto interleaved = build_schedule({ScheduleKind::Interleaved1F1B, 4, 2, 8});
  const auto one_f_one_b = build_schedule({ScheduleKind::OneFOneB, 4, 1, 8});
  EXPECT_NEAR(simulate(interleaved, SimCosts{}).bubble_fraction, 0.158, 1e-3);
  EXPECT_GT(simulate(interleaved, in_place).bubble_fraction, 0.4);
  EXPECT_DOUBLE_EQ(simulate(one_f_one_b, in_place).makespan, simulate(one_f_one_b, SimCosts{}).makespan);
}

TEST(Simulate, LatencyAndStageCosts) {
  const auto s = build_schedule({ScheduleKind::GPipe, 2, 1, 1});
  SimCosts costs;
  costs.p2p_latency = 0.5;
  const SimResult r = simulate(s, costs);
  // F on rank 0 (1), hop (0.5), F and B on rank 1 (1 + 2), hop (0.5), B on rank 0 (2).
  EXPECT_DOUBLE_EQ(r.makespan, 7.0);
  costs.stage_scale = {1.0, 2.0};
  EXPECT_DOUBLE_EQ(simulate(s, costs).makespan, 10.0);
  costs.stage_scale = {1.0};
  EXPECT_TRUE(Contains(error_of([&] { simulate(s, costs); }), "one per stage"));
}

// Simulating torch's own lowered lists gives the same bubble fractions as ours (the schedules are the same).
TEST(Simulate, TorchListsSimulateLikeOurs) {
  ASSERT_FALSE(golden().empty()) << "no output from the golden script: " << golden_command();
  int compared = 0;
  for (const auto& g : golden()) {
    if (!g.error.empty() || g.comms.empty()) continue;
    const auto ours = build_schedule({parse_schedule_name(g.name), g.pp, g.stages_per_rank, g.microbatches});
    PipelineSchedule theirs = ours;
    theirs.actions = parse_lists(g.comms);
    EXPECT_DOUBLE_EQ(simulate(theirs, SimCosts{}).makespan, simulate(ours, SimCosts{}).makespan) << g.name;
    ++compared;
  }
  EXPECT_GE(compared, 30);
}

}  // namespace
}  // namespace fsdp::pipeline
