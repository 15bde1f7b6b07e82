#!/usr/bin/env python3
"""Where one side's lease pairs spend their time (rows 6a/6b, issue 30 point 6).

Runs `workloads --profile-single SIDE PAIRS INSTANCES` against a running
server of its own (DATABASE_URL, PGDATA) and meanwhile:

- samples pg_stat_activity every ~1 ms from another connection (the function
  in waits.sql, installed in the server's `postgres` database), from 1 s after
  the start for SAMPLE seconds: per sample, how many of the side's backends
  are active, and in which wait event (none: on CPU or runnable);
- reads /proc/<pid>/task/*/schedstat of the client process (every thread) and
  of every process of the server every 20 ms: CPU time, time runnable but
  not running (run queue), and timeslices (a timeslice is a wake-up).

Prints per pair: client CPU / run-queue wait / wake-ups, server the same
(every server process), and the mean number of the side's backends in each
state per sample.

    DATABASE_URL=... PGDATA=... python3 benches/profile/waits.py SIDE PAIRS INSTANCES [SAMPLE]
"""
import glob, os, subprocess, sys, threading, time

side, pairs, inst = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sample = float(sys.argv[4]) if len(sys.argv) > 4 else 3.0
here = os.path.dirname(os.path.abspath(__file__))
B = os.environ.get("B") or max(
    (p for p in glob.glob(os.path.join(here, "../../target/release/deps/workloads-*")) if not p.endswith(".d")),
    key=os.path.getmtime)
pgdata, url = os.environ["PGDATA"], os.environ["DATABASE_URL"]
postmaster = int(open(os.path.join(pgdata, "postmaster.pid")).readline())

def sched(pid):
    """{tid: (cpu ns, runqueue ns, slices)} of every thread of pid."""
    out = {}
    for f in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            a = open(f).read().split()
            out[(pid, f.split("/")[4])] = tuple(int(x) for x in a)
        except OSError:
            pass
    return out

def children(pid):
    try:
        return [int(x) for x in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []

first, last = {}, {}
kinds = {}
def kind(pid):
    if pid not in kinds:
        try:
            c = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
        except OSError:
            c = "?"
        # "postgres: user db [local] ..." is a client backend
        if pid != postmaster and ":" not in c:
            return "backends"  # a child not yet named: a new backend
        k = c.split(":", 1)[1].strip() if ":" in c else "postmaster"
        if k.startswith("postgres ") or "[local]" in k or "idle" in k:
            k = "backends"
        kinds[pid] = " ".join(k.split()[:2])
    return kinds[pid]
def poll(proc_pid, who):
    if who == "server":
        who = "server/" + kind(proc_pid)
    d = sched(proc_pid)
    for k, v in d.items():
        first.setdefault((who,) + k, v)
        last[(who,) + k] = v

# CMD: another client instead (pgbench, fleet.sh), its output's last line shown
cmd = os.environ.get("CMD")
proc = subprocess.Popen(["sh", "-c", "exec " + cmd + " 1>&2"] if cmd else [B, "--profile-single", side, str(pairs), str(inst)],
                        stderr=subprocess.PIPE, text=True)
waits = {}
def sampler():
    time.sleep(float(os.environ.get("SAMPLE_AFTER", "1.0")))
    q = f"SELECT datname, state, wait, samples FROM pgw_sample_waits({sample}, 0.001)"
    r = subprocess.run(["psql", "-X", "-At", "-F", "|", url, "-c", q], capture_output=True, text=True)
    waits["out"] = r.stdout + r.stderr
t = threading.Thread(target=sampler); t.start()
t0 = time.time()
while proc.poll() is None:
    poll(proc.pid, "client")
    poll(postmaster, "server")
    for c in children(postmaster):
        poll(c, "server")
    time.sleep(0.02)
wall = time.time() - t0
err = proc.stderr.read()
t.join()

tot = {}
for k, v in last.items():
    f = first[k]
    a = tot.setdefault(k[0], [0, 0, 0])
    for i in range(3):
        a[i] += v[i] - f[i]
line = [l for l in err.splitlines() if "pairs in" in l or "tps =" in l]
print(f"{side} x{inst}: {line[-1] if line else err.strip()[-300:]}")
load = open("/proc/loadavg").read().split()[0]
srv = [0, 0, 0]
for who in list(tot):
    if who.startswith("server/"):
        for i in range(3):
            srv[i] += tot[who][i]
tot["server (all)"] = srv
for who in sorted(tot):
    cpu, rq, sl = tot.get(who, [0, 0, 0])
    if cpu / pairs < 50:
        continue
    print(f"  {who}: CPU {cpu/1e3/pairs:6.1f} µs/pair, run queue {rq/1e3/pairs:6.1f} µs/pair, timeslices {sl/pairs:5.2f}/pair")
# samples: the side's database is the one with the most active samples
rows = [l.split("|") for l in waits.get("out", "").splitlines() if l.count("|") == 3]
bydb = {}
for d, st, w, n in rows:
    bydb.setdefault(d, []).append((st, w, int(n)))
if len(bydb) > 1:
    db = max((d for d in bydb if d != "#samples"), key=lambda d: sum(n for st, w, n in bydb[d] if st == "active"))
    act = [(w, n) for st, w, n in bydb[db] if st == "active"]
    nsamp = bydb["#samples"][0][2]
    print(f"  samples {nsamp:.0f} over {sample}s; the side's backends per sample (of {inst} tasks):")
    for w, n in sorted(act, key=lambda x: -x[1]):
        print(f"    active {w:28s} {n/nsamp:6.3f}")
    idle = sum(n for st, w, n in bydb[db] if st != "active")
    print(f"    not active (incl. the pools' unused connections) {idle/nsamp:6.3f}")
else:
    print("  no samples:", waits.get("out", "")[:500])
print(f"  wall {wall:.2f}s, load {load}")
