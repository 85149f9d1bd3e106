#include "fully_shard/mesh_cache.h"

#include <map>
#include <memory>
#include <mutex>

namespace fsdp::detail {

DeviceMesh cached_mesh(const std::string& key, const std::function<DeviceMesh()>& make) {
  static std::mutex mutex;
  static std::weak_ptr<ProcessGroup> cached_world;  // the world the entries below belong to
  static std::map<std::string, DeviceMesh> meshes;
  std::lock_guard<std::mutex> lock(mutex);
  ProcessGroupPtr current = world();
  if (cached_world.lock() != current) {
    // A new world (destroy_process_group + init_process_group): the old meshes' groups are dead.
    meshes.clear();
    cached_world = current;
  }
  auto it = meshes.find(key);
  if (it == meshes.end()) it = meshes.emplace(key, make()).first;
  return it->second;
}

}  // namespace fsdp::detail
