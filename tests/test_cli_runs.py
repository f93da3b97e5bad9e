"""The `dpfl-tf` commands that train, run as real processes: output paths checked
before any data is loaded, results rewritten with a status as the run goes,
Ctrl-C / SIGTERM ending a run cleanly (exit code 130 / 143, no traceback, a
checkpoint), exact resume, a quiet start-up and a --help without TensorFlow."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = ("oneDNN", "cuda", "absl::InitializeLog", "Error occurred when finalizing", "Traceback")


def _env(**extra):
    env = {**os.environ, "PYTHONPATH": ROOT, **extra}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the CLI must be quiet by itself
    return env


def _run(args, timeout=300, **env):
    return subprocess.run(
        [sys.executable, "-m", "dpfl_tf", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(**env),
        timeout=timeout,
    )


def _start(args, **env):
    return subprocess.Popen(
        [sys.executable, "-m", "dpfl_tf", *args],
        cwd=ROOT,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _interrupt_while_running(args, out, sig, **env):
    """Starts the CLI, sends `sig` once the results file says "running", and
    returns (exit code, stderr)."""
    proc = _start(args, **env)
    _wait_for(lambda: (_read(out) or {}).get("status") == "running", proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=240)
    return proc.returncode, err


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _wait_for(condition, proc, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError("the run ended before the signal: " + proc.stderr.read()[-3000:])
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("timed out waiting for the run")


# -- --help and start-up --------------------------------------------------------------------
@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["federated", "--help"]])
def test_help_answers_without_importing_tensorflow(args):
    """Nor dp-accounting and SciPy (one to two seconds): the parsers' choices come
    from modules that import neither (`dpfl_tf.privacy.choices`,
    `dpfl_tf.federated.settings`)."""
    code = (
        "import sys\nfrom dpfl_tf.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n"
        "    pass\nprint('TF-LOADED' if 'tensorflow' in sys.modules else 'NO-TF',"
        " 'DPA-LOADED' if {'dp_accounting', 'scipy'} & set(sys.modules) else 'NO-DPA')" % (args,)
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=120,
    )
    assert out.stdout.strip().endswith("NO-TF NO-DPA"), out.stdout[-500:] + out.stderr[-500:]
    assert "usage: dpfl-tf" in out.stdout


def test_help_import_time_has_no_tensorflow():
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dpfl_tf", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=120,
    )
    assert out.returncode == 0
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()]
    assert "dpfl_tf.cli" in imported and "tensorflow" not in imported and "keras" not in imported


# -- output paths -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "command",
    [["train", "mnist", "--epochs", "1"], ["federated", "--rounds", "1", "--no-progress"]],
)
def test_unwritable_output_is_refused_before_data_loads(command, tmp_path):
    (tmp_path / "afile").write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    offline = dict(
        DPFL_DATA_DIR=str(empty), HOME=str(empty), KERAS_HOME=str(empty), DPFL_NO_DOWNLOAD="1"
    )  # loading data would fail with another message
    for flag, value, message in [
        ("--output", str(tmp_path / "afile" / "r.json"), "is a file, not a directory"),
        ("--output", "/proc/dpfl_out/r.json", "cannot write there"),
        ("--checkpoint-dir", str(tmp_path / "afile"), "it is a file, not a directory"),
    ]:
        args = [*command, flag, value]
        if flag != "--output":
            args += ["--output", str(tmp_path / "ok" / "r.json")]
        res = _run(args, **offline)
        assert res.returncode == 2, res.stderr[-2000:]
        last = res.stderr.strip().splitlines()[-1]
        assert (
            last.startswith(f"dpfl-tf {command[0]}: error: {flag} {value}: ") and message in last
        ), res.stderr[-2000:]
        assert "download disabled" not in res.stderr and "Traceback" not in res.stderr


def test_train_refusals_are_one_line_and_missing_data_names_the_flags(tmp_path):
    """A refusal is one line (no usage block); a finished run's results are not
    replaced without --overwrite; the data-not-found message of `train` and
    `federated` (both take --data-dir) speaks the command line's words, not
    Python's (data_dir=, download=False)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    offline = dict(
        DPFL_DATA_DIR=str(empty), HOME=str(empty), KERAS_HOME=str(empty), DPFL_NO_DOWNLOAD="1"
    )
    done = tmp_path / "done.json"
    done.write_text(json.dumps({"status": "completed", "test_accuracy": 0.9448}))
    for args, message in (
        (["--mirror-views"], "--mirror-views is for --model scatter_linear"),
        (
            ["--output", str(done)],
            "holds the results of a finished run (status completed); pass --overwrite",
        ),
    ):
        res = _run(["train", "mnist", *args], **offline)
        assert res.returncode == 2 and res.stderr.strip().splitlines() == [
            f"dpfl-tf train: error: {res.stderr.strip().split('error: ', 1)[1]}"
        ], res.stderr
        assert message in res.stderr and "usage:" not in res.stderr
    assert json.loads(done.read_text())["test_accuracy"] == 0.9448  # untouched
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for command in (
        ["train", "mnist", "--output", str(done), "--overwrite"],
        ["federated", "--rounds", "1", "--output", str(tmp_path / "fed.json")],
    ):
        res = _run([*command, "--data-dir", str(elsewhere)], **offline)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert str(elsewhere) in res.stderr  # where --data-dir pointed is searched
        assert "--data-dir /that/dir" in res.stderr and "usage:" not in res.stderr
        for python_words in ("data_dir", "download=True", "download=False"):
            assert python_words not in res.stderr, res.stderr


