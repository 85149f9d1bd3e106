#!/usr/bin/env python3
"""Recovery time of a lost rank (issue 28): replica-group fault tolerance against a restart from disk, side by side.

Both runs train the same HSDP job — 2 replicas x 2 shards, 4 ranks on this machine, the same model, batch and steps —
and SIGKILL one rank of replica 1 at a random step (the same steps in both, from --seed):
  ft    [fault_tolerance]: fsdp-lighthouse and two fsdp-train jobs of 2 ranks (replica 1 under fsdprun
        --max-restarts 1). Measured: from the kill to replica 1's first step back in the quorum, and the longest
        pause of replica 0 (the survivor) around the kill.
  disk  one fsdp-train job of 4 ranks (data_parallel_replicate_degree 2 x shard 2) under fsdprun --max-restarts 1,
        a checkpoint every K steps (--disk-intervals; 1 is the best case for disk: no step is lost, but every step
        pays a save). Measured: from the kill to the job's first step after the restart (every rank stopped,
        restarted and read the checkpoint), and to its first step past the one it had reached (the redone steps
        included).
Each printed line is one kill; the table at the end gives the medians.

  python3 bench/ft_recovery.py --build build [--trials 3] [--flavor cpu_tiny] [--steps 80] [--seed N]
"""
import argparse
import os
import random
import re
import shutil
import signal
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fault"))
import fault_util as fu  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--build", default=os.path.join(ROOT, "build"))
ap.add_argument("--trials", type=int, default=3)
ap.add_argument("--flavor", default="cpu_tiny")
ap.add_argument("--steps", type=int, default=80)
ap.add_argument("--seq-len", type=int, default=32)
ap.add_argument("--seed", type=int, default=None)
ap.add_argument("--workdir", default="/tmp/fsdp_ft_recovery")
ap.add_argument("--disk-intervals", default="1,10", help="checkpoint.interval of the disk runs, comma-separated")
a = ap.parse_args()
seed = a.seed if a.seed is not None else random.randrange(1 << 30)
rng = random.Random(seed)
B = a.build
FSDPRUN, TRAIN = f"{B}/apps/fsdprun/fsdprun", f"{B}/apps/fsdp-train/fsdp-train"
LIGHTHOUSE = f"{B}/apps/fsdp-lighthouse/fsdp-lighthouse"
COMMON = ["--model.flavor", a.flavor, "--training.seq_len", str(a.seq_len), "--training.local_batch_size", "2",
          "--training.global_batch_size", "8", "--training.steps", str(a.steps), "--metrics.peak_tflops", "1",
          "--metrics.log_freq", "1", "--validation.enable", "false"]
STEP_RX = re.compile(r"^\[rank 0\] step:\s+(\d+)\s")


def steps_of(job, since=0.0):
    return [(t, int(m.group(1))) for t, l in job.lines if t >= since for m in [STEP_RX.match(l)] if m]


def victim_pid(marker, rank):
    return fu.marked_pid("fsdp-train", BENCH_JOB=marker, RANK=rank)


def dump_log(work, jobs, t_kill):
    """Every job's lines with their time relative to the kill, in <work>/<job>.log."""
    os.makedirs(work, exist_ok=True)
    for j in jobs:
        with open(os.path.join(work, j.name.replace(" ", "_") + ".log"), "w") as f:
            for t, line in j.lines:
                f.write(f"{t - (t_kill or j.start):+9.3f} {line}\n")


def kill_at(jobs, watch, marker, step, rank):
    """SIGKILLs `rank` of the job marked `marker` right after `watch` logged step - 1; returns the time."""
    if not fu.wait_until(jobs, lambda: any(s == step - 1 for _, s in steps_of(watch)), 180):
        return None
    time.sleep(rng.uniform(0, 0.04))
    pid = victim_pid(marker, rank)
    if not pid:
        return None
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def ft_trial(work, step, rank):
    light, addr = fu.start_lighthouse(LIGHTHOUSE)
    assert addr, "fsdp-lighthouse did not start"
    args = COMMON + ["--parallelism.data_parallel_shard_degree", "2", "--fault_tolerance.enable",
                     "--fault_tolerance.group_size", "2", "--job.dump_folder", work]
    jobs = [fu.Job([FSDPRUN, "--nproc-per-node", "2", "--max-restarts", str(r), TRAIN] + args +
                   ["--fault_tolerance.replica_id", str(r)], f"replica {r}", FSDP_LIGHTHOUSE=addr,
                   BENCH_JOB=f"ft{r}") for r in (0, 1)]
    r0, r1 = jobs
    try:
        t_kill = kill_at(jobs + [light], r1, "ft1", step, rank)
        healed = fu.wait_until(jobs + [light], lambda: next((t for t, l in r1.lines if t_kill and t >= t_kill and
                                                          "healed from replica 0" in l), None), 120)
        back = fu.wait_until(jobs + [light], lambda: next((t for t, _ in steps_of(r1, healed)), None) if healed else None,
                          60)
        for j in jobs:
            fu.wait_until(jobs + [light], lambda: j.proc.poll() is not None, 300)
    finally:
        fu.end_jobs(jobs, light)
        dump_log(work, jobs, t_kill if "t_kill" in dir() else None)
    times = [t for t, _ in steps_of(r0)]
    gaps = [b - a for a, b in zip(times, times[1:]) if t_kill and b >= t_kill]
    heal_line = next((l for _, l in r1.lines if "healed from replica 0" in l), "")
    return {"recovery_s": back - t_kill if t_kill and back else None,
            "survivor_pause_s": max(gaps[:20]) if gaps else None,
            "survivor_step_s": statistics.median([b - a for a, b in zip(times, times[1:])][:10]) if len(times) > 3 else None,
            "heal": heal_line.split("ft: ", 1)[-1]}


