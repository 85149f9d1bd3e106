"""Side-by-side: libfsdp's pipeline (fsdp-bench-pp under fsdprun) vs torch.distributed.pipelining + FSDP2 (pp_torch.py
under torch.distributed.run), Gloo on CPU. Builds nothing (build targets fsdp-bench-pp and fsdprun first).

For each layout (pp x dp) and schedule both sides train the same closed-form model on the same closed-form
batches (model_init.py) with the same microbatches and SGD; the runs alternate (torch, ours, then ours, torch on
the next repeat) so both see the same machine state. Prints a markdown table: max relative loss difference over
all steps, median step time of each side and their ratio, and our measured idle per rank in the last step next
to the simulator's idle for that pp rank (fsdp::pipeline::simulate with our measured mean action costs).
Exit status 1 when a loss curve differs by more than --rtol (or the torch side fails its own single-process
reference check).

    .venv/bin/python bench/pipeline/run.py --build-dir build [--layouts 2x1 4x1 2x2] [--schedules 1F1B GPipe]
    .venv/bin/python bench/pipeline/run.py --sides torch      # the torch side alone, against its reference
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULES = ["GPipe", "1F1B", "LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def machine_details():
    """The machine line of bench/vs_pytorch/run.py (CPU model, cores, RAM, kernel, torch, Python, load)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vs_pytorch", "run.py")
    spec = importlib.util.spec_from_file_location("vs_pytorch_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its main() runs only as a script
    return module.machine_details()


class SideFailed(Exception):
    """One side's run failed; the report marks its row instead of losing every other row (a torch-side abort, e.g.
    Gloo's "pair is not connected" in ZBVZeroBubble on torch 2.11, once lost the whole bubble table)."""


def first_error_lines(text, n=2):
    """The first lines that say what went wrong (torch.distributed.run's own boilerplate left out), for a table
    cell: no '|'."""
    noise = ("errors.html", "error_file", "To enable traceback")
    lines = [ln for ln in text.splitlines()
             if any(k in ln for k in ("Error", "error", "FAIL", "failed", "unknown")) and not any(k in ln for k in noise)]
    return " / ".join(ln.strip()[:200].replace("|", "/") for ln in (lines or text.splitlines()[-n:])[:n])


def run_side(cmd, env, log, timeout):
    """Runs one side; returns its PPBENCH record (rank 0's line). Raises SideFailed."""
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            f.write(out)
            raise SideFailed(f"timed out after {timeout} s (log: {log})") from None
        f.write(r.stdout)
    # fsdprun prefixes every line with "[rank N] "; torch.distributed.run does not.
    recs = [json.loads(line.split("PPBENCH ", 1)[1]) for line in r.stdout.splitlines()
            if line.startswith("PPBENCH ") or line.startswith("[rank 0] PPBENCH ")]
    if r.returncode != 0 or not recs:
        sys.stderr.write(r.stdout[-3000:])
        raise SideFailed(f"exit {r.returncode}, {len(recs)} result lines: {first_error_lines(r.stdout)} (log: {log})")
    return recs[0]


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(HERE, "..", "..", "build"))
    p.add_argument("--bench", help="fsdp-bench-pp binary (default: <build-dir>/bench/fsdp-bench-pp)")
    p.add_argument("--fsdprun", help="fsdprun binary (default: <build-dir>/apps/fsdprun/fsdprun)")
    p.add_argument("--sides", default="torch,ours", help="torch,ours (default) or torch (no build needed)")
    p.add_argument("--layouts", nargs="+", default=["2x1", "4x1", "2x2"], help="PPxDP, world = PP x DP")
    p.add_argument("--schedules", nargs="+", default=SCHEDULES)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--repeats", type=int, default=1, help="runs per side, alternating which side goes first")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank, both sides")
    p.add_argument("--rtol", type=float, default=1e-5, help="max relative loss difference, ours vs torch")
    p.add_argument("--no-check-reference", action="store_true",
                   help="skip the torch side's own check against single-process training")
    p.add_argument("--work-dir", default=None, help="logs and results (default: a fresh dir under /tmp)")
    p.add_argument("--markdown", help="also write the report to this file")
    p.add_argument("--timeout", type=int, default=600, help="per command, seconds")
    o = p.parse_args()

    sides = [s.strip() for s in o.sides.split(",") if s.strip()]
    if not set(sides) <= {"torch", "ours"} or "torch" not in sides:
        raise SystemExit(f"run.py: --sides must be torch,ours or torch, got {o.sides!r}")
    with_ours = "ours" in sides
    bench = o.bench or os.path.join(o.build_dir, "bench", "fsdp-bench-pp")
    fsdprun = o.fsdprun or os.path.join(o.build_dir, "apps", "fsdprun", "fsdprun")
    if with_ours:
        for b in (bench, fsdprun):
            if not os.access(b, os.X_OK):
                raise SystemExit(f"run.py: missing binary {b}: build targets fsdp-bench-pp and fsdprun first "
                                 f"(or --sides torch)")
    work = o.work_dir or os.path.join("/tmp", f"ppbench_{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(o.threads))
    details = machine_details()

    rows, failures = [], []
    for layout in o.layouts:
        pp, dp = (int(v) for v in layout.lower().replace("pp", "").replace("dp", "").split("x"))
        W = pp * dp
        for sched in o.schedules:
            common = ["--pp", str(pp), "--dp", str(dp), "--schedule", sched, "--microbatches", str(o.microbatches),
                      "--dim", str(o.dim), "--layers", str(o.layers), "--global-batch", str(o.global_batch),
                      "--steps", str(o.steps), "--warmup", str(o.warmup), "--lr", str(o.lr),
                      "--momentum", str(o.momentum)]
            torch_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(W),
                         os.path.join(HERE, "pp_torch.py"), *common]
            if not o.no_check_reference:
                torch_cmd.append("--check-reference")
            ours_cmd = [fsdprun, "--nproc-per-node", str(W), "--timeout", str(o.timeout), bench, *common]
            recs = {"torch": [], "ours": []}
            failed = {}  # side -> why its run failed (that side's later repeats are skipped)
            for rep in range(o.repeats):
                order = ["torch", "ours"] if rep % 2 == 0 else ["ours", "torch"]
                for side in order:
                    if side not in sides or side in failed:
                        continue
                    cmd = torch_cmd if side == "torch" else ours_cmd
                    log = os.path.join(work, f"{side}_pp{pp}xdp{dp}_{sched}_{rep}.log")
                    try:
                        recs[side].append(run_side(cmd, env, log, o.timeout + 30))
                    except SideFailed as e:
                        failed[side] = str(e)
                        failures.append(f"pp{pp}xdp{dp} {sched}: the {side} side failed: {e}")
            row = summarize(pp, dp, sched, recs, failed, o)
            rows.append(row)
            # Written after every row, so that a caller that stops this run (scripts/gpu-check.sh all, a stage over
            # its time budget) still has every finished row.
            with open(os.path.join(work, "summary.json.tmp"), "w") as f:
                json.dump(rows, f, indent=1)
            os.replace(os.path.join(work, "summary.json.tmp"), os.path.join(work, "summary.json"))
            if row["torch_ref_ok"] is False:
                failures.append(f"pp{pp}xdp{dp} {sched}: torch side vs single process {row['torch_ref_diff']:.2e}")
            if row.get("max_rel_diff") is not None and not (row["max_rel_diff"] <= o.rtol):
                failures.append(f"pp{pp}xdp{dp} {sched}: ours vs torch {row['max_rel_diff']:.2e}")
            print(f"[{time.strftime('%H:%M:%S')}] pp{pp}xdp{dp} {sched}: " + row_line(row, with_ours),
                  file=sys.stderr, flush=True)

    report = render(rows, o, details, with_ours)
    print(report)
    if o.markdown:
        with open(o.markdown, "w") as f:
            f.write(report)
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if failures:
        print("FAIL: " + "; ".join(failures), file=sys.stderr)
        return 1
    print(f"PASS: {len(rows)} runs; " + (f"loss curves ours vs torch within rtol {o.rtol}" if with_ours else
                                          "torch side equals single-process training") + f" (logs: {work})")
    return 0


