#!/usr/bin/env python3
"""The fault-tolerant launches of docs/trainer.md ("Fault tolerance across replica groups") run as written.

  1. The by-hand launch: the fenced block after "by hand" is read from docs/trainer.md itself and run with bash, the
     binaries found on PATH (the build's), two changes only: `--training.steps 3` on the fsdp-train line (the default
     job is 300 steps) and a free port in place of 29600.
  2. `FSDP_FT_RANKS=2 scripts/train_ft.sh --training.steps 3` (the script's own set-up is a no-op on a built tree).
Each must end with exit 0, both replica groups training all 3 steps together (`replicas: 0,1`) — before, both
failed on the default job with `global_batch_size (16) must be a multiple of ... = 32`."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_util as fu  # noqa: E402

ap = fu.arg_parser()
ap.add_argument("--lighthouse", required=True)
ap.add_argument("--source-dir", required=True)
ap.add_argument("--build-dir", required=True)
a = fu.parse_args(ap)

STEPS = ["--training.steps", "3", "--validation.enable", "false"]
doc = open(os.path.join(a.source_dir, "docs", "trainer.md")).read()
section = doc.split("## Fault tolerance across replica groups", 1)[1]
block = re.search(r"by hand[^\n]*\n(?:[^\n]*\n)*?```\n(.*?)```", section, re.S)
if not fu.check(block is not None, "docs/trainer.md has the by-hand launch"):
    fu.finish_test("ft_docs_test")
script = block.group(1)
fu.log("info", "the documented launch:\n" + script)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
script = script.replace("29600", str(port))
script = re.sub(r"(--fault_tolerance\.replica_id \$r)", r"\1 " + " ".join(STEPS), script)
fu.check(str(port) in script and "--training.steps 3" in script, "the launch was adapted (port, steps) and nothing else")
# The documented lines, then: wait for the replica groups (every background job but the first, the lighthouse), stop
# the lighthouse, exit non-zero if a group failed.
runner = script + """
jobs_list=($(jobs -p))
status=0
for p in "${jobs_list[@]:1}"; do wait "$p" || status=1; done
kill -TERM "${jobs_list[0]}"; wait "${jobs_list[0]}" || true
exit $status
"""
path = os.pathsep.join([os.path.dirname(a.lighthouse), os.path.dirname(a.fsdprun), os.path.dirname(a.train),
                        os.environ.get("PATH", "")])
work = os.path.join(a.workdir, "by_hand")
os.makedirs(work)
job = fu.Job(["bash", "-c", f"cd '{work}'\n" + runner], "by-hand launch", PATH=path)
job.finish(600)
steps = job.grep(r"step:\s+3\s.*replicas: 0,1")
fu.check(job.proc.returncode == 0 and len(steps) == 2,
         f"the by-hand launch ran (exit {job.proc.returncode}): both groups trained step 3 together ({len(steps)} "
         "lines)" + ("" if job.proc.returncode == 0 else ": " + job.text()[-800:]))
fu.check(not job.grep(r"must be a multiple"), "no batch size error")

# ---- scripts/train_ft.sh ------------------------------------------------------------------------------------------
dump = os.path.join(a.workdir, "train_ft")
venv = os.path.dirname(os.path.dirname(sys.executable))
t0 = time.monotonic()
job = fu.Job(["bash", os.path.join(a.source_dir, "scripts", "train_ft.sh")] + STEPS + ["--job.dump_folder", dump],
             "train_ft.sh", FSDP_FT_RANKS=2, FSDP_BUILD_DIR=a.build_dir, FSDP_VENV=venv)
job.finish(600)
logs = {r: open(os.path.join(dump, f"replica_{r}.log")).read() if os.path.exists(os.path.join(dump, f"replica_{r}.log"))
        else "" for r in (0, 1)}
together = [r for r in (0, 1) if re.search(r"step:\s+3\s.*replicas: 0,1", logs[r])]
fu.check(job.proc.returncode == 0 and together == [0, 1],
         f"FSDP_FT_RANKS=2 scripts/train_ft.sh ran in {time.monotonic() - t0:.0f} s (exit {job.proc.returncode}): "
         f"groups that trained step 3 with both {together}" + ("" if job.proc.returncode == 0 else ": " +
                                                               job.text()[-800:]))
fu.check(bool(job.grep(r"global batch 16 over 4 data ranks: --training.local_batch_size 4")),
         "train_ft.sh said which local batch it chose")

# ---- the healing line says whether the group read a checkpoint --------------------------------------------------
# Replica 1 (1 rank, a checkpoint every 4 steps) is SIGKILLed after its checkpoint of step 8; its fsdprun restarts it,
# it loads that checkpoint, finds replica 0 ahead and heals: its healing line must name the checkpoint it loaded (it
# once said "no checkpoint read" whatever had happened at start-up).
light, addr = fu.start_lighthouse(a.lighthouse, "lighthouse (heal after load)")
work = os.path.join(a.workdir, "heal_after_load")
small = ["--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--training.global_batch_size", "4", "--training.steps", "2000", "--metrics.log_freq", "1",
         "--validation.enable", "false", "--checkpoint.enable", "--checkpoint.interval", "4",
         "--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--job.dump_folder", work]
groups = [fu.Job([a.fsdprun, "--nproc-per-node", "1", "--max-restarts", str(r), "--timeout", "300", a.train] + small +
                 ["--fault_tolerance.replica_id", str(r)], f"replica {r} (heal after load)", FSDP_LIGHTHOUSE=addr,
                 FT_REPLICA_ID=r) for r in (0, 1)]
# Polled every few ms by wait_until below: compiled once.
TRAINED_ALONE = re.compile(r"ft: step (\d+) trained by replicas 0$")
STEP_LINE = re.compile(r"step:\s+(\d+)")
killed = False
try:
    ck = os.path.join(work, "replica_1", "checkpoint", "step-8", "metadata.json")
    if fu.wait_until(groups + [light], lambda: os.path.exists(ck), 120):
        victim = fu.marked_pid("fsdp-train", FT_REPLICA_ID=1)
        if victim:
            # Replica 1's fsdprun is held (SIGSTOP) while its rank dies, so that it restarts only once replica 0
            # trained on alone: a restart quicker than replica 0's wait for the lost group found both groups at
            # the same step, and nothing to heal (seen under a loaded ctest -j2).
            os.kill(groups[1].proc.pid, signal.SIGSTOP)
            os.kill(victim, 9)
            killed = True
            fu.injected(f"SIGKILL replica 1 (pid {victim}) after its checkpoint of step 8, its fsdprun held")

            def replica0_ahead():
                alone = [int(m.group(1)) for m in map(TRAINED_ALONE.search, (l for _, l in groups[0].lines)) if m]
                steps = [int(m.group(1)) for m in map(STEP_LINE.search, (l for _, l in groups[0].lines)) if m]
                return bool(alone) and bool(steps) and max(steps) >= alone[0] + 2
            ahead = fu.wait_until(groups + [light], replica0_ahead, 120)
            os.kill(groups[1].proc.pid, signal.SIGCONT)
            fu.check(ahead, "replica 0 trained on alone while replica 1 was down")
    # 2000 steps keep replica 0 training (alone, a few ms a step) until replica 1 is back however slow its restart
    # is on a loaded machine; both are stopped once replica 1 healed (or either ended).
    fu.wait_until(groups + [light], lambda: groups[1].grep(r"ft: replica 1 healed from replica 0") or
                  any(j.proc.poll() is not None for j in groups), 240)
    for j in groups:
        if j.proc.poll() is None:
            os.killpg(j.proc.pid, signal.SIGTERM)
finally:
    fu.end_jobs(groups, light)
r1 = groups[1]
loads = r1.grep(r"checkpoint: loaded \S+/step-(\d+)")
loaded = int(re.search(r"step-(\d+)", loads[-1]).group(1)) if loads else None
heals = [l for l in r1.grep(r"ft: replica 1 healed from replica 0") if f"step {loaded} ->" in l] if loads else []
fu.check(killed and loaded is not None and len(heals) == 1 and
         f"this group loaded its checkpoint of step {loaded} at start-up" in heals[0] and
         "no checkpoint read" not in heals[0],
         f"after loading its checkpoint of step {loaded}, replica 1's healing line says so: "
         f"{heals[0].split('ft: ', 1)[1] if heals else r1.text()[-600:]}")
fu.finish_test("ft_docs_test")
