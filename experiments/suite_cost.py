"""What the test suite costs: wall time and peak memory of the README's test command.

Runs a command (default: the README's test command without its ``pip install``)
and samples, every half second, the resident memory of every process it started
(pytest, its xdist workers and their child processes).  Records the wall time,
the peak of the *sum* over the process tree (what the machine must hold) and the
peak of the largest single process, the machine's busy cores every 10 s (where the
suite leaves a core idle), and appends a row to results/suite_cost.json.  With
DPFL_TEST_MEMORY_LOG=<file> set, the test processes also log their memory and the
time after every test (tests/conftest.py), which names the tests behind the peaks
and the idle stretches.  Run it on an idle machine: the wall time is the claim.

    python experiments/suite_cost.py                       # the full suite
    python experiments/suite_cost.py --label fast -- python -m pytest -q -n 2 \\
        --dist loadfile -m "not slow"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time

from _common import RESULTS, ROOT, commit_of


def readme_test_command() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("<!-- test-command -->", 1)[1].split("<!-- /test-command -->", 1)[0]
    line = [x for x in block.splitlines() if x.strip() and not x.startswith("```")][0]
    return line.split("&&", 1)[-1].split()  # without the pip install


def _tree_rss(root: int) -> tuple[int, int, int]:
    """(sum of RSS over `root` and its descendants, largest single RSS, its pid)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(name), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        rss[pid] = int(fields[21]) * page
    total, largest, largest_pid, todo = 0, 0, root, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        if rss.get(pid, 0) > largest:
            largest, largest_pid = rss[pid], pid
        todo.extend(children.get(pid, []))
    return total, largest, largest_pid


def memory_growth_by_file(log: str) -> dict[str, float]:
    """GB each test file added to the processes that ran it, from a
    DPFL_TEST_MEMORY_LOG file: per process, the resident memory after each test
    minus after the test before it, summed per file (a process's first test
    counts from its own first row).  The files over ~0.4 GB not yet marked
    `pytest.mark.isolated` are the ones to mark (tests/isolation.py); the marked
    ones are listed too, with what they grow their own child process by."""
    last: dict[int, float] = {}
    growth: dict[str, float] = {}
    with open(log) as f:
        for line in f:
            row = json.loads(line)
            before = last.get(row["pid"], row["rss_gb"])
            last[row["pid"]] = row["rss_gb"]
            path = row["test"].split("::", 1)[0]
            growth[path] = growth.get(path, 0.0) + row["rss_gb"] - before
    return dict(sorted(growth.items(), key=lambda kv: -kv[1]))


BUSY_SECONDS = 10.0


def _cpu_jiffies() -> int:
    """The machine's CPU time so far (user, nice, system, irq, softirq, steal), in
    clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return "?"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="full")
    p.add_argument("--output", default=os.path.join(RESULTS, "suite_cost.json"))
    p.add_argument("command", nargs="*", help="default: the README's test command")
    args = p.parse_args(argv)
    cmd = args.command or [sys.executable if c == "python" else c for c in readme_test_command()]
    log = os.environ.get("DPFL_TEST_MEMORY_LOG")
    if log and os.path.exists(log):  # the test processes append: start it empty
        os.remove(log)
    peak = {"tree": 0, "process": 0, "process_cmdline": ""}
    start, started = time.perf_counter(), time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    done = threading.Event()

    busy = []  # the machine's busy cores, averaged over each BUSY_SECONDS

    def sample() -> None:
        last, mark = _cpu_jiffies(), time.perf_counter()
        while not done.wait(0.5):
            tree, single, pid = _tree_rss(proc.pid)
            peak["tree"] = max(peak["tree"], tree)
            if single > peak["process"]:
                peak["process"], peak["process_cmdline"] = single, _cmdline(pid)
            now = time.perf_counter()
            if now - mark >= BUSY_SECONDS:
                jiffies = _cpu_jiffies()
                busy.append(round((jiffies - last) / os.sysconf("SC_CLK_TCK") / (now - mark), 2))
                last, mark = jiffies, now

    threading.Thread(target=sample, daemon=True).start()
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    code = proc.wait()
    done.set()
    seconds = time.perf_counter() - start
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = used.ru_utime + used.ru_stime
    summary = next((x for x in reversed(lines) if re.search(r"\d+ (passed|failed)", x)), "")
    row = {
        "label": args.label,
        "command": " ".join(args.command) if args.command else "README test command",
        "argv": cmd[1:] if cmd[0] == sys.executable else cmd,
        "commit": commit_of(),
        "exit_code": code,
        "summary": summary.strip(" =\n"),
        "wall_seconds": round(seconds, 1),
        "peak_tree_rss_gb": round(peak["tree"] / 1e9, 2),
        "peak_process_rss_gb": round(peak["process"] / 1e9, 2),
        "peak_process": peak["process_cmdline"],
        # CPU seconds of every process the command started and waited for (pytest
        # waits for its workers, they for their children): busy / (wall x cores) is how
        # much of the machine the suite kept busy
        "cpu_seconds": round(cpu, 1),
        "cpu_busy": round(cpu / (seconds * os.cpu_count()), 2),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "started": round(started, 1),
        # busy cores of the whole machine (not only the suite's processes), one value
        # per BUSY_SECONDS: where the suite leaves the machine idle
        "busy_cores_every_10s": busy,
    }
    if log and os.path.exists(log):
        growth = memory_growth_by_file(log)
        row["memory_growth_gb_by_file"] = {
            k: round(v, 2) for k, v in list(growth.items())[:15] if v >= 0.1
        }
    rows = json.load(open(args.output)) if os.path.exists(args.output) else []
    rows.append(row)
    with open(args.output, "w") as f:
        json.dump(rows, f, indent=1)
    print(json.dumps(row))
    return code


if __name__ == "__main__":
    sys.exit(main())
