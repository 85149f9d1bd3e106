// DeviceMesh: row-major N-d layout of world ranks, one process group per slice of each dim.
//
// Construction is collective: every rank walks all dims in order and, for each dim, all its slices in
// row-major order of the other dims, calling new_group for each. The walk is identical on every rank, so
// new_group's counter (and with it each group's store key space) agrees everywhere; each rank keeps the one
// slice per dim that contains it. Sub-meshes reuse these groups.

#include <fsdp/device_mesh.h>

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <set>
#include <sstream>

namespace fsdp {

struct DeviceMesh::Impl {
  c10::DeviceType device_type = c10::kCPU;
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  std::vector<int> ranks;  // row-major
  std::vector<int64_t> coordinate;
  std::vector<ProcessGroupPtr> groups;  // per dim: the slice containing this rank
  // The mesh this one was sliced from (null for a mesh built by the constructor), for concatenate().
  std::shared_ptr<const Impl> root;
};

namespace {

std::string join(const std::vector<std::string>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) st[i] = st[i + 1] * shape[i + 1];
  return st;
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

DeviceMesh::DeviceMesh(c10::DeviceType device_type, std::vector<int64_t> shape, std::vector<std::string> dim_names,
                       std::vector<int> ranks) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  TORCH_CHECK(nd >= 1, "fsdp: DeviceMesh needs at least one dim");
  for (int64_t d = 0; d < nd; ++d) {
    TORCH_CHECK(shape[d] > 0, "fsdp: DeviceMesh shape ", c10::IntArrayRef(shape), ": dim ", d, " has size ", shape[d],
                "; sizes must be positive");
  }
  if (dim_names.empty()) {
    for (int64_t d = 0; d < nd; ++d) dim_names.push_back(c10::str("dim", d));
  }
  TORCH_CHECK(static_cast<int64_t>(dim_names.size()) == nd, "fsdp: DeviceMesh shape ", c10::IntArrayRef(shape), " has ", nd,
              " dims but ", dim_names.size(), " names were given: ", join(dim_names));
  std::set<std::string> seen;
  for (const auto& n : dim_names) {
    TORCH_CHECK(!n.empty(), "fsdp: DeviceMesh dim names must not be empty: ", join(dim_names));
    TORCH_CHECK(seen.insert(n).second, "fsdp: DeviceMesh dim name '", n, "' appears twice in ", join(dim_names));
  }
  int64_t numel = 1;
  for (auto s : shape) numel *= s;
  auto w = world();
  TORCH_CHECK(numel == w->size(), "fsdp: DeviceMesh shape ", c10::IntArrayRef(shape), " holds ", numel,
              " ranks but the world has ", w->size(), " (the mesh must cover the whole world)");
  if (ranks.empty()) {
    for (int64_t i = 0; i < numel; ++i) ranks.push_back(static_cast<int>(i));
  }
  TORCH_CHECK(static_cast<int64_t>(ranks.size()) == numel, "fsdp: DeviceMesh shape ", c10::IntArrayRef(shape), " needs ", numel,
              " ranks, got ", ranks.size());
  {
    std::vector<int> sorted = ranks;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < numel; ++i) {
      TORCH_CHECK(sorted[i] == i, "fsdp: DeviceMesh ranks must be a permutation of 0..", numel - 1);
    }
  }

  auto impl = std::make_shared<Impl>();
  impl->device_type = device_type;
  impl->shape = shape;
  impl->names = dim_names;
  impl->ranks = ranks;
  const auto strides = row_major_strides(shape);
  const int me = w->rank();
  const int64_t my_index = std::find(ranks.begin(), ranks.end(), me) - ranks.begin();
  impl->coordinate.resize(nd);
  for (int64_t d = 0; d < nd; ++d) impl->coordinate[d] = (my_index / strides[d]) % shape[d];

  impl->groups.resize(nd);
  for (int64_t d = 0; d < nd; ++d) {
    // Slices of dim d: one per index of the other dims, enumerated row-major (skipping dim d).
    const int64_t num_slices = numel / shape[d];
    for (int64_t s = 0; s < num_slices; ++s) {
      // Decode s into coordinates of the other dims, then list ranks along d.
      int64_t base = 0;
      int64_t rem = s;
      for (int64_t e = nd - 1; e >= 0; --e) {
        if (e == d) continue;
        base += (rem % shape[e]) * strides[e];
        rem /= shape[e];
      }
      std::vector<int> slice;
      for (int64_t i = 0; i < shape[d]; ++i) slice.push_back(ranks[base + i * strides[d]]);
      auto g = new_group(slice, c10::str("mesh[", dim_names[d], "]#", s));
      if (g) impl->groups[d] = std::move(g);
    }
    TORCH_CHECK(impl->groups[d] != nullptr, "fsdp: DeviceMesh internal error: no group for dim ", d);
  }
  impl_ = std::move(impl);
}

