"""Writes tests/slow.txt, the tests the fast tier (``pytest -m "not slow"``) leaves
out, from the per-test times of a whole-suite run:

    python -m pytest -q --junitxml=/tmp/suite.xml
    python tests/mark_slow.py /tmp/suite.xml            # tests over 1.5 s are slow
    python tests/mark_slow.py /tmp/suite.xml --fast-minutes 5
        # the threshold that leaves at most 5 minutes of tests (one process) fast

conftest.py marks every test listed in slow.txt with ``pytest.mark.slow``; a test
may also carry the mark itself.  Entries of slow.txt that the given runs did not
time are kept: whole files (a path without '::': child processes, multi-process
runs, statistical audits, slow as a whole) and functions timed in other runs.
A parametrized test is listed by its function (all its cases are slow) when its
cases take more than the threshold in all.

It also writes tests/file_seconds.txt, the seconds each test file took: conftest.py
hands the files to the workers slowest first, so that no long file starts last and
keeps one worker busy after the other has finished.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
SLOW_LIST = HERE / "slow.txt"
FILE_SECONDS = HERE / "file_seconds.txt"


def test_times(junit_xml: str) -> dict[str, float]:
    """Seconds per test function (parametrized cases summed), keyed
    'tests/path.py::function' (setup and teardown included)."""
    times: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        name = case.get("name", "").split("[", 1)[0]
        times[f"{path}::{name}"] += float(case.get("time", 0.0))
    return dict(times)


def budget_threshold(times: dict[str, float], budget: float) -> float:
    """The largest per-function time t such that the functions of at most t seconds
    sum to at most `budget` seconds."""
    total, threshold = 0.0, 0.0
    for seconds in sorted(times.values()):
        if total + seconds > budget:
            break
        total, threshold = total + seconds, seconds
    return threshold


def listed(path: pathlib.Path) -> list[str]:
    """The entries of a list file of this directory (slow.txt, file_seconds.txt): its
    non-empty lines, stripped, without the '#' comments; none if it does not exist."""
    if not path.exists():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def read_file_seconds() -> dict[str, float]:
    """tests/file_seconds.txt as {path: seconds}."""
    rows = (line.split(maxsplit=1) for line in listed(FILE_SECONDS))
    return {path: float(s) for s, path in rows}


def write_file_seconds(times: dict[str, float]) -> None:
    """tests/file_seconds.txt: '<seconds> <path>' per test file, slowest first (files
    listed before and not timed now are kept)."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for test, s in times.items():
        seconds[test.split("::", 1)[0]] += s
    for path, s in read_file_seconds().items():
        seconds.setdefault(path, s)
    rows = sorted(seconds.items(), key=lambda row: -row[1])
    FILE_SECONDS.write_text(
        "# seconds per test file in a whole-suite run (tests/mark_slow.py); conftest.py "
        "starts the slowest first\n" + "".join(f"{s:.0f} {path}\n" for path, s in rows)
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit_xml", nargs="+", help="one or more junit XML files")
    p.add_argument("--threshold", type=float, default=1.5, help="seconds (default: 1.5)")
    p.add_argument(
        "--fast-minutes",
        type=float,
        help="instead of --threshold: the largest threshold whose fast tier sums to at "
        "most this many minutes of test time",
    )
    args = p.parse_args(argv)
    times: dict[str, float] = {}
    for path in args.junit_xml:
        times.update(test_times(path))
    write_file_seconds(times)
    kept = [entry for entry in listed(SLOW_LIST) if entry not in times]
    files = {t for t in kept if "::" not in t}  # slow as a whole
    times = {t: s for t, s in times.items() if t.split("::", 1)[0] not in files}
    if args.fast_minutes is not None:
        args.threshold = budget_threshold(times, args.fast_minutes * 60)
    slow = sorted(t for t, s in times.items() if s > args.threshold)
    slow = kept + [t for t in slow if t not in kept]
    fast = sum(s for t, s in times.items() if s <= args.threshold)
    header = (
        f"# tests over {args.threshold:.3g} s in a whole-suite run (tests/mark_slow.py); "
        f"the rest took {fast / 60:.1f} min\n"
    )
    SLOW_LIST.write_text(header + "".join(f"{t}\n" for t in slow))
    print(
        f"{len(slow)} of {len(times)} test functions are slow ({SLOW_LIST}); the fast tier "
        f"took {fast / 60:.1f} min, the slow ones "
        f"{sum(times.get(t, 0.0) for t in slow) / 60:.1f} min"
    )


if __name__ == "__main__":
    main()