def disk_trial(work, step, rank, interval):
    args = COMMON + ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                     "2", "--checkpoint.enable", "--checkpoint.interval", str(interval), "--checkpoint.keep_latest_k",
                     "2", "--job.dump_folder", work]
    job = fu.Job([FSDPRUN, "--nproc-per-node", "4", "--max-restarts", "1", TRAIN] + args, "hsdp", BENCH_JOB="disk")
    try:
        # Replica 1's rank `rank` is world rank 2 + rank (mesh [dp_replicate, dp_shard]).
        t_kill = kill_at([job], job, "disk", step, 2 + rank)
        restart = fu.wait_until([job], lambda: next((t for t, l in job.lines if t_kill and t >= t_kill and
                                                 "restarting" in l), None), 60)
        back = fu.wait_until([job], lambda: next((t for t, _ in steps_of(job, restart)), None) if restart else None, 120)
        reached = max((s for t, s in steps_of(job) if t_kill and t < t_kill), default=0)
        past = fu.wait_until([job], lambda: next((t for t, s in steps_of(job, restart) if s > reached), None)
                          if restart else None, 120)
        fu.wait_until([job], lambda: job.proc.poll() is not None, 300)
    finally:
        fu.end_jobs([job])
        dump_log(work, [job], t_kill if "t_kill" in dir() else None)
    load = next((l for _, l in job.lines if "checkpoint: loaded" in l), "")
    times = [t for t, _ in steps_of(job)]
    return {"recovery_s": back - t_kill if t_kill and back else None,
            "caught_up_s": past - t_kill if t_kill and past else None,
            "step_s": statistics.median([b - a for a, b in zip(times, times[1:])][:10]) if len(times) > 3 else None,
            "load": load.split("] ", 1)[-1]}


shutil.rmtree(a.workdir, ignore_errors=True)
os.makedirs(a.workdir)
intervals = [int(k) for k in a.disk_intervals.split(",")]
print(f"# ft_recovery: flavor {a.flavor}, seq {a.seq_len}, {a.steps} steps, HSDP 2 x 2 on 4 ranks; seed {seed}")
rows = []
for n in range(a.trials):
    step, rank = rng.randrange(8, 25), rng.randrange(2)
    ft = ft_trial(os.path.join(a.workdir, f"ft{n}"), step, rank)
    disks = {k: disk_trial(os.path.join(a.workdir, f"disk{n}_every{k}"), step, rank, k) for k in intervals}
    rows.append((ft, disks))
    line = (f"kill rank {rank} of replica 1 at step {step}: ft: replica 1 back in {ft['recovery_s']:.2f} s, survivor's "
            f"longest pause {ft['survivor_pause_s']:.2f} s (its step {ft['survivor_step_s'] * 1e3:.0f} ms; "
            f"{ft['heal']})")
    for k, d in disks.items():
        line += (f"; disk every {k}: first step after the restart {d['recovery_s']:.2f} s, past the kill step "
                 f"{d['caught_up_s']:.2f} s (step {d['step_s'] * 1e3:.0f} ms; {d['load']})")
    print(line, flush=True)


def med(values):
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.2f} s" if values else "n/a"


print(f"\n| {a.flavor}, {len(rows)} kills (medians) | time until training goes on | the lost group back | "
      f"median step time |")
print("|---|---|---|---|")
print(f"| fault tolerance (2 replica groups) | survivor's longest pause: {med(f['survivor_pause_s'] for f, _ in rows)} | "
      f"{med(f['recovery_s'] for f, _ in rows)} (healed from replica 0) | "
      f"{med(f['survivor_step_s'] for f, _ in rows)} |")
for k in intervals:
    print(f"| restart from disk, checkpoint every {k} step(s) | every rank: {med(d[k]['recovery_s'] for _, d in rows)} "
          f"to the first step, {med(d[k]['caught_up_s'] for _, d in rows)} past the step reached | "
          f"(the whole job) | {med(d[k]['step_s'] for _, d in rows)} |")
fu.no_process_left()
