"""Golden pipeline schedules from the venv's torch (torch.distributed.pipelining), for schedule_test.cpp.

Prints a line-based text format on stdout (one token per action, "-" for an idle step):

  CASE <schedule> <pp> <stages_per_rank> <microbatches>
  ERROR <message>                       torch refused the case (the remaining lines are absent)
  COMPUTE <rank> <action>...            torch's compute-only IR (pipeline_order)
  COMMS <rank> <action>...              torch's lowered IR (_prepare_schedule_with_comms), runtime schedules only
  RUNTIME <rank> <action>...            GPipe / 1F1B only: the order in which the hand-written runtime loop
                                        (_step_microbatches) computes and issues its P2P ops, recorded by running
                                        it against a fake stage and recording P2P functions
  END

  CSVCASE <schedule> <pp> <stages_per_rank> <microbatches> <path>
                                        torch's _dump_csv of the schedule was written to <path>; the COMMS lines
                                        that follow are what torch's _load_csv lowers that file to

Usage: schedule_golden.py [<schedule>:<pp>:<stages_per_rank>:<microbatches> ...]   (default: the test's set)
       schedule_golden.py CSV:<schedule>:<pp>:<v>:<m>:<path>        (also CSV_COMMS: the lowered lists, which
                                                                      torch's compute_only loader refuses)
"""

import sys
from unittest import mock

import torch.distributed.pipelining.schedules as sched_mod
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime,
    get_schedule_class,
    PipelineScheduleSingle,
)
from torch.distributed.pipelining.stage import PipelineStage

