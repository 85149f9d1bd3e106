// One rank of a replica group for ft_quorum_test.py: trains a tiny linear model under fsdp::ft::Manager and logs
// every step so that the driver can replay it against its own reference (PyTorch in the venv). Started directly, it
// is a replica group of one rank; under fsdprun (RANK set), one of WORLD_SIZE ranks. With several ranks it stands in
// for HSDP's layout: every rank computes a gradient on its own batch, the replica group averages them (all-reduce),
// rank s keeps shard s of the flat gradient (what FSDP's reduce-scatter leaves it), averages that shard across the
// quorum's replicas over the quorum group of shard index s, and the group all-gathers the averaged shards. (Every
// rank keeps the whole tiny model and optimizer state, and heals all of it from its peer of the same shard index.)
//
//   ft_replica_worker --replica-id R --steps S --out FILE [--min-replicas N] [--expected N] [--join-timeout-ms MS]
//                     [--timeout-ms MS] [--pause-after-quorum-ms MS] [--pause-before-vote-ms MS]
//
// Data rule (docs/reliability.md): the batch of rank s of replica r at step t is a fixed function of (t, r, s) —
// data(t, r, s) below, mirrored in the driver. A replica missing from step t's quorum contributes nothing: its batch of step t is
// skipped, and the gradient is the average over the members' batches.
//
// Output lines (stdout, flushed):
//   QUORUM id=<q> step=<t> members=<ids> heal=<0|1> rebuilt=<0|1>
//                                        (then it sleeps --pause-after-quorum-ms: a kill there comes before the
//                                        all-reduce, which then fails on the other replica)
//   HEALED step=<t> position=<blob>
//   ALLREDUCED step=<t>                  (then it sleeps --pause-before-vote-ms: the window the driver kills in)
//   COMMIT step=<t> members=<ids> w=<the parameters after the update, %.9g each>
//   ABORT step=<t> error=<why>
//   DONE step=<t>
// (only rank 0 prints them, but ALLREDUCED, prefixed "[rank s] " by fsdprun) and at the end FILE (FILE.rank<s> on
// rank s > 0) holds the parameters and momentum buffers as raw float32 bytes.

#include <fsdp/fault_tolerance.h>
#include <fsdp/process_group.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

namespace {

struct Args {
  int replica_id = -1;
  int64_t steps = 10;
  std::string out;
  int min_replicas = 1;
  int expected = 0;
  int join_timeout_ms = 1000;
  int timeout_ms = 3000;
  int pause_before_vote_ms = 0;
  int pause_after_quorum_ms = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--replica-id") a.replica_id = std::stoi(v);
    else if (k == "--steps") a.steps = std::stoll(v);
    else if (k == "--out") a.out = v;
    else if (k == "--min-replicas") a.min_replicas = std::stoi(v);
    else if (k == "--expected") a.expected = std::stoi(v);
    else if (k == "--join-timeout-ms") a.join_timeout_ms = std::stoi(v);
    else if (k == "--timeout-ms") a.timeout_ms = std::stoi(v);
    else if (k == "--pause-before-vote-ms") a.pause_before_vote_ms = std::stoi(v);
    else if (k == "--pause-after-quorum-ms") a.pause_after_quorum_ms = std::stoi(v);
    else TORCH_CHECK(false, "ft_replica_worker: unknown argument ", k);
  }
  TORCH_CHECK(a.replica_id >= 0 && !a.out.empty(), "ft_replica_worker: --replica-id and --out are required");
  return a;
}

// The driver computes the same with the same torch ops (float32 throughout).
std::pair<torch::Tensor, torch::Tensor> data(int64_t step, int replica, int shard) {
  const double shift = static_cast<double>(step) * 1.3 + replica * 2.1 + shard * 0.9;
  torch::Tensor x = torch::arange(32, torch::kFloat).mul(0.37).add(shift).sin().view({8, 4});
  torch::Tensor y = torch::arange(24, torch::kFloat).mul(0.21).add(static_cast<double>(step) * 0.7 - replica * 0.5)
                        .cos().view({8, 3});
  return {x, y};
}

