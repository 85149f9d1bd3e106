#!/usr/bin/env python3
"""fsdp-train across replica groups ([fault_tolerance], docs/reliability.md): an fsdp-lighthouse and two replica
groups, each an fsdp-train job of 2 ranks under its own fsdprun (HSDP's 2 replicas x 2 shards, real fully_shard inside
each group). Replica 0 runs under fsdprun without restarts, replica 1 with --max-restarts 1.

Trials 1..TRIALS: one rank (random) of replica 1 is SIGKILLed at a random step; its fsdprun brings the group down and
starts it again; the new group finds no checkpoint, joins the quorum and heals from replica 0.
Then two trials: rank 0, then rank 1 of replica 1 is SIGSTOPped at a random step and SIGCONTed once replica 0 has
trained a few steps alone; replica 1 finds itself behind and heals.
Last, the disk fallback: one rank of each group is SIGKILLed at once (no replica alive); both groups restart and go
on from their own checkpoints (every 5 steps), nobody heals, and the run still equals the reference.

Checked in every trial:
  * replica 0 never stops: its fsdprun never restarts, it exits 0, its steps are 1..N once each in order (its step
    counter never goes back) and it reads no checkpoint;
  * replica 1 restarted (or resumed), healed from replica 0 with no checkpoint read, and trained to the end;
  * the loss of every step of replica 0 equals ft_trainer_reference (the same training in one process, no sharding,
    no fsdp::ft) given that step's membership (from metrics.jsonl), to 1e-5 relative; the reference moved; steps ran
    both with both groups and with replica 0 alone (a step a member failed in was discarded, else a half-reduced
    gradient would show here);
  * after healing, replica 1 logs the same losses as replica 0 at the same steps, and the final checkpoints of the two
    groups (model and optimizer state, step, schedule) are bit-identical (fsdp-ckpt diff --atol 0; only the data
    loader positions differ, being each group's own share);
  * the stopped rank's group is dropped within the timeout (replica 0's first solo step).
Also printed: the recovery time, from the kill to replica 1's first step back in the quorum.

--extra runs another layout inside each group (TP, PP, EP, an MoE model; docs/reliability.md, "Layouts inside a
replica group"), passed to fsdp-train and the reference alike; --expect-log proves from replica 0's log that the layout
ran; --expert-tokens-per-group checks each step's mean expert load against a hand count times the step's members."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_util as fu  # noqa: E402

ap = fu.arg_parser(ckpt_tool=True)
ap.add_argument("--lighthouse", required=True)
ap.add_argument("--reference", required=True)
ap.add_argument("--trials", type=int, default=5, help="kill trials (then two SIGSTOP trials)")
ap.add_argument("--no-stop-trials", action="store_true")
ap.add_argument("--no-fallback-trial", action="store_true")
ap.add_argument("--steps", type=int, default=120)
ap.add_argument("--seed", type=int, default=None)
ap.add_argument("--name", default="ft_trainer_test")
# Another layout inside each replica group (e.g. tensor parallelism): fsdp-train arguments appended to the run's (and
# the reference's), and a regular expression replica 0's log must match (the layout really ran).
ap.add_argument("--extra", action="append", default=[], help="fsdp-train arguments appended, e.g. "
                "'--parallelism.tensor_parallel_degree 2'")
ap.add_argument("--expect-log", action="append", default=[], help="a regex replica 0's log must match")
# An MoE model: the tokens one expert receives on average from one group's batch (its samples x seq_len x top-k /
# experts, counted by hand). Each step's logged mean must be that times the step's members: the load-balancing bias
# moves on the counts of the whole quorum's batch, summed across the groups.
ap.add_argument("--expert-tokens-per-group", type=float, default=None)
a = fu.parse_args(ap)
seed = a.seed if a.seed is not None else random.randrange(1 << 30)
rng = random.Random(seed)
fu.log("info", f"random seed {seed} (rerun with --seed {seed})")

STEPS = a.steps
PG_TIMEOUT_MS, JOIN_MS = 3000, 1000
TRAIN = ["--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--training.global_batch_size", "8", "--training.steps", str(STEPS), "--metrics.peak_tflops", "1",
         "--metrics.log_freq", "1", "--validation.enable", "false", "--parallelism.data_parallel_shard_degree", "2",
         "--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
         "--fault_tolerance.process_group_timeout_ms", str(PG_TIMEOUT_MS),
         "--fault_tolerance.join_timeout_ms", str(JOIN_MS),
         ] + [arg for extra in a.extra for arg in extra.split()] + [
         # Only the last step is saved: the checkpoint the two groups are compared by. A restarted group finds none.
         "--checkpoint.enable", "--checkpoint.interval", str(10 * STEPS)]
STEP_RX = re.compile(r"^\[rank 0\] step:\s+(\d+)\s")


def step_lines(job, since=0.0):
    return [(t, int(m.group(1))) for t, l in job.lines if t >= since for m in [STEP_RX.match(l)] if m]


def metrics(folder):
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(l) for l in open(path) if '"loss"' in l]


def rank_pid(rid, rank):
    return fu.marked_pid("fsdp-train", FT_REPLICA_ID=rid, RANK=rank)


def save_logs(work, r0, r1, light):
    """Ends the run (fu.end_jobs) and keeps every job's output in <work>/<name>.log."""
    fu.end_jobs([r0, r1], light)
    for j, name in ((r0, "replica_0"), (r1, "replica_1"), (light, "lighthouse")):
        with open(os.path.join(work, name + ".log"), "w") as f:
            f.write(j.text() + "\n")


