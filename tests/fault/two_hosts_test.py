#!/usr/bin/env python3
"""Two hosts over real TCP: two network namespaces joined by a veth pair that the test creates (private
addresses 10.213.<k>.1/.2 on a /30, nothing else in them). `fsdprun --nnodes 2 --node-rank R --master-addr
10.213.<k>.1 --master-port P --rdzv-id <id>` runs in each namespace with 2 ranks, GLOO_SOCKET_IFNAME set to the veth;
fsdp-train uses HSDP with the replicate dim across the "hosts" (replicate 2 x shard 2). The loss curve must equal
the same job on one host (4 ranks, same mesh) — bit for bit is not required across a different rank placement,
1e-5 relative is. Skipped (exit 77, reason printed) where namespaces or veth pairs cannot be created."""
import os
import random
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_util as fu  # noqa: E402

ap = fu.arg_parser(ckpt_tool=False)
a = fu.parse_args(ap)

k = random.randrange(1, 250)
tag = f"{os.getpid() % 10000}"
NS = [f"fsdp2h-{tag}-a", f"fsdp2h-{tag}-b"]
VETH = [f"fv{tag}a", f"fv{tag}b"]
ADDR = [f"10.213.{k}.1", f"10.213.{k}.2"]


def sh(*args, check=True):
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r


def cleanup():
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)


try:
    for ns in NS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", "name", VETH[0], "netns", NS[0], "type", "veth", "peer", "name", VETH[1], "netns", NS[1])
    for i in range(2):
        sh("ip", "-n", NS[i], "addr", "add", ADDR[i] + "/30", "dev", VETH[i])
        sh("ip", "-n", NS[i], "link", "set", VETH[i], "up")
        sh("ip", "-n", NS[i], "link", "set", "lo", "up")
except (RuntimeError, FileNotFoundError) as e:
    cleanup()
    fu.skip(f"cannot create network namespaces joined by a veth pair here ({e}); needs CAP_NET_ADMIN and iproute2")
fu.log("info", f"namespaces {NS}, veth {VETH[0]} {ADDR[0]} <-> {VETH[1]} {ADDR[1]}")

TRAIN_ARGS = ["--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
              "--training.global_batch_size", "8", "--training.steps", "6", "--lr_scheduler.warmup_steps", "2",
              "--metrics.peak_tflops", "1", "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32",
              "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
              "--comm.init_timeout_seconds", "60"]


def losses(folder):
    """Full-precision losses from the job's metrics.jsonl (written by rank 0)."""
    import json
    path = os.path.join(a.workdir, folder, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    return [r["loss"] for r in rows if "loss" in r]  # training steps (other rows: validation, ...)


try:
    one = fu.Job([a.fsdprun, "--nproc-per-node", "4", "--timeout", "200", a.train] + TRAIN_ARGS +
                 ["--job.dump_folder", os.path.join(a.workdir, "one_host")], "one_host")
    rc1 = one.finish(220)
    ref = losses("one_host")
    fu.observed(f"one host, 4 ranks: exit {rc1}, losses {ref}")
    fu.check(rc1 == 0 and len(ref) == 6 and ref[-1] != ref[0], "the one-host reference trains")

    port = 29000 + random.randrange(1000)
    rdzv = f"two-hosts-{tag}"
    jobs = []
    for r in range(2):
        cmd = ["ip", "netns", "exec", NS[r], "env", f"GLOO_SOCKET_IFNAME={VETH[r]}", a.fsdprun, "--nnodes", "2",
               "--node-rank", str(r), "--nproc-per-node", "2", "--master-addr", ADDR[0], "--master-port", str(port),
               "--rdzv-id", rdzv, "--timeout", "200", a.train] + TRAIN_ARGS + [
               "--job.dump_folder", os.path.join(a.workdir, "two_hosts")]  # one config on every node (checked at startup)
        jobs.append(fu.Job(cmd, f"host{r}"))
    fu.injected(f"2 fsdprun 'hosts' in namespaces {NS} over veth, master {ADDR[0]}:{port}, HSDP replicate across them")
    rcs = [j.finish(240) for j in jobs]
    two = losses("two_hosts")
    fu.observed(f"two hosts: exits {rcs}, host0 losses {two}")
    if any(rcs):
        for j in jobs:
            print(j.text()[-2000:])
    fu.check(rcs == [0, 0], "both hosts finish")
    fu.check(len(two) == len(ref) and all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(two, ref)),
             "two hosts train equal to one host (full-precision losses within 1e-5 relative)")
    world = jobs[0].grep(r"ranks +4 \(dp replicate 2 x shard 2\)")
    fu.check(bool(world), "one job of 4 ranks over both hosts (rank 0 reports world 4, replicate 2 x shard 2)")
    fu.check(any(re.match(r"\[rank [23]\]", l) for l in jobs[1].text().splitlines()) or rcs[1] == 0,
             "the second host ran ranks 2 and 3 and they exited 0")
finally:
    cleanup()
fu.finish_test("two_hosts_test")
