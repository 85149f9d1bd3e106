// Communication overlaps computation, shown from timestamps (issue 11, "Overlap"): in forward, the
// all-gather of block i+1 (prefetched) is in flight while block i computes; in backward, the reduce-scatter
// of block i+1 is in flight while block i's backward computes. The group records a timeline
// (fsdp::record_timeline, fsdp/comm_stats.h): when each collective was issued, when its transfers completed (stamped
// by an observer thread, not when the training thread came to wait), and how long the training thread
// waited for it. The compute intervals are stamped by the model itself around a parameter-free heavy part
// (repeated matmuls with a fixed matrix), so they contain no FSDP work.
//
// Blocks have distinct hidden sizes, so every collective is identified by its byte count.

#include "fully_shard/fsdp_test_util.h"
#include <fsdp/comm_stats.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <optional>

namespace {
using Clock = fsdp::CollectiveSpan::Clock;
using fsdp_test::test_world;

constexpr int64_t kDim = 192, kBatch = 192, kBlocks = 4, kReps = 24;
int64_t hidden_of(int64_t i) { return 1024 + 96 * i; }  // distinct; ~2 MB of parameters per block

struct Interval {
  Clock::time_point begin, end;
};
double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct HeavyBlockImpl : torch::nn::Module {
  HeavyBlockImpl(int64_t hidden, torch::Tensor mix) : mix(std::move(mix)) {
    fc1 = register_module("fc1", torch::nn::Linear(kDim, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, kDim));
  }
  // The forward body (after FSDP's pre-forward, which waits for this block's own all-gather) is the block's
  // forward compute; its backward runs from the output's gradient to the input's gradient.
  torch::Tensor forward(torch::Tensor x) {
    Interval fwd;
    fwd.begin = Clock::now();
    auto h = torch::tanh(fc2(torch::relu(fc1(x))));
    auto y = h;
    for (int r = 0; r < kReps; ++r) y = torch::tanh(y.matmul(mix));  // heavy, parameter-free
    auto out = x + y;
    fwd.end = Clock::now();
    if (torch::GradMode::is_enabled()) {
      forward_compute.push_back(fwd);
      auto slot = std::make_shared<Interval>();
      backward_compute.push_back(slot);
      // Registered before FSDP's own hooks on the output (its post-forward runs after this body), so the
      // interval also covers FSDP's pre-backward work for this block.
      out.register_hook([slot](const torch::Tensor&) { slot->begin = Clock::now(); });
      x.register_hook([slot](const torch::Tensor&) { slot->end = Clock::now(); });
    }
    return out;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor mix;  // not a parameter: a fixed matrix, so the heavy part has no FSDP work of its own
  std::vector<Interval> forward_compute;
  std::vector<std::shared_ptr<Interval>> backward_compute;
};
TORCH_MODULE(HeavyBlock);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(5);
    auto mix = torch::randn({kDim, kDim}) / std::sqrt(static_cast<double>(kDim));
    input = register_module("input", torch::nn::Linear(kDim, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < kBlocks; ++i) blocks->push_back(HeavyBlock(hidden_of(i), mix));
    output = register_module("output", torch::nn::Linear(kDim, 3));
  }
  HeavyBlockImpl& block(int64_t i) { return *blocks->ptr<HeavyBlockImpl>(i); }
  torch::Tensor forward(torch::Tensor x) {
    auto h = input(x);
    for (int64_t i = 0; i < kBlocks; ++i) h = fsdp::nn::call(blocks->ptr<HeavyBlockImpl>(i), h);
    return output(h);
  }
  torch::nn::Linear input{nullptr}, output{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Net);

// Bytes of block i's all-gather input on this rank: each parameter's dim 0 padded to a multiple of the
// world size, this rank's rows of it (FSDP's padded shard). FSDP may align each parameter's shard in the
// flat buffer (up to 16 bytes each): spans are matched within that slack.
constexpr int64_t kAlignSlack = 4 * 16;
int64_t shard_bytes(int64_t i, int64_t world) {
  auto padded_rows = [&](int64_t rows) { return (rows + world - 1) / world; };
  const int64_t h = hidden_of(i);
  const int64_t elems = padded_rows(h) * kDim + padded_rows(h) + padded_rows(kDim) * h + padded_rows(kDim);
  return elems * 4;
}

// The first span of `collective` with [bytes, bytes + slack] issued at or after `from`.
std::optional<fsdp::CollectiveSpan> find_span(const std::vector<fsdp::CollectiveSpan>& spans,
                                              const std::string& collective, int64_t bytes, int64_t slack,
                                              Clock::time_point from) {
  for (const auto& s : spans) {
    if (s.collective == collective && s.bytes >= bytes && s.bytes <= bytes + slack && s.issued >= from) return s;
  }
  return std::nullopt;
}

// Time the span's transfers were in flight during the interval.
Clock::duration overlap(const fsdp::CollectiveSpan& s, const Interval& iv) {
  const auto from = std::max(s.issued, iv.begin);
  const auto to = std::min(s.completed, iv.end);
  return to > from ? to - from : Clock::duration::zero();
}

}  // namespace

TEST(Overlap, NextAllGatherDuringForwardAndReduceScatterDuringBackward) {
  const int64_t world = test_world()->size();
  ASSERT_GE(world, 2) << "overlap needs communication";
  fsdp::FullyShardOptions opts;
  opts.mesh = fsdp::init_device_mesh("cpu", {world}, {"shard"});
  Net net;
  for (int64_t i = 0; i < kBlocks; ++i) fsdp::fully_shard(net->blocks[i], opts);
  fsdp::fully_shard(net.ptr(), opts);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
  torch::manual_seed(100 + test_world()->rank());
  auto x = torch::randn({kBatch, kDim});
  auto y = torch::randn({kBatch, 3});
  auto step = [&] {
    opt.zero_grad();
    torch::mse_loss(fsdp::nn::call(net.ptr(), x), y).backward();
    opt.step();
  };
  step();  // warm-up: the first forward teaches the implicit forward prefetch its order

  // Every recorded step checks the order of events (prefetch before compute, wait after it). Whether the
  // transfers then ran during compute, and how much of them the training thread waited for, depends on the
  // scheduler: on this loaded 2-core machine a rank may be descheduled long enough for a transfer to finish
  // in the gap, or its peer may lag and keep it waiting. So up to kSteps steps are recorded and one where
  // both passes show communication during compute and most of it hidden is required.
  auto group = opts.mesh.group(0);
  const long long r = static_cast<long long>(test_world()->rank());
  constexpr int kSteps = 6;
  int good_steps = 0;
  for (int attempt = 0; attempt < kSteps; ++attempt) {
    for (int64_t i = 0; i < kBlocks; ++i) {
      net->block(i).forward_compute.clear();
      net->block(i).backward_compute.clear();
    }
    fsdp::record_timeline(*group, true);
    const auto start = Clock::now();
    step();
    const auto spans = fsdp::comm_timeline(*group);
    fsdp::record_timeline(*group, false);
    ASSERT_FALSE(spans.empty()) << "no collective recorded";
    // For each prefetched collective: how long its transfers were in flight, how much of that overlapped the
    // neighbouring block's compute, and how long the training thread sat waiting for it (exposed).
    struct Tally {
      double in_flight = 0, during_compute = 0, exposed = 0;
    };
    Tally forward, backward;
    auto account = [&](Tally& tally, const char* pass, const fsdp::CollectiveSpan& c, int64_t i, const Interval& compute) {
      EXPECT_NE(c.completed, Clock::time_point{}) << pass << ": " << c.collective << " of block " << i + 1
                                                  << " never completed";
      EXPECT_NE(c.wait_end, Clock::time_point{}) << pass << ": " << c.collective << " of block " << i + 1
                                                 << " never waited for";
      const double in_flight = ms(c.completed - c.issued), during = ms(overlap(c, compute));
      const double exposed = ms(c.wait_end - c.wait_begin);
      std::printf("rank %lld %s: %s block %lld issued %+.2f ms, done %+.2f ms, waited for %.2f ms; block %lld runs "
                  "0 .. %+.2f ms; in flight during it %.2f of %.2f ms\n", r, pass, c.collective.c_str(),
                  static_cast<long long>(i + 1), ms(c.issued - compute.begin), ms(c.completed - compute.begin), exposed,
                  static_cast<long long>(i), ms(compute.end - compute.begin), during, in_flight);
      tally.in_flight += in_flight;
      tally.during_compute += during;
      tally.exposed += std::min(exposed, in_flight);
    };
    for (int64_t i = 0; i + 1 < kBlocks; ++i) {
      // Forward: block i+1's all-gather is issued (prefetched) before block i's forward runs, and waited for
      // only after it: block i's compute is what it can hide behind.
      ASSERT_EQ(net->block(i).forward_compute.size(), 1u);
      const Interval fwd = net->block(i).forward_compute[0];
      auto ag = find_span(spans, "all_gather_into_tensor", shard_bytes(i + 1, world), kAlignSlack, start);
      ASSERT_TRUE(ag.has_value()) << "no all-gather of block " << i + 1 << " (" << shard_bytes(i + 1, world) << " bytes)";
      EXPECT_LE(ag->issued, fwd.begin) << "all-gather of block " << i + 1 << " was not prefetched";
      EXPECT_GE(ag->wait_begin, fwd.end) << "all-gather of block " << i + 1 << " waited for during block " << i;
      account(forward, "forward", *ag, i, fwd);
      // Backward: block i+1's reduce-scatter is issued when block i+1's backward ends, about when block i's
      // begins, and reduced on the progress thread while block i's backward runs.
      ASSERT_EQ(net->block(i).backward_compute.size(), 1u);
      const Interval bwd = *net->block(i).backward_compute[0];
      ASSERT_GT(bwd.end, bwd.begin) << "backward of block " << i << " not stamped";
      auto rs = find_span(spans, "reduce_scatter_tensor", world * shard_bytes(i + 1, world), world * kAlignSlack,
                          start);
      ASSERT_TRUE(rs.has_value()) << "no reduce-scatter of block " << i + 1;
      EXPECT_LT(rs->issued, bwd.end) << "reduce-scatter of block " << i + 1 << " issued after block " << i
                                     << "'s backward ended";
      account(backward, "backward", *rs, i, bwd);
    }
    bool good = true;
    for (const auto& [pass, tally] : {std::pair<const char*, const Tally*>{"forward", &forward}, {"backward", &backward}}) {
      const double hidden_share = 1.0 - tally->exposed / std::max(tally->in_flight, 1e-9);
      std::printf("rank %lld step %d %s: in flight %.2f ms, %.2f ms of it during the neighbouring block's compute; "
                  "the training thread waited %.2f ms: %.0f%% hidden\n", r, attempt, pass, tally->in_flight,
                  tally->during_compute, tally->exposed, 100.0 * hidden_share);
      good = good && tally->during_compute > 0.0 && hidden_share >= 0.5;
    }
    good_steps += good ? 1 : 0;
  }
  std::printf("rank %lld: %d of %d recorded steps showed communication during compute, mostly hidden\n", r,
              good_steps, kSteps);
  EXPECT_GE(good_steps, 1) << "no step overlapped communication with compute";
}
