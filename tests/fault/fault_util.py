"""Shared pieces of the fault tests (tests/fault/*_test.py): start fsdprun jobs marked with a unique environment
variable, read their output as it comes, inject faults, print what was injected and what was observed, and prove at
the end that no process of the test is left (every process started by a test carries the marker in its
environment, so one scan of /proc finds them all, whoever their parent is now)."""
import argparse
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid

MARKER = "FSDP_FAULT_TEST_ID"


def arg_parser(ckpt_tool=False):
    """The arguments every fault test takes: the built binaries (CMake passes them) and a scratch folder."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--fsdprun", required=True)
    ap.add_argument("--train", required=True)
    if ckpt_tool:
        ap.add_argument("--ckpt-tool", required=True)
    ap.add_argument("--workdir", required=True)
    return ap


def parse_args(ap):
    """The test's arguments, with its scratch folder emptied."""
    a = ap.parse_args()
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    return a
def lighthouse_server_test_args(ap):
    """The start of a lighthouse server test: `ap` (holding the test's own arguments) gets --lighthouse and
    --workdir, the workdir is emptied, and PyTorch's TCPStore (the reference client) is imported; the test is
    skipped where it is not importable. Returns (args, TCPStore)."""
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--workdir", required=True)
    a = parse_args(ap)
    try:
        from torch.distributed import TCPStore
    except ImportError as e:
        skip(f"PyTorch's TCPStore is not importable in this Python ({e}): it is the reference client")
    return a, TCPStore


_test_id = uuid.uuid4().hex
_failures = []


def log(kind, text):
    print(f"[{kind}] {text}", flush=True)


def injected(text):
    log("injected", text)


def observed(text):
    log("observed", text)


def check(cond, what):
    if cond:
        log("ok", what)
    else:
        log("FAIL", what)
        _failures.append(what)
    return cond


def env(**extra):
    e = dict(os.environ)
    e[MARKER] = _test_id
    e.setdefault("OMP_NUM_THREADS", "1")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def marked_pids():
    """Processes carrying this test's marker (ourselves excluded)."""
    pids = []
    needle = f"{MARKER}={_test_id}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(d))
        except OSError:
            pass
    return pids


def proc_env(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {}


def rank_pids(rank, exe_name=None):
    """Marked processes whose RANK is `rank` (the ranks themselves and anything they started)."""
    out = []
    for pid in marked_pids():
        e = proc_env(pid)
        if e.get(b"RANK") != str(rank).encode():
            continue
        if exe_name:
            try:
                if os.path.basename(os.readlink(f"/proc/{pid}/exe")) != exe_name:
                    continue
            except OSError:
                continue
        out.append(pid)
    return out


def marked_pid(exe_name, **env_values):
    """The first marked process running `exe_name` whose environment holds every NAME=value given, or None."""
    want = {k.encode(): str(v).encode() for k, v in env_values.items()}
    for pid in marked_pids():
        e = proc_env(pid)
        if any(e.get(k) != v for k, v in want.items()):
            continue
        try:
            if os.path.basename(os.readlink(f"/proc/{pid}/exe")) == exe_name:
                return pid
        except OSError:
            pass
    return None


class Job:
    """One fsdprun process; its merged stdout/stderr is read line by line with timestamps."""

    def __init__(self, args, name, **extra_env):
        self.name = name
        self.lines = []  # (time, line)
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env(**extra_env),
                                     start_new_session=True)
        self._buf = b""
        self.start = time.monotonic()

    def _pump(self, timeout):
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            return False
        chunk = os.read(self.proc.stdout.fileno(), 65536)
        if not chunk:
            return None
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            self.lines.append((time.monotonic(), line.decode(errors="replace")))
        return True

    def wait_for(self, pattern, timeout):
        """Time of the first line (already read or arriving within timeout) matching pattern, else None."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for t, line in self.lines[seen:]:
                if rx.search(line):
                    return t
            seen = len(self.lines)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self._pump(min(left, 0.2)) is None and self.proc.poll() is not None:
                for t, line in self.lines[seen:]:
                    if rx.search(line):
                        return t
                return None

    def finish(self, timeout):
        """Reads until fsdprun exits; kills its whole session after `timeout` s. Returns the exit code."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None or self._pump(0) is True:
            if time.monotonic() > deadline:
                log("FAIL", f"{self.name}: fsdprun still running after {timeout} s; killing its session")
                _failures.append(f"{self.name} did not end in time")
                dump_stacks()
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                break
            self._pump(0.2)
        while self._pump(0) is True:
            pass
        self.end = time.monotonic()
        return self.proc.returncode

    def text(self):
        return "\n".join(line for _, line in self.lines)

    def grep(self, pattern):
        rx = re.compile(pattern)
        return [line for _, line in self.lines if rx.search(line)]