RUNTIME_KINDS = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"]  # (and DualPipeV)
DEFAULT_CASES = (
    [f"{k}:{pp}:2:{m}" for k in RUNTIME_KINDS for pp in (2, 4) for m in (4, 8, 16)]
    + [f"{k}:8:2:16" for k in RUNTIME_KINDS]
    + [f"{k}:4:3:8" for k in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")]
    + [f"{k}:4:4:8" for k in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")]
    + [f"{k}:4:1:8" for k in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")]
    + [f"{k}:4:2:6" for k in ("Interleaved1F1B", "InterleavedZeroBubble")]  # rounds=1, m not a multiple of pp
    + [f"{k}:4:2:10" for k in ("Interleaved1F1B", "InterleavedZeroBubble")]  # rounds=2, 5 per round
    + [f"{k}:4:2:2" for k in RUNTIME_KINDS]  # fewer microbatches than ranks
    + ["ZBVZeroBubble:4:2:5", "Interleaved1F1B:4:2:9"]  # 9 % (9//4) != 0: refused
    + [f"{k}:1:2:4" for k in RUNTIME_KINDS]  # one rank: every neighbour is local
    + ["ZBVZeroBubble:3:2:7", "Interleaved1F1B:3:2:6", "InterleavedZeroBubble:3:3:6", "LoopedBFS:3:2:1"]
    + ["Interleaved1F1B:2:2:1", "ZBVZeroBubble:2:2:1", "InterleavedZeroBubble:2:2:1"]  # one microbatch
    + [f"{k}:{pp}:1:{m}" for k in ("GPipe", "1F1B") for pp in (1, 2, 4) for m in (4, 8)]
    + ["1F1B:4:1:3", "GPipe:4:1:2", "1F1B:8:1:16", "GPipe:8:1:16"]
    # DualPipeV (OVERLAP_F_B pairs): m >= 2 pp; odd and even ranks differ in the drain, rank pp-1 in the main phase
    + [f"DualPipeV:{pp}:2:{m}" for pp in (1, 2, 3, 4) for m in (8, 9, 16)]
    + ["DualPipeV:2:2:4", "DualPipeV:8:2:16", "DualPipeV:8:2:20", "DualPipeV:2:2:3"]  # 3 < 4 stages: refused
)


def fmt(actions):
    return " ".join("-" if a is None else str(a) for a in actions)


def mock_stages(pp, v, single):
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank = 0
    stage.group_size = pp
    stage.submod = None
    stage.num_stages = pp * v
    return stage if single else [stage for _ in range(v)]


class RecordingStage:
    """Stands in for one PipelineStage: records compute calls; P2P op lists are plain strings."""

    def __init__(self, stage_index, num_stages, log):
        self.stage_index, self.num_stages, self.log = stage_index, num_stages, log
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.output_chunks = []

    def _op(self, kind, mb, present):
        return [f"{self.stage_index}{kind}{mb}"] if present else []

    def get_fwd_recv_ops(self, mb):
        return self._op("RECV_F", mb, not self.is_first)

    def get_fwd_send_ops(self, mb):
        return self._op("SEND_F", mb, not self.is_last)

    def get_bwd_recv_ops(self, mb):
        return self._op("RECV_B", mb, not self.is_last)

    def get_bwd_send_ops(self, mb):
        return self._op("SEND_B", mb, not self.is_first)

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.log.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb, loss=None, last_backward=False):
        self.log.append(f"{self.stage_index}B{mb}")

    def perform_reduce_grad(self, scale):
        self.log.append(f"{self.stage_index}REDUCE_GRAD")


def runtime_loop_order(name, pp, m):
    """Runs the schedule's real _step_microbatches for every rank against RecordingStage."""
    cls = get_schedule_class(name)
    out = []
    for rank in range(pp):
        log = []

        def issue(ops, desc=None):
            log.extend(ops)
            return []

        def issue_sorted(ops, desc=None):
            log.extend(ops)
            return {}

        stage = RecordingStage(rank, pp, log)
        schedule = cls(stage, m)
        schedule._initialize_stage = lambda *a, **k: None
        with mock.patch.object(sched_mod, "_batch_p2p", issue), mock.patch.object(
            sched_mod, "_sorted_batch_p2p", issue_sorted
        ), mock.patch.object(sched_mod, "_wait_batch_p2p", lambda work: None):
            schedule._step_microbatches([() for _ in range(m)], [{} for _ in range(m)])
        out.append(log)
    return out


def emit_case(name, pp, v, m):
    print(f"CASE {name} {pp} {v} {m}")
    cls = get_schedule_class(name)
    single = issubclass(cls, PipelineScheduleSingle)
    try:
        schedule = cls(mock_stages(pp, v, single), m)
        compute = [schedule.pipeline_order[r] for r in range(pp)]
        comms = None
        if not single:
            runtime = _PipelineScheduleRuntime(mock_stages(pp, v, False), m)
            runtime._prepare_schedule_with_comms(schedule.pipeline_order)
            comms = [runtime.pipeline_order_with_comms[r] for r in range(pp)]
        runtime_order = runtime_loop_order(name, pp, m) if single else None
    except Exception as e:  # torch refused the case: the test checks that we refuse it too
        print("ERROR " + " ".join(f"{type(e).__name__}: {e}".split()))
        print("END")
        return
    for r, acts in enumerate(compute):
        print(f"COMPUTE {r} {fmt(acts)}")
    for r, acts in enumerate(comms or []):
        print(f"COMMS {r} {fmt(acts)}")
    for r, acts in enumerate(runtime_order or []):
        print(f"RUNTIME {r} {' '.join(acts)}")
    print("END")


def emit_csv(name, pp, v, m, path, fmt_name):
    """Writes torch's own CSV of a schedule (_dump_csv) to `path`; for compute_only, prints what torch's
    _PipelineScheduleRuntime._load_csv makes of that file (its lowered lists) as COMMS lines."""
    print(f"CSVCASE {name} {pp} {v} {m} {path}")
    schedule = get_schedule_class(name)(mock_stages(pp, v, False), m)
    schedule._dump_csv(path, format=fmt_name)
    if fmt_name == "compute_only":
        runtime = _PipelineScheduleRuntime(mock_stages(pp, v, False), m)
        runtime._load_csv(path)
        for r in range(pp):
            print(f"COMMS {r} {fmt(runtime.pipeline_order_with_comms[r])}")
    print("END")


def main(argv):
    cases = argv[1:] or DEFAULT_CASES
    for case in cases:
        if case.startswith("CSV"):  # CSV[_COMMS]:<schedule>:<pp>:<v>:<m>:<path>
            kind, name, pp, v, m, path = case.split(":", 5)
            emit_csv(name, int(pp), int(v), int(m), path, "compute_comms" if kind == "CSV_COMMS" else "compute_only")
            continue
        name, pp, v, m = case.split(":")
        emit_case(name, int(pp), int(v), int(m))


if __name__ == "__main__":
    main(sys.argv)
