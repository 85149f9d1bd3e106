// Cross-rank agreement for the checkpoint layers (see agreement.h).
#include "checkpoint/agreement.h"

#include "checkpoint/storage.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <sstream>

namespace fsdp::checkpoint::detail {

ProcessGroupPtr resolve_group(const ProcessGroupPtr& g) {
  if (g) return g;
  return is_initialized() ? world() : nullptr;
}

std::string error_text(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->msg();
  return e.what();
}

std::string list_names(const std::vector<std::string>& names, size_t max) {
  std::ostringstream os;
  for (size_t i = 0; i < names.size() && i < max; ++i) os << (i ? ", " : "") << "'" << names[i] << "'";
  if (names.size() > max) os << " and " << names.size() - max << " more";
  return os.str();
}

// Every rank's string, in group-rank order.
std::vector<std::string> all_gather_strings(const ProcessGroupPtr& group, const std::string& mine) {
  if (!group || group->size() == 1) return {mine};
  const int n = group->size();
  const auto dev = group->device();
  at::Tensor len = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong).to(dev);
  at::Tensor lens = at::empty({n}, len.options());
  group->all_gather_into_tensor(lens, len).wait();
  lens = lens.cpu();
  int64_t max_len = 1;
  for (int i = 0; i < n; ++i) max_len = std::max(max_len, lens[i].item<int64_t>());
  at::Tensor buf = at::zeros({max_len}, at::kByte);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  buf = buf.to(dev);
  at::Tensor all = at::empty({n * max_len}, buf.options());
  group->all_gather_into_tensor(all, buf).wait();
  all = all.cpu();
  std::vector<std::string> out;
  const auto* p = static_cast<const char*>(all.data_ptr());
  for (int i = 0; i < n; ++i) out.emplace_back(p + i * max_len, static_cast<size_t>(lens[i].item<int64_t>()));
  return out;
}

// Rank 0's string on every rank.
std::string broadcast_string(const ProcessGroupPtr& group, const std::string& s) {
  if (!group || group->size() == 1) return s;
  const auto dev = group->device();
  at::Tensor len = at::tensor({static_cast<int64_t>(s.size())}, at::kLong).to(dev);
  group->broadcast(len, 0).wait();
  const int64_t n = len.cpu().item<int64_t>();
  if (n == 0) return {};
  at::Tensor buf = at::zeros({n}, at::kByte);
  if (group->rank() == 0) std::memcpy(buf.data_ptr(), s.data(), s.size());
  buf = buf.to(dev);
  group->broadcast(buf, 0).wait();
  buf = buf.cpu();
  return std::string(static_cast<const char*>(buf.data_ptr()), static_cast<size_t>(n));
}

// True on every rank when any rank passes true.
bool any_rank(const ProcessGroupPtr& group, bool mine) {
  if (!group || group->size() == 1) return mine;
  at::Tensor t = at::tensor({mine ? 1.0f : 0.0f}).to(group->device());
  group->all_reduce(t, ReduceOp::Max).wait();
  return t.cpu().item<float>() > 0;
}

std::string first_error(const ProcessGroupPtr& group, const std::string& mine) {
  if (!any_rank(group, !mine.empty())) return {};
  for (const auto& e : all_gather_strings(group, mine)) {
    if (!e.empty()) return e;
  }
  return {};
}

int64_t commit_on_coordinator(const ProcessGroupPtr& group, bool coordinator, const std::string& tmp,
                              const std::string& what, const std::string& final_dir,
                              const std::function<int64_t()>& commit) {
  std::string status;
  if (coordinator) {
    try {
      status = "ok " + std::to_string(commit());
    } catch (const std::exception& e) {
      status = error_text(e);
      try {
        remove_tree(tmp);
      } catch (...) {
      }
    }
  }
  status = broadcast_string(group, status);
  TORCH_CHECK(status.compare(0, 3, "ok ") == 0, what, " to ", final_dir, " failed: ", status);
  return std::stoll(status.substr(3));
}

}  // namespace fsdp::checkpoint::detail
