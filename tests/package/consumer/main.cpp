// Links against the exported fsdp::fsdp target and runs a 1-rank world through it.
#include <fsdp/device_mesh.h>
#include <fsdp/process_group.h>

#include <iostream>

int main() {
  fsdp::InitOptions options;
  options.rank = 0;
  options.world_size = 1;
  auto world = fsdp::init_process_group(options);
  auto mesh = fsdp::init_device_mesh("cpu", {1}, {"shard"});
  std::cout << "consumer: world " << world->size() << ", mesh " << mesh.to_string() << "\n";
  fsdp::destroy_process_group();
  return world->size() == 1 ? 0 : 1;
}