def fmt(v, spec, missing="—"):
    return missing if v is None else format(v, spec)


def row_line(row, with_ours):
    parts = []
    for side in ("torch", "ours"):
        if row["failed"].get(side):
            parts.append(f"{side} side FAILED: {row['failed'][side]}")
    if with_ours and row.get("max_rel_diff") is not None:
        parts.append(f"loss diff {row['max_rel_diff']:.2e}, step {row['ours_ms']:.1f} / {row['torch_ms']:.1f} ms")
    elif with_ours and row.get("ours_ms") is not None:
        parts.append(f"ours alone: step {row['ours_ms']:.1f} ms")
    elif row.get("torch_ms") is not None:
        parts.append(f"torch vs single process {row['torch_ref_diff']:.2e}, step {row['torch_ms']:.1f} ms")
    return "; ".join(parts)


def summarize(pp, dp, sched, recs, failed, o):
    """One report row; a side that failed leaves its columns empty and says why (row["failed"])."""
    t = recs["torch"]
    row = {"pp": pp, "dp": dp, "schedule": sched, "failed": dict(failed), "torch_losses": None, "torch_ms": None,
           "torch_ref_diff": None, "torch_ref_ok": None, "max_rel_diff": None, "ours_ms": None, "ratio": None}
    if t:
        row.update({"torch_losses": t[0]["losses"],
                    "torch_ms": 1e3 * med([s for r in t for s in r["step_times"][r["warmup"]:]]),
                    "torch_ref_diff": max((r.get("ref_max_rel_loss_diff", 0.0) for r in t), default=0.0)})
    if t and "ref_max_rel_loss_diff" in t[0]:
        row["torch_ref_ok"] = all(r["ref_max_rel_loss_diff"] <= 1e-5 and r["ref_max_rel_param_diff"] <= 1e-5
                                  and r["ref_moved"] for r in t)
        row["torch_ref_param_diff"] = max(r["ref_max_rel_param_diff"] for r in t)
    if not recs["ours"]:
        return row
    ours = recs["ours"]
    rel = None
    for a in ours:  # every repeat of ours against every repeat of torch (all are deterministic)
        for b in t:
            assert len(a["losses"]) == len(b["losses"]) == o.steps
            rel = max(rel or 0.0, max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a["losses"], b["losses"])))
    last = ours[-1]
    row.update({
        "ours_losses": ours[0]["losses"], "max_rel_diff": rel,
        "ours_ms": 1e3 * med([s for r in ours for s in r["step_times"][r["warmup"]:]]),
        "measured_idle_ms": [1e3 * v for v in last["measured_idle_s"]],
        "measured_span_ms": [1e3 * v for v in last["measured_span_s"]],
        "pp_rank_of_rank": [int(v) for v in last["pp_rank_of_rank"]],
        "sim_idle_ms": [1e3 * v for v in last["sim_idle_s"]], "sim_makespan_ms": 1e3 * last["sim_makespan_s"],
        "sim_bubble_fraction": last["sim_bubble_fraction"], "costs_ms": {k: 1e3 * v for k, v in last["costs_s"].items()},
    })
    row["ratio"] = row["ours_ms"] / row["torch_ms"] if row["torch_ms"] else None
    spans = row["measured_span_ms"]
    row["measured_bubble_fraction"] = sum(row["measured_idle_ms"]) / (len(spans) * max(spans)) if spans else 0.0
    return row