c10::DeviceType DeviceMesh::device_type() const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  return impl_->device_type;
}
int64_t DeviceMesh::ndim() const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  return static_cast<int64_t>(impl_->shape.size());
}
const std::vector<int64_t>& DeviceMesh::shape() const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  return impl_->shape;
}
int64_t DeviceMesh::size() const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  return static_cast<int64_t>(impl_->ranks.size());
}
int64_t DeviceMesh::size(int64_t dim) const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  TORCH_CHECK(dim >= 0 && dim < ndim(), "fsdp: DeviceMesh dim ", dim, " out of range for ", to_string());
  return impl_->shape[dim];
}
const std::vector<std::string>& DeviceMesh::dim_names() const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  return impl_->names;
}
int64_t DeviceMesh::dim_index(const std::string& name) const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  auto it = std::find(impl_->names.begin(), impl_->names.end(), name);
  TORCH_CHECK(it != impl_->names.end(), "fsdp: DeviceMesh has no dim named '", name, "'; its dims are ",
              join(impl_->names));
  return it - impl_->names.begin();
}
const std::vector<int>& DeviceMesh::ranks() const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  return impl_->ranks;
}
std::vector<int64_t> DeviceMesh::coordinate() const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  return impl_->coordinate;
}
int64_t DeviceMesh::local_rank(int64_t dim) const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  TORCH_CHECK(dim >= 0 && dim < ndim(), "fsdp: DeviceMesh dim ", dim, " out of range for ", to_string());
  return impl_->coordinate[dim];
}
ProcessGroupPtr DeviceMesh::group(int64_t dim) const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  TORCH_CHECK(dim >= 0 && dim < ndim(), "fsdp: DeviceMesh dim ", dim, " out of range for ", to_string());
  return impl_->groups[dim];
}
ProcessGroupPtr DeviceMesh::group(const std::string& name) const { return group(dim_index(name)); }

DeviceMesh DeviceMesh::operator[](const std::string& name) const { return slice({name}); }

DeviceMesh DeviceMesh::slice(const std::vector<std::string>& names) const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  TORCH_CHECK(!names.empty(), "fsdp: DeviceMesh::slice needs at least one dim name");
  std::vector<int64_t> dims;
  std::set<std::string> seen;
  for (const auto& n : names) {
    TORCH_CHECK(seen.insert(n).second, "fsdp: DeviceMesh::slice: dim '", n, "' requested twice");
    dims.push_back(dim_index(n));
  }
  const auto& p = *impl_;
  const auto strides = row_major_strides(p.shape);
  auto impl = std::make_shared<Impl>();
  impl->device_type = p.device_type;
  impl->root = p.root ? p.root : impl_;
  // Offset of this rank's sub-mesh: its coordinates on the dims not kept.
  int64_t base = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(p.shape.size()); ++e) {
    if (std::find(dims.begin(), dims.end(), e) == dims.end()) base += p.coordinate[e] * strides[e];
  }
  std::vector<int64_t> sub_shape;
  for (auto d : dims) {
    sub_shape.push_back(p.shape[d]);
    impl->names.push_back(p.names[d]);
    impl->coordinate.push_back(p.coordinate[d]);
    impl->groups.push_back(p.groups[d]);
  }
  impl->shape = sub_shape;
  const auto sub_strides = row_major_strides(sub_shape);
  int64_t sub_numel = 1;
  for (auto s : sub_shape) sub_numel *= s;
  for (int64_t i = 0; i < sub_numel; ++i) {
    int64_t off = base;
    for (size_t k = 0; k < dims.size(); ++k) off += ((i / sub_strides[k]) % sub_shape[k]) * strides[dims[k]];
    impl->ranks.push_back(p.ranks[off]);
  }
  return DeviceMesh(std::shared_ptr<const Impl>(std::move(impl)));
}

DeviceMesh DeviceMesh::concatenate(const std::vector<DeviceMesh>& meshes) {
  TORCH_CHECK(!meshes.empty(), "fsdp: DeviceMesh::concatenate needs at least one mesh");
  std::shared_ptr<const Impl> root;
  std::vector<std::string> names;
  for (const auto& m : meshes) {
    TORCH_CHECK(m.valid(), "fsdp: DeviceMesh::concatenate: an empty mesh");
    auto r = m.impl_->root ? m.impl_->root : m.impl_;
    TORCH_CHECK(!root || root == r, "fsdp: DeviceMesh::concatenate: ", meshes.front().to_string(), " and ",
                m.to_string(), " are not sub-meshes of one mesh");
    root = r;
    for (const auto& n : m.dim_names()) names.push_back(n);
  }
  return DeviceMesh(root).slice(names);  // slice() rejects a dim named twice
}

DeviceMesh DeviceMesh::root() const {
  TORCH_CHECK(impl_, "fsdp: empty DeviceMesh");
  return impl_->root ? DeviceMesh(impl_->root) : *this;
}

std::string DeviceMesh::to_string() const {
  if (!impl_) return "DeviceMesh(empty)";
  std::ostringstream os;
  os << "DeviceMesh(" << c10::DeviceTypeName(impl_->device_type, /*lower_case=*/true) << ", shape "
     << c10::IntArrayRef(impl_->shape) << ", dims " << join(impl_->names) << ", coordinate " << c10::IntArrayRef(impl_->coordinate) << ")";
  return os.str();
}

DeviceMesh init_device_mesh(const std::string& device_type, std::vector<int64_t> shape,
                            std::vector<std::string> dim_names) {
  c10::DeviceType type;
  try {
    type = c10::Device(device_type).type();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fsdp: init_device_mesh: unknown device type '", device_type, "'");
  }
  auto w = world();
  TORCH_CHECK(type == w->device().type(), "fsdp: init_device_mesh(\"", device_type, "\"): the world's ",
              w->backend(), " group works on ", w->device(), ", not ", device_type);
  return DeviceMesh(type, std::move(shape), std::move(dim_names));
}

}  // namespace fsdp
