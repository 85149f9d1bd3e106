// fsdp-train's [parallelism] pipeline_parallel_schedule is the library's fsdp::pipeline::ScheduleKind: the config's
// names are the library's schedule names.
#include "config.h"

#include <fsdp/pipeline/schedule.h>

#include <gtest/gtest.h>

#include <cctype>

using namespace fsdp_train;

// pipeline_parallel_schedule is the library's ScheduleKind: the config's names are the library's (Csv, a file,
// is no name of the key).
TEST(TrainerPipelineInit, ConfigScheduleNamesAreTheLibrarys) {
  using fsdp::pipeline::ScheduleKind;
  int named = 0;
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::LoopedBFS,
                            ScheduleKind::Interleaved1F1B, ScheduleKind::InterleavedZeroBubble,
                            ScheduleKind::ZBVZeroBubble, ScheduleKind::DualPipeV}) {
    const std::string name = fsdp::pipeline::schedule_name(kind);
    EXPECT_EQ(to_string(kind), name);
    std::string lower = name;
    for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    EXPECT_EQ(parse_choice<PipelineSchedule>(lower), kind) << lower;
    EXPECT_EQ(fsdp::pipeline::parse_schedule_name(lower), kind) << lower;
    ++named;
  }
  EXPECT_EQ(named, 7);
  EXPECT_FALSE(parse_choice<PipelineSchedule>("csv").has_value());
}