# -- train: Ctrl-C, SIGTERM, resume --------------------------------------------------------------
# epochs of 100 lots (600 of 60,000): the signal comes in epoch 2 (the results file says
# "running" once epoch 1 is written), two epochs before the end even on a loaded machine; the
# resume finishes epoch 2 in a fit of its own, then trains epochs 3-4
TRAIN = ["train", "mnist", "--epochs", "4", "--epsilon", "8"]
LOTS = 400


def test_train_ctrl_c_keeps_results_and_checkpoint_and_resumes_exactly(tmp_path):
    out, ckpt = tmp_path / "t.json", tmp_path / "ckpt"
    args = [*TRAIN, "--output", str(out), "--checkpoint-dir", str(ckpt)]
    code, err = _interrupt_while_running(args, out, signal.SIGINT)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    message = [line for line in err.splitlines() if line.startswith("interrupted (Ctrl-C)")]
    assert len(message) == 1 and "checkpoint in" in message[0]
    assert f"resume with: dpfl-tf {' '.join(args)}" in message[0]
    data = _read(out)
    lots = data["lots"]
    assert data["status"] == "interrupted" and 100 < lots < LOTS  # in epoch 2
    assert [e["count"] for e in data["ledger"]] == [1, lots]  # DP-PCA, then the lots
    state = _read(ckpt / "state.json")
    assert state["lots_applied"] == state["ledger_count"] - 1 == lots

    resumed = _run(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt}: {lots} lots" in resumed.stdout
    assert "epsilon so far" in resumed.stdout
    final = _read(out)
    assert final["status"] == "completed" and final["lots"] == LOTS  # as if never stopped
    assert [e["count"] for e in final["ledger"]] == [1, LOTS]
    assert final["history"][-1]["lots"] == LOTS
    assert _read(ckpt / "state.json")["lots_applied"] == LOTS
    assert not [n for n in NOISE if n in resumed.stderr], resumed.stderr[-2000:]
    # a finished run is not resumed again
    again = _run(args)
    assert again.returncode == 2 and "holds a finished run" in again.stderr


def test_train_sigterm_marks_results_interrupted_and_writes_a_checkpoint(tmp_path):
    out = tmp_path / "t.json"
    code, err = _interrupt_while_running([*TRAIN, "--output", str(out)], out, signal.SIGTERM)
    assert code == 143, err[-3000:]
    assert "Traceback" not in err and "interrupted (SIGTERM)" in err
    data = _read(out)
    assert data["status"] == "interrupted" and data["ledger"][-1]["count"] == data["lots"]
    default = tmp_path / "t.checkpoint"
    assert _read(default / "state.json")["lots_applied"] == data["lots"]
    assert f"--checkpoint-dir {default}" in err


# -- train cifar10 (frozen convolutions): SIGTERM, resume, a failure mid-run -----------------
CIFAR_TRAIN, CIFAR_TEST, CIFAR_PUBLIC = 40, 10, 100  # real images per class; public images
CIFAR_LOTS_PER_EPOCH = (10 * CIFAR_TRAIN - CIFAR_PUBLIC) // 50  # 300 private, lots of 50


