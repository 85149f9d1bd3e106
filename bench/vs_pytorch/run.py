"""Side-by-side: libfsdp (ours.cpp under fsdprun) vs PyTorch FSDP2 (vs_pytorch.py under torchrun).

For each world size: same initial weights (safetensors written by our side), same token batches (a raw int64
file written here), same mesh (1-D over the world), reshard policy, dtype (fp32) and AdamW settings. Prints a
table: loss match, median step time ratio, peak RSS ratio, bytes per step (ours measured, FSDP2 requested,
analytic optimum), and a roofline (compute limit = the same per-rank work without FSDP on one process; comm
limit = bytes / memcpy bandwidth). Exit status 1 when a loss curve differs by more than --check-rtol.

    .venv/bin/python bench/vs_pytorch/run.py --build-dir build-bench            (or bench/vs_pytorch/run.sh)
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import st_io  # noqa: E402


def write_tokens(path, steps, global_batch, seq, vocab, seed):
    """Learnable synthetic data: each sequence follows t[i+1] = (a*t[i] + c) mod V, with 20% of positions
    replaced by random tokens. Deterministic for a seed; both sides read the same file."""
    g = torch.Generator().manual_seed(seed)
    n = steps * global_batch
    a = torch.randint(1, 16, (n, 1), generator=g)
    c = torch.randint(0, vocab, (n, 1), generator=g)
    t = torch.empty(n, seq + 1, dtype=torch.int64)
    t[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for i in range(seq):
        t[:, i + 1] = (a[:, 0] * t[:, i] + c[:, 0]) % vocab
    noise = torch.rand(n, seq + 1, generator=g) < 0.2
    t[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    t.numpy().tofile(path)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


RENDER_ONLY = False  # --render-only: re-read a kept --work-dir instead of running anything


class RunFailed(Exception):
    """One command of a world size failed: that world's row is marked failed (with the first error lines) and the
    report still covers every other row (scripts/gpu-check.sh all relies on a report even when FSDP2 fails)."""


def first_error_lines(text, n=2):
    """The first lines of a log that say what went wrong (launcher boilerplate left out), for a table cell."""
    noise = ("errors.html", "error_file", "To enable traceback", "warnings.warn")
    lines = [ln for ln in text.splitlines()
             if any(k in ln for k in ("Error", "error", "FAIL", "failed", "Expected", "Exception"))
             and not any(k in ln for k in noise)]
    return " / ".join(ln.strip()[:240].replace("|", "/") for ln in (lines or text.splitlines()[-n:])[:n])


def run(cmd, env, log, timeout, outputs_complete=None):
    """Runs cmd with its output in `log`. outputs_complete(): True when every result file is complete; a command
    that fails after writing all of them (a crash at process teardown) is reported and accepted."""
    if RENDER_ONLY:
        return float("nan")
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        t0 = time.time()
        try:
            r = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"timed out after {timeout} s (log: {log})") from None
    if r.returncode != 0 and outputs_complete is not None and outputs_complete():
        print(f"warning: exit status {r.returncode} after all results were written (teardown crash), accepted: "
              f"{' '.join(cmd[:6])} ... (log: {log})", file=sys.stderr)
    elif r.returncode != 0:
        with open(log) as f:
            text = f.read()
        sys.stderr.write(text[-6000:])
        raise RunFailed(f"exit {r.returncode}: {first_error_lines(text)} (log: {log})")
    return time.time() - t0


def machine_details():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    load = os.getloadavg()
    return (f"{cpu}, {os.cpu_count()} cores, {mem} RAM, Linux {platform.release()}, torch {torch.__version__} "
            f"(both sides: same libtorch), Python {platform.python_version()}, load average at start "
            f"{load[0]:.1f}")


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(HERE, "..", "..", "build"))
    p.add_argument("--ours", help="fsdp-bench-ours binary (default: <build-dir>/bench/fsdp-bench-ours)")
    p.add_argument("--fsdprun", help="fsdprun binary (default: <build-dir>/apps/fsdprun/fsdprun)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--global-batch", type=int, default=8, help="fixed across world sizes (local = global / W)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--tie-embeddings", action="store_true",
                   help="tie the output layer to the embeddings (any flavor; 1B and 3B are tied already)")
    p.add_argument("--reshard", default="default", help="blocks' reshard_after_forward: default|true|false|<int>")
    p.add_argument("--replicate", type=int, default=1, help="HSDP replicate degree (mesh replicate x W/replicate)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: both sides on cuda:0 (ranks share the GPU, Gloo collectives on CUDA tensors), bf16 by "
                        "default; plain training = `single` on the GPU; no memcpy/collective roofline, no world1 "
                        "interleaving. Not yet run on a GPU (docs/benchmarks.md)")
    p.add_argument("--mp", default=None, choices=["fp32", "bf16"],
                   help="bf16: MixedPrecisionPolicy(bf16 params, fp32 reduce) on both sides, loss on fp32 logits")
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank, both sides")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time")
    p.add_argument("--no-roofline", action="store_true")
    p.add_argument("--no-force-sum", action="store_true", help="FSDP2 side: keep AVG reductions on Gloo")
    p.add_argument("--check-rtol", type=float, default=None, help="exit 1 if max relative loss diff exceeds this")
    p.add_argument("--work-dir", help="keep inputs, logs and JSONL here (default: a temp dir, removed)")
    p.add_argument("--markdown", help="also write the report (markdown) to this file")
    p.add_argument("--render-only", action="store_true", help="rebuild the report from a kept --work-dir")
    p.add_argument("--timeout", type=int, default=1800, help="per command, seconds")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="per-rank peak for MFU (H100/H200 bf16 dense: 989.4); default: a matmul measured here")
    o = p.parse_args()
    if o.mp is None:
        o.mp = "bf16" if o.device == "cuda" else "fp32"
    if o.device == "cuda" and not o.render_only and not torch.cuda.is_available():
        raise SystemExit(f"run.py: --device cuda, but torch {torch.__version__} in {sys.executable} sees no CUDA "
                         f"device (a CPU-only build, or no GPU on this machine). The GPU comparison needs a CUDA torch "
                         f"on both sides and a CUDA build of libfsdp; it has not been run yet (docs/benchmarks.md)")

    global RENDER_ONLY
    RENDER_ONLY = o.render_only
    if o.render_only and not o.work_dir:
        raise SystemExit("--render-only needs --work-dir")
    ours = o.ours or os.path.join(o.build_dir, "bench", "fsdp-bench-ours")
    fsdprun = o.fsdprun or os.path.join(o.build_dir, "apps", "fsdprun", "fsdprun")
    for b in (ours, fsdprun):
        if not os.access(b, os.X_OK):
            raise SystemExit(f"missing binary {b}: build targets fsdp-bench-ours and fsdprun first")
    work = o.work_dir or tempfile.mkdtemp(prefix="vs_pytorch_")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(o.threads))
    details_file = os.path.join(work, "machine.txt")
    if RENDER_ONLY and os.path.exists(details_file):
        details = open(details_file).read().strip()
    else:
        details = machine_details()
        with open(details_file, "w") as f:
            f.write(details + "\n")
    try:
        weights = os.path.join(work, "init.safetensors")
        run([ours, "init", "--flavor", o.flavor, "--seed", str(o.seed), "--out", weights]
            + (["--tie-embeddings"] if o.tie_embeddings else []), env,
            os.path.join(work, "init.log"), o.timeout)
        init_tensors, meta = st_io.load(weights)
        vocab = int(meta["vocab_size"])
        n_params = sum(t.numel() for t in init_tensors.values())
        del init_tensors
        flops = flops_per_token(meta, n_params, o.seq)
        peak_tflops = o.peak_tflops or (float("nan") if RENDER_ONLY else measure_peak_tflops(o))
        tokens = os.path.join(work, "tokens.bin")
        if not RENDER_ONLY:
            write_tokens(tokens, o.steps, o.global_batch, o.seq, vocab, o.seed + 1)

        memcpy_gbs = None
        if not o.no_roofline and o.device == "cpu":  # host memcpy bounds loopback TCP, not a GPU's traffic
            memcpy_file = os.path.join(work, "memcpy.json")
            if not RENDER_ONLY:
                r = subprocess.run([ours, "memcpy"], env=env, capture_output=True, text=True, check=True)
                with open(memcpy_file, "w") as f:
                    f.write(r.stdout.strip().splitlines()[-1] + "\n")
            memcpy_gbs = read_jsonl(memcpy_file)[0]["gb_per_s"]

        results = []
        for W in o.world_sizes:
            if o.global_batch % W:
                raise SystemExit(f"--global-batch {o.global_batch} is not divisible by world size {W}")
            lb = o.global_batch // W
            d = os.path.join(work, f"w{W}")
            os.makedirs(d, exist_ok=True)
            if not RENDER_ONLY:  # results of an earlier run in a kept --work-dir must not count as this run's
                for name in os.listdir(d):
                    if name.endswith(".jsonl") or name == "collectives.json":
                        os.remove(os.path.join(d, name))
            common = ["--weights", weights, "--tokens", tokens, "--steps", str(o.steps), "--local-batch", str(lb),
                      "--seq", str(o.seq), "--out-dir", d, "--lr", str(o.lr), "--weight-decay", str(o.weight_decay)]
            failed = {}  # side -> why its command failed; the row is then marked failed, the report goes on
            t_ours = t_theirs = None
            try:
                t_ours = run([fsdprun, "--nproc-per-node", str(W), "--timeout", str(o.timeout), ours, "train",
                              *common, "--reshard", o.reshard, "--replicate", str(o.replicate), "--mp", o.mp,
                              "--device", o.device],
                             env, os.path.join(d, "ours.log"), o.timeout + 30)
            except RunFailed as e:
                failed["ours"] = str(e)
            theirs_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(W),
                          os.path.join(HERE, "vs_pytorch.py"), *common, "--reshard", o.reshard,
                          "--replicate", str(o.replicate), "--mp", o.mp, "--device", o.device]
            if o.no_force_sum:
                theirs_cmd.append("--no-force-sum")
            def complete(prefix, W=W, d=d):
                paths = [os.path.join(d, f"{prefix}_rank{k}.jsonl") for k in range(W)]
                try:
                    return all(os.path.exists(p) and
                               sum(1 for r in read_jsonl(p) if r["event"] == "step") == o.steps for p in paths)
                except ValueError:  # a half-written line
                    return False

            try:
                t_theirs = run(theirs_cmd, env, os.path.join(d, "theirs.log"), o.timeout + 30,
                               outputs_complete=lambda: complete("theirs"))
            except RunFailed as e:
                failed["FSDP2"] = str(e)
            roof = None
            if not o.no_roofline:
                # Compute limit: the same per-rank work without FSDP, alone and as W concurrent copies (the copies
                # share the cores exactly as the W ranks do, also with whatever else runs on the machine).
                # On the GPU the plain baseline runs in the compared dtype; the CPU roofline stays fp32 as before.
                single = [ours, "single", *common, "--device", o.device] + (["--mp", o.mp] if o.device == "cuda" else [])
                try:
                    run(single, env, os.path.join(d, "single.log"), o.timeout)
                    alone = [r for r in read_jsonl(os.path.join(d, "single.jsonl")) if r["event"] == "step"]
                    if W == 1:  # one copy is the process alone: not run twice
                        copies = [alone]
                    else:
                        run([fsdprun, "--nproc-per-node", str(W), *single], env,
                            os.path.join(d, "single_concurrent.log"), o.timeout)
                        copies = [[r for r in read_jsonl(os.path.join(d, f"single_rank{k}.jsonl"))
                                   if r["event"] == "step"] for k in range(W)]
                    coll = None
                    if W > 1 and o.device == "cpu":  # Gloo collective bandwidth at the size of one block's slot
                        mib = 4 * n_params / W / (int(meta["n_layers"]) + 1) / 2**20
                        run([fsdprun, "--nproc-per-node", str(W), ours, "collectives", "--mib", f"{mib:.4f}",
                             "--out-dir", d], env, os.path.join(d, "collectives.log"), o.timeout)
                        coll = read_jsonl(os.path.join(d, "collectives.json"))[0]
                    roof = {"alone": alone, "copies": copies, "coll": coll}
                except RunFailed as e:
                    failed["plain"] = str(e)
            world1 = None
            if W == 1 and o.replicate == 1 and o.mp == "fp32" and o.reshard == "default" and o.device == "cpu" \
                    and not failed:
                # Issue 11's "world 1 within 2 % of no FSDP", measured with both sides in one process, their steps
                # interleaved, so the noise of this machine cancels (separate runs drift by more than 2 %).
                try:
                    if not RENDER_ONLY:
                        run([fsdprun, "--nproc-per-node", "1", ours, "world1", *common], env,
                            os.path.join(d, "world1.log"), o.timeout)
                    world1 = [r for r in read_jsonl(os.path.join(d, "world1.jsonl")) if r["event"] == "summary"][0]
                except RunFailed as e:
                    failed["world1"] = str(e)
            perf = perf_figures(W, d, o, flops, peak_tflops)
            if failed:
                results.append({"world": W, "local_batch": lb, "failed": failed, "perf": perf})
                continue
            ranks = []
            for r in range(W):
                ranks.append((read_jsonl(os.path.join(d, f"ours_rank{r}.jsonl")),
                              read_jsonl(os.path.join(d, f"theirs_rank{r}.jsonl"))))
            results.append(summarize(W, lb, ranks, roof, memcpy_gbs, o, t_ours, t_theirs, n_params))
            results[-1]["perf"] = perf
            if world1:
                results[-1]["world1_interleaved"] = world1

        report = render(results, o, details, memcpy_gbs)
        print(report)
        if o.markdown:
            with open(o.markdown, "w") as f:
                f.write(report)
        with open(os.path.join(work, "summary.json"), "w") as f:
            json.dump(results, f, indent=1)
        if o.check_rtol is not None:
            bad = [r for r in results if r.get("failed") or not (r["max_rel_diff"] <= o.check_rtol)]
            if bad:
                print(f"FAIL: loss curves differ by more than {o.check_rtol} at world sizes "
                      f"{[r['world'] for r in bad]}", file=sys.stderr)
                return 1
            print(f"PASS: loss curves match within rtol {o.check_rtol} at world sizes {o.world_sizes}")
        return 0
    except RunFailed as e:  # the set-up itself (weights, token file): nothing to compare, but say why
        msg = f"### libfsdp vs PyTorch FSDP2, flavor `{o.flavor}`: FAILED before any world size ran: {e}\n"
        print(msg)
        if o.markdown:
            with open(o.markdown, "w") as f:
                f.write(msg)
        return 1
    finally:
        if not o.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def flops_per_token(meta, n_params, seq):
    """TorchTitan's count (get_num_flop_per_token, as src/models/llama.cpp's flops_per_token): 6 x the parameters
    without the embedding table + 6 x layers x heads x head_dim x seq for attention."""
    dim, layers, heads = int(meta["dim"]), int(meta["n_layers"]), int(meta["n_heads"])
    return 6.0 * (n_params - int(meta["vocab_size"]) * dim) + 6.0 * layers * heads * (dim // heads) * seq


def measure_peak_tflops(o):
    """Dense matmul throughput of one rank's device in the compared dtype (bf16 on a GPU), the MFU denominator when
    --peak-tflops is not given; on the CPU with OMP_NUM_THREADS = --threads, as every rank runs."""
    dev = torch.device("cuda", 0) if o.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if o.mp == "bf16" and dev.type == "cuda" else torch.float32
    n = 4096 if dev.type == "cuda" else 512
    threads = torch.get_num_threads()
    torch.set_num_threads(o.threads)
    try:
        a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        for _ in range(3):
            a @ b
        sync()
        reps, t0 = 10, time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        return 2.0 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12
    finally:
        torch.set_num_threads(threads)


def perf_figures(W, d, o, flops, peak_tflops):
    """Per side (ours = fully_shard, FSDP2, plain = `single`, one process without FSDP): median step (slowest rank,
    warm-up left out), tokens/s over all ranks, MFU, peak device memory allocated / reserved (max over ranks), from
    whichever result files are complete; a side whose run failed is absent."""
    w = o.warmup if o.steps > o.warmup + 2 else 0
    out = {}
    for side, names in (("ours", [f"ours_rank{k}.jsonl" for k in range(W)]),
                        ("FSDP2", [f"theirs_rank{k}.jsonl" for k in range(W)]), ("plain", ["single.jsonl"])):
        try:
            per_rank = [[r for r in read_jsonl(os.path.join(d, n)) if r["event"] == "step"] for n in names]
        except (OSError, ValueError):
            continue
        if not per_rank or any(len(rs) != o.steps for rs in per_rank):
            continue
        slowest = [max(ts) for ts in zip(*[[r["step_time"] for r in rs] for rs in per_rank])]
        step = med(slowest[w:])
        # plain training runs one rank's share (local batch); the FSDP sides the global batch over W ranks
        tokens = (o.global_batch // W if side == "plain" else o.global_batch) * o.seq
        tps = tokens / step
        ranks_busy = 1 if side == "plain" else W
        out[side] = {"step_s": step, "tokens_per_s": tps,
                     "mfu": tps * flops / (ranks_busy * peak_tflops * 1e12) if peak_tflops == peak_tflops else None,
                     "peak_allocated_mib": max(r.get("device_peak_bytes", 0) for rs in per_rank for r in rs) / 2**20,
                     "peak_reserved_mib": max(r.get("device_reserved_peak_bytes", 0) for rs in per_rank
                                              for r in rs) / 2**20,
                     "peak_rss_mib": max(r.get("vmhwm_kib", 0) for rs in per_rank for r in rs) / 1024,
                     "first_loss": per_rank[0][0]["loss"], "last_loss": per_rank[0][-1]["loss"]}
    out["flops_per_token"], out["peak_tflops"] = flops, peak_tflops
    return out


def summarize(W, lb, ranks, roof, memcpy_gbs, o, t_ours, t_theirs, n_params):
    ours0 = [r for r in ranks[0][0] if r["event"] == "step"]
    theirs0 = [r for r in ranks[0][1] if r["event"] == "step"]
    setup_ours = ranks[0][0][0]
    assert len(ours0) == len(theirs0) == o.steps, (len(ours0), len(theirs0))
    losses = [(a["loss"], b["loss"]) for a, b in zip(ours0, theirs0)]
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in losses]
    absd = [abs(a - b) for a, b in losses]
    w = o.warmup if o.steps > o.warmup + 2 else 0

    def step_times(side):  # per step, the slowest rank (the step ends for everyone at the last collective)
        per_rank = [[r["step_time"] for r in ranks[k][side] if r["event"] == "step"] for k in range(W)]
        return [max(ts) for ts in zip(*per_rank)][w:]

    t_o, t_t = med(step_times(0)), med(step_times(1))

    def peak(side, key="vmhwm_kib"):
        return max(max(r[key] for r in ranks[k][side] if r["event"] == "step") for k in range(W))

    def growth(side):  # training-phase peak above the RSS right after set-up, max over ranks
        out = []
        for k in range(W):
            setup = ranks[k][side][0]["rss_setup_kib"]
            out.append(max(r["vmhwm_kib"] for r in ranks[k][side] if r["event"] == "step") - setup)
        return max(out)

    bytes_ours = med([r["bytes_sent"] for r in ours0[1:]])
    bytes_theirs = med([r["bytes_requested"] for r in theirs0[1:]])
    res = {
        "world": W, "local_batch": lb,
        "losses": losses, "max_rel_diff": max(rel), "max_abs_diff": max(absd), "rel_diff_step0": rel[0],
        "step_time_ours": t_o, "step_time_theirs": t_t, "time_ratio": t_o / t_t,
        "wall_ours": t_ours, "wall_theirs": t_theirs,
        "peak_rss_ours_mib": peak(0) / 1024, "peak_rss_theirs_mib": peak(1) / 1024,
        "rss_ratio": peak(0) / peak(1),
        "growth_ours_mib": growth(0) / 1024, "growth_theirs_mib": growth(1) / 1024,
        "bytes_ours": bytes_ours, "bytes_theirs_requested": bytes_theirs,
        "bytes_optimum": setup_ours["optimum_bytes_per_step"],
        "ag_calls_ours": ours0[-1]["all_gather_calls"], "rs_calls_ours": ours0[-1]["reduce_scatter_calls"],
        "ag_calls_theirs": theirs0[-1]["all_gather_calls"], "rs_calls_theirs": theirs0[-1]["reduce_scatter_calls"],
    }
    if o.device == "cuda":  # peak bytes allocated on the GPU during training, max over ranks (they share it)
        res["device_peak_ours_mib"] = peak(0, "device_peak_bytes") / 2**20
        res["device_peak_theirs_mib"] = peak(1, "device_peak_bytes") / 2**20
    # Our last step recorded each collective's timeline: the share of in-flight communication time during
    # which the training thread was not blocked waiting for it (mean over ranks).
    shares = []
    for k in range(W):
        ov = [r for r in ranks[k][0] if r["event"] == "overlap"]
        if ov and ov[-1]["in_flight_s"] > 0:
            shares.append(1.0 - ov[-1]["exposed_s"] / ov[-1]["in_flight_s"])
    res["comm_hidden_share"] = sum(shares) / len(shares) if shares else None
    if roof is not None:
        alone = [r["step_time"] for r in roof["alone"]][w:]
        cores = os.cpu_count() or 1
        oversub = max(1.0, W * o.threads / cores)  # W ranks on fewer cores: each gets cores/W of one
        # The compute limit is a lower bound: the fastest step of the same per-rank work on one process alone,
        # times the oversubscription. W concurrent copies are shown too: they measure the contention from other
        # processes on this shared machine at that moment (not a limit).
        compute = min(alone) * oversub
        copies = [max(ts) for ts in zip(*[[r["step_time"] for r in c] for c in roof["copies"]])][w:]
        ours_best, theirs_best = min(step_times(0)), min(step_times(1))
        comm_memcpy = bytes_ours / (memcpy_gbs * 1e9) if memcpy_gbs else 0.0
        comm_gloo = 0.0
        if roof["coll"]:
            # Split of our bytes: the reduce-scatters send (W-1)/W of every fp32 gradient, the rest is all-gathers.
            rs_bytes = (W - 1) * 4 * n_params / W
            ag_bytes = max(bytes_ours - rs_bytes, 0)
            comm_gloo = ag_bytes / (roof["coll"]["all_gather_gb_per_s"] * 1e9) + \
                rs_bytes / (roof["coll"]["reduce_scatter_gb_per_s"] * 1e9)
        limit = max(compute, comm_memcpy)
        if o.device == "cuda":
            res["device_peak_single_mib"] = max(r.get("device_peak_bytes", 0) for r in roof["alone"]) / 2**20
        res.update({"single_alone_median": med(alone), "single_alone_best": min(alone), "oversubscription": oversub,
                    "compute_limit": compute, "copies_median": med(copies), "comm_limit": comm_memcpy,
                    "comm_gloo": comm_gloo, "limit": limit, "ours_over_limit": t_o / limit,
                    "theirs_over_limit": t_t / limit, "ours_best": ours_best, "theirs_best": theirs_best,
                    "ours_best_over_limit": ours_best / limit, "theirs_best_over_limit": theirs_best / limit,
                    "ours_best_over_model": ours_best / (compute + comm_gloo),
                    "coll": roof["coll"], "single_loss_step0": roof["alone"][0]["loss"]})
    return res


def fmt_bytes(b):
    return f"{b / 2**20:.3f} MiB"


def render_perf(results, o):
    """Throughput and memory per side and world size, failed runs included (their side says FAILED and why)."""
    def cell(p, key, spec, scale=1.0):
        return "—" if p is None or p.get(key) is None else format(p[key] * scale, spec)

    L = ["| world | side | step (median) | tokens/s | MFU | peak allocated | peak reserved | loss first -> last |",
         "|---|---|---|---|---|---|---|---|"]
    for r in results:
        perf, failed = r.get("perf", {}), r.get("failed", {})
        for side in ("ours", "FSDP2", "plain"):
            p = perf.get(side)
            if p is None:
                why = failed.get(side) or ("not run (--no-roofline)" if side == "plain" and o.no_roofline
                                           else "no complete result")
                L.append(f"| {r['world']} | {side} | FAILED: {why} | — | — | — | — | — |")
                continue
            dev = o.device == "cuda"
            L.append(f"| {r['world']} | {side}{' (1 rank share)' if side == 'plain' and r['world'] > 1 else ''} | "
                     f"{p['step_s'] * 1e3:.1f} ms | {p['tokens_per_s']:,.0f} | {cell(p, 'mfu', '.1%')} | "
                     f"{cell(p, 'peak_allocated_mib', '.0f') + ' MiB' if dev else 'cpu (RSS %.0f MiB)' % p['peak_rss_mib']} | "
                     f"{cell(p, 'peak_reserved_mib', '.0f') + ' MiB' if dev else '—'} | "
                     f"{p['first_loss']:.4f} -> {p['last_loss']:.4f} |")
        for side, why in failed.items():
            if side not in ("ours", "FSDP2", "plain"):
                L.append(f"| {r['world']} | {side} | FAILED: {why} | — | — | — | — | — |")
    any_perf = next((r["perf"] for r in results if r.get("perf")), None)
    if any_perf:
        L += ["", f"MFU = tokens/s x {any_perf['flops_per_token'] / 1e6:.1f} MFLOP/token (TorchTitan's count) / "
              f"(ranks x {any_perf['peak_tflops']:.1f} TFLOP/s per rank, "
              f"{'given' if o.peak_tflops else 'a matmul measured on this device'}); tokens/s over all ranks "
              f"(plain: one rank's share alone). Peak memory: the CUDA caching allocator's max allocated / reserved, "
              f"max over ranks."]
    return L + [""]


def render(all_results, o, details, memcpy_gbs):
    # Rows whose runs all completed get the full tables; a failed row says which side failed and why.
    results = [r for r in all_results if not r.get("failed")]
    L = []
    L.append(f"### libfsdp vs PyTorch FSDP2 (torch {torch.__version__}), flavor `{o.flavor}`, "
             f"{'fp32' if o.mp == 'fp32' else 'bf16 compute / fp32 params and reduce'}, "
             f"{'Gloo on CPU' if o.device == 'cpu' else 'one GPU (cuda:0) shared by the ranks, Gloo on CUDA tensors'}")
    L.append("")
    L.append(f"- machine: {details}")
    L.append(f"- setup: {o.steps} steps, global batch {o.global_batch} (local = global / world), seq {o.seq}, "
             f"AdamW lr {o.lr} betas (0.9, 0.95) eps 1e-8 weight_decay {o.weight_decay}, cross-entropy mean, "
             f"{'1-D mesh' if o.replicate == 1 else f'HSDP mesh (replicate {o.replicate} x shard W/{o.replicate})'}, fully_shard per block (reshard_after_forward={o.reshard}) + root (default), "
             f"OMP_NUM_THREADS={o.threads} on every rank of both sides")
    L.append(f"- FSDP2 side: {'set_force_sum_reduction_for_comms(True) (SUM + post-divide) on every FSDP module' if not o.no_force_sum else 'AVG reductions (force-sum off)'}")
    if o.reshard not in ("default", "true", "false") and int(o.reshard) > 1:
        L.append(f"- reshard_after_forward={o.reshard} (hpZ): 'bytes/step ours' counts the shard group only; the "
                 f"backward all-gathers inside the {o.reshard}-rank groups are not included (the optimum includes them)")
    if memcpy_gbs:
        L.append(f"- memcpy bandwidth (1 thread): {memcpy_gbs:.2f} GB/s")
    L.append("")
    L += render_perf(all_results, o)
    if not results:
        return "\n".join(L + ["No world size completed on both sides: no loss or traffic comparison."]) + "\n"
    L.append("| world | loss max rel diff | (step 0) | step time ours / theirs (median) | ratio | peak RSS ours / theirs (max rank) | ratio | training-phase RSS growth ours / theirs | bytes/step ours | FSDP2 requested | analytic optimum | AG/RS calls ours, theirs | comm hidden (ours) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        L.append(f"| {r['world']} | {r['max_rel_diff']:.2e} | {r['rel_diff_step0']:.1e} | "
                 f"{r['step_time_ours'] * 1e3:.1f} / {r['step_time_theirs'] * 1e3:.1f} ms | {r['time_ratio']:.2f} | "
                 f"{r['peak_rss_ours_mib']:.0f} / {r['peak_rss_theirs_mib']:.0f} MiB | {r['rss_ratio']:.2f} | "
                 f"{r['growth_ours_mib']:.1f} / {r['growth_theirs_mib']:.1f} MiB | {fmt_bytes(r['bytes_ours'])} | "
                 f"{fmt_bytes(r['bytes_theirs_requested'])} | {fmt_bytes(r['bytes_optimum'])}"
                 f"{' (ours x%.4f)' % (r['bytes_ours'] / r['bytes_optimum']) if r['bytes_optimum'] else ''} | "
                 f"{r['ag_calls_ours']}/{r['rs_calls_ours']}, {r['ag_calls_theirs']}/{r['rs_calls_theirs']} | "
                 f"{'-' if r.get('comm_hidden_share') is None else '%.0f%%' % (100 * r['comm_hidden_share'])} |")
    L.append("")
    for r in results:
        if "device_peak_ours_mib" in r:
            single = r.get("device_peak_single_mib")
            L.append(f"World {r['world']}: GPU peak allocated (max rank) ours {r['device_peak_ours_mib']:.0f} MiB, "
                     f"FSDP2 {r['device_peak_theirs_mib']:.0f} MiB"
                     f"{'' if single is None else f', plain training (one process, no FSDP) {single:.0f} MiB'}.")
            L.append("")
    for r in results:
        w1 = r.get("world1_interleaved")
        if w1:
            L.append(f"World 1, fully_shard vs the same model without FSDP in one process, steps interleaved "
                     f"({w1['steps_timed']} timed): median step {w1['median_fsdp_s'] * 1e3:.1f} vs "
                     f"{w1['median_plain_s'] * 1e3:.1f} ms, ratio of medians **{w1['ratio_of_medians']:.4f}**, median "
                     f"of per-step ratios {w1['median_pair_ratio']:.4f}; best {w1['best_fsdp_s'] * 1e3:.1f} vs "
                     f"{w1['best_plain_s'] * 1e3:.1f} ms; losses "
                     f"{'bit-identical' if w1['losses_identical'] else 'DIFFERENT'} "
                     f"({w1['first_loss']:.4f} -> {w1['last_loss']:.4f}).")
            L.append("")
    L.append("Comm hidden: on our last step every collective's timeline is recorded (fsdp::record_timeline): "
             "1 - (time the training thread sat in wait()) / (time the transfers were in flight), summed over the "
             "step's collectives, mean over ranks.")
    if results and "limit" in results[0]:
        L.append("")
        L.append("Roofline (per step). Compute limit: the fastest step of the same per-rank work without FSDP on "
                 "one process alone, x W/cores when ranks outnumber cores. Comm limit: bytes/step at memcpy "
                 "bandwidth. Roofline = max of the two. Gloo comm: bytes/step at the bandwidth our all-gather / "
                 "reduce-scatter reach here (loopback TCP, one block's message size); on CPU nothing overlaps, so "
                 "compute + Gloo comm is the no-overlap model. 'W copies' = W concurrent single processes "
                 "(median of the slowest): the contention from other processes on this shared machine, not a limit.")
        L.append("")
        L.append("| world | one process alone median / best | compute limit | W copies (median) | comm limit (memcpy) | ours / roofline: median, best step | theirs / roofline: median, best step | Gloo AG / RS bandwidth | Gloo comm | ours best / (compute + Gloo comm) |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            c = r.get("coll")
            bw = f"{c['all_gather_gb_per_s']:.2f} / {c['reduce_scatter_gb_per_s']:.2f} GB/s" if c else "-"
            L.append(f"| {r['world']} | {r['single_alone_median'] * 1e3:.1f} / {r['single_alone_best'] * 1e3:.1f} ms | "
                     f"{r['compute_limit'] * 1e3:.1f} ms{' (x%.0f)' % r['oversubscription'] if r['oversubscription'] > 1 else ''} | "
                     f"{r['copies_median'] * 1e3:.1f} ms | {r['comm_limit'] * 1e3:.2f} ms | "
                     f"{r['ours_over_limit']:.2f}, {r['ours_best_over_limit']:.2f} | "
                     f"{r['theirs_over_limit']:.2f}, {r['theirs_best_over_limit']:.2f} | {bw} | "
                     f"{r['comm_gloo'] * 1e3:.1f} ms | {r['ours_best_over_model']:.2f} |")
    L.append("")
    L.append("Loss at each logged step (ours / theirs):")
    L.append("")
    head = "| step | " + " | ".join(f"world {r['world']} ours | theirs" for r in results) + " |"
    L.append(head)
    L.append("|---" * (1 + 2 * len(results)) + "|")
    steps = len(results[0]["losses"])
    log_every = max(1, steps // 10)
    for s in list(range(0, steps, log_every)) + ([steps - 1] if (steps - 1) % log_every else []):
        L.append(f"| {s} | " + " | ".join(f"{r['losses'][s][0]:.6f} | {r['losses'][s][1]:.6f}" for r in results) + " |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
