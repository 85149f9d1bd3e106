#!/usr/bin/env python3
"""Launch mismatches are detected at startup through the rendezvous store, before any collective (fsdp-train on
2 ranks under fsdprun; the rank-1 differences are injected by a small shell wrapper):
  * world size (rank 1 told WORLD_SIZE=3), library version (rank 1 with FSDP_LIBRARY_VERSION_OVERRIDE),
    configuration (rank 1 with --training.steps 5), model shapes (rank 1 with another --model.flavor):
    the job fails within seconds, the error names the check, the ranks and the differing values, no step runs;
  * a second job on the same MASTER_PORT (its own run id): refused, and the first job finishes unharmed;
  * rank 0's store listens only on MASTER_ADDR (127.0.0.2 here): a connection to 127.0.0.1 on the same port is
    refused while the job runs.
A matched launch of the same wrapper trains (the checks do not fire falsely)."""
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_util as fu  # noqa: E402

ap = fu.arg_parser(ckpt_tool=False)
a = fu.parse_args(ap)

TRAIN_ARGS = ["--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
              "--training.global_batch_size", "4", "--lr_scheduler.warmup_steps", "2", "--metrics.peak_tflops", "1",
              "--metrics.log_freq", "1", "--comm.init_timeout_seconds", "30"]


def wrapped(rank1_prefix, rank1_args, steps, folder):
    """fsdprun's command: a shell that execs fsdp-train, with extra environment/arguments on rank 1 only."""
    args = " ".join(TRAIN_ARGS + ["--training.steps", str(steps), "--job.dump_folder", folder])
    script = (f'if [ "$RANK" = 1 ]; then exec env {rank1_prefix} "{a.train}" {args} {rank1_args}; '
              f'else exec "{a.train}" {args}; fi')
    return ["sh", "-c", script]


def mismatch_case(name, rank1_prefix, rank1_args, expect):
    folder = os.path.join(a.workdir, name)
    fu.injected(f"{name}: rank 1 started with `{(rank1_prefix + ' ' + rank1_args).strip()}`")
    job = fu.Job([a.fsdprun, "--nproc-per-node", "2", "--timeout", "120"] + wrapped(rank1_prefix, rank1_args, 3, folder),
                 name)
    rc = job.finish(150)
    secs = job.end - job.start
    errors = job.grep(r"launch mismatch|refuses|did not arrive")
    fu.observed(f"{name}: exit {rc} after {secs:.1f} s; " + (errors[0] if errors else "no launch-check error"))
    fu.check(rc != 0, f"{name}: the job fails")
    fu.check(any(all(e in line for e in expect) for line in errors),
             f"{name}: an error names {expect}")
    fu.check(not job.grep(r"step:? +1\b"), f"{name}: no training step ran")
    fu.check(secs < 60, f"{name}: failed at startup ({secs:.1f} s), not after a collective timeout")


# A matched launch through the same wrapper trains: the checks pass when nothing differs.
job = fu.Job([a.fsdprun, "--nproc-per-node", "2", "--timeout", "150"] + wrapped("", "", 2, a.workdir + "/matched"),
             "matched")
rc = job.finish(180)
fu.observed(f"matched launch: exit {rc}, {len(job.grep(r'step'))} step lines")
fu.check(rc == 0, "a matched launch trains and exits 0")
if rc != 0:
    print(job.text()[-3000:])

mismatch_case("world_size", "WORLD_SIZE=3", "", ["world size", "rank 1", "'3'", "'2'"])
mismatch_case("library_version", "FSDP_LIBRARY_VERSION_OVERRIDE='libfsdp 9.9.9'", "",
              ["library version", "libfsdp 9.9.9", "libtorch"])
mismatch_case("config", "", "--training.steps 5", ["job configuration", "steps = 5", "steps = 3"])
mismatch_case("model_shapes", "", "--model.flavor debugmodel", ["model parameter shapes", "rank 1", "rank 0"])

# A second job on the same MASTER_PORT, and the store bound to MASTER_ADDR only.
with socket.socket() as s:
    s.bind(("127.0.0.2", 0))
    port = s.getsockname()[1]
first = fu.Job([a.fsdprun, "--nproc-per-node", "2", "--timeout", "240", "--master-addr", "127.0.0.2",
                "--master-port", str(port)] + wrapped("", "", 150, a.workdir + "/first"), "first")
t = first.wait_for(r"step:? +2\b", 150)
fu.check(t is not None, "the first job is training (step 2 seen)")
refused = {}
for addr in ("127.0.0.2", "127.0.0.1"):
    try:
        socket.create_connection((addr, port), timeout=2).close()
        refused[addr] = False
    except OSError as e:
        refused[addr] = str(e)
fu.observed(f"connect to the store port {port} while the job runs: 127.0.0.2 -> "
            f"{'refused: ' + refused['127.0.0.2'] if refused['127.0.0.2'] else 'accepted'}; 127.0.0.1 -> "
            f"{'refused: ' + refused['127.0.0.1'] if refused['127.0.0.1'] else 'accepted'}")
fu.check(refused["127.0.0.2"] is False, "the store accepts connections on MASTER_ADDR (127.0.0.2)")
fu.check(bool(refused["127.0.0.1"]), "the store does not listen on 127.0.0.1 (not MASTER_ADDR)")
fu.injected(f"a second job on the same MASTER_ADDR:MASTER_PORT 127.0.0.2:{port} while the first trains")
second = fu.Job([a.fsdprun, "--nproc-per-node", "2", "--timeout", "60", "--master-addr", "127.0.0.2",
                 "--master-port", str(port)] + wrapped("", "", 3, a.workdir + "/second"), "second")
rc2 = second.finish(90)
fu.check(first.proc.poll() is None, "the first job was still running (holding the port) while the second one ran")
if rc2 == 0:
    print(second.text()[-2500:])
msgs = second.grep(r"refuses the rendezvous store|another job is using this port")
fu.observed(f"second job: exit {rc2} after {second.end - second.start:.1f} s; " + " | ".join(msgs[:2]))
fu.check(rc2 != 0, "the second job fails")
fu.check(any("refuses the rendezvous store" in m and "belongs to run" in m for m in msgs) or
         any("another job is using this port" in m for m in msgs),
         "its ranks say that the port belongs to another run")
rc1 = first.finish(240)
fu.observed(f"first job: exit {rc1}, last step line: {(first.grep(r'step') or ['none'])[-1]}")
fu.check(rc1 == 0, "the first job is unharmed and finishes")
fu.check(bool(first.grep(r"step:? +150\b")), "the first job ran all 150 steps")
fu.finish_test("launch_mismatch_test")
