#!/usr/bin/env python3
"""Hangs and stragglers: fsdp-train on 2 ranks (FSDP) with comm.train_timeout_seconds = 4. After step 3 one rank
stops participating (SIGSTOP: it neither computes nor answers, the way a hung or swapped-out rank looks to its
peers). The other rank must fail within the configured timeout (plus the diagnosis grace and Gloo's slack) with an
error naming the collective, the group and the missing rank; fsdprun must then tear the group down (the stopped
rank included) and nothing may be left running. Three cases: the stopped rank is rank 1; rank 0 under standalone
fsdprun (which serves the rendezvous store itself, so the survivor names rank 0 as missing); and rank 0 serving the
store (an explicit --master-port), so the survivor can only say that the store does not answer."""
import os
import re
import signal
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_util as fu  # noqa: E402

ap = fu.arg_parser(ckpt_tool=False)
a = fu.parse_args(ap)

TIMEOUT = 4
TRAIN_ARGS = ["--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
              "--training.global_batch_size", "4", "--training.steps", "200", "--lr_scheduler.warmup_steps", "2",
              "--metrics.peak_tflops", "1", "--metrics.log_freq", "1", "--comm.init_timeout_seconds", "60",
              "--comm.train_timeout_seconds", str(TIMEOUT)]


def case(victim, rank0_serves_store=False):
    survivor = 1 - victim
    name = f"stop_rank{victim}" + ("_serving_store" if rank0_serves_store else "")
    port_args = []
    if rank0_serves_store:  # with --master-port, rank 0 serves the store (standalone fsdprun serves it itself)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port_args = ["--master-port", str(s.getsockname()[1])]
    job = fu.Job([a.fsdprun, "--nproc-per-node", "2", "--kill-grace", "2"] + port_args + [a.train] + TRAIN_ARGS +
                 ["--job.dump_folder", os.path.join(a.workdir, name)], name)
    fu.check(job.wait_for(r"^\[rank 0\] step: +3\b", 120) is not None, f"{name}: step 3 reached")
    pids = fu.rank_pids(victim, "fsdp-train")
    t_stop = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    fu.injected(f"{name}: SIGSTOP to rank {victim} (pid {pids}) after step 3; comm.train_timeout_seconds = {TIMEOUT}")
    t_err = job.wait_for(rf"^\[rank {survivor}\].*failed \(timeout", 60)
    rc = job.finish(60)
    err = next((l for l in job.grep(rf"^\[rank {survivor}\].*failed \(timeout")), "")
    took = (t_err - t_stop) if t_err else None
    fu.observed(f"{name}: rank {survivor} failed after {took if took is None else round(took, 1)} s: {err[:600]}")
    fu.observed(f"{name}: fsdprun exit {rc}, {job.end - t_stop:.1f} s after the stop; "
                + " | ".join(job.grep(r"^fsdprun:")[:3]))
    fu.check(took is not None and took <= TIMEOUT + 8, f"{name}: the survivor fails within the timeout "
             f"({TIMEOUT} s + diagnosis grace and slack)")
    fu.check(re.search(r"(all_gather_into_tensor|reduce_scatter_tensor|all_reduce|broadcast|barrier)\(", err) is not None,
             f"{name}: the error names the collective")
    fu.check(re.search(r"group '[^']+' \(world ranks \[0, 1\]", err) is not None, f"{name}: the error names the group")
    if victim == 1:
        fu.check("missing: world rank(s) [1]" in err, f"{name}: the error names the missing rank 1")
    elif rank0_serves_store:
        fu.check("world rank 0 may be the one missing" in err,
                 f"{name}: the error points at rank 0 (the store it serves does not answer)")
    else:
        fu.check("missing: world rank(s) [0]" in err,
                 f"{name}: the error names the missing rank 0 (fsdprun's store still answers)")
    fu.check(rc != 0, f"{name}: the job fails")
    fu.check(job.end - t_stop < TIMEOUT + 20, f"{name}: the launcher tore the group down promptly")
    fu.no_process_left()


case(1)
case(0)
case(0, rank0_serves_store=True)
fu.finish_test("hang_test")
