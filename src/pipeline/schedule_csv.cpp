// CSV schedules: torch's _PipelineScheduleRuntime._load_csv(format="compute_only") — what TorchTitan's
// pipeline_parallel_schedule_csv names and torch's _dump_csv(format="compute_only") writes (Python's csv.writer:
// one row per rank, "\r\n" line ends, an idle step as an empty cell). Read, checked with the validator's rules
// (errors point at the file's row and column), checked for deadlock, then lowered like a built schedule.
#include <fsdp/pipeline/schedule.h>

#include "pipeline/schedule_internal.h"

#include <c10/util/Exception.h>

#include <fstream>
#include <sstream>

namespace fsdp::pipeline {
namespace {

// One cell of the file: its action (nullopt: idle) and where it was, 1-based as an editor shows it.
struct Cell {
  std::optional<Action> action;
  int row = 0, column = 0;
  std::string text;
};

std::string trim(const std::string& text) {
  const size_t begin = text.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(" \t") - begin + 1);
}

std::string where(const std::string& source, int row, int column, const std::string& cell) {
  std::string out = source + ": row " + std::to_string(row);
  if (column > 0) out += ", column " + std::to_string(column) + " ('" + cell + "')";
  return out;
}

// The rows of the file, split into cells (csv.writer quotes no action string; a quoted cell is unquoted).
std::vector<std::vector<Cell>> read_cells(const std::string& text, const std::string& source) {
  std::vector<std::vector<Cell>> rows;
  std::istringstream lines(text);
  std::string line;
  int row = 0;
  while (std::getline(lines, line)) {
    ++row;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::vector<Cell> cells;
    int column = 0;
    for (size_t start = 0; start <= line.size();) {
      size_t end = line.find(',', start);
      if (end == std::string::npos) end = line.size();
      Cell cell;
      cell.row = row;
      cell.column = ++column;
      cell.text = trim(line.substr(start, end - start));
      if (cell.text.size() >= 2 && cell.text.front() == '"' && cell.text.back() == '"')
        cell.text = trim(cell.text.substr(1, cell.text.size() - 2));
      if (!cell.text.empty()) {
        try {
          cell.action = Action::parse(cell.text);
        } catch (const c10::Error& e) {
          std::string why = e.what_without_backtrace();
          const size_t colon = why.find("\": ");  // keep the parser's reason, not its repetition of the text
          TORCH_CHECK(false, where(source, row, column, cell.text), ": not an action: ",
                      colon == std::string::npos ? why : why.substr(colon + 3));
        }
      }
      cells.push_back(std::move(cell));
      start = end + 1;
    }
    if (line.empty()) cells.clear();  // csv.reader: an empty line is a row without cells (a rank with no actions)
    rows.push_back(std::move(cells));
  }
  return rows;
}

}  // namespace

PipelineSchedule parse_schedule_csv(const std::string& text, const std::string& source, int pp, int num_stages,
                                    int microbatches) {
  TORCH_CHECK(pp >= 1 && num_stages >= 1 && microbatches >= 1, source,
              ": pp, num_stages and microbatches must be >= 1, got ", pp, ", ", num_stages, ", ", microbatches);
  const std::vector<std::vector<Cell>> rows = read_cells(text, source);
  TORCH_CHECK(static_cast<int>(rows.size()) == pp, source, ": ", rows.size(),
              " rows, expected one per pipeline rank (", pp, ")");
  ComputeGrid compute(pp);
  for (int rank = 0; rank < pp; ++rank)
    for (const Cell& cell : rows[rank]) compute[rank].push_back(cell.action);
  auto cell_at = [&](int rank, int step) -> const Cell& { return rows[rank][static_cast<size_t>(step)]; };

  // validate_compute's rules, reported at the cell.
  PipelineSchedule schedule;
  if (auto v = detail::check_compute(compute, num_stages, microbatches, &schedule.stage_to_rank)) {
    std::string what = v->what;
    if (v->step >= 0 && !is_compute(cell_at(v->rank, v->step).action->type))
      what += "; the file must be compute-only (torch's _dump_csv(format=\"compute_only\")), the runtime adds "
              "the communication and FSDP actions";
    if (v->step >= 0) TORCH_CHECK(false, where(source, v->rank + 1, v->step + 1, cell_at(v->rank, v->step).text), ": ", what);
    TORCH_CHECK(false, source, ": ", what, " (", num_stages, " stages and ", microbatches,
                " microbatches expected)");
  }

  // Deadlock: the sends and receives cannot be placed when a rank waits for an input that is never produced
  // before it (add_send_recv's walk, on the compute actions alone).
  ActionLists lists(pp);
  std::vector<std::vector<int>> step_of(pp);  // index in the list -> column - 1
  for (int rank = 0; rank < pp; ++rank) {
    for (int step = 0; step < static_cast<int>(compute[rank].size()); ++step) {
      if (!compute[rank][step]) continue;
      lists[rank].push_back(*compute[rank][step]);
      step_of[rank].push_back(step);
    }
  }
  const auto stuck = detail::place_send_recv(lists, schedule.stage_to_rank, nullptr);
  if (!stuck.empty()) {
    std::string blocked;
    for (const auto& [rank, index] : stuck) {
      const int step = step_of[rank][index];
      blocked += (blocked.empty() ? "" : "; ") + where(source, rank + 1, step + 1, cell_at(rank, step).text);
    }
    TORCH_CHECK(false, source, ": the schedule deadlocks: every unfinished rank waits for an input that no rank "
                "produces before it (", blocked, ")");
  }

  schedule.spec = ScheduleSpec{ScheduleKind::Csv, pp, num_stages / pp, microbatches};
  schedule.num_stages = num_stages;
  schedule.compute = std::move(compute);
  schedule.actions = lower_compute(schedule.compute, schedule.stage_to_rank, microbatches);
  validate_lowered(schedule.actions, schedule.stage_to_rank, microbatches);
  return schedule;
}

PipelineSchedule load_schedule_csv(const std::string& path, int pp, int num_stages, int microbatches) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, path, ": cannot open the pipeline schedule CSV");
  std::ostringstream text;
  text << in.rdbuf();
  TORCH_CHECK(!in.bad(), path, ": cannot read the pipeline schedule CSV");
  return parse_schedule_csv(text.str(), path, pp, num_stages, microbatches);
}

}  // namespace fsdp::pipeline