def trial(n, stop, stop_rank=None):
    tag = f"trial {n} ({'SIGSTOP' if stop else 'SIGKILL'})"
    work = os.path.join(a.workdir, f"trial{n}")
    os.makedirs(work)
    light, addr = fu.start_lighthouse(a.lighthouse, f"{tag}: lighthouse")
    if not fu.check(addr is not None, f"{tag}: fsdp-lighthouse printed its address"):
        return

    def start(rid, restarts):
        return fu.Job([a.fsdprun, "--nproc-per-node", "2", "--max-restarts", str(restarts), "--timeout", "300",
                       a.train] + TRAIN + ["--job.dump_folder", work, "--fault_tolerance.replica_id", str(rid)],
                      f"{tag}: replica {rid}", FSDP_LIGHTHOUSE=addr, FT_REPLICA_ID=rid)

    r0, r1 = start(0, 0), start(1, 1)
    jobs = [r0, r1, light]
    fault_step = rng.randrange(8, 25)
    victim_rank = rng.randrange(2) if stop_rank is None else stop_rank
    fault_at = resumed_at = None
    try:
        # The fault lands a random few ms after replica 1 logged step fault_step - 1: inside step fault_step (or
        # the next one), wherever that step happens to be (forward, backward, the cross-group all-reduce, the vote).
        if fu.wait_until(jobs, lambda: any(s == fault_step - 1 for _, s in step_lines(r1)), 120):
            time.sleep(rng.uniform(0, 0.04))
            victim = rank_pid(1, victim_rank)
            if victim:
                os.kill(victim, signal.SIGSTOP if stop else signal.SIGKILL)
                fault_at = time.monotonic()
                fu.injected(f"{tag}: {'SIGSTOP' if stop else 'SIGKILL'} rank {victim_rank} of replica 1 (pid {victim}) "
                            f"in step {fault_step}")
        fu.check(fault_at is not None, f"{tag}: replica 1 reached step {fault_step} and the fault was injected")
        if stop and fault_at:
            # Replica 0 goes on alone within the timeout; after 3 solo steps the stopped rank is resumed.
            solo = fu.wait_until(jobs, lambda: [t for t, s in step_lines(r0, fault_at)][:3]
                              if len(step_lines(r0, fault_at)) >= 3 else None, 60)
            bound = (PG_TIMEOUT_MS + JOIN_MS) / 1000 + 5
            first_solo = solo[0] - fault_at if solo else float("nan")
            fu.check(bool(solo) and first_solo < bound,
                     f"{tag}: replica 0 dropped the stopped group within {bound:.0f} s and trained alone (first step "
                     f"{first_solo:.1f} s after SIGSTOP)")
            os.kill(victim, signal.SIGCONT)
            resumed_at = time.monotonic()
            fu.injected(f"{tag}: SIGCONT rank {victim_rank} of replica 1")
        healed = fu.wait_until(jobs, lambda: next((t for t, l in r1.lines if fault_at and t >= fault_at and
                                                 "ft: replica 1 healed from replica 0" in l), None), 120)
        back = fu.wait_until(jobs, lambda: next((t for t, s in step_lines(r1, healed)), None) if healed else None, 60)
        if fault_at and back:
            fu.observed(f"{tag}: recovery {back - fault_at:.2f} s from the fault to replica 1's first step back in the "
                        f"quorum (heal {healed - fault_at:.2f} s after the fault)")
        for j in (r0, r1):
            fu.wait_until(jobs, lambda: j.proc.poll() is not None, 240)
    finally:
        save_logs(work, r0, r1, light)

    for rx in a.expect_log:
        hit = r0.grep(rx)
        fu.check(bool(hit), f"{tag}: replica 0's log shows the layout ({rx!r}): {hit[0][:200] if hit else None}")

    # ---- replica 0 never stopped -------------------------------------------------------------------------------
    fu.check(r0.proc.returncode == 0 and not r0.grep(r"restarting"), f"{tag}: replica 0 ran through without a restart "
             f"(exit {r0.proc.returncode})")
    fu.check(r1.proc.returncode == 0, f"{tag}: replica 1 finished (exit {r1.proc.returncode})")
    if not stop:
        fu.check(bool(r1.grep(r"restarting \(attempt 1/1\)")), f"{tag}: replica 1's fsdprun restarted the group")
    m0 = metrics(os.path.join(work, "replica_0"))
    m1 = metrics(os.path.join(work, "replica_1"))
    steps0 = [m["step"] for m in m0]
    fu.check(steps0 == list(range(1, STEPS + 1)), f"{tag}: replica 0 logged steps 1..{STEPS} once each, in order "
             f"({len(steps0)} records)")
    fu.check(not r0.grep(r"checkpoint: loaded") and not r1.grep(r"checkpoint: loaded"),
             f"{tag}: no checkpoint was read by either group")
    heals = r1.grep(r"ft: replica 1 healed from replica 0")
    fu.check(len(heals) >= 1 and all("no checkpoint read" in h for h in heals),
             f"{tag}: replica 1 healed from replica 0: {heals[0].split('ft: ', 1)[1] if heals else None}")
    discards = r0.grep(r"ft: step \d+ discarded")
    fu.observed(f"{tag}: replica 0 discarded {len(discards)} step(s)" +
                (f", e.g. {discards[0].split('ft: ', 1)[1][:200]}" if discards else " (the fault fell between steps)"))

    # ---- the loss curve against the reference with each step's membership -------------------------------------
    members = [",".join(str(i) for i in m.get("ft_replicas", [])) for m in m0]
    fu.observed(f"{tag}: membership " + (" ".join(f"{s}:{m}" for s, m in zip(steps0, members) if m != "0,1")
                                         + " (all other steps 0,1)" if set(members) != {"0,1"} else "0,1 at every step"))
    # A stopped group is away until SIGCONT: replica 0 must have trained alone meanwhile. A killed group's fsdprun
    # restarts it in about a second and a half, often before replica 0's next round closes: solo steps are then
    # legitimately absent, and reported.
    solo_steps = members.count("0")
    if stop:
        fu.check(members.count("0,1") >= 3 and solo_steps >= 1,
                 f"{tag}: steps ran with both groups ({members.count('0,1')}) and with replica 0 alone ({solo_steps})")
    else:
        fu.check(members.count("0,1") >= 3, f"{tag}: steps ran with both groups ({members.count('0,1')})")
        fu.observed(f"{tag}: replica 0 trained {solo_steps} step(s) alone while replica 1 restarted")
    if a.expert_tokens_per_group is not None:
        wrong = [(m["step"], m.get("expert_tokens_mean"), mem) for m, mem in zip(m0, members)
                 if m.get("expert_tokens_mean") != a.expert_tokens_per_group * len(mem.split(","))]
        fu.check(not wrong, f"{tag}: every step's mean expert load is {a.expert_tokens_per_group:g} tokens x its "
                 f"members (the counts summed over the quorum)" + (f"; first mismatch (step, mean, members) {wrong[0]}"
                                                                   if wrong else ""))
    mem_file, ref_file = os.path.join(work, "membership.txt"), os.path.join(work, "reference.txt")
    with open(mem_file, "w") as f:
        for s, m in zip(steps0, members):
            f.write(f"{s} {m}\n")
    r = subprocess.run([a.reference, mem_file, ref_file, "--"] + TRAIN, capture_output=True, text=True, timeout=300)
    if not fu.check(r.returncode == 0, f"{tag}: the reference ran ({r.stderr.strip()[-300:]})"):
        return
    ref = [float(l.split()[1]) for l in open(ref_file)]
    worst, first_bad = 0.0, None
    for s, m, x in zip(steps0, m0, ref):
        d = abs(m["loss"] - x) / abs(x)
        worst = max(worst, d)
        if d > 1e-5 and first_bad is None:
            first_bad = f"step {s} ({members[s - 1]}): {m['loss']} vs {x}"
    fu.check(len(ref) == STEPS and first_bad is None,
             f"{tag}: replica 0's loss equals the reference at every step (max rel. difference {worst:.2g})"
             + (f"; first mismatch {first_bad}" if first_bad else ""))
    fu.check(ref and ref[-1] < ref[0] - 0.5, f"{tag}: the reference moved (loss {ref[0]:.3f} -> {ref[-1]:.3f})")

    # ---- replica 1 after healing ----------------------------------------------------------------------------------
    by_step = {m["step"]: m["loss"] for m in m0}
    healed_to = int(re.search(r"-> (\d+)", heals[-1]).group(1)) if heals else STEPS
    after = [m for m in m1 if m["step"] > healed_to]
    fu.check(bool(after) and all(by_step.get(m["step"]) == m["loss"] for m in after),
             f"{tag}: after healing, replica 1 logged replica 0's loss at each of its {len(after)} steps")
    ck = [os.path.join(work, f"replica_{i}", "checkpoint", f"step-{STEPS}") for i in (0, 1)]
    if fu.check(all(os.path.isdir(c) for c in ck), f"{tag}: both groups saved step {STEPS}"):
        d = subprocess.run([a.ckpt_tool, "diff", ck[0], ck[1], "--atol", "0", "--ignore", "dataloader."],
                           capture_output=True, text=True, timeout=120)
        lines = d.stdout.strip().splitlines()
        fu.check(d.returncode == 0 and lines and lines[-1] == "identical",
                 f"{tag}: the groups' final model and optimizer state are bit-identical ({len(lines) - 1} entries "
                 f"compared, fsdp-ckpt diff --atol 0)" + ("" if d.returncode == 0 else ": " + d.stdout[-600:]))