@pytest.fixture(scope="module")
def cifar_slice(tmp_path_factory):
    """(data dir, weights): real images of the offline JPEG copy, and the weights of
    a one-epoch pretraining on the slice's 100-image public split."""
    from tests.data import CIFAR10_JPEG_ARCHIVE, isolate, real_cifar10_jpeg_slice

    if not CIFAR10_JPEG_ARCHIVE.is_file():
        pytest.skip(f"no offline JPEG copy at {CIFAR10_JPEG_ARCHIVE}")
    root = tmp_path_factory.mktemp("cifar")
    real_cifar10_jpeg_slice(root / "cifar10_jpg", n_test=CIFAR_TEST, n_train=CIFAR_TRAIN)
    weights = root / "public.weights.h5"
    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, tmp_path_factory.mktemp("pre"))
        from dpfl_tf.recipes.cifar10 import PretrainConfig, pretrain_public, save_pretrained

        net, info = pretrain_public(
            PretrainConfig(
                public_size=CIFAR_PUBLIC, epochs=1, batch_size=50, seed=0, data_dir=str(root)
            ),
            verbose=False,
        )
        save_pretrained(net, info, weights)
    return root, weights


def _cifar(data_dir, weights, out, *more, epochs=5):
    """`train cifar10` on the slice: 6 lots of 50 per epoch, sigma 1, `epochs` epochs."""
    args = [
        "train",
        "cifar10",
        "--pretrained",
        str(weights),
        "--data-dir",
        str(data_dir),
        "--lot-size",
        "50",
        "--epochs",
        str(epochs),
        "--noise-multiplier",
        "1",
        "--epsilon",
        "100",
        "--output",
        str(out),
        *more,
    ]
    env = dict(
        DPFL_DATA_DIR=str(data_dir), DPFL_NO_DOWNLOAD="1", DPFL_CACHE_DIR=str(out.parent / "cache")
    )
    return args, env


def _epsilon(lots):
    from dpfl_tf.privacy import compute_epsilon, dp_sgd_event

    q = 50 / (10 * CIFAR_TRAIN - CIFAR_PUBLIC)
    return compute_epsilon(dp_sgd_event(1.0, lots, sampling_rate=q), 1e-5, "moments")


def test_train_cifar10_sigterm_then_resume_continues_the_ledger(cifar_slice, tmp_path):
    out, ckpt = tmp_path / "c.json", tmp_path / "ckpt"
    args, env = _cifar(*cifar_slice, out, "--checkpoint-dir", str(ckpt))
    total = 5 * CIFAR_LOTS_PER_EPOCH
    code, err = _interrupt_while_running(args, out, signal.SIGTERM, **env)
    assert code == 143, err[-3000:]
    assert "Traceback" not in err
    message = [line for line in err.splitlines() if line.startswith("interrupted (SIGTERM)")]
    assert len(message) == 1 and f"resume with: dpfl-tf {' '.join(args)}" in message[0]
    data = _read(out)
    lots = data["lots"]
    assert data["status"] == "interrupted" and CIFAR_LOTS_PER_EPOCH <= lots < total
    assert [e["count"] for e in data["ledger"]] == [lots]
    assert data["epsilon"] == pytest.approx(_epsilon(lots), rel=1e-9)
    state = _read(ckpt / "state.json")
    assert state["lots_applied"] == state["ledger_count"] == lots
    assert _read(ckpt / "run.json")["finished"] is None

    resumed = _run(args, **env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"resumed from {ckpt}: {lots} lots ({lots / CIFAR_LOTS_PER_EPOCH:.2f} epochs), "
        f"epsilon so far {data['epsilon']:.4f}"
    ) in resumed.stdout
    final = _read(out)
    # the ledger goes on from the checkpoint: the lots before the signal plus those trained
    # after the resume make the lots of an uninterrupted run, and epsilon is theirs
    assert final["status"] == "completed" and final["lots"] == total
    assert [e["count"] for e in final["ledger"]] == [total]
    assert final["epsilon"] == pytest.approx(_epsilon(total), rel=1e-9)
    assert final["epsilon"] > data["epsilon"]
    history = final["history"]
    assert [r["epoch"] for r in history] == list(range(6))
    assert [r.get("lots") for r in history[1:]][-1] == total
    done = lots // CIFAR_LOTS_PER_EPOCH  # whole epochs before the signal: kept as they were
    assert history[: done + 1] == data["history"][: done + 1]
    assert all(r["lots"] > lots for r in history[done + 1 :])
    assert final["frozen_layers_unchanged"] and final["frozen_layers"] == ["conv1", "conv2", "fc1"]
    assert final["trainable_layers"] == ["fc2", "logits"]
    assert final["pretrained_on_cifar10_test"] == data["pretrained_on_cifar10_test"]
    assert _read(ckpt / "state.json")["lots_applied"] == total
    assert _read(ckpt / "run.json")["finished"]  # marked finished: not resumed again (the
    # refusal itself is checked by the MNIST Ctrl-C test, the same code)
    assert not [n for n in NOISE if n in resumed.stderr], resumed.stderr[-2000:]


