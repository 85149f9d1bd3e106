#pragma once
// The pipeline schedules by name: the one enum the library's schedule generators (schedule.h) and fsdp-train's
// [parallelism] pipeline_parallel_schedule key both use. No includes at all: fsdp-train's config core, which is
// built without torch and links no libfsdp, names it too.

namespace fsdp::pipeline {

enum class ScheduleKind {
  GPipe,
  OneFOneB,
  LoopedBFS,
  Interleaved1F1B,
  InterleavedZeroBubble,
  ZBVZeroBubble,
  DualPipeV,
  Csv  // read from a file (load_schedule_csv); not a name parse_schedule_name accepts
};

}  // namespace fsdp::pipeline
