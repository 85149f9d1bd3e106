#!/usr/bin/env python3
"""Replica-group fault tolerance (docs/reliability.md, "Replica-group fault tolerance"): an fsdp-lighthouse and two
replica groups (tests/fault/ft_replica_worker.cpp: a tiny linear model, SGD with momentum, under fsdp::ft::Manager,
min_replicas 1), trained for STEPS steps.
With one rank per replica group (started directly):
  1. replica 1 is SIGKILLed at a random step, in the middle of it (after its gradient all-reduce, before its commit
     vote); once replica 0 has trained a few steps alone, replica 1 is started again (a fresh process, no disk);
  2. later replica 1 is SIGSTOPped in the middle of a random step, and SIGCONTed once replica 0 has trained a few
     steps alone.
With --ranks-per-replica 2 (each replica group an fsdprun job of 2 ranks, --max-restarts 1): a random rank of
replica 1 is SIGKILLed in the middle of a random step; its fsdprun brings the group down and restarts it, and the
restarted group heals shard index by shard index.
Checked against a reference computed here with PyTorch (the same data rule: the batch of replica r at step t is a
function of (t, r); a replica missing from a step's quorum has its batch of that step skipped):
  * replica 0 never stops and its step counter never goes back: its committed steps are exactly 0, 1, ..., STEPS-1;
  * the step in which replica 1 was killed (and the one in which it was stopped) is discarded by replica 0 (ABORT),
    never applied half-reduced: after every committed step replica 0's weights equal the reference replayed with
    that step's membership (the average over the members' batches), and the reference moved;
  * replica 0 trains alone (members 0) while replica 1 is away, and a stopped replica is dropped within the timeout;
  * replica 1, restarted or resumed, heals from replica 0 (HEALED, no checkpoint exists) and afterwards both commit
    the same weights at the same steps and end with bit-identical weights and momentum buffers."""
import argparse
import os
import random
import re
import signal
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_util as fu  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--lighthouse", required=True)
ap.add_argument("--worker", required=True)
ap.add_argument("--workdir", required=True)
ap.add_argument("--seed", type=int, default=None)
ap.add_argument("--steps", type=int, default=36)
ap.add_argument("--ranks-per-replica", type=int, default=1)
ap.add_argument("--fsdprun", help="needed with --ranks-per-replica > 1")
ap.add_argument("--name", default="ft_quorum_test")
ap.add_argument("--kill-point", choices=["before_allreduce", "after_allreduce", "random"], default="random",
                help="where in the step replica 1's rank dies: as the step starts (replica 0's all-reduce then fails) "
                     "or between its all-reduce and its vote (replica 0's vote then times out)")
a = ap.parse_args()
G = a.ranks_per_replica
if G > 1 and not a.fsdprun:
    ap.error("--ranks-per-replica > 1 needs --fsdprun")
os.makedirs(a.workdir, exist_ok=True)
for f in os.listdir(a.workdir):
    os.remove(os.path.join(a.workdir, f))
seed = a.seed if a.seed is not None else random.randrange(1 << 30)
rng = random.Random(seed)
fu.log("info", f"random seed {seed} (rerun with --seed {seed})")

try:
    import torch
except ImportError:
    fu.skip("torch is not importable by this Python (the reference needs it)")
torch.set_num_threads(1)

STEPS = a.steps
JOIN_MS, TIMEOUT_MS, PAUSE_MS = 1000, 3000, 150
jobs = []


def rank_prefix(rank=0):
    """fsdprun prefixes each rank's lines with "[rank N] "; a replica started directly prints bare lines."""
    return rf"^(?:\[rank {rank}\] )?"


def lines_of(job, kind):
    return [re.sub(r"^\[rank \d+\] ", "", l) for l in job.grep(rank_prefix() + rf"{kind} ")]


def field(line, name):
    m = re.search(rf"\b{name}=(\S*)", line)
    return m.group(1) if m else None


def start_replica(rid, tag):
    launcher = [] if G == 1 else [a.fsdprun, "--nproc-per-node", str(G), "--max-restarts", "1", "--timeout", "200"]
    job = fu.Job(launcher + [a.worker, "--replica-id", str(rid), "--steps", str(STEPS), "--out",
                  os.path.join(a.workdir, f"final-{rid}.bin"), "--min-replicas", "1", "--expected", "2",
                  "--join-timeout-ms", str(JOIN_MS), "--timeout-ms", str(TIMEOUT_MS),
                  "--pause-after-quorum-ms", str(PAUSE_MS), "--pause-before-vote-ms", str(PAUSE_MS)],
                 f"replica {rid} ({tag})", FSDP_LIGHTHOUSE=lighthouse_addr,
                 FT_REPLICA_ID=rid)
    jobs.append(job)
    return job


