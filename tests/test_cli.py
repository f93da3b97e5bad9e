"""`dpfl-tf privacy` end to end, through the real entry points."""

import json
import subprocess
import sys

import pytest

from dpfl_tf.cli import main
from tests import warm_python


def run(args):
    return warm_python.run(
        [sys.executable, "-m", "dpfl_tf", *args], capture_output=True, text=True, timeout=120
    )


def test_privacy_json_reproduces_paper_value():
    out = run(
        [
            "privacy",
            "--sampling-rate",
            "0.01",
            "--noise-multiplier",
            "4",
            "--epochs",
            "100",
            "--delta",
            "1e-5",
            "--json",
        ]
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["epsilon"] == pytest.approx(1.259, abs=0.02)
    for key in ["epsilon", "delta", "accountant", "steps", "sampling_rate", "noise_multiplier"]:
        assert key in data
    assert data["steps"] == 10000 and data["accountant"] == "moments"


def test_privacy_text_and_calibration(capsys):
    assert (
        main(
            [
                "privacy",
                "-q",
                "0.01",
                "--target-epsilon",
                "2",
                "--epochs",
                "100",
                "--delta",
                "1e-5",
                "--accountant",
                "rdp",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["epsilon"] <= 2.0 and data["noise_multiplier"] > 0
    assert main(["privacy", "-q", "0.01", "-s", "4", "-T", "40000", "-d", "1e-5"]) == 0
    assert "epsilon = 2.57" in capsys.readouterr().out


def test_privacy_counts_in_the_number_they_take(capsys):
    assert main(["privacy", "-q", "0.01", "-s", "1.1", "-E", "1", "-d", "1e-5"]) == 0
    assert "100 steps (1 epoch):" in capsys.readouterr().out
    assert main(["privacy", "-q", "0.01", "-s", "1.1", "-E", "2.5", "-d", "1e-5"]) == 0
    assert "250 steps (2.5 epochs):" in capsys.readouterr().out
    shuffle = ["--sampling", "shuffle", "--dataset-size", "100", "--lot-size", "100"]
    assert (
        main(["privacy", "-s", "1.1", "-T", "1", "-d", "1e-5", *shuffle, "--accountant", "rdp"])
        == 0
    )
    assert "1 step: 1 epoch of 1 lot touched" in capsys.readouterr().out


def test_zero_noise_is_said_plainly(capsys):
    assert main(["privacy", "-q", "0.01", "-s", "0", "-E", "1", "-d", "1e-5"]) == 0
    assert "epsilon = inf" in capsys.readouterr().out
    assert main(["privacy", "-q", "0.01", "-s", "0", "-E", "1", "-d", "1e-5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["epsilon"] is None and data["epsilon_is_infinite"] is True


def test_privacy_shuffle_counts_every_epoch_touched(capsys):
    """An epoch of shuffled lots is N // L lots: 2341 lots of 256 from 60000 touch
    ceil(2341 / 234) = 11 epochs, and --epochs 10 means 10 * 234 lots."""
    from dpfl_tf.privacy import compute_epsilon, dp_sgd_event

    base = [
        "privacy",
        "--sampling",
        "shuffle",
        "--dataset-size",
        "60000",
        "--lot-size",
        "256",
        "-s",
        "4",
        "-d",
        "1e-5",
        "--json",
    ]
    assert main(base + ["-T", "2341"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["event"] == "11 x Gaussian(sigma=2) (replace-one)"
    assert data["epochs_accounted"] == 11 and data["lots_per_epoch"] == 234
    assert data["epsilon"] == compute_epsilon(
        dp_sgd_event(4.0, 2341, "shuffle", epochs=11), 1e-5, "moments"
    )
    assert main(base + ["-T", "2340"]) == 0
    assert json.loads(capsys.readouterr().out)["epochs_accounted"] == 10
    assert main(base + ["--epochs", "10"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"] == 2340 and data["epochs_accounted"] == 10
    assert data["event"] == "10 x Gaussian(sigma=2) (replace-one)"
    assert main(base[:-1] + ["-T", "2341"]) == 0
    assert "11 epochs" in capsys.readouterr().out


def test_privacy_refuses_a_sampling_rate_that_contradicts_the_sizes():
    out = run(
        [
            "privacy",
            "-q",
            "0.01",
            "--dataset-size",
            "60000",
            "--lot-size",
            "256",
            "-s",
            "4",
            "-E",
            "1",
            "-d",
            "1e-5",
        ]
    )
    assert out.returncode != 0 and "--sampling-rate" in out.stderr and "0.01" in out.stderr
    out = run(
        [
            "privacy",
            "--sampling",
            "shuffle",
            "-q",
            "0.01",
            "--dataset-size",
            "60000",
            "--lot-size",
            "256",
            "-s",
            "4",
            "-E",
            "1",
            "-d",
            "1e-5",
        ]
    )
    assert out.returncode != 0 and "--sampling-rate" in out.stderr and "shuffle" in out.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["-q", "1.5", "-s", "1", "-E", "1", "-d", "1e-5"], "--sampling-rate must be in (0, 1]"),
        (["-q", "0", "-s", "1", "-E", "1", "-d", "1e-5"], "--sampling-rate must be in (0, 1]"),
        (["-q", "0.1", "-s", "-1", "-E", "1", "-d", "1e-5"], "--noise-multiplier must be >= 0"),
        (["-q", "0.1", "-s", "nan", "-E", "1", "-d", "1e-5"], "--noise-multiplier must be >= 0"),
        (["-q", "0.1", "-s", "1", "-T", "-5", "-d", "1e-5"], "--steps must be a whole number >= 0"),
        (["-q", "0.1", "-s", "1", "-E", "-1", "-d", "1e-5"], "--epochs must be >= 0"),
        (["-q", "0.1", "-s", "1", "-E", "1", "-d", "0"], "--delta must be in (0, 1)"),
        (["-q", "0.1", "-s", "1", "-E", "1", "-d", "1.5"], "--delta must be in (0, 1)"),
        (["-q", "0.1", "-s", "1", "-E", "1", "-d", "nan"], "--delta must be in (0, 1)"),
        (["-q", "x", "-s", "1", "-E", "1", "-d", "1e-5"], "not a number"),
        (["--sampling", "fixed_size", "-s", "1", "-E", "1", "-d", "1e-5"], "needs --dataset-size"),
    ],
)
def test_bad_input_exits_nonzero_naming_the_argument(args, message):
    out = run(["privacy", *args])
    assert out.returncode != 0
    assert message in out.stderr


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("dpfl-tf")
    if exe is None:
        pytest.skip("package not installed with pip (console script absent)")
    out = subprocess.run(
        [exe, "privacy", "-q", "0.01", "-s", "4", "-E", "1", "-d", "1e-5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "epsilon =" in out.stdout


def test_train_runs_end_to_end_and_writes_results(tmp_path):
    out = tmp_path / "train.json"
    res = run(
        ["train", "mnist", "--epsilon", "2", "--epochs", "1", "--seed", "0", "--output", str(out)]
    )
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["epochs"] == 1 and data["test_accuracy"] > 0.5
    assert data["accountant"] == "moments"  # the paper's; only scatter models default to pld
    assert data["epsilon"] <= 2.0
    assert "test accuracy =" in res.stdout and "epsilon =" in res.stdout
    assert "(non-private statistic)" in res.stdout  # train accuracy is on the private data
    assert "train_accuracy" in data["non_private_statistics"]
    assert "NOT for deployment" in res.stdout
    assert (tmp_path / "train.png").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--epsilon", "-1"], "--epsilon must be > 0"),
        (["--delta", "2"], "--delta must be in (0, 1)"),
        (["--lot-size", "0"], "--lot-size must be a whole number >= 1"),
        (["--noise-multiplier", "-2"], "--noise-multiplier must be > 0"),
    ],
)
def test_train_bad_input(args, message, tmp_path):
    out = tmp_path / "never.json"
    res = run(["train", "mnist", *args, "--output", str(out)])
    assert res.returncode != 0 and message in res.stderr
    assert not out.exists()


def test_train_unknown_dataset_and_missing_data(tmp_path, monkeypatch):
    res = run(["train", "cifar1000"])
    assert res.returncode != 0 and "invalid choice" in res.stderr
    # the CLI with the system data directory hidden (Debian's dataset-fashion-mnist
    # installs there, as CI does): the search finds nothing and says where it looked
    hide_system_data = (
        "import sys; import dpfl_tf.data.locate as where; where.SYSTEM_DATA_DIRS = (); "
        "from dpfl_tf.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env_run = subprocess.run(
        [
            sys.executable,
            "-c",
            hide_system_data,
            "train",
            "fashion_mnist",
            "--epochs",
            "1",
            "--data-dir",
            str(tmp_path),
            "--output",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **__import__("os").environ,
            "DPFL_DATA_DIR": str(tmp_path),
            "HOME": str(tmp_path),
            "DPFL_NO_DOWNLOAD": "1",
            "KERAS_HOME": str(tmp_path / "keras"),
        },
    )
    assert env_run.returncode == 2, env_run.stdout[-2000:] + env_run.stderr[-2000:]
    assert "apt-get install -y dataset-fashion-mnist" in env_run.stderr  # the refusal's advice
    assert str(tmp_path) in env_run.stderr and not (tmp_path / "r.json").exists()


def test_federated_is_a_dpfl_tf_command():
    out = run(["federated", "--help"])
    assert out.returncode == 0 and "--clients-per-round" in out.stdout


def _config_trained_by(monkeypatch, argv):
    """The recipe config `dpfl-tf <argv>` would train, caught before training."""
    from dpfl_tf import cli
    from dpfl_tf.recipes import mnist

    class Seen(Exception):
        pass

    def fake_train(config, **_):
        raise Seen(config)

    monkeypatch.setattr(mnist, "train_mnist", fake_train)
    with pytest.raises(Seen) as seen:
        cli.main(argv)
    return seen.value.args[0]


@pytest.mark.parametrize(
    "dataset,model,extra,norm,mirror",
    [
        ("cifar10", "scatter_linear", [], "dp_stats", True),
        ("cifar10", "scatter_cnn", [], "dp_stats", True),
        ("cifar10", "scatter_linear", ["--feature-norm", "group"], "group", True),
        ("cifar10", "scatter_cnn", ["--no-mirror-views"], "dp_stats", False),
        ("mnist", "scatter_linear", [], "group", False),
        ("fashion_mnist", "scatter_linear", ["--mirror-views"], "group", True),
    ],
)
def test_train_scatter_models_use_their_defaults(
    monkeypatch, tmp_path, dataset, model, extra, norm, mirror
):
    """`train cifar10 --model scatter_linear|scatter_cnn` goes to the ScatterNet recipe
    (lot 8192, lr 4, clip 0.1, momentum 0.9, 60 epochs, noise calibrated by the PLD
    accountant, channel statistics released under DP, mirror views), not the frozen
    convnet; mnist keeps GroupNorm and no mirror (a mirrored digit is another sign)."""
    config = _config_trained_by(
        monkeypatch,
        [
            "train",
            dataset,
            "--model",
            model,
            "--epsilon",
            "3",
            *extra,
            "--output",
            str(tmp_path / "r.json"),
        ],
    )
    colour = dataset == "cifar10"
    assert (
        config.dataset,
        config.model,
        config.lot_size,
        config.learning_rate,
        config.l2_norm_clip,
        config.momentum,
        config.epochs,
        config.noise_multiplier,
        config.target_epsilon,
        config.feature_norm,
        config.accountant,
        config.mirror_views,
    ) == (
        dataset,
        model,
        8192 if colour else 4096,
        4.0 if colour else 8.0,
        0.1,
        0.9,
        60,
        None,
        3.0,
        norm,
        "pld",
        mirror,
    )
    # the physical batch: smaller with two views, smallest for the CNN (memory only)
    assert config.batch_size == (4096 if not mirror else 256 if model == "scatter_cnn" else 2048)


def test_mirror_views_are_refused_for_models_without_scattering_features(capsys):
    from dpfl_tf import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "mnist", "--mirror-views"])
    assert stop.value.code == 2
    assert "--mirror-views is for --model scatter_linear and scatter_cnn" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model,extra,accountant",
    [
        ("scatter_linear", ["--accountant", "rdp"], "rdp"),  # an explicit choice wins
        ("scatter_cnn", ["--accountant", "moments"], "moments"),
        ("mlp", [], "moments"),  # Abadi et al.'s own accountant
        ("tanh_cnn", [], "pld"),
    ],
)  # as its measured recipe
def test_train_accountant_default_depends_on_the_model(
    monkeypatch, tmp_path, model, extra, accountant
):
    config = _config_trained_by(
        monkeypatch,
        ["train", "mnist", "--model", model, *extra, "--output", str(tmp_path / "r.json")],
    )
    assert config.accountant == accountant


@pytest.mark.parametrize(
    "model,expected",
    [
        # Papernot et al. 2021's recipe, not the MLP's (lot 600, clip 4, sigma 4)
        (
            "tanh_cnn",
            dict(
                lot_size=256,
                batch_size=256,
                l2_norm_clip=0.1,
                learning_rate=4.0,
                final_learning_rate=4.0,
                epochs=40,
                noise_multiplier=None,
                projection="none",
            ),
        ),
        # Abadi et al. 2016: the medium-noise setting for epsilon 2, linear decay over 10 epochs
        (
            "mlp",
            dict(
                lot_size=600,
                l2_norm_clip=4.0,
                learning_rate=0.1,
                final_learning_rate=0.052,
                decay_epochs=10,
                noise_multiplier=4.0,
                pca_noise_multiplier=7.0,
                projection="dp_pca",
                setting="medium_noise",
            ),
        ),
    ],
)
def test_train_models_run_their_papers_recipes(monkeypatch, tmp_path, model, expected):
    config = _config_trained_by(
        monkeypatch, ["train", "mnist", "--model", model, "--output", str(tmp_path / "r.json")]
    )
    assert {k: getattr(config, k) for k in expected} == expected


def test_a_given_setting_overrides_the_models_default_and_keeps_its_schedule(monkeypatch, tmp_path):
    config = _config_trained_by(
        monkeypatch,
        [
            "train",
            "mnist",
            "--lr",
            "0.2",
            "--lot-size",
            "300",
            "--noise-multiplier",
            "3",
            "--output",
            str(tmp_path / "r.json"),
        ],
    )
    assert (
        config.learning_rate,
        config.final_learning_rate,
        config.lot_size,
        config.noise_multiplier,
        config.setting,
    ) == (0.2, 0.104, 300, 3.0, "custom")


def test_every_recipe_states_what_its_defaults_reach():
    """`train --help` tells what each model's defaults reach at the default
    epsilon, with the results that show it: none may be unmeasured."""
    import os
    import re

    from dpfl_tf.recipes.settings import TRAIN_DEFAULTS, TrainDefaults

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for (family, model), d in TRAIN_DEFAULTS.items():
        assert d.reaches != TrainDefaults.reaches, (family, model)
        assert "not measured" not in d.reaches, (family, model, d.reaches)
        assert re.search(r"\d+(\.\d+)?%", d.reaches), (family, model, d.reaches)
        for path in re.findall(r"(?:results|experiments|models)/[\w./-]+\.\w+", d.reaches):
            assert os.path.exists(os.path.join(root, path)), (family, model, path)


# -- user-level DP-SGD (--users, --user-ids) and the private search (--tune) ---------------
@pytest.fixture
def small_mnist(monkeypatch):
    """The real MNIST cut to its first 2,000 training and 500 test examples, for
    the recipe the command runs (and so for the command)."""
    from tests.keras.helpers import cut_recipe_data

    cut_recipe_data(monkeypatch, 2000, 500)


def _refused(argv, capsys):
    """The one line `dpfl-tf <argv>` is refused with (exit code 2)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpfl-tf train: error: "), err
    return err[0]


TANH = ["train", "mnist", "--model", "tanh_cnn"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "mnist", "--users", "10", "--lot-size", "2"], "DP-PCA projection whose unit"),
        (TANH + ["--users", "10"], "give --lot-size, the expected number of users in a lot"),
        (["train", "cifar10", "--users", "10", "--lot-size", "2"], "the convnet recipe"),
        (
            ["train", "cifar10", "--model", "scatter_linear", "--users", "10", "--lot-size", "2"],
            "(--feature-norm dp_stats, this dataset's default) protect one example",
        ),
        (TANH + ["--user-ids", "/no/such/ids.npy", "--lot-size", "2"], "no such file"),
        (TANH + ["--users", "0", "--lot-size", "2"], "--users must be a whole number >= 1"),
        (TANH + ["--user-split", "unequal"], "--user-split is for user-level runs"),
        (TANH + ["--max-examples-per-user", "4"], "--max-examples-per-user is for user-level"),
        (TANH + ["--tune-trials", "3"], "--tune-trials is for --tune"),
        (TANH + ["--tune", "--noise-multiplier", "2"], "--tune with --noise-multiplier"),
        (TANH + ["--tune", "--lr", "1"], "give the values with --tune-lr"),
        (TANH + ["--tune", "--clip", "1"], "give the values with --tune-clip"),
        (TANH + ["--tune", "--checkpoint-dir", "ckpt"], "not checkpointed nor resumed"),
        (TANH + ["--tune", "--users", "10", "--lot-size", "2"], "--tune with --users"),
        (TANH + ["--tune", "--accountant", "pld"], "--accountant must be rdp"),
        (TANH + ["--tune", "--tune-trials", "1"], "--tune-trials must be > 1"),
        (TANH + ["--tune", "--tune-lr", "0.5,-1"], "--tune-lr must be > 0"),
        (TANH + ["--tune", "--tune-validation", "0"], "--tune-validation must be in (0, 1), got 0"),
        (TANH + ["--tune", "--tune-validation", "400"], "must be in (0, 1), got 400"),
        (["train", "mnist", "--tune"], "--tune with --model mlp needs --epochs"),
        (["train", "cifar10", "--tune"], "not convnet"),
    ],
)
def test_user_level_and_tune_refusals_name_the_flag(args, message, capsys, tmp_path):
    line = _refused([*args, "--output", str(tmp_path / "r.json")], capsys)
    assert message in line
    assert not (tmp_path / "r.json").exists()


def test_user_ids_and_users_cannot_both_be_given(capsys):
    with pytest.raises(SystemExit) as stop:
        main(TANH + ["--users", "10", "--user-ids", "ids.npy"])
    assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_user_ids_of_the_wrong_length_are_refused_once_the_data_are_read(
    small_mnist, tmp_path, capsys
):
    import numpy as np

    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(1999) % 40)  # one short of the 2,000 training examples
    out = tmp_path / "r.json"
    argv = TANH + ["--user-ids", str(ids), "--lot-size", "4", "--output", str(out)]
    line = _refused(argv, capsys)
    assert f"--user-ids {ids}: holds 1999 ids, the training set has 2000 examples" in line
    shards = ["--users", "1001", "--user-split", "shards", "--lot-size", "4"]
    line = _refused(TANH + [*shards, "--output", str(out)], capsys)
    assert "--users (1001) of user_split 'shards' hold two label shards each: at most 1000" in line
    np.save(ids, np.arange(2000) % 40)  # 40 users: a lot of 50 users is too many
    line = _refused(
        TANH + ["--user-ids", str(ids), "--lot-size", "50", "--output", str(out)], capsys
    )
    assert "--lot-size (50) counts users in a user-level run: it exceeds the 40 users" in line
    assert not out.exists()


@pytest.mark.slow
def test_users_run_is_user_level_and_prints_the_accountants_epsilon_per_user(
    small_mnist, tmp_path, capsys
):
    """200 simulated users of 10 examples, 10 users a lot: q = 10 / 200 (not the
    example-level 10 / 2,000) and 20 lots an epoch; the noise is calibrated for
    that, and the epsilon printed and saved is the RDP accountant's for it."""
    import dp_accounting

    out = tmp_path / "u.json"
    argv = TANH + ["--users", "200", "--lot-size", "10", "--epochs", "1", "--epsilon", "3"]
    argv += ["--accountant", "rdp", "--seed", "0", "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["status"] in ("completed", "budget_spent") and data["lots"] == 20
    assert (data["privacy_unit"], data["users"], data["examples"]) == ("user", 200, 2000)
    assert (data["user_split"], data["users_seed"], data["user_ids"]) == ("iid", 0, None)
    assert [(e["label"], e["count"]) for e in data["ledger"]] == [("dpsgd (user-level)", 20)]
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(
        dp_accounting.PoissonSampledDpEvent(
            10 / 200, dp_accounting.GaussianDpEvent(data["noise_multiplier"])
        ),
        20,
    )
    epsilon = accountant.get_epsilon(1e-5)
    assert data["epsilon"] == pytest.approx(epsilon, rel=1e-9) and epsilon <= 3.0
    assert f"epsilon = {epsilon:.4f} at delta = 1e-05 per user (user-level: 200 users" in printed
    assert "200 simulated users (iid split, seed 0)" in printed and "lot=10 users" in printed


def test_tune_refuses_a_budget_its_scores_alone_exceed(small_mnist, tmp_path, capsys):
    argv = TANH + ["--tune", "--tune-score-noise", "0.5", "--epsilon", "0.5", "--epochs", "1"]
    line = _refused([*argv, "--output", str(tmp_path / "t.json")], capsys)
    assert "validation scores alone cost epsilon = " in line and "budget 0.5" in line
    assert not (tmp_path / "t.json").exists()


@pytest.mark.slow
def test_tune_releases_the_best_trial_and_the_searchs_epsilon(small_mnist, tmp_path, capsys):
    """A private search (geometric number of trials, mean 1.2) on ~1,600 training
    examples, ~400 held out: the epsilon saved is the RDP accountant's for the
    RepeatAndSelect event of the trials actually run (n // 100 lots of q = 100 / n
    at the saved sigma, then the score's Gaussian of noise 20), within the
    budget and tight (1% less noise would exceed it); the number of trials is
    not in the results."""
    import dp_accounting
    from dp_accounting import dp_event

    out = tmp_path / "t.json"
    argv = TANH + ["--tune", "--tune-trials", "1.2", "--epochs", "1", "--lot-size", "100"]
    argv += ["--tune-validation", "0.2", "--epsilon", "4", "--seed", "0", "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["status"] == "completed" and data["accountant"] == "rdp"
    n, held = data["trial"]["training_examples"], data["score"]["validation_examples"]
    assert n + held == 2000 and abs(held - 400) < 100  # held out by content, p = 0.2
    lots = data["trial"]["lots"]
    assert lots == n // 100

    def search(sigma):
        run = dp_accounting.ComposedDpEvent(
            [
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.PoissonSampledDpEvent(
                        100 / n, dp_accounting.GaussianDpEvent(sigma)
                    ),
                    lots,
                ),
                dp_accounting.GaussianDpEvent(20.0),
            ]
        )
        accountant = dp_accounting.rdp.RdpAccountant()
        accountant.compose(dp_event.RepeatAndSelectDpEvent(run, 1.2, 1.0))
        return accountant.get_epsilon(1e-5)

    sigma = data["noise_multiplier"]
    assert data["epsilon"] == pytest.approx(search(sigma), rel=1e-9)
    assert data["epsilon"] <= 4.0 < search(0.99 * sigma)
    assert data["search"]["epsilon_covers_search"] is True
    assert data["trials"] == "geometric(mean=1.2)" and data["privacy_unit"] == "example"
    assert data["trial_epsilon"] < data["epsilon"]
    best = data["best"]
    assert best["hyperparameters"]["learning_rate"] in data["space"]["learning_rate"]
    assert best["hyperparameters"]["l2_norm_clip"] in data["space"]["l2_norm_clip"]
    assert data["space"] == {
        "learning_rate": [1.0, 2.0, 4.0, 8.0],
        "l2_norm_clip": [0.05, 0.1, 0.2],
    }
    assert 0.0 <= data["test_accuracy"] == best["test_accuracy"] <= 1.0
    # what the results hold, and nothing that tells how many trials ran (no count, no
    # time: the search's duration would give the count)
    assert set(data) == {
        "status", "dataset", "model", "mode", "epsilon", "epsilon_covers",
        "target_epsilon", "delta", "accountant", "trials", "trial_epsilon",
        "noise_multiplier", "test_accuracy", "best", "search", "trial", "score", "space",
        "recipe", "privacy_unit", "privacy_units", "stop_reason", "not_released", "note",
    }  # fmt: skip
    assert set(data["search"]) <= {
        "epsilon", "delta", "accountant", "event", "epsilon_covers_search", "trials",
        "best", "trial_epsilon", "note",
    }, set(data["search"])  # fmt: skip
    assert "trial 1: learning rate" not in printed and "no line per trial" in printed
    assert f"test accuracy = {data['test_accuracy']:.4f} (the best trial's model)" in printed
    assert f"epsilon = {data['epsilon']:.4f} at delta = 1e-05 for the whole search" in printed


def _search_epsilon(data, trials_event, accountant):
    """dp-accounting's epsilon of the search a `--tune` results file saved:
    `trials_event(run)` around one run (its lots at the saved sigma, then the
    score's Gaussian of noise 20), composed in `accountant`."""
    import dp_accounting

    n, lots = data["trial"]["training_examples"], data["trial"]["lots"]
    run = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(
                    100 / n, dp_accounting.GaussianDpEvent(data["noise_multiplier"])
                ),
                lots,
            ),
            dp_accounting.GaussianDpEvent(20.0),
        ]
    )
    accountant.compose(trials_event(run))
    return accountant.get_epsilon(1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "distribution, trials, described, shape",
    [
        ("logarithmic", "1.5", "logarithmic(mean=1.5)", 0.0),
        ("poisson", "1.5", "Poisson(mean=1.5)", float("inf")),
        ("fixed", "2", "2 (fixed)", None),
    ],
)
def test_each_trial_distribution_is_the_event_the_search_is_charged(
    distribution, trials, described, shape, monkeypatch, tmp_path, capsys
):
    """--tune-distribution logarithmic / poisson / fixed on a 600-example slice:
    the saved epsilon is dp-accounting's epsilon of that distribution's event
    (RepeatAndSelect with shape 0 or inf, in RDP; k runs composed when fixed, in
    PLD, the recipe's default accountant) at the saved sigma, within the budget.
    --tune-show-trials prints one line per trial run (with a warning, for a
    secret count); a fixed count prints them anyway.  With no --output, a random
    search's file name carries no date."""
    import re

    import dp_accounting

    from tests.keras.helpers import cut_recipe_data

    def event(run):
        if shape is None:
            return dp_accounting.SelfComposedDpEvent(run, int(trials))
        return dp_accounting.dp_event.RepeatAndSelectDpEvent(run, float(trials), shape)

    if shape is None:
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        accountant = dp_accounting.rdp.RdpAccountant()

    cut_recipe_data(monkeypatch, 600, 100)
    monkeypatch.chdir(tmp_path)
    argv = TANH + ["--tune", "--tune-distribution", distribution, "--tune-trials", trials]
    argv += ["--tune-show-trials", "--epochs", "1", "--lot-size", "100"]
    argv += ["--tune-validation", "0.2", "--epsilon", "4", "--seed", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    [path] = (tmp_path / "runs").iterdir()
    data = json.loads(path.read_text())
    assert data["trials"] == described
    assert data["accountant"] == ("pld" if shape is None else "rdp")
    expected = _search_epsilon(data, event, accountant)
    assert data["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert data["epsilon"] <= 4.0
    lines = re.findall(r"^trial (\d+): learning rate \S+, clip \S+ \(\d+ s\)$", printed, re.M)
    assert lines == [str(i) for i in range(1, len(lines) + 1)]
    if distribution == "fixed":
        assert len(lines) == 2 and "keep this output private" not in printed
        assert re.fullmatch(r"train_mnist-\d{8}-\d{6}\.json", path.name), path.name
    else:
        assert "the trial lines below show how many trials ran" in printed
        assert re.fullmatch(r"train_mnist-[0-9a-f]{8}\.json", path.name), path.name
    if lines:
        assert data["best"] is not None and "best trial (released)" in printed
    else:  # Poisson may draw no trial: nothing is released
        assert data["best"] is None and "the search drew no trial (Poisson)" in printed
