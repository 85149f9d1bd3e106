#!/usr/bin/env python3
"""Storage faults during checkpoint saves of fsdp-train (2 ranks, FSDP, fp32, 9 steps, a checkpoint every 3).
The checkpoint folder lives on a tmpfs that the test mounts in a private mount namespace of its own (so nothing
outlives the test); the rest of the job's output stays on the normal disk.
  * disk full: the tmpfs holds the step-3 checkpoint but not step 6 -> the job fails with an error naming the
    cause and the path; step-3 still verifies; after the disk is enlarged, the same job resumes from step 3 and
    ends bit-identical to an uninterrupted run (the training state of the checkpoint is intact);
  * read-only: the tmpfs is remounted read-only right after step 3 is committed -> the same checks;
  * vanished: the checkpoint folder is deleted right after step 3 is committed -> whatever happens must be clear:
    either an error naming the folder, or the folder is recreated and the step-6/9 checkpoints are complete; the
    final weights still equal the uninterrupted run's.
Skipped (exit 77, reason printed) where a mount namespace or a tmpfs mount is not allowed."""
import ctypes
import os
import shutil
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_util as fu  # noqa: E402
from fault_util import read_final_weights, complete_steps, Inotify  # noqa: E402

ap = fu.arg_parser(ckpt_tool=True)
a = fu.parse_args(ap)

# A private mount namespace for this process and its children: the tmpfs disappears with them.
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS = 0x00020000
if libc.unshare(CLONE_NEWNS) != 0:
    fu.skip(f"cannot create a mount namespace (unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}; needs "
            "CAP_SYS_ADMIN) - storage faults need a small filesystem of the test's own")
if subprocess.run(["mount", "--make-rprivate", "/"], capture_output=True).returncode != 0:
    fu.skip("cannot make the mounts private in the new namespace")
MNT = os.path.join(a.workdir, "fs")
os.makedirs(MNT)