def pump_all(seconds):
    """Reads every job's output for `seconds` (so that no pipe fills while we wait on another job)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for j in jobs:
            j._pump(0.01)


def wait_line(job, pattern, timeout):
    """Pumps every job until `job` prints a line matching pattern (returns the line) or the timeout passes."""
    rx = re.compile(pattern)
    end = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < end:
        for _, line in job.lines[seen:]:
            if rx.search(line):
                return line
        seen = len(job.lines)
        pump_all(0.02)
    return None


def solo_commits_after(job, t0):
    rx = re.compile(rank_prefix() + "COMMIT ")
    return [l for t, l in job.lines if t >= t0 and rx.search(l) and field(l, "members") == "0"]


def rank_pid(rid, rank):
    """The worker process of rank `rank` of replica `rid` (fsdprun's child), or None."""
    for pid in fu.marked_pids():
        e = fu.proc_env(pid)
        if e.get(b"FT_REPLICA_ID") == str(rid).encode() and e.get(b"RANK", b"0") == str(rank).encode():
            try:
                if os.path.basename(os.readlink(f"/proc/{pid}/exe")) == os.path.basename(a.worker):
                    return pid
            except OSError:
                pass
    return None


# ---- the run -------------------------------------------------------------------------------------------------------
light = fu.Job([a.lighthouse, "--port", "0"], "lighthouse")
port_line = light.wait_for(r"serving on", 30)
served = re.search(r"serving on (\S+)", light.text()) if port_line else None
if not served:
    fu.check(False, "fsdp-lighthouse printed its address")
    light.proc.kill()
    fu.finish_test(a.name)
lighthouse_addr = served.group(1)
fu.observed(f"fsdp-lighthouse serves on {lighthouse_addr}")

r0 = start_replica(0, "survivor")
r1 = start_replica(1, "first run")
kill_step = rng.randrange(3, 9)
kill_rank = rng.randrange(G)
kill_point = a.kill_point if a.kill_point != "random" else rng.choice(["before_allreduce", "after_allreduce"])
# Rank 0 prints the step's QUORUM line as the step starts; every rank prints ALLREDUCED before its pause and vote.
kill_line = (rank_prefix() + rf"QUORUM id=\d+ step={kill_step}\b" if kill_point == "before_allreduce"
             else rank_prefix(kill_rank) + rf"ALLREDUCED step={kill_step}\b")
stop_step = None
killed_at = stopped_at = None
r1b = None
try:
    if wait_line(r1, kill_line, 120):
        victim = r1.proc.pid if G == 1 else rank_pid(1, kill_rank)
        if victim:
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            fu.injected(f"SIGKILL rank {kill_rank} of replica 1 (pid {victim}) in step {kill_step}, " +
                        ("as it starts (before the gradient all-reduce)" if kill_point == "before_allreduce"
                         else "after its gradient all-reduce, before its vote"))
    fu.check(killed_at is not None, f"replica 1 reached step {kill_step} and was killed")
    if G == 1:
        # Replica 0 goes on alone; after 3 solo steps replica 1 is started again.
        end = time.monotonic() + 60
        while killed_at and len(solo_commits_after(r0, killed_at)) < 3 and time.monotonic() < end:
            pump_all(0.05)
        r1b = start_replica(1, "restarted")
        fu.injected("replica 1 started again (fresh process; there is no checkpoint anywhere)")
    else:
        r1b = r1  # its fsdprun restarts the group by itself
    restarted_at = time.monotonic()
    healed = wait_line(r1b, rank_prefix() + r"HEALED ", 90)
    # To replica 0's step: at least the step the kill discarded (more when replica 0 went on alone meanwhile).
    fu.check(healed is not None and int(field(healed, "step")) >= kill_step,
             f"the restarted replica 1 (from step 0) healed from replica 0: {healed}")
    solo = solo_commits_after(r0, killed_at) if killed_at else []
    # One rank per replica: the driver restarts replica 1 only after 3 solo steps. Under fsdprun the group may be back
    # (restarted, joined) before replica 0's next round closes: then replica 0 never has to train alone.
    if G == 1:
        fu.check(len(solo) >= 3, f"replica 0 trained alone after the kill ({len(solo)} solo steps seen)")
    else:
        fu.observed(f"replica 0 trained {len(solo)} step(s) alone while replica 1 restarted")
    if solo:
        first_solo = next(t for t, l in r0.lines if t >= killed_at and l.endswith(solo[0]))
        fu.observed(f"replica 0's first solo commit {first_solo - killed_at:.1f} s after the kill: "
                    f"{solo[0].split(' w=')[0]}")
    first_back = wait_line(r1b, rank_prefix() + r"COMMIT ", 60) if G == 1 else None
    if first_back:
        # Then a stop: replica 1 is SIGSTOPped in the middle of a random later step.
        stop_step = int(field(first_back, "step")) + rng.randrange(2, 5)
        if stop_step < STEPS - 6 and wait_line(r1b, rf"^ALLREDUCED step={stop_step}\b", 60):
            os.kill(r1b.proc.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            fu.injected(f"SIGSTOP replica 1 (pid {r1b.proc.pid}) after its all-reduce of step {stop_step}")
        fu.check(stopped_at is not None, f"replica 1 was stopped at step {stop_step}")
    if stopped_at:
        end = time.monotonic() + 60
        while len(solo_commits_after(r0, stopped_at)) < 3 and time.monotonic() < end:
            pump_all(0.05)
        solo2 = [t for t, l in r0.lines if t >= stopped_at and l.startswith("COMMIT ") and field(l, "members") == "0"]
        # Dropped = replica 0's vote on the stopped step times out, its next round closes after the join timeout.
        bound = (TIMEOUT_MS + JOIN_MS) / 1000 + 5
        fu.check(bool(solo2) and solo2[0] - stopped_at < bound,
                 f"the stopped replica was dropped within {bound:.0f} s (first solo commit "
                 f"{(solo2[0] - stopped_at) if solo2 else float('nan'):.1f} s after SIGSTOP)")
        os.kill(r1b.proc.pid, signal.SIGCONT)
        fu.injected("SIGCONT replica 1")
    for j in (r0, r1b):
        while j.proc.poll() is None and time.monotonic() - j.start < 240:
            pump_all(0.05)
finally:
    for j in jobs:
        if j.proc.poll() is None:
            fu.log("FAIL", f"{j.name} still running; killing it")
            fu._failures.append(f"{j.name} did not end in time")
            os.killpg(j.proc.pid, signal.SIGKILL)
        j.finish(10)
    light.proc.send_signal(signal.SIGTERM)
    light_rc = light.finish(10)

fu.check(light_rc == 0 and light.grep(r"SIGTERM, stopping"), f"fsdp-lighthouse stopped on SIGTERM (exit {light_rc})")
fu.check(r0.proc.returncode == 0 and r0.grep(rank_prefix() + rf"DONE step={STEPS}$"), f"replica 0 finished {STEPS} steps "
         f"(exit {r0.proc.returncode})")
fu.check(r1b is not None and r1b.proc.returncode == 0 and r1b.grep(rank_prefix() + rf"DONE step={STEPS}$"),
         "the restarted replica 1 finished too")

# ---- replica 0 never went back, and discarded the failed steps -----------------------------------------------------
commits0 = lines_of(r0, "COMMIT")
steps0 = [int(field(l, "step")) for l in commits0]
fu.check(steps0 == list(range(STEPS)), f"replica 0 committed steps 0..{STEPS - 1} once each, in order "
         f"(got {steps0[:5]}...{steps0[-3:]}, {len(steps0)} commits)")
aborts0 = [int(field(l, "step")) for l in lines_of(r0, "ABORT")]
fu.observed(f"replica 0 discarded steps {aborts0}: " + "; ".join(l.split("error=", 1)[-1] for l in lines_of(r0, "ABORT"))[:600])
# The kill lands in one of the victim's pauses (PAUSE_MS, after its quorum or before its vote); on a machine so loaded
# that it landed after the vote, the step was committed by both, legitimately: then say so instead of failing.
# (The killed incarnation's lines: those before the first quorum line after the kill, which a restart prints.)
back = [t for t, l in r1.lines if killed_at and t >= killed_at and re.search(rank_prefix() + "QUORUM ", l)]
victim_lines = [re.sub(r"^\[rank \d+\] ", "", l) for t, l in r1.lines if not back or t < back[0]]
if any(l.startswith(f"COMMIT step={kill_step} ") for l in victim_lines):
    fu.observed(f"the kill landed after replica 1's vote on step {kill_step}: the step committed on both")
else:
    fu.check(kill_step in aborts0, f"replica 0 discarded step {kill_step}, the one replica 1 was killed in")
if stop_step is not None:
    fu.check(stop_step in aborts0, f"replica 0 discarded step {stop_step}, the one replica 1 was stopped in")
members = [field(l, "members") for l in commits0]
fu.observed("membership per step: " + " ".join(f"{s}:{m}" for s, m in zip(steps0, members)))
fu.check(("0" in members or G > 1) and members.count("0,1") >= 3,
         "steps ran with both replicas" + (" and with replica 0 alone" if G == 1 else ""))


# ---- the reference: replay with the membership of each step --------------------------------------------------------
def data(step, replica, shard):
    shift = float(step) * 1.3 + replica * 2.1 + shard * 0.9
    x = torch.arange(32, dtype=torch.float32).mul(0.37).add(shift).sin().view(8, 4)
    y = torch.arange(24, dtype=torch.float32).mul(0.21).add(float(step) * 0.7 - replica * 0.5).cos().view(8, 3)
    return x, y


w = torch.arange(12, dtype=torch.float32).mul(0.5).sin().mul(0.3).view(3, 4)
b = torch.arange(3, dtype=torch.float32).cos().mul(0.1)
w0 = torch.cat([w.flatten(), b]).clone()
bufs = None
worst = 0.0
mismatch = None
for step, line in zip(steps0, commits0):
    ids = [int(i) for i in field(line, "members").split(",")]
    grads = []
    for r in ids:
        # The replica's own average over its ranks' batches first (in rank order, as its all-reduce sums them).
        per_rank = []
        for sh in range(G):
            wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
            x, y = data(step, r, sh)
            torch.nn.functional.mse_loss(x @ wr.t() + br, y).backward()
            per_rank.append(torch.cat([wr.grad.flatten(), br.grad]))
        gr = per_rank[0].clone()
        for other in per_rank[1:]:
            gr += other
        grads.append(gr / G)
    g = grads[0].clone()
    for other in grads[1:]:
        g += other
    g /= len(ids)
    gw, gb = g[:12].view(3, 4), g[12:]
    if bufs is None:
        bufs = [gw.clone(), gb.clone()]
    else:
        bufs[0].mul_(0.9).add_(gw)
        bufs[1].mul_(0.9).add_(gb)
    w = w.add(bufs[0], alpha=-0.1)
    b = b.add(bufs[1], alpha=-0.1)
    got = torch.tensor([float(v) for v in field(line, "w").split(",")], dtype=torch.float32)
    ref = torch.cat([w.flatten(), b])
    diff = (got - ref).abs().max().item()
    worst = max(worst, diff)
    if diff > 1e-6 and mismatch is None:
        mismatch = f"step {step} (members {ids}): max |replica 0 - reference| = {diff:.3g}"
fu.check(mismatch is None and len(commits0) == STEPS,
         f"replica 0's weights equal the reference after every step (max difference {worst:.3g})"
         + (f"; first mismatch at {mismatch}" if mismatch else ""))
moved = (torch.cat([w.flatten(), b]) - w0).abs().max().item()
fu.check(moved > 1e-2, f"the reference moved from the initial weights (max change {moved:.3g})")

# ---- replica 1 after healing ---------------------------------------------------------------------------------------
if r1b is not None:
    after = [re.sub(r"^\[rank \d+\] ", "", l) for t, l in r1b.lines if t >= restarted_at]
    quorums = [l for l in after if l.startswith("QUORUM ")]
    fu.check(bool(quorums) and field(quorums[0], "heal") == "1", "the restarted replica 1 was told to heal at once")
    heals = [l for l in after if l.startswith("HEALED ")]
    fu.check(len(heals) >= (2 if stopped_at else 1), "replica 1 healed after the restart"
             + (" and after SIGCONT" if stopped_at else "") + f": {heals}")
    by_step0 = {int(field(l, "step")): field(l, "w") for l in commits0}
    commits1 = [l for l in after if l.startswith("COMMIT ")]
    same = [by_step0.get(int(field(l, "step"))) == field(l, "w") for l in commits1]
    fu.check(bool(commits1) and all(same), f"after healing, replica 1 committed the same weights as replica 0 at each "
             f"of its {len(commits1)} steps")
    files = [os.path.join(a.workdir, f"final-{r}.bin") + (f".rank{s}" if s else "") for r in (0, 1) for s in range(G)]
    if all(os.path.exists(f) for f in files):
        b0 = open(files[0], "rb").read()
        fu.check(len(b0) == 2 * 15 * 4 and all(open(f, "rb").read() == b0 for f in files),
                 f"final weights and momentum buffers are bit-identical on all {len(files)} ranks of both replicas "
                 f"({len(b0)} bytes each)")
        final = torch.tensor(struct.unpack(f"{len(b0) // 4}f", b0)[:15])
        fu.check((final - torch.cat([w.flatten(), b])).abs().max().item() <= 1e-6,
                 "the final weights are the reference's")
    else:
        fu.check(False, "both replicas wrote their final state")
fu.finish_test(a.name)