def render(rows, o, details, with_ours):
    L = [f"### Pipeline: libfsdp vs torch.distributed.pipelining + FSDP2, Gloo on CPU", "",
         f"- machine: {details}",
         f"- setup: chain of {o.layers} Linear({o.dim}, {o.dim}) + tanh, closed-form weights and batches "
         f"(bench/pipeline/model_init.py), global batch {o.global_batch} (local = global / dp), {o.microbatches} "
         f"microbatches, layers split evenly over pp x v stages (v = 2 for the multi-stage schedules), fully_shard "
         f"per layer + stage part over dp (reshard_after_forward=False) when dp > 1, SGD lr {o.lr} momentum "
         f"{o.momentum}, {o.steps} steps (median step time over steps {o.warmup}.., {o.repeats} run(s) per side, "
         f"alternating), OMP_NUM_THREADS={o.threads} on every rank of both sides", ""]
    if with_ours:
        L += ["| layout | schedule | loss max rel diff | step ours / torch (median) | ratio | torch vs 1 process | "
              "ours: idle per rank, measured / simulated (last step) | bubble measured / simulated | ours: mean F/B/I/W |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            head = f"| pp{r['pp']} x dp{r['dp']} | {r['schedule']} | "
            if r["ours_ms"] is None:  # ours failed: say why, keep the torch figure if any
                L.append(head + f"ours FAILED: {r['failed'].get('ours', '?')} | — / {fmt(r['torch_ms'], '.1f')} ms | "
                         f"— | {fmt(r['torch_ref_diff'], '.1e')} | — | — | — |")
                continue
            idle = ", ".join(f"r{k}: {m:.1f}/{r['sim_idle_ms'][r['pp_rank_of_rank'][k]]:.1f}"
                             for k, m in enumerate(r["measured_idle_ms"]))
            diff = (f"torch FAILED: {r['failed']['torch']}" if "torch" in r["failed"]
                    else fmt(r["max_rel_diff"], ".2e"))
            L.append(head + f"{diff} | {r['ours_ms']:.1f} / {fmt(r['torch_ms'], '.1f')} ms | {fmt(r['ratio'], '.2f')} | "
                     f"{fmt(r['torch_ref_diff'], '.1e')} | {idle} ms | "
                     f"{r['measured_bubble_fraction']:.3f} / {r['sim_bubble_fraction']:.3f} | "
                     f"{'/'.join('%.2f' % r['costs_ms'][k] for k in 'FBIW')} ms |")
        L += ["", "Idle = the rank's last-step span (first action start to last action end, from "
              "Pipeline::last_step_timeline) minus its compute in F/B/I/W. The runtime's F/B/I spans include the "
              "waits for a received activation or gradient and for the all-gather; fsdp-bench-pp excludes them by "
              "noting when the stage's forward is really called and when the backward reaches the stage output (a "
              "tensor hook), so those waits count as idle. Simulated = fsdp::pipeline::simulate on the "
              "same schedule with our mean measured F/B/I/W/UNSHARD/RESHARD/REDUCE_GRAD durations (all ranks, timed "
              "steps) and zero P2P latency, for the rank's pp rank. Bubble = sum of idle / (ranks x longest span) "
              "(simulated: / (pp x makespan)). 'torch vs 1 process' = max relative loss difference of the torch side "
              "against the unsplit model trained on the global batch in one process."]
    else:
        L += ["| layout | schedule | torch vs 1 process: loss max rel diff | param max rel diff | step torch (median) |",
              "|---|---|---|---|---|"]
        for r in rows:
            if "torch" in r["failed"]:
                L.append(f"| pp{r['pp']} x dp{r['dp']} | {r['schedule']} | torch FAILED: {r['failed']['torch']} | — | — |")
                continue
            L.append(f"| pp{r['pp']} x dp{r['dp']} | {r['schedule']} | {r['torch_ref_diff']:.2e} | "
                     f"{r.get('torch_ref_param_diff', float('nan')):.2e} | {r['torch_ms']:.1f} ms |")
    complete = [r for r in rows if r["torch_losses"] and (not with_ours or r.get("ours_losses"))]
    if complete:
        r0 = complete[0]
        L += ["", f"Losses, first complete layout and schedule (pp{r0['pp']} x dp{r0['dp']} {r0['schedule']}): torch "
              f"{r0['torch_losses'][0]:.6f} -> {r0['torch_losses'][-1]:.6f}" +
              (f", ours {r0['ours_losses'][0]:.6f} -> {r0['ours_losses'][-1]:.6f}" if with_ours else "")]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