std::string ids(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

void say(const std::string& line) {
  std::cout << line << std::endl;  // endl flushes: the driver reacts to lines as they come
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  torch::manual_seed(0);
  fsdp::InitOptions init;
  init.backend = "gloo";
  init.timeout = std::chrono::seconds(30);
  if (!std::getenv("RANK")) {  // started directly: a replica group of one rank
    init.rank = 0;
    init.world_size = 1;
  }
  auto world = fsdp::init_process_group(init);
  const int shard = world->rank(), shards = world->size();
  const bool talk = shard == 0;  // the protocol lines come from rank 0 only

  fsdp::ft::ManagerOptions opt;
  opt.replica_id = a.replica_id;
  opt.min_replicas = a.min_replicas;
  opt.expected_replicas = a.expected;
  opt.join_timeout = std::chrono::milliseconds(a.join_timeout_ms);
  opt.timeout = std::chrono::milliseconds(a.timeout_ms);
  opt.quorum_timeout = std::chrono::seconds(60);
  fsdp::ft::Manager manager(opt, world);

  torch::nn::Linear model(4, 3);
  {
    torch::NoGradGuard no_grad;
    model->weight.copy_(torch::arange(12, torch::kFloat).mul(0.5).sin().mul(0.3).view({3, 4}));
    model->bias.copy_(torch::arange(3, torch::kFloat).cos().mul(0.1));
  }
  std::vector<torch::Tensor> params = {model->weight, model->bias};
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  // The momentum buffers, created (zero) when missing so that a healing replica has tensors to receive into.
  auto momentum = [&] {
    std::vector<torch::Tensor> bufs;
    for (auto& p : params) {
      auto& slot = optimizer.state()[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto st = std::make_unique<torch::optim::SGDParamState>();
        st->momentum_buffer(torch::zeros_like(p));
        slot = std::move(st);
      }
      bufs.push_back(static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer());
    }
    return bufs;
  };

  int64_t step = 0;
  while (step < a.steps) {
    const fsdp::ft::Quorum& q = manager.start_quorum(step);
    if (talk) say("QUORUM id=" + std::to_string(q.id) + " step=" + std::to_string(step) + " members=" + ids(q.replica_ids) +
        " heal=" + std::to_string(q.heal) + " rebuilt=" + std::to_string(q.group_rebuilt));
    bool ok = true;
    if (q.heal || !q.heal_targets.empty()) {
      std::vector<torch::Tensor> state = params;
      for (auto& b : momentum()) state.push_back(b);
      if (q.heal) {
        auto healed = manager.receive_state(state);
        ok = healed.has_value();
        if (healed) {
          step = healed->step;
          if (talk) say("HEALED step=" + std::to_string(step) + " position=" + healed->data_position);
        }
      } else {
        manager.send_state(state, step, "step " + std::to_string(step));
      }
    }
    if (a.pause_after_quorum_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a.pause_after_quorum_ms));
    optimizer.zero_grad();
    auto [x, y] = data(step, a.replica_id, shard);
    torch::mse_loss(model->forward(x), y).backward();
    // 15 gradient values, padded to a multiple of the shard count.
    const int64_t chunk = (15 + shards - 1) / shards;
    torch::Tensor flat = torch::zeros({chunk * shards});
    flat.narrow(0, 0, 15).copy_(torch::cat({model->weight.grad().flatten(), model->bias.grad().flatten()}));
    world->all_reduce(flat).wait();
    flat.div_(shards);
    torch::Tensor mine = flat.narrow(0, shard * chunk, chunk).clone();
    manager.allreduce_average(mine);
    world->all_gather_into_tensor(flat, mine).wait();
    say("ALLREDUCED step=" + std::to_string(step));
    if (a.pause_before_vote_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a.pause_before_vote_ms));
    if (manager.should_commit(ok)) {
      model->weight.grad().copy_(flat.narrow(0, 0, 12).view({3, 4}));
      model->bias.grad().copy_(flat.narrow(0, 12, 3));
      optimizer.step();
      std::string w;
      for (auto& p : params) {
        auto c = p.detach().flatten();
        for (int64_t i = 0; i < c.numel(); ++i) {
          char buf[32];
          std::snprintf(buf, sizeof buf, "%s%.9g", w.empty() ? "" : ",", c[i].item<float>());
          w += buf;
        }
      }
      if (talk) say("COMMIT step=" + std::to_string(step) + " members=" + ids(q.replica_ids) + " w=" + w);
      ++step;
    } else {
      // Discarded: no update, the gradient is dropped (zero_grad at the next attempt), the same step is retried.
      if (talk) say("ABORT step=" + std::to_string(step) + " error=" + manager.error());
    }
  }
  std::ofstream out(shard == 0 ? a.out : a.out + ".rank" + std::to_string(shard), std::ios::binary);
  for (auto& p : params) out.write(static_cast<const char*>(p.data_ptr()), p.numel() * sizeof(float));
  for (auto& b : momentum()) out.write(static_cast<const char*>(b.data_ptr()), b.numel() * sizeof(float));
  if (talk) say("DONE step=" + std::to_string(step));
  return 0;
}
