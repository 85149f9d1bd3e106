#!/usr/bin/env python3
"""fsdp-lighthouse's memory per connection is bounded, and a client that breaks a limit is refused without
stalling the others (docs/reliability.md, "The lighthouse as a server"; the relay: apps/fsdp-lighthouse/relay.h).

  0. Every operation of PyTorch's TCPStore client (set, get, add, compare_set, append, check, multi_set/get,
     num_keys, delete_key, list_keys, a wait that times out and is cancelled, queues, barrier, a 1 MB value) returns
     through the lighthouse what it returns against a TCPStore server of PyTorch's own, started by the test.
The reference client is PyTorch's own TCPStore client, timing set/get round trips on a thread of its own through
each scenario; the lighthouse's memory is its VmRSS read from /proc/PID/status before and after.
  1. One client validates and streams a MULTI_SET of 8192 keys of 4 KiB values (33 MB). c10d's server alone kept
     every unfinished byte and parsed them again at every read (89 s for 32 MB, other clients' round trips 3.3 s)
     and set the keys it had parsed so far. Checked: the connection is closed with one log line naming the client's
     port and the rule, its first key never reached the store, every round trip stayed under 200 ms, RSS grew
     less than 32 MB. A MULTI_SET within the limits (3 MB) is stored (the limits refuse what they should only).
  2. One client sends GETs of a 1 MB value for 3 s and never reads (c10d would queue every reply: 1 MB each).
     Checked: what the lighthouse accepted from it stops growing (it stops reading), RSS grew less than 48 MB,
     round trips stayed under 200 ms; then the client reads and its first reply is the value, whole.
  3. N malformed connections (garbage, a wrong magic number, an unknown command, an oversized key or count), each
     opened and dropped. Checked: one log line each, RSS grew less than 2 MB (c10d leaked 4 KiB for each malformed
     connection it dropped), round trips stayed under 200 ms, and the store still answers.
  4. A lighthouse with --max-connections 3: a 4th connection is closed with one line, the 3 are served, and a new
     client is once they closed; --max-keys 0 is refused with one line naming the flag.
Pass --lighthouse the previous binary to measure what it did (with --max-gets 200: c10d queues every reply in
memory)."""
import argparse
import atexit
import os
import re
import socket
import struct
import sys
import threading
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_util as fu  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--malformed", type=int, default=1000)
ap.add_argument("--gets-seconds", type=float, default=3.0)
ap.add_argument("--max-gets", type=int, default=0, help="send at most this many GETs (0: no limit)")
ap.add_argument("--multi-set-seconds", type=float, default=30.0, help="give up streaming the big request after")
a, TCPStore = fu.lighthouse_server_test_args(ap)

ROUND_TRIP_BOUND_S = 0.2
MB = 1 << 20
VALIDATE = b"\0" + struct.pack("<I", 0x3C85F7CE)


def w_str(b):
    return struct.pack("<Q", len(b)) + b