def mount_tmpfs(size_bytes):
    subprocess.run(["umount", MNT], capture_output=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", MNT], capture_output=True, text=True)
    if r.returncode != 0:
        fu.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")


STEPS, INTERVAL = 9, 3
TRAIN_ARGS = ["--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
              "--training.global_batch_size", "4", "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "2",
              "--metrics.peak_tflops", "1", "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32",
              "--checkpoint.enable", "--checkpoint.interval", str(INTERVAL), "--checkpoint.keep_latest_k", "0",
              "--checkpoint.last_save_model_only", "false", "--comm.init_timeout_seconds", "60",
              "--comm.train_timeout_seconds", "20"]


def launch(name, ckpt_folder):
    return fu.Job([a.fsdprun, "--nproc-per-node", "2", "--timeout", "200", a.train] + TRAIN_ARGS +
                  ["--job.dump_folder", os.path.join(a.workdir, name), "--checkpoint.folder", ckpt_folder], name)


def verify(step_dir):
    r = subprocess.run([a.ckpt_tool, "verify", step_dir], capture_output=True, text=True, env=fu.env())
    return r.returncode == 0, (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(d) for f in fs)


# ---- reference ----------------------------------------------------------------------------------------------------
ref_ckpt = os.path.join(a.workdir, "reference-ckpt")
job = launch("reference", ref_ckpt)
rc = job.finish(200)
fu.check(rc == 0, f"the uninterrupted reference run succeeds (exit {rc})")
if rc != 0:
    print(job.text()[-3000:])
    fu.finish_test("storage_fault_test")
reference = read_final_weights(a.ckpt_tool, ref_ckpt, STEPS, os.path.join(a.workdir, "ref-converted"))
step3_bytes = dir_bytes(os.path.join(ref_ckpt, "step-3"))
fu.observed(f"reference: {len(reference)} tensors; a full checkpoint is {step3_bytes} bytes")


def resume_and_compare(name, ckpt):
    job = launch(name + "_resume", ckpt)
    rc = job.finish(200)
    loaded = job.grep(r"checkpoint: loaded")
    fu.observed(f"{name}: resumed run exit {rc}; {loaded[0] if loaded else 'no checkpoint loaded'}")
    fu.check(rc == 0 and any("step-3" in l for l in loaded), f"{name}: the job resumes from step-3 and finishes")
    if rc == 0:
        got = read_final_weights(a.ckpt_tool, ckpt, STEPS, os.path.join(a.workdir, name + "-converted"))
        same = got.keys() == reference.keys() and all(got[k] == reference[k] for k in reference)
        fu.check(same, f"{name}: final weights bit-identical to the uninterrupted run")


def after_step3(ckpt, job, action, what):
    """Runs `action` the moment step-3 is committed (its rename into place, seen through inotify)."""
    os.makedirs(ckpt, exist_ok=True)
    watch = Inotify(ckpt, moved_to=True)
    ok = watch.wait_created("step-3", 120)
    t0 = time.monotonic()
    action()
    watch.close()
    fu.injected(f"{what} {1000 * (time.monotonic() - t0):.0f} ms after step-3 was committed"
                + ("" if ok else " (commit not seen!)"))
    fu.check(ok, "step-3 was committed before the fault")


def expect_clear_failure(name, job, patterns, ckpt):
    rc = job.finish(200)
    errors = [l for l in job.grep(r"rror|failed") if any(p in l for p in patterns)]
    fu.observed(f"{name}: exit {rc}; error: {errors[0][:400] if errors else 'none matching ' + str(patterns)}")
    fu.check(rc != 0, f"{name}: the job fails")
    fu.check(bool(errors) and ckpt in errors[0], f"{name}: the error names the cause ({patterns}) and the path")
    ok, last = verify(os.path.join(ckpt, "step-3"))
    fu.observed(f"{name}: complete checkpoints after the failure {complete_steps(ckpt)}; fsdp-ckpt verify step-3: "
                f"{'ok' if ok else 'FAILED'} ({last[0][:200]})")
    fu.check(ok, f"{name}: the previous checkpoint (step-3) still verifies")
    fu.check(complete_steps(ckpt) == [3], f"{name}: no incomplete save taken for complete")


# ---- disk full ----------------------------------------------------------------------------------------------------
ckpt = os.path.join(MNT, "disk_full")
mount_tmpfs(step3_bytes + step3_bytes // 2)
fu.injected(f"disk_full: checkpoint folder on a tmpfs of {step3_bytes + step3_bytes // 2} bytes "
            f"(one checkpoint is {step3_bytes})")
job = launch("disk_full", ckpt)
expect_clear_failure("disk_full", job, ["No space left on device"], ckpt)
subprocess.run(["mount", "-o", "remount,size=256m", MNT], check=True)
fu.injected("disk_full: tmpfs enlarged to 256 MiB, same job started again")
resume_and_compare("disk_full", ckpt)

# ---- read-only ----------------------------------------------------------------------------------------------------
mount_tmpfs(256 << 20)
ckpt = os.path.join(MNT, "read_only")
job = launch("read_only", ckpt)


def make_read_only():
    # A read-only bind mount over the folder: a remount of the tmpfs itself would be refused while a rank holds a
    # file open for writing (EBUSY); the fresh bind mount has no writers, and every new open goes through it.
    subprocess.run(["mount", "--bind", ckpt, ckpt], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", ckpt], check=True)


after_step3(ckpt, job, make_read_only, "read_only: checkpoint folder made read-only (read-only bind mount)")
expect_clear_failure("read_only", job, ["Read-only file system"], ckpt)
subprocess.run(["umount", "-l", ckpt], check=True)
fu.injected("read_only: read-only bind mount removed, same job started again")
resume_and_compare("read_only", ckpt)

# ---- vanished -----------------------------------------------------------------------------------------------------
ckpt = os.path.join(MNT, "vanished")
job = launch("vanished", ckpt)
after_step3(ckpt, job, lambda: shutil.rmtree(ckpt), "vanished: checkpoint folder deleted")
rc = job.finish(200)
errors = job.grep(r"rror|failed")
steps = complete_steps(ckpt) if os.path.isdir(ckpt) else []
fu.observed(f"vanished: exit {rc}; complete checkpoints now {steps}; "
            f"{errors[0][:300] if errors else 'no error printed'}")
if rc == 0:
    fu.check(steps == [6, 9] and all(verify(os.path.join(ckpt, f"step-{s}"))[0] for s in steps),
             "vanished: the folder was recreated and the later checkpoints are complete and verify")
    got = read_final_weights(a.ckpt_tool, ckpt, STEPS, os.path.join(a.workdir, "vanished-converted"))
    fu.check(got == reference, "vanished: final weights bit-identical to the uninterrupted run")
else:
    fu.check(any(ckpt in e for e in errors), "vanished: the error names the folder")
    print("\n".join(l for l in job.text().splitlines() if "frame #" not in l)[-3000:])
subprocess.run(["umount", MNT], capture_output=True)
fu.finish_test("storage_fault_test")
