// Test helper started by fsdprun in tests/launcher: one rank of a real rendezvous. It joins the world through
// fsdp::init_process_group (the store fsdprun serves in standalone mode, or rank 0's), all-reduces RANK + 1 over
// Gloo and prints one line the test checks against the analytic sum WORLD_SIZE * (WORLD_SIZE + 1) / 2:
//   sum=S restart=A agent_store=V port=P
#include <fsdp/process_group.h>

#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <iostream>

int main() {
  try {
    fsdp::InitOptions init;
    init.backend = "gloo";
    init.timeout = std::chrono::seconds(120);  // a loaded machine starts the ranks of many jobs slowly
    const fsdp::ProcessGroupPtr world = fsdp::init_process_group(init);
    at::Tensor value = at::full({1}, static_cast<double>(world->rank() + 1), at::kDouble);
    world->all_reduce(value).wait();
    const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    std::cout << "sum=" << value.item<double>() << " restart=" << std::getenv("TORCHELASTIC_RESTART_COUNT")
              << " agent_store=" << (agent != nullptr ? agent : "<unset>") << " port=" << std::getenv("MASTER_PORT")
              << std::endl;
    fsdp::destroy_process_group();
  } catch (const std::exception& e) {
    std::cerr << "store_rank: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
