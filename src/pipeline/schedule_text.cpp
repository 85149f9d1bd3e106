// Schedules as text: torch's action strings ("2F0", "1UNSHARD", "3SEND_F1"), the schedule names, and the printable
// grid every error message and `describe` show (torch's _format_pipeline_order).
#include <fsdp/pipeline/schedule.h>

#include "pipeline/schedule_internal.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <sstream>

namespace fsdp::pipeline {
using detail::as_grid;
using detail::is_stage_wide;
namespace {

struct TypeToken {
  ActionType type;
  const char* token;
};
// Longest tokens first so that parsing "SEND_F" never stops at a shorter prefix.
constexpr std::array<TypeToken, 12> kTypeTokens{{{ActionType::OverlapFB, "OVERLAP_F_B"},
                                                 {ActionType::ReduceGrad, "REDUCE_GRAD"},
                                                 {ActionType::Unshard, "UNSHARD"},
                                                 {ActionType::Reshard, "RESHARD"},
                                                 {ActionType::SendF, "SEND_F"},
                                                 {ActionType::RecvF, "RECV_F"},
                                                 {ActionType::SendB, "SEND_B"},
                                                 {ActionType::RecvB, "RECV_B"},
                                                 {ActionType::Forward, "F"},
                                                 {ActionType::Backward, "B"},
                                                 {ActionType::BackwardInput, "I"},
                                                 {ActionType::BackwardWeight, "W"}}};

std::string lower_case(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

constexpr std::array<ScheduleKind, 7> kAllKinds{ScheduleKind::GPipe,
                                                ScheduleKind::OneFOneB,
                                                ScheduleKind::LoopedBFS,
                                                ScheduleKind::Interleaved1F1B,
                                                ScheduleKind::InterleavedZeroBubble,
                                                ScheduleKind::ZBVZeroBubble,
                                                ScheduleKind::DualPipeV};

}  // namespace

namespace detail {

std::string error_with_grid(const std::string& where, const std::string& what, const ComputeGrid& grid,
                            int step) {
  return where + ": " + what + "\n\nFull pipeline schedule:\n" + format_grid(grid, step);
}

ComputeGrid as_grid(const ActionLists& lists) {
  ComputeGrid grid(lists.size());
  for (size_t r = 0; r < lists.size(); ++r) grid[r].assign(lists[r].begin(), lists[r].end());
  return grid;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------------------------
// Actions and names

const char* action_type_token(ActionType type) {
  for (const auto& t : kTypeTokens)
    if (t.type == type) return t.token;
  TORCH_CHECK(false, "unknown ActionType ", static_cast<int>(type));
}

bool is_compute(ActionType type) {
  return type == ActionType::Forward || type == ActionType::Backward || type == ActionType::BackwardInput ||
         type == ActionType::BackwardWeight || type == ActionType::OverlapFB;
}
bool is_send(ActionType type) { return type == ActionType::SendF || type == ActionType::SendB; }
bool is_recv(ActionType type) { return type == ActionType::RecvF || type == ActionType::RecvB; }

std::string Action::str() const {
  if (type == ActionType::OverlapFB) {  // torch: "(0F3;3B1)OVERLAP_F_B"
    std::string out = "(";
    for (size_t i = 0; i < sub_actions.size(); ++i) out += (i ? ";" : "") + sub_actions[i].str();
    return out + ")" + action_type_token(type);
  }
  std::string out = std::to_string(stage) + action_type_token(type);
  if (!is_stage_wide(type)) out += std::to_string(microbatch);
  return out;
}

Action Action::parse(const std::string& text) {
  auto bad = [&](const std::string& why) {
    TORCH_CHECK(false, "Action::parse: invalid action \"", text, "\": ", why,
                "; expected <stage><type><microbatch> such as 2F0, 1B3, 0I1, 0W1, 3SEND_F1, 2RECV_B0, or "
                "<stage><type> for UNSHARD, RESHARD, REDUCE_GRAD (e.g. 1UNSHARD), or "
                "(<action>;<action>)OVERLAP_F_B (e.g. (0F3;3B1)OVERLAP_F_B)");
  };
  if (!text.empty() && text[0] == '(') {  // OVERLAP_F_B: its compute actions in parentheses, ';'-separated
    const size_t close = text.find(')');
    if (close == std::string::npos) bad("no closing parenthesis");
    if (text.substr(close + 1) != action_type_token(ActionType::OverlapFB))
      bad("only OVERLAP_F_B groups actions in parentheses");
    Action overlap{-1, ActionType::OverlapFB, -1};
    std::string inner = text.substr(1, close - 1);
    for (size_t start = 0; start <= inner.size();) {
      size_t end = inner.find(';', start);
      if (end == std::string::npos) end = inner.size();
      const std::string part = inner.substr(start, end - start);
      if (part.empty() || part[0] == '(') bad("an OVERLAP_F_B part must be one F, B, I or W action");
      Action sub = parse(part);
      if (sub.type != ActionType::Forward && sub.type != ActionType::Backward &&
          sub.type != ActionType::BackwardInput && sub.type != ActionType::BackwardWeight)
        bad("an OVERLAP_F_B part must be one F, B, I or W action, got " + part);
      overlap.sub_actions.push_back(std::move(sub));
      start = end + 1;
    }
    return overlap;
  }
  size_t pos = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) ++pos;
  if (pos == 0) bad("it does not start with a stage number");
  if (pos > 9) bad("the stage number is too large");
  const int stage = std::stoi(text.substr(0, pos));
  const auto* token = std::find_if(kTypeTokens.begin(), kTypeTokens.end(), [&](const TypeToken& t) {
    return text.compare(pos, std::char_traits<char>::length(t.token), t.token) == 0;
  });
  if (token == kTypeTokens.end()) bad("unknown action type after the stage number");
  if (token->type == ActionType::OverlapFB) bad("OVERLAP_F_B is written (<action>;<action>)OVERLAP_F_B");
  pos += std::char_traits<char>::length(token->token);
  const std::string rest = text.substr(pos);
  if (is_stage_wide(token->type)) {
    if (!rest.empty()) bad(std::string(token->token) + " takes no microbatch");
    return Action{stage, token->type, -1};
  }
  if (rest.empty()) bad(std::string(token->token) + " needs a microbatch number");
  if (rest.size() > 9 || !std::all_of(rest.begin(), rest.end(), [](char c) {
        return std::isdigit(static_cast<unsigned char>(c));
      }))
    bad("the microbatch is not a number");
  return Action{stage, token->type, std::stoi(rest)};
}

std::vector<Action> Action::leaves() const {
  if (type == ActionType::OverlapFB) return sub_actions;
  return {*this};
}

Action Action::overlap(Action forward, Action backward) {
  Action pair{-1, ActionType::OverlapFB, -1};
  pair.sub_actions = {std::move(forward), std::move(backward)};
  return pair;
}

ScheduleKind parse_schedule_name(const std::string& name) {
  for (ScheduleKind kind : kAllKinds)
    if (lower_case(schedule_name(kind)) == lower_case(name)) return kind;
  std::string valid;
  for (ScheduleKind kind : kAllKinds) valid += (valid.empty() ? "" : ", ") + schedule_name(kind);
  TORCH_CHECK(false, "unknown pipeline schedule \"", name, "\"; valid names (case-insensitive): ", valid);
}

std::string schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::GPipe: return "GPipe";
    case ScheduleKind::OneFOneB: return "1F1B";
    case ScheduleKind::LoopedBFS: return "LoopedBFS";
    case ScheduleKind::Interleaved1F1B: return "Interleaved1F1B";
    case ScheduleKind::InterleavedZeroBubble: return "InterleavedZeroBubble";
    case ScheduleKind::ZBVZeroBubble: return "ZBVZeroBubble";
    case ScheduleKind::DualPipeV: return "DualPipeV";
    case ScheduleKind::Csv: return "CSV";
  }
  TORCH_CHECK(false, "unknown ScheduleKind ", static_cast<int>(kind));
}

int default_stages_per_rank(ScheduleKind kind) { return is_single_stage_kind(kind) ? 1 : 2; }

bool is_single_stage_kind(ScheduleKind kind) {
  return kind == ScheduleKind::GPipe || kind == ScheduleKind::OneFOneB;
}

std::string format_grid(const ComputeGrid& grid, int error_step) {
  size_t steps = 0;
  for (const auto& rank : grid) steps = std::max(steps, rank.size());
  const size_t label_digits = std::to_string(steps == 0 ? 0 : steps - 1).size();
  auto step_label = [&](size_t step) {
    std::string digits = std::to_string(step);
    return "Step " + std::string(label_digits - digits.size(), '0') + digits;
  };
  std::vector<size_t> width(grid.size());
  for (size_t r = 0; r < grid.size(); ++r) {
    width[r] = ("Rank " + std::to_string(r)).size();
    for (const auto& a : grid[r])
      if (a) width[r] = std::max(width[r], a->str().size());
  }
  auto pad = [](std::string text, size_t w) { return text + std::string(w > text.size() ? w - text.size() : 0, ' '); };
  std::ostringstream out;
  out << std::string(step_label(0).size() + 2, ' ');
  for (size_t r = 0; r < grid.size(); ++r) out << (r ? " " : "") << pad("Rank " + std::to_string(r), width[r]);
  out << "\n";
  for (size_t step = 0; step < steps; ++step) {
    out << step_label(step) << ": ";
    for (size_t r = 0; r < grid.size(); ++r) {
      const bool has = step < grid[r].size() && grid[r][step];
      out << (r ? " " : "") << pad(has ? grid[r][step]->str() : "", width[r]);
    }
    if (static_cast<int>(step) == error_step) out << " <-- ERROR HERE";
    out << "\n";
  }
  return out.str();
}

std::string format_schedule(const PipelineSchedule& schedule, bool with_comms) {
  std::ostringstream out;
  out << schedule_name(schedule.spec.kind) << " pp=" << schedule.spec.pp
      << " stages_per_rank=" << schedule.spec.stages_per_rank << " microbatches=" << schedule.spec.microbatches
      << (with_comms ? " (lowered)" : " (compute)") << "\n";
  out << format_grid(with_comms ? as_grid(schedule.actions) : schedule.compute);
  return out.str();
}

}  // namespace fsdp::pipeline
