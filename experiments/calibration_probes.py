"""How many accountings `calibrate_noise_multiplier` takes, next to a bisection.

Each probe of the search accounts for the whole planned event (for a long run under
PLD, up to about a second each).  For a grid of targets and DP-SGD runs it records, per
accountant, the probes and CPU seconds of the library's search and of a bisection to the
same tolerance (what the library did before: double from 1, then halve [0, hi]), and
checks both answers: epsilon within the target, and half the tolerance less noise over it.

    python experiments/calibration_probes.py            # results/calibration_probes.json
    python experiments/calibration_probes.py --quick    # RDP only, a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import write_result

from dpfl_tf.privacy import calibration, dp_sgd_event

DELTA, TOLERANCE = 1e-5, 1e-3
TARGETS = (0.5, 1.0, 2.0, 4.0, 8.0)
RUNS = {  # sampling rate, lots: MNIST (lots of 600 of 60,000 for 100 epochs), ...
    "mnist_100_epochs": (0.01, 10_000),
    "cifar10_lot_2000_30_epochs": (0.04, 750),
    "federated_100_of_1000_100_rounds": (0.1, 100),
}


def bisection(target, make_event, accountant):
    """The reference, what the library did before: double hi from 1 until it fits, then
    bisect [0, hi] to the same tolerance."""

    def eps(sigma):
        return calibration.compute_epsilon(make_event(sigma), DELTA, accountant)

    hi = 1.0
    while eps(hi) > target:
        hi *= 2.0
    lo = 0.0
    while hi - lo > TOLERANCE * max(1.0, hi) * 0.5:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if eps(mid) <= target else (mid, hi)
    return hi, eps(hi)


def measured(search, target, make_event, accountant):
    """(sigma, eps, probes, CPU seconds) of one search; a probe is an accounting of a
    noise multiplier not accounted before in the search (asking again is a cache hit).
    The library's caches (epsilons, RDP curves, PLDs, log-moments) are cleared first:
    each search starts cold."""
    from dpfl_tf.privacy import accountants, moments

    for cached in (
        accountants._epsilon,
        accountants._rdp_of_leaf,
        accountants._gaussian_pld,
        accountants._sampled_gaussian_pld,
        moments._log_moment_integrated,
    ):
        cached.cache_clear()
    probes = set()
    real = calibration.compute_epsilon

    def counted(event, *a, **k):
        probes.add(repr(event))
        return real(event, *a, **k)

    calibration.compute_epsilon = counted
    try:
        start = time.process_time()
        sigma, eps = search(target, make_event, accountant)
        seconds = time.process_time() - start
    finally:
        calibration.compute_epsilon = real
    below = sigma - TOLERANCE * max(1.0, sigma) / 2
    assert eps <= target < real(make_event(below), DELTA, accountant), (sigma, eps)
    return sigma, eps, len(probes), seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="RDP only")
    args = parser.parse_args()
    accountants = ("rdp",) if args.quick else ("rdp", "moments", "pld")
    library = lambda t, m, a: calibration.calibrate_noise_multiplier(  # noqa: E731
        t, DELTA, m, a, tolerance=TOLERANCE
    )
    rows = {}
    for accountant in accountants:
        cases = []
        for run, (rate, lots) in RUNS.items():
            for target in TARGETS:

                def make(sigma, rate=rate, lots=lots):
                    return dp_sgd_event(sigma, lots, sampling_rate=rate)

                s_new, e_new, p_new, t_new = measured(library, target, make, accountant)
                s_old, e_old, p_old, t_old = measured(bisection, target, make, accountant)
                cases.append(
                    dict(
                        run=run,
                        target=target,
                        sigma=round(s_new, 5),
                        epsilon=round(e_new, 5),
                        probes=p_new,
                        cpu_seconds=round(t_new, 3),
                        bisection_sigma=round(s_old, 5),
                        bisection_epsilon=round(e_old, 5),
                        bisection_probes=p_old,
                        bisection_cpu_seconds=round(t_old, 3),
                    )
                )
                print(accountant, cases[-1], flush=True)
        rows[accountant] = dict(
            cases=cases,
            median_probes=statistics.median(c["probes"] for c in cases),
            max_probes=max(c["probes"] for c in cases),
            median_bisection_probes=statistics.median(c["bisection_probes"] for c in cases),
            cpu_seconds=round(sum(c["cpu_seconds"] for c in cases), 2),
            bisection_cpu_seconds=round(sum(c["bisection_cpu_seconds"] for c in cases), 2),
        )
    name = "calibration_probes_quick.json" if args.quick else "calibration_probes.json"
    write_result(name, rows, delta=DELTA, tolerance=TOLERANCE)


if __name__ == "__main__":
    main()