def test_train_cifar10_failing_mid_run_leaves_results_marked_failed(cifar_slice, tmp_path):
    """The training images go bad while the run reads them (a disk or a network share
    failing): the run stops with an error, and the results file keeps what was measured
    up to the last finished epoch, marked failed."""
    root, weights = cifar_slice
    data_dir = tmp_path / "data"
    shutil.copytree(root / "cifar10_jpg", data_dir / "cifar10_jpg")
    out = tmp_path / "c.json"
    args, env = _cifar(data_dir, weights, out, epochs=20)
    proc = _start(args, **env)
    _wait_for(lambda: (_read(out) or {}).get("status") == "running", proc)
    for image in (data_dir / "cifar10_jpg" / "train").rglob("*.jpg"):
        image.write_bytes(b"not a JPEG any more")
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err[-3000:]
    # one line naming what was kept, no usage block, no traceback
    assert "failed after" in err and "(status failed)" in err, err[-3000:]
    assert "usage:" not in err and "Traceback" not in err, err[-3000:]
    data = _read(out)
    assert data["status"] == "failed", err[-3000:]
    assert "not a JPEG" in data["error"] or ".jpg" in data["error"], data["error"]
    lots = data["lots"]
    assert 1 <= data["epochs"] < 20 and lots == data["epochs"] * CIFAR_LOTS_PER_EPOCH
    assert [e["count"] for e in data["ledger"]] == [lots]
    assert data["epsilon"] == pytest.approx(_epsilon(lots), rel=1e-9)
    assert [r["epoch"] for r in data["history"]] == list(range(data["epochs"] + 1))


def test_train_scatter_run_prints_no_third_party_start_up_lines(cifar_slice, tmp_path):
    """A ScatterNet run (scattering transform, DP feature statistics, mirror views)
    prints what the run says and nothing from TensorFlow or absl; with -v it may."""
    root, _ = cifar_slice
    out = tmp_path / "s.json"
    args, env = _cifar(root, None, out, "--model", "scatter_linear", epochs=1)
    args = [a for a in args if a not in ("--pretrained", "None")]
    res = _run(args, **env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _read(out)["status"] == "completed"
    for stream in (res.stdout, res.stderr):
        assert not [n for n in (*NOISE, "absl") if n in stream], stream[-2000:]
        # absl / TensorFlow C++ log lines: "I0000 00:00:..." before absl starts logging,
        # "W0526 12:34:56.789 ..." after it
        assert not re.search(r"(?m)^[IWEF]\d{4} \d\d:\d\d:\d\d", stream), stream[-2000:]


# -- federated: Ctrl-C and resume ------------------------------------------------------------
FED = [
    "federated",
    "--clients",
    "10",
    "--train-subset",
    "600",
    "--clients-per-round",
    "5",
    "--rounds",
    "12",
    "--local-epochs",
    "4",
    "--hidden",
    "16",
    "--dp",
    "global",
    "--delta-max",
    "1e-3",
    "--no-progress",
]


def test_federated_ctrl_c_then_resume(tmp_path):
    """Ctrl-C mid-run: exit 130, the results and checkpoint kept, and a resume command
    that names the checkpoint directory once (it was appended again when given as
    ``--checkpoint-dir=X``); running that command resumes from the checkpoint."""
    out, ckpt = tmp_path / "f.json", tmp_path / "ckpt"
    args = [*FED, "--output", str(out), f"--checkpoint-dir={ckpt}"]
    code, err = _interrupt_while_running(args, out, signal.SIGINT)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "resume with:" in err
    data = _read(out)
    done = data["rounds"]
    assert data["status"] == "interrupted" and 1 <= done < 12
    assert data["privacy"]["rounds"] == done == len(data["history"])
    assert _read(ckpt / "state.json")["round"] == done
    command = err.split("resume with: ", 1)[1].splitlines()[0].strip()
    assert command.count("--checkpoint-dir") == 1 and f"--checkpoint-dir={ckpt}" in command
    words = shlex.split(command)
    assert words[:2] == ["dpfl-tf", "federated"]

    resumed = _run(words[1:])  # the printed command
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt}: {done} rounds, epsilon so far" in resumed.stdout
    final = _read(out)
    assert final["status"] == "completed" and final["rounds"] == final["privacy"]["rounds"] == 12
    assert [r["round"] for r in final["history"]] == list(range(1, 13))