def wait_until(jobs, cond, timeout):
    """Reads every job's output (so that no pipe fills) until cond() is truthy, which it returns, or `timeout` s
    pass; then it returns cond() once more."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        for j in jobs:
            j._pump(0.01)
    return cond()


def start_lighthouse(binary, name="lighthouse"):
    """fsdp-lighthouse on a free port: (job, "host:port"); the address is None (and the job ended) when it printed
    none within 30 s."""
    light = Job([binary, "--port", "0"], name)
    light.wait_for(r"serving on", 30)
    served = re.search(r"serving on (\S+)", light.text())
    if served is None:
        light.proc.kill()
        light.finish(10)
    return light, served.group(1) if served else None


def end_jobs(jobs, light=None, timeout=15):
    """Lets every job end (killing its session after `timeout` s), then stops the lighthouse with SIGTERM."""
    for j in jobs:
        j.finish(timeout)
    if light is not None:
        light.proc.send_signal(signal.SIGTERM)
        light.finish(10)


def dump_stacks(max_lines=150):
    """Where the test's processes hang, printed before they are killed so that a CI log says it: every thread's
    backtrace from gdb (scripts/setup.sh installs it), else each thread's kernel wait channel. Processes the test
    stopped on purpose (state T) and the Python test itself are left out. Best effort, bounded in time."""
    gdb = shutil.which("gdb")
    for pid in marked_pids():
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "T" or exe.startswith("python"):
            continue
        lines = []
        if gdb:
            try:
                r = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 12"],
                                   capture_output=True, text=True, timeout=60)
                threads = []  # [header, frames...] per thread; the main thread (LWP == pid) first
                for l in r.stdout.splitlines():
                    if l.startswith("Thread "):
                        threads.append([l[:200]])
                    elif l.startswith("#") and threads:
                        threads[-1].append(l[:200])
                threads.sort(key=lambda t: f"(LWP {pid})" not in t[0])
                lines = [l for t in threads for l in t]
            except (OSError, subprocess.TimeoutExpired):
                pass
        if not lines:  # no gdb, or not allowed to attach: which kernel wait each thread sits in
            for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
                try:
                    with open(f"/proc/{pid}/task/{tid}/comm") as c, open(f"/proc/{pid}/task/{tid}/wchan") as w:
                        lines.append(f"thread {tid} ({c.read().strip()}): waiting in {w.read().strip() or '-'}")
                except OSError:
                    pass
        log("stacks", f"pid {pid} ({exe}, state {state}, rank {proc_env(pid).get(b'RANK', b'?').decode()}):")
        for l in lines[:max_lines]:
            print("    " + l, flush=True)


def no_process_left(grace=5.0):
    deadline = time.monotonic() + grace
    while marked_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = marked_pids()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)  # our own marked processes only
        except OSError:
            pass
    return check(not left, f"no process of this test left running (found {left})" if left else
                 "no process of this test left running")


def finish_test(name):
    no_process_left()
    if _failures:
        log("result", f"{name}: FAILED ({len(_failures)}): " + "; ".join(_failures))
        sys.exit(1)
    log("result", f"{name}: passed")
    sys.exit(0)


def skip(reason):
    log("skip", reason)
    sys.exit(77)


# ---- checkpoints ---------------------------------------------------------------------------------------------------
def complete_steps(ckpt_folder):
    """Steps with a committed checkpoint (step-N/metadata.json) in a checkpoint folder."""
    out = []
    for n in os.listdir(ckpt_folder):
        if n.startswith("step-") and n[5:].isdigit() and os.path.exists(os.path.join(ckpt_folder, n, "metadata.json")):
            out.append(int(n[5:]))
    return sorted(out)


def read_safetensors(path):
    """{name: (dtype, shape, raw bytes)} of a safetensors file, read with the standard library only."""
    import json
    import struct
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def read_final_weights(ckpt_tool, ckpt_folder, step, out):
    """The model tensors of checkpoint step-<step>, through `fsdp-ckpt convert --model-only`."""
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([ckpt_tool, "convert", "--model-only", os.path.join(ckpt_folder, f"step-{step}"), out],
                   check=True, stdout=subprocess.DEVNULL, env=env())
    tensors = {}
    for n in sorted(os.listdir(out)):
        if n.endswith(".safetensors"):
            tensors.update(read_safetensors(os.path.join(out, n)))
    return tensors


class Inotify:
    """Names created in (or, with moved_to, renamed into) one directory, via inotify (ctypes: not in Python's
    standard library). Lets a test act within a millisecond of a checkpoint save starting or committing."""

    def __init__(self, path, moved_to=False):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_CLOEXEC)
        mask = 0x100 | (0x80 if moved_to else 0)  # IN_CREATE | IN_MOVED_TO
        if self.fd < 0 or libc.inotify_add_watch(self.fd, path.encode(), mask) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {path}")

    def wait_created(self, name, timeout):
        import struct
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.fd], [], [], 0.2)
            if not r:
                continue
            buf = os.read(self.fd, 65536)
            i = 0
            while i < len(buf):
                _, _, _, ln = struct.unpack_from("iIII", buf, i)
                got = buf[i + 16:i + 16 + ln].rstrip(b"\0").decode()
                i += 16 + ln
                if got == name:
                    return True
        return False

    def close(self):
        os.close(self.fd)