def rss_bytes(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


light = fu.Job([a.lighthouse, "--port", "0"], "lighthouse")
atexit.register(lambda: light.proc.poll() is None and light.proc.kill())  # also when a step raises
light.wait_for(r"serving on", 30)
served = re.search(r"serving on (\S+):(\d+)$", light.text(), re.M)
if not fu.check(served is not None, f"fsdp-lighthouse started: {light.text()[:300]}"):
    fu.finish_test("lighthouse_limits_test")
host, port = served.group(1), int(served.group(2))

drained = threading.Event()


def drain():  # the lighthouse's output is read all along (a full pipe would block it)
    while not drained.is_set():
        light._pump(0.05)


threading.Thread(target=drain, daemon=True).start()


class RoundTrips:
    """PyTorch's TCPStore client doing set+get round trips on its own thread while a scenario runs."""

    def __init__(self):
        self.client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        self.trips, self.n = [], 0

    def __enter__(self):
        self.trips, self.stop, self.pending = [], threading.Event(), None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.is_set():
            t = time.monotonic()
            self.pending = t
            try:
                self.client.set(f"rt/{self.n}", str(self.n))
                ok = self.client.get(f"rt/{self.n}") == str(self.n).encode()
            except Exception as e:
                fu.log("info", f"round trip {self.n} failed: {e}")
                self.trips.append(float("inf"))
                return
            self.pending = None
            self.trips.append(time.monotonic() - t if ok else float("inf"))
            self.n += 1
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(35)
        stalled = time.monotonic() - self.pending if self.pending is not None else 0.0
        self.worst = max(self.trips + [stalled]) if self.trips else float("inf")

    def check(self, scenario):
        fu.check(len(self.trips) >= 10 and self.worst < ROUND_TRIP_BOUND_S,
                 f"{scenario}: {len(self.trips)} set/get round trips of another client, each under "
                 f"{ROUND_TRIP_BOUND_S * 1000:.0f} ms (slowest {self.worst * 1000:.0f} ms)")


def closed_lines(local_port, pattern=""):
    return light.grep(rf"closed the connection from 127\.0\.0\.1:{local_port}: {pattern}")




def every_command(s):
    """Each operation of PyTorch's TCPStore client (every command of the wire protocol but PING and VALIDATE, which
    its connect sends) and what it returned or raised."""
    out = []

    def rec(name, f):
        try:
            out.append((name, f()))
        except Exception as e:  # a timeout, an empty queue: the same error is expected from both stores
            out.append((name, f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"))

    rec("set", lambda: s.set("a", "1"))
    rec("get", lambda: s.get("a"))
    rec("add", lambda: (s.add("n", 5), s.add("n", -2)))
    rec("compare_set", lambda: (s.compare_set("a", "1", "2"), s.compare_set("a", "1", "3")))
    rec("append", lambda: (s.append("a", "xyz"), s.get("a")))
    rec("check", lambda: (s.check(["a", "n"]), s.check(["a", "absent"])))
    rec("multi_set/get", lambda: (s.multi_set(["m1", "m2"], ["v1", "v2"]), s.multi_get(["m1", "m2", "a"])))
    rec("num_keys", lambda: s.num_keys())
    rec("delete_key", lambda: (s.delete_key("m1"), s.delete_key("m1")))
    rec("list_keys", lambda: sorted(s.list_keys()))
    rec("wait (times out: CANCEL_WAIT)", lambda: s.wait(["never"], timedelta(seconds=0.5)))
    rec("after the cancelled wait", lambda: (s.set("w", "ok"), s.get("w"), s.wait(["w"], timedelta(seconds=5))))
    rec("queue", lambda: (s.queue_push("q", "e1"), s.queue_push("q", "e2"), s.queue_len("q"), s.queue_pop("q"),
                          s.queue_pop("q", block=False)))
    rec("queue empty", lambda: s.queue_pop("q", block=False))
    rec("barrier", lambda: s.barrier("b", 1, timedelta(seconds=5)))
    rec("large value", lambda: (s.set("big", b"x" * 1000000), len(s.get("big"))))
    return out


# ---- 0. every command, through the relay and against PyTorch's own store -------------------------------------
reference = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
want = every_command(TCPStore("127.0.0.1", reference.port, is_master=False, timeout=timedelta(seconds=10)))
got = every_command(TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10)))
differ = [(w, g) for w, g in zip(want, got) if w != g]
fu.check(not differ and len(got) == len(want) == 16,
         f"every operation of PyTorch's TCPStore client gives through the lighthouse what it gives against a "
         f"TCPStore of PyTorch's own ({len(want)} compared; differences: {differ})")
fu.check(want[10][1].startswith("DistStoreError") and want[11][1][1] == b"ok",
         f"(the reference did time out a wait and serve the client afterwards: {want[10:12]})")
del reference

pid = light.proc.pid
rt = RoundTrips()

# ---- 1. a 33 MB MULTI_SET ----------------------------------------------------------------------------------------
keys, value = 8192, os.urandom(4096)
request = VALIDATE + b"\x0b" + struct.pack("<Q", keys)
pairs = [w_str(b"/big/%05d" % i) + w_str(value) for i in range(keys)]
total = len(request) + sum(len(p) for p in pairs)
rss0 = rss_bytes(pid)
with rt:
    big = socket.create_connection((host, port), timeout=10)
    big_port = big.getsockname()[1]
    big.settimeout(2)
    sent, refused, t0 = 0, None, time.monotonic()
    try:
        big.sendall(request)
        sent = len(request)
        for p in pairs:
            if time.monotonic() - t0 > a.multi_set_seconds:
                break
            big.sendall(p)
            sent += len(p)
    except OSError as e:  # closed by the lighthouse: EPIPE, ECONNRESET, or a send that no longer moves
        refused = e
    took = time.monotonic() - t0
    if refused is None:  # everything went out: the connection must still be closed from the other side
        try:
            refused = "EOF" if big.recv(1) == b"" else None
        except OSError as e:
            refused = e
    big.close()
    time.sleep(0.3)
rss1 = rss_bytes(pid)
fu.observed(f"a {total / MB:.1f} MB MULTI_SET: {sent / MB:.1f} MB sent in {took:.1f} s, then {refused!r}; "
            f"lighthouse RSS {rss0 / MB:.1f} -> {rss1 / MB:.1f} MB; round trips meanwhile: {len(rt.trips)}, slowest "
            f"{rt.worst * 1000:.0f} ms")
line = closed_lines(big_port, "MULTI_SET request over --max-request-bytes")
fu.check(refused is not None and len(line) == 1 and sent < total,
         f"the {total / MB:.0f} MB MULTI_SET was refused and its connection closed, with one log line naming the "
         f"client and the rule: {line}")
fu.check(not rt.client.check(["big/00000"]),
         "none of its keys reached the store (c10d sets a MULTI_SET's keys as it parses them)")
fu.check(rss1 - rss0 < 32 * MB, f"the lighthouse's RSS grew by {(rss1 - rss0) / MB:.1f} MB (< 32 MB)")
rt.check("during the MULTI_SET")
within = socket.create_connection((host, port), timeout=10)
n_within = 700  # 700 x 4 KiB values: 2.9 MB, within --max-request-bytes (4 MiB)
within.sendall(VALIDATE + b"\x0b" + struct.pack("<Q", n_within) +
               b"".join(w_str(b"/ok/%05d" % i) + w_str(value) for i in range(n_within)))
deadline = time.monotonic() + 10
while time.monotonic() < deadline and not rt.client.check([f"ok/{n_within - 1:05d}"]):
    time.sleep(0.05)
fu.check(rt.client.get("ok/00000") == value and rt.client.get(f"ok/{n_within - 1:05d}") == value,
         f"a MULTI_SET within the limits ({n_within} values, {n_within * 4 / 1024:.1f} MB) is stored")
within.close()

# ---- 2. GETs of a large value, never read --------------------------------------------------------------------------
large = os.urandom(1000 * 1000)
rt.client.set("large", large)
rt.client.get("large")  # (a set is not answered: read it back so that it is stored before the other client's GETs)
get = b"\x03" + w_str(b"/large")  # (the TCPStore client puts its keys under "/")
rss0 = rss_bytes(pid)
with rt:
    hog = socket.create_connection((host, port), timeout=10)
    hog.setblocking(False)
    pending, accepted, history, t0 = VALIDATE + get * 64, 0, [], time.monotonic()
    limit = len(VALIDATE) + len(get) * a.max_gets if a.max_gets else 1 << 62
    while time.monotonic() - t0 < a.gets_seconds and accepted < limit:
        try:
            n = hog.send(pending[:limit - accepted])
            accepted += n
            pending = pending[n:] + (get * 64 if n else b"")
        except BlockingIOError:
            time.sleep(0.01)
        history.append((time.monotonic() - t0, accepted))
    time.sleep(0.3)
    rss1 = rss_bytes(pid)
half = [n for t, n in history if t <= a.gets_seconds / 2][-1]
gets = accepted // len(get)
fu.observed(f"a client sent {gets} GETs of a 1 MB value ({accepted} bytes accepted, {half} by half time) without "
            f"reading; lighthouse RSS {rss0 / MB:.1f} -> {rss1 / MB:.1f} MB; round trips meanwhile: {len(rt.trips)}, "
            f"slowest {rt.worst * 1000:.0f} ms")
fu.check(gets > 100 and accepted - half < 64 * 1024,
         f"the lighthouse stopped taking its requests: {gets} GETs ({gets} MB of replies) sent, no more than 64 KiB "
         f"of them in the second half ({accepted - half} bytes)")
fu.check(rss1 - rss0 < 48 * MB, f"the lighthouse's RSS grew by {(rss1 - rss0) / MB:.1f} MB (< 48 MB)")
rt.check("while a client did not read its replies")
hog.setblocking(True)
hog.settimeout(10)
reply = b""
try:
    while len(reply) < 8 + len(large):
        chunk = hog.recv(1 << 20)
        if not chunk:
            break
        reply += chunk
except OSError:
    pass
fu.check(reply[:8 + len(large)] == w_str(large), f"when it reads, its first reply is the 1 MB value, whole (length field {struct.unpack('<Q', reply[:8])[0] if len(reply) >= 8 else None}, bytes equal {reply[8:8 + len(large)] == large}) "
         f"({len(reply)} bytes read)")
hog.close()

# ---- 3. malformed connections --------------------------------------------------------------------------------------
malformed = [
    ("garbage", lambda: os.urandom(4096)),
    ("a wrong magic number", lambda: b"\0" + struct.pack("<I", 0x12345678)),
    ("an unknown command", lambda: VALIDATE + b"\x7f"),
    ("an oversized key", lambda: VALIDATE + b"\x01" + struct.pack("<Q", 1 << 40) + b"k"),
    ("an oversized count", lambda: VALIDATE + b"\x0a" + struct.pack("<Q", 1 << 30)),
    ("a SET before VALIDATE", lambda: b"\x01" + w_str(b"k") + w_str(b"v")),
]


def churn(count):
    ports = []
    for i in range(count):
        c = socket.create_connection((host, port), timeout=10)
        ports.append(c.getsockname()[1])
        c.sendall(malformed[i % len(malformed)][1]())
        try:  # dropped: the lighthouse closes it (read its EOF, or the reset of unread garbage)
            c.settimeout(1)
            c.recv(1)
        except OSError:
            pass
        c.close()
    return ports


churn(50)  # warm up: the code paths and allocator arenas of a refusal
time.sleep(0.3)
rss0 = rss_bytes(pid)
with rt:
    ports = churn(a.malformed)
    time.sleep(0.3)
rss1 = rss_bytes(pid)
logged = sum(1 for p in ports if closed_lines(p))
fu.observed(f"{a.malformed} malformed connections opened and dropped: {logged} log lines; lighthouse RSS "
            f"{rss0 / MB:.2f} -> {rss1 / MB:.2f} MB; round trips meanwhile: {len(rt.trips)}, slowest "
            f"{rt.worst * 1000:.0f} ms")
fu.check(logged == a.malformed, f"each was closed with one log line naming it ({logged} of {a.malformed})")
fu.check(rss1 - rss0 < 2 * MB, f"the lighthouse's RSS grew by {(rss1 - rss0) / 1024:.0f} KiB (< 2 MB)")
rt.check("during the malformed connections")
examples = [light.grep(rf"closed the connection from .*: {p}") for p in
            ("the first request is SET", "VALIDATE with a wrong magic", "unknown command byte 127",
             "SET with a key of 1099511627776 bytes, over --max-key-bytes", "MULTI_GET of 1073741824 keys")]
fu.check(all(examples), "the rules named: " + " | ".join(e[0].split(": ", 2)[-1] if e else "(missing)" for e in examples))
fresh = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
fresh.set("after", "1")
fu.check(fresh.get("after") == b"1" and rt.client.get("rt/0") == b"0", "the store still answers old and new clients")
del fresh

drained.set()
light.proc.send_signal(15)
light.finish(10)
fu.check(light.proc.returncode == 0, f"the lighthouse stopped on SIGTERM (exit {light.proc.returncode})")

# ---- 4. --max-connections, and a bad limit value ------------------------------------------------------------------
small = fu.Job([a.lighthouse, "--port", "0", "--max-connections", "3"], "lighthouse --max-connections 3")
atexit.register(lambda: small.proc.poll() is None and small.proc.kill())
small.wait_for(r"serving on", 30)
m = re.search(r"serving on (\S+):(\d+)$", small.text(), re.M)
if fu.check(m is not None, f"fsdp-lighthouse --max-connections 3 started: {small.text()[:200]}"):
    addr = (m.group(1), int(m.group(2)))
    held = [TCPStore(*addr, is_master=False, timeout=timedelta(seconds=10)) for _ in range(3)]
    extra = socket.create_connection(addr, timeout=10)
    extra_port = extra.getsockname()[1]
    extra.settimeout(5)
    try:
        dropped = extra.recv(1) == b""
    except OSError:
        dropped = True
    extra.close()
    small.wait_for(rf"refused the connection from 127\.0\.0\.1:{extra_port}", 5)
    fu.check(dropped and small.grep(rf"refused the connection from 127\.0\.0\.1:{extra_port}: --max-connections \(3\)"),
             f"a 4th connection is closed with one line: {small.grep('refused the connection')}")
    held[0].set("k", "v")
    fu.check(held[2].get("k") == b"v", "the 3 connections within the limit are served")
    del held
    time.sleep(0.3)
    again = TCPStore(*addr, is_master=False, timeout=timedelta(seconds=10))
    fu.check(again.get("k") == b"v", "once they closed, a new client is served")
    del again
small.proc.send_signal(15)
small.finish(10)
bad = fu.Job([a.lighthouse, "--port", "0", "--max-keys", "0"], "lighthouse --max-keys 0")
bad.finish(10)
fu.check(bad.proc.returncode == 2 and bad.grep(r"^fsdp-lighthouse: bad --max-keys '0' \(expected an integer in 1\.\.") and
         not bad.grep("serving on"), f"--max-keys 0 is refused with a line naming the flag: {bad.text()[:120]}")
fu.finish_test("lighthouse_limits_test")
