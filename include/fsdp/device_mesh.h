#pragma once
// DeviceMesh: an N-d arrangement of the world's ranks with named dims, one process group per dim slice.
// 1-D mesh = plain FSDP (ZeRO-3); 2-D ("replicate", "shard") = HSDP.

#include <fsdp/process_group.h>

#include <c10/core/DeviceType.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp {

class DeviceMesh {
 public:
  struct Impl;
  DeviceMesh() = default;  // empty mesh; valid() is false

  // Collective over the world: builds a group for every slice of every dim (every rank must call it).
  // `ranks` is the row-major layout of world ranks; empty = 0..world-1 reshaped to `shape`.
  DeviceMesh(c10::DeviceType device_type, std::vector<int64_t> shape, std::vector<std::string> dim_names = {},
             std::vector<int> ranks = {});

  bool valid() const { return impl_ != nullptr; }
  c10::DeviceType device_type() const;
  int64_t ndim() const;
  const std::vector<int64_t>& shape() const;
  int64_t size() const;               // number of ranks in the mesh
  int64_t size(int64_t dim) const;
  const std::vector<std::string>& dim_names() const;
  int64_t dim_index(const std::string& name) const;  // error naming the known dims when absent
  const std::vector<int>& ranks() const;            // row-major world ranks
  std::vector<int64_t> coordinate() const;          // this rank's coordinate
  int64_t local_rank(int64_t dim) const;            // coordinate()[dim]
  ProcessGroupPtr group(int64_t dim) const;         // the slice of `dim` that contains this rank
  ProcessGroupPtr group(const std::string& name) const;

  // Sub-mesh over the named dims (in the given order), keeping this rank's coordinates on the other dims.
  // The groups are shared with the parent mesh: no new communicators are created.
  DeviceMesh operator[](const std::string& name) const;
  DeviceMesh slice(const std::vector<std::string>& names) const;

  std::string to_string() const;

  // The mesh this one was sliced from (operator[], slice, concatenate); itself for a mesh the constructor
  // built. Two sub-meshes of one root over the same dims hold the same process groups on every rank.
  DeviceMesh root() const;

  // The mesh over the dims of `meshes` (in order), all sub-meshes of one parent mesh (e.g. mesh["dp_shard"]
  // and mesh["tp"] -> a 2-D mesh like mesh.slice({"dp_shard", "tp"})). No new communicators. Error if they
  // come from different parents or share a dim. PyTorch's DeviceMesh._concatenate.
  static DeviceMesh concatenate(const std::vector<DeviceMesh>& meshes);

 private:
  explicit DeviceMesh(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

// init_device_mesh("cpu", {2, 2}, {"replicate", "shard"}). Requires init_process_group() first; the product
// of `shape` must equal the world size and names must be distinct.
DeviceMesh init_device_mesh(const std::string& device_type, std::vector<int64_t> shape,
                            std::vector<std::string> dim_names = {});

}  // namespace fsdp