def fallback_trial(n):
    """No replica group alive: one rank of each group is SIGKILLed at the same moment; both fsdpruns restart their
    groups, which find no live peer ahead of them and go on from their own checkpoints on disk."""
    tag = f"trial {n} (disk fallback)"
    work = os.path.join(a.workdir, f"trial{n}")
    os.makedirs(work)
    light, addr = fu.start_lighthouse(a.lighthouse, f"{tag}: lighthouse")
    if not fu.check(addr is not None, f"{tag}: fsdp-lighthouse printed its address"):
        return
    interval = 5
    args = TRAIN[:-1] + [str(interval), "--job.dump_folder", work]  # a checkpoint every 5 steps (and the last)
    jobs = [fu.Job([a.fsdprun, "--nproc-per-node", "2", "--max-restarts", "1", "--timeout", "300", a.train] + args +
                   ["--fault_tolerance.replica_id", str(r)], f"{tag}: replica {r}", FSDP_LIGHTHOUSE=addr,
                   FT_REPLICA_ID=r) for r in (0, 1)]
    r0, r1 = jobs
    kill_step = rng.randrange(8, 20)
    killed = False
    try:
        if fu.wait_until(jobs + [light], lambda: any(s == kill_step for _, s in step_lines(r0)), 120):
            victims = [rank_pid(r, rng.randrange(2)) for r in (0, 1)]
            if all(victims):
                for v in victims:
                    os.kill(v, signal.SIGKILL)
                killed = True
                fu.injected(f"{tag}: SIGKILL one rank of each replica group (pids {victims}) after step {kill_step}")
        fu.check(killed, f"{tag}: both groups reached step {kill_step} and were killed")
        for j in jobs:
            fu.wait_until(jobs + [light], lambda: j.proc.poll() is not None, 240)
    finally:
        save_logs(work, r0, r1, light)
    for r, j in ((0, r0), (1, r1)):
        loads = j.grep(r"checkpoint: loaded \S+/step-(\d+)")
        step = int(re.search(r"step-(\d+)", loads[0]).group(1)) if loads else -1
        fu.check(j.proc.returncode == 0 and j.grep(r"restarting \(attempt 1/1\)") and
                 step >= kill_step - interval - 1 and step % interval == 0,
                 f"{tag}: replica {r} restarted and went on from its checkpoint on disk: {loads[0] if loads else None}")
    fu.check(not r0.grep(r"healed from") and not r1.grep(r"healed from"), f"{tag}: nobody healed (no live peer was ahead)")
    # Replica 1's checkpoint holds data ranks 2 and 3 only: its loader position must still be found (it once was
    # not, and replica 1 silently restarted its data from step 0).
    fu.check(not r0.grep(r"starts fresh") and not r1.grep(r"starts fresh"),
             f"{tag}: both groups restored their data loader position (no state started fresh)")
    # The membership of every step from replica 0's log lines (both incarnations: the later line of a redone step
    # wins), its losses from metrics.jsonl (one file: the first incarnation's steps up to its checkpoint, then the
    # restarted one's).
    members = {}
    for _, l in r0.lines:
        m = re.match(r"^\[rank 0\] step:\s+(\d+)\s.*replicas: (\S+)$", l)
        if m:
            members[int(m.group(1))] = m.group(2)
    m0 = metrics(os.path.join(work, "replica_0"))
    if not fu.check(sorted(members) == list(range(1, STEPS + 1)) and m0 and m0[-1]["step"] == STEPS,
                    f"{tag}: replica 0 logged every step 1..{STEPS}"):
        return
    mem_file, ref_file = os.path.join(work, "membership.txt"), os.path.join(work, "reference.txt")
    with open(mem_file, "w") as f:
        for step in range(1, STEPS + 1):
            f.write(f"{step} {members[step]}\n")
    r = subprocess.run([a.reference, mem_file, ref_file, "--"] + TRAIN, capture_output=True, text=True, timeout=300)
    if not fu.check(r.returncode == 0, f"{tag}: the reference ran ({r.stderr.strip()[-300:]})"):
        return
    ref = [float(l.split()[1]) for l in open(ref_file)]
    worst = max(abs(m["loss"] - ref[m["step"] - 1]) / abs(ref[m["step"] - 1]) for m in m0)
    fu.check(worst <= 1e-5 and [m["step"] for m in m0] == list(range(1, STEPS + 1)),
             f"{tag}: replica 0's metrics.jsonl holds every step once across the restart, each loss equal to the "
             f"reference (max rel. difference {worst:.2g})")
    ck = [os.path.join(work, f"replica_{i}", "checkpoint", f"step-{STEPS}") for i in (0, 1)]
    d = subprocess.run([a.ckpt_tool, "diff", ck[0], ck[1], "--atol", "0", "--ignore", "dataloader."],
                       capture_output=True, text=True, timeout=120)
    fu.check(d.returncode == 0 and d.stdout.strip().endswith("identical"),
             f"{tag}: the groups' final states are bit-identical" + ("" if d.returncode == 0 else ": " + d.stdout[-600:]))


for n in range(1, a.trials + 1):
    trial(n, stop=False)
if not a.no_stop_trials:
    # Rank 0 of a group joins the rounds for it (and its heartbeat stops with it); rank 1 is a plain rank, whose
    # group must stay out of the rounds until it answers again.
    trial(a.trials + 1, stop=True, stop_rank=0)
    trial(a.trials + 2, stop=True, stop_rank=1)
if not a.no_fallback_trial:
    fallback_trial(a.trials + 3)
fu.finish_test(a.name)
