"""DP-SGD on an on-disk array larger than the memory the process may use.

Writes a 2 GiB float32 array (500,000 x 1,024 synthetic features whose labels a
fixed linear teacher gives, so training is meaningful) to disk in chunks, then
trains the same MLP twice in child processes, each inside a cgroup (v1 memory
controller) whose limit counts the process's memory *and* its page cache:

  memmap     fit(np.load(path, mmap_mode="r"), y): lots are read from disk
  in_memory  fit(np.load(path), y): the array is loaded whole first

With a 1.5 GiB limit the in-memory run cannot even load its data (it is
killed, the kernel's OOM killer), the memmap run trains a whole epoch; a third
run, in memory without a limit, is the speed reference.  For
each run: exit status, lots, epsilon, seconds per epoch, the process's peak
RSS (VmHWM) and the cgroup's peak usage.

    sudo python experiments/out_of_memory.py            # needs a writable cgroup
    python experiments/out_of_memory.py --no-limit      # just the figures

Writes results/out_of_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _common import RESULTS, ROOT, peak_rss_mb

CGROUP = "/sys/fs/cgroup/memory"


def write_data(path: str, n: int, d: int, chunk: int = 50_000) -> None:
    import numpy as np

    if os.path.exists(path) and os.path.getsize(path) > n * d * 4:
        return
    rng = np.random.default_rng(0)
    teacher = np.zeros((d, 10), np.float32)  # labels depend on 16 of the features
    teacher[:16] = rng.normal(size=(16, 10))
    x = np.lib.format.open_memmap(path + ".tmp", mode="w+", dtype=np.float32, shape=(n, d))
    y = np.empty(n, np.int64)
    for lo in range(0, n, chunk):
        block = rng.normal(size=(min(chunk, n - lo), d)).astype("float32")
        x[lo : lo + len(block)] = block
        y[lo : lo + len(block)] = np.argmax(block @ teacher, axis=1)
    x.flush()
    del x
    np.save(path.replace(".npy", "_labels.npy"), y)
    os.replace(path + ".tmp", path)


def child(args) -> dict:
    """One training run (in this process)."""
    import keras
    import numpy as np

    from dpfl_tf.keras import DPSGD, DPModel

    y = np.load(args.path.replace(".npy", "_labels.npy"))
    x = np.load(args.path, mmap_mode="r" if args.mode == "memmap" else None)
    d = x.shape[1]
    model = keras.Sequential(
        [keras.Input((d,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)]
    )
    dp = DPModel(model)
    dp.compile(
        optimizer=DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    start = time.perf_counter()
    history = dp.fit(x, y, lot_size=args.lot_size, epochs=1, verbose=0)
    seconds = time.perf_counter() - start
    with open("/proc/self/status") as f:
        status = {
            line.split(":")[0]: int(line.split()[1])
            for line in f
            if line.startswith(("VmHWM", "RssAnon", "RssFile"))
        }
    return {
        "mode": args.mode,
        "lots": dp.lots_computed,
        "ledger_lots": dp.privacy_ledger.count(),
        "epsilon": dp.epsilon(1e-6),
        "delta": 1e-6,
        "seconds_per_epoch": seconds,
        "train_accuracy": float(history.history["accuracy"][-1]),
        "peak_rss_mb": status["VmHWM"] / 1024,  # includes mapped (reclaimable) file pages
        "anonymous_rss_mb_at_end": status["RssAnon"] / 1024,
        "file_rss_mb_at_end": status["RssFile"] / 1024,
        "maxrss_mb": peak_rss_mb(),
    }


def _evict_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_limited(args, mode: str, limit_bytes: int | None) -> dict:
    out = os.path.join(RESULTS, f".oom_{mode}.json")
    if os.path.exists(out):
        os.unlink(out)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--mode",
        mode,
        "--path",
        args.path,
        "--lot-size",
        str(args.lot_size),
        "--output",
        out,
    ]
    group = None
    if limit_bytes is not None:
        group = os.path.join(CGROUP, f"dpfl_oom_{os.getpid()}_{mode}")
        os.makedirs(group, exist_ok=True)
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_bytes))
        memsw = os.path.join(group, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):  # no swapping around the limit either
            with open(memsw, "w") as f:
                f.write(str(limit_bytes))
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")

    def enter():
        if group is not None:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    _evict_from_page_cache(args.path)  # so the child's reads are charged to its cgroup
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, preexec_fn=enter, capture_output=True, text=True)
    row = {
        "mode": mode,
        "exit_status": proc.returncode,
        "limit_mb": None if limit_bytes is None else limit_bytes / 2**20,
        "wall_seconds": time.perf_counter() - start,
    }
    if group is not None:
        for name in ("memory.max_usage_in_bytes", "memory.failcnt"):
            with open(os.path.join(group, name)) as f:
                row[name.replace("memory.", "cgroup_")] = int(f.read())
        row["cgroup_peak_mb"] = row.pop("cgroup_max_usage_in_bytes") / 2**20
        os.rmdir(group)
    if proc.returncode == 0 and os.path.exists(out):
        with open(out) as f:
            row.update(json.load(f))
        os.unlink(out)
    else:
        row["error"] = (
            f"killed by signal {-proc.returncode}"
            if proc.returncode < 0
            else (proc.stderr or "").strip().splitlines()[-1:] or "failed"
        )
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default="/tmp/dpfl_oom/x.npy")
    p.add_argument("--examples", type=int, default=500_000)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--lot-size", type=int, default=1000)
    p.add_argument("--limit-mb", type=float, default=1536)
    p.add_argument("--no-limit", action="store_true")
    p.add_argument("--output", default=os.path.join(RESULTS, "out_of_memory.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        with open(args.output, "w") as f:
            json.dump(child(args), f)
        return
    os.makedirs(os.path.dirname(args.path), exist_ok=True)
    write_data(args.path, args.examples, args.features)
    limit = None if args.no_limit else int(args.limit_mb * 2**20)
    if limit is not None and not os.access(CGROUP, os.W_OK):
        sys.exit(f"{CGROUP} is not writable: run as root, or pass --no-limit")
    rows = []
    for mode, run_limit in (("memmap", limit), ("in_memory", limit), ("in_memory", None)):
        row = run_limited(args, mode, run_limit)  # the last: the reference, no limit
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {
        "data_bytes": os.path.getsize(args.path),
        "examples": args.examples,
        "features": args.features,
        "lot_size": args.lot_size,
        "command": "python experiments/out_of_memory.py"
        + (" --no-limit" if args.no_limit else f" --limit-mb {args.limit_mb:g}"),
        "runs": rows,
    }
    from dpfl_tf._io import atomic_write_json

    atomic_write_json(args.output, result)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
