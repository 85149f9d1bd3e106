#pragma once
// Meshes that fully_shard creates on its own — the default 1-D mesh over the world, the post-forward groups of
// reshard_after_forward=N — are process-group registrations: created once, identically on every rank (creating
// one is collective), shared by every parameter group, and forgotten when the world is re-initialized.

#include <fsdp/device_mesh.h>

#include <functional>
#include <string>

namespace fsdp::detail {

// The mesh registered under `key` for the current world, made by `make` on first use.
DeviceMesh cached_mesh(const std::string& key, const std::function<DeviceMesh()>& make);

}  // namespace fsdp::detail
