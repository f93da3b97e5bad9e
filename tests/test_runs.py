"""dpfl_tf._runs: output paths checked before a run, results files with a status,
signals turned into a clean stop.  No TensorFlow here."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from dpfl_tf._runs import (
    Interrupts,
    ResultsFile,
    RunInterrupted,
    check_output_dir,
    check_output_file,
    running,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_missing_parents_are_created(tmp_path):
    path = tmp_path / "a" / "b" / "r.json"
    assert check_output_file("--output", str(path)) == str(path)
    assert (tmp_path / "a" / "b").is_dir() and not path.exists()
    assert os.listdir(tmp_path / "a" / "b") == []  # the write test leaves nothing


def test_parent_that_is_a_file_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError) as e:
        check_output_file("--output", str(tmp_path / "afile" / "sub" / "r.json"))
    assert str(e.value) == (
        f"--output {tmp_path / 'afile' / 'sub' / 'r.json'}: cannot write "
        f"there: {tmp_path / 'afile'} is a file, not a directory"
    )
    with pytest.raises(ValueError, match="--checkpoint-dir .*: cannot write there: it is a file"):
        check_output_dir("--checkpoint-dir", str(tmp_path / "afile"))


def test_output_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--output .*: is a directory; give a file name"):
        check_output_file("--output", str(tmp_path))


def test_unwritable_place_is_refused():
    # /proc refuses new files even to root (a chmod'ed directory does not stop root)
    with pytest.raises(ValueError, match=r"^--output /proc/dpfl_out/r.json: cannot write there"):
        check_output_file("--output", "/proc/dpfl_out/r.json")


def test_read_only_directory_is_refused(read_only_dir):
    ro, reason = read_only_dir
    with pytest.raises(ValueError) as e:
        check_output_file("--output", str(ro / "r.json"))
    assert str(e.value) == f"--output {ro / 'r.json'}: cannot write there: {reason}"
    with pytest.raises(ValueError, match=f"^--checkpoint-dir {ro / 'ckpt'}: cannot write there"):
        check_output_dir("--checkpoint-dir", str(ro / "ckpt"))
    assert os.listdir(ro) == []


def test_results_file_is_written_only_when_asked_and_carries_a_status(tmp_path):
    path = tmp_path / "r.json"
    results = ResultsFile(str(path))
    assert not path.exists() and not results.written
    results.write("running", {"epochs": 1, "ledger": [{"count": 10}]})
    assert json.loads(path.read_text())["status"] == "running"
    results.write("failed", results.last, error="boom")
    data = json.loads(path.read_text())
    assert (data["status"], data["epochs"], data["error"]) == ("failed", 1, "boom")
    with pytest.raises(
        ValueError,
        match="status must be one of running, completed, "
        "budget_spent, interrupted, failed, got 'done'",
    ):
        results.write("done", {})


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_inside_a_deferred_section_only_asks_to_stop(sig, code, capsys):
    before = signal.getsignal(sig)  # another library in this process may have installed its own
    with Interrupts() as interrupts:
        with interrupts.deferred():
            os.kill(os.getpid(), sig)
            assert interrupts.requested and interrupts.exit_code == code
            with pytest.raises(RunInterrupted):  # a second signal stops at once
                os.kill(os.getpid(), sig)
    assert "stopping after the current step" in capsys.readouterr().err
    assert signal.getsignal(sig) is before  # the handler in place before the run is restored


def test_a_signal_outside_a_deferred_section_raises_at_once():
    with Interrupts() as interrupts:
        with pytest.raises(RunInterrupted) as e:
            os.kill(os.getpid(), signal.SIGTERM)
        assert e.value.signum == signal.SIGTERM and interrupts.exit_code == 143


# -- the results file of a run: where it goes, and no finished run overwritten ------------------
def test_a_directory_output_takes_the_default_name_inside(tmp_path):
    from dpfl_tf._runs import resolve_output

    new = str(tmp_path / "some" / "new" / "dir") + os.sep  # a trailing slash: a directory
    assert resolve_output("--output", new, "train_mnist") == os.path.join(new, "train_mnist.json")
    assert (tmp_path / "some" / "new" / "dir").is_dir()
    assert resolve_output("--output", str(tmp_path), "x") == str(tmp_path / "x.json")


def test_the_default_output_is_a_new_file_under_runs(tmp_path, monkeypatch):
    from dpfl_tf._runs import resolve_output

    monkeypatch.chdir(tmp_path)
    first = resolve_output("--output", None, "train_mnist")
    assert first.startswith(os.path.join("runs", "train_mnist-")) and first.endswith(".json")
    open(first, "w").close()
    second = resolve_output("--output", None, "train_mnist")
    assert second != first and not os.path.exists(second)


def test_an_untimed_run_has_no_time_in_its_default_name_or_its_results(tmp_path, monkeypatch):
    """A search with a secret number of trials: the start time in the name and an
    'updated' time in the file would give its duration, and so the count."""
    import re

    from dpfl_tf._runs import resolve_output

    monkeypatch.chdir(tmp_path)
    timed = resolve_output("--output", None, "train_mnist")
    assert re.fullmatch(r"runs/train_mnist-\d{8}-\d{6}\.json", timed)
    untimed = resolve_output("--output", None, "train_mnist", timed=False)
    assert re.fullmatch(r"runs/train_mnist-[0-9a-f]{8}\.json", untimed)
    ResultsFile(str(tmp_path / "a.json")).write("completed", {"x": 1})
    ResultsFile(str(tmp_path / "b.json"), timed=False).write("completed", {"x": 1})
    assert "updated" in json.loads((tmp_path / "a.json").read_text())
    assert json.loads((tmp_path / "b.json").read_text()) == {"status": "completed", "x": 1}


@pytest.mark.parametrize(
    "status,refused",
    [("completed", True), ("budget_spent", True), ("interrupted", False), ("failed", False)],
)
def test_the_results_of_a_finished_run_are_not_overwritten_without_asking(
    tmp_path, status, refused
):
    from dpfl_tf._runs import resolve_output

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"status": status, "test_accuracy": 0.9448}))
    if refused:
        with pytest.raises(
            ValueError,
            match=f"holds the results of a finished run \\(status {status}\\); pass --overwrite",
        ):
            resolve_output("--output", str(path), "x")
        assert resolve_output("--output", str(path), "x", overwrite=True) == str(path)
        assert resolve_output("--output", str(path), "x", resuming=True) == str(path)
    else:
        assert resolve_output("--output", str(path), "x") == str(path)


def test_a_second_signal_inside_a_finalizer_still_stops_the_run():
    """Python prints and drops an exception raised in __del__ ("Exception ignored
    in ..."): the stop is raised again once outside the finalizer."""
    import sys
    import time

    class Finalized:
        def __del__(self):  # the second Ctrl-C arrives while the GC runs this
            interrupts._handler(signal.SIGINT, sys._getframe())

    with Interrupts() as interrupts:
        with interrupts.deferred():
            interrupts._handler(signal.SIGINT, None)  # the first Ctrl-C: asks to stop
            assert interrupts.requested
            with pytest.raises(RunInterrupted):
                obj = Finalized()
                del obj
                time.sleep(1.0)  # the stop arrives here, not inside __del__


@pytest.mark.parametrize("second_signal", [False, True])
def test_an_interrupted_run_that_cannot_resume_says_why_and_offers_no_resume(
    tmp_path, capsys, second_signal
):
    """A run marked not resumable (a private search, charged in full when it
    starts) stopped by Ctrl-C -- after the current step, or at once by a
    second signal -- names its results and says why it cannot resume; it never
    prints a resume command."""
    from dpfl_tf._runs import CommandRun, run_command

    out = tmp_path / "search.json"

    def run(*, checkpoint_dir, checkpoint_every, should_stop, on_progress, on_resume):
        on_progress({"epsilon": 1.5})
        os.kill(os.getpid(), signal.SIGINT)  # the first: stop after the current step
        assert should_stop()
        if second_signal:
            os.kill(os.getpid(), signal.SIGINT)  # the second: at once
        return {"epsilon": 1.5, "stop_reason": "interrupted"}

    code = run_command(
        CommandRun(
            command="train",
            argv=["train", "mnist", "--tune"],
            output=str(out),
            checkpoint_dir=None,
            unit="search",
            run=run,
            status=lambda r: r["stop_reason"],
            resumed=lambda info: "",
            progress=lambda r: "",
            summary=lambda r: [],
            resumable=False,
            not_resumable="the search cannot be resumed",
        ),
        refuse=pytest.fail,
    )
    err = capsys.readouterr().err
    assert code == 130
    kept = "kept results of the run so far" if second_signal else "results"
    assert f"{kept} in {out} (status interrupted); the search cannot be resumed" in err
    assert "resume with" not in err and "checkpoint" not in err
    data = json.loads(out.read_text())
    assert data["status"] == "interrupted" and data["epsilon"] == 1.5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_die_with_parent_ends_when_its_parent_is_killed():
    """The parent starts two `sleep`s, one with `die_with_parent`, and is SIGKILLed:
    that one ends (SIGTERM from the kernel), the other keeps running (the control)."""
    parent_code = (
        "import subprocess, sys, time\n"
        "from dpfl_tf._runs import die_with_parent\n"
        "a = subprocess.Popen(['sleep', '60'], preexec_fn=die_with_parent)\n"
        "b = subprocess.Popen(['sleep', '60'])\n"
        "print(a.pid, b.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    with_it, without = (int(p) for p in parent.stdout.readline().split())
    parent.kill()
    parent.wait()

    try:
        deadline = time.monotonic() + 10
        while running(with_it) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(with_it)
        assert running(without)
    finally:
        parent.stdout.close()
        for pid in (with_it, without):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
