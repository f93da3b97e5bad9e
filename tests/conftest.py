"""Test set-up: point the data loaders at the offline copies in ../shared/data
(when the project sits beside it, as in CI) and never try to download."""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"

if "DPFL_DATA_DIR" not in os.environ and SHARED_DATA.is_dir():
    os.environ["DPFL_DATA_DIR"] = str(SHARED_DATA)
os.environ.setdefault("DPFL_NO_DOWNLOAD", "1")
if "DPFL_CACHE_DIR" not in os.environ:  # tests never read or fill the user's cache
    import atexit
    import shutil
    import tempfile

    os.environ["DPFL_CACHE_DIR"] = tempfile.mkdtemp(prefix="dpfl_tf_test_cache_")
    atexit.register(shutil.rmtree, os.environ["DPFL_CACHE_DIR"], True)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _read_only_as_root(directory):
    """Makes `directory` really read-only for root, who ignores permission bits:
    a read-only bind mount of it onto itself, else the immutable attribute.
    Returns (the error the OS gives, how to undo it), or None if neither works."""
    import subprocess

    def run(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True).returncode == 0

    path = str(directory)
    if run("mount", "--bind", path, path):
        if run("mount", "-o", "remount,ro,bind", path):
            return "Read-only file system", lambda: run("umount", path)
        run("umount", path)
    if run("chattr", "+i", path):
        return "Operation not permitted", lambda: run("chattr", "-i", path)
    return None


import pytest  # noqa: E402


def pytest_configure(config):
    """Files marked `isolated` run in a child process each (tests/isolation.py)."""
    from tests import isolation

    if not config.pluginmanager.is_registered(isolation):
        config.pluginmanager.register(isolation, "dpfl-isolation")
    # pytest-xdist's --dist loadfile hands out the files with the most tests first unless
    # told not to; the order that shortens the run is the slowest first
    # (`pytest_collection_modifyitems`): a one-test file of four minutes (the Flower
    # deployment) handed out last kept one worker busy after the other had finished
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_finish(session):
    """What collection imported (TensorFlow, Keras, the package, the test modules)
    lives as long as the process: `gc.freeze` takes it out of the garbage
    collector's scans, so the collection each test ends with costs milliseconds
    instead of ~0.3 s (8 of the suite's CPU minutes)."""
    import gc

    gc.collect()
    gc.freeze()


_MEMORY_LOG = os.environ.get("DPFL_TEST_MEMORY_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With DPFL_TEST_MEMORY_LOG=<file>: after each test, one line of JSON with the
    test process's resident memory now and at its peak so far, and the peak of the
    child processes it waited for (experiments/suite_cost.py reads them to name
    the tests that set the suite's memory peaks)."""
    yield
    if _MEMORY_LOG:
        import json
        import resource
        import time

        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        row = {
            "test": item.nodeid,
            "end": round(time.time(), 1),
            "pid": os.getpid(),
            "rss_gb": round(rss / 1e9, 3),
            "peak_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3),
            "children_peak_gb": round(
                resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6, 3
            ),
        }
        with open(_MEMORY_LOG, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Every test starts from a clear Keras state: the models, traced functions and
    layer names of earlier tests are released (`clear_session` also runs the
    garbage collector once, over what was made since its file began: see
    `pytest_runtest_teardown`)."""
    yield
    import keras

    keras.backend.clear_session()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a file's last test: one full collection, then `gc.freeze` of what is
    still alive (the imports, the caches, what later files share).  The
    collection each test ends with (`clear_session`) then scans only what was
    made since its file began; it scanned everything alive, which grew with each
    file the worker had run (0.16 s a test on average, 220 of the suite's CPU
    seconds in its two workers).  What a file leaves unreachable is still freed
    when the file ends, as before."""
    yield
    if nextitem is None or nextitem.path != item.path:
        import gc

        gc.unfreeze()
        gc.collect()
        gc.freeze()


@pytest.fixture
def read_only_dir(tmp_path):
    """(an existing directory no file can be created in, the error message the
    OS gives).  For a normal user a chmod 555 directory ("Permission denied");
    for root a read-only bind mount ("Read-only file system") or an immutable
    directory ("Operation not permitted"); skipped if none can be made."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro, "Permission denied"
        ro.chmod(0o755)
        return
    made = _read_only_as_root(ro)
    if made is None:
        pytest.skip(
            "root ignores permission bits, and neither a read-only bind mount nor "
            "chattr +i is possible here"
        )
    message, undo = made
    try:
        yield ro, message
    finally:
        undo()


def pytest_collection_modifyitems(config, items):
    """Marks the tests of tests/slow.txt slow (the fast tier is -m "not slow"), and
    puts the slowest files first (tests/file_seconds.txt; the order within a file is
    kept): with `--dist loadfile` a long file that starts last keeps one worker busy
    while the other has finished."""
    from tests.mark_slow import SLOW_LIST, listed, read_file_seconds

    seconds = read_file_seconds()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], 0.0))  # stable
    slow = set(listed(SLOW_LIST))  # test functions ('path::function') and whole files
    for item in items:
        function = item.nodeid.split("[", 1)[0]
        if function in slow or function.split("::", 1)[0] in slow:
            item.add_marker(pytest.mark.slow)
