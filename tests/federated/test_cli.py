"""`dpfl-tf federated`: the parser, its errors, and a tiny end-to-end run."""

import argparse
import json

import pytest

from dpfl_tf.federated.cli import add_federated_parser, config_from_args


def _parser():
    parser = argparse.ArgumentParser(prog="dpfl-tf")
    sub = parser.add_subparsers(dest="command")
    return parser, add_federated_parser(sub)


def _run(tmp_path, capsys, *argv) -> tuple[dict, str]:
    """Runs `dpfl-tf federated ... --no-progress`; (results file, printed text with
    whitespace collapsed)."""
    parser, fed = _parser()
    out = tmp_path / "run.json"
    args = parser.parse_args(["federated", *argv, "--no-progress", "--output", str(out)])
    assert args.func(args, fed.error) == 0
    printed = " ".join(capsys.readouterr().out.split())
    return json.loads(out.read_text()), printed


def test_parser_reads_the_documented_flags():
    parser, _ = _parser()
    args = parser.parse_args(
        "federated --dataset mnist --clients 1000 --partition shards --dp global --epsilon 8 "
        "--clients-per-round 100 --sampling poisson --rounds 50 --local-epochs 4 "
        "--local-batch-size 10 --lr 0.05 --momentum 0.9 --clip 1.5 --noise-multiplier 1.1 "
        "--delta-max 1e-5 --accountant rdp --aggregator mean --seed 3 --output r.json".split()
    )
    c = config_from_args(args)
    assert (c.clients, c.clients_per_round, c.rounds, c.local_epochs, c.local_batch_size) == (
        1000,
        100,
        50,
        4,
        10,
    )
    assert c.dp.value == "global" and c.target_epsilon == 8 and c.delta_max == 1e-5
    assert c.clip == 1.5 and c.noise_multiplier == 1.1 and c.accountant.value == "rdp"
    assert c.learning_rate == 0.05 and c.momentum == 0.9 and c.seed == 3
    adaptive = config_from_args(
        parser.parse_args(
            "federated --dp global --clip adaptive --clip-initial 0.3 --clip-quantile 0.7 "
            "--clip-lr 0.1 --clip-count-stddev 4".split()
        )
    )
    assert (
        adaptive.clip,
        adaptive.clip_initial,
        adaptive.clip_quantile,
        adaptive.clip_lr,
        adaptive.clip_count_stddev,
    ) == ("adaptive", 0.3, 0.7, 0.1, 4.0)
    defaults = config_from_args(parser.parse_args("federated --dp global --clip adaptive".split()))
    assert (defaults.clip_quantile, defaults.clip_lr, defaults.clip_count_stddev) == (
        0.5,
        0.2,
        None,
    )


@pytest.mark.parametrize(
    "argv", ["", "--dp global", "--dp client", "--dp local", "--dp distributed"]
)
def test_the_defaults_are_the_configs(argv):
    """No flag given: the CLI builds exactly the config's defaults (they were 100 rounds in
    the CLI against 10 in FederatedConfig), mode-dependent ones resolved by the config."""
    from dpfl_tf.federated.runner import FederatedConfig

    parser, _ = _parser()
    args = parser.parse_args(["federated", *argv.split()])
    dp = argv.split()[-1] if argv else "none"
    assert config_from_args(args) == FederatedConfig(dp=dp)
    c = FederatedConfig(dp=dp)
    assert (c.clients, c.rounds, c.fraction, c.hidden) == (1000, 100, 0.1, (32,))
    assert (c.sampling.value, c.accountant.value, c.noise_multiplier) == {
        "none": ("poisson", "moments", 0.0),
        "global": ("poisson", "moments", 1.0),
        "client": ("fixed_size", "rdp", 0.2),
        "local": ("poisson", "moments", 0.0),
        "distributed": ("fixed_size", "rdp", 2.0),
    }[dp]


def test_help_shows_every_default_and_the_choices_are_the_enums(capsys):
    from dpfl_tf.federated.distributed_dp import DistributedMechanism
    from dpfl_tf.federated.partition import PartitionScheme
    from dpfl_tf.federated.runner import AggregatorKind, DPMode
    from dpfl_tf.federated.settings import MechanismKind
    from dpfl_tf.privacy.accountants import AccountantKind

    parser, fed = _parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["federated", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    choices = {a.dest: a.choices for a in fed._actions if a.choices}
    for dest, enum in [
        ("partition", PartitionScheme),
        ("dp", DPMode),
        ("aggregator", AggregatorKind),
        ("accountant", AccountantKind),
        ("ldp_mechanism", MechanismKind),
        ("ddp_mechanism", DistributedMechanism),
    ]:
        assert choices[dest] == [m.value for m in enum]
    assert choices["sampling"] == ["poisson", "fixed_size", "cyclic_poisson"]
    for action in fed._actions:
        if action.dest in ("help", "verbose") or action.const is True:
            continue  # --help, -v and on/off switches
        assert "default" in fed.formatter_class("x")._get_help_string(action), action.dest
    for shown in [
        "number of clients K (default: 1000)",
        "(default: 100)",
        "(default: 1 with --dp global, 0.2 with --dp client, 2 with --dp "
        "distributed, 1 with --dp ftrl, 1 with --dp banded_mf, 1 with --dp blt)",
        "The defaults (MNIST, K = 1000",
    ]:
        assert shown in text, shown


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(clients=10, clients_per_round=20),
            r"clients_per_round \(m=20\) must be <= the number of clients \(K=10\)",
        ),
        (dict(dp="global", clients=100, delta_max=0.5), r"delta_max must be < 1/K = 0.01"),
        (
            dict(sampling="shuffle"),
            "sampling must be one of poisson, fixed_size, cyclic_poisson, got 'shuffle'",
        ),
        (dict(aggregator="trimmed"), "aggregator must be one of mean, median, got 'trimmed'"),
    ],
)
def test_the_config_owns_the_rules(kwargs, message):
    """The rules tying two settings live in FederatedConfig (the CLI, experiments and Flower
    get them without checking again)."""
    from dpfl_tf.federated.runner import FederatedConfig

    with pytest.raises(ValueError, match=message):
        FederatedConfig(**kwargs)


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--clients 10 --clients-per-round 20", "--clients-per-round (m=20) must be <= the number"),
        ("--dp global --clip 0", "--clip must be > 0"),
        ("--dp global --clip -1", "--clip must be > 0"),
        ("--dp global --delta-max 0.5 --clients 100", "--delta-max must be < 1/K = 0.01"),
        ("--dp client --sampling poisson", "needs sampling='fixed_size'"),
        ("--dp global --clip median", "no longer offered; use clip='adaptive'"),
        ("--dp none --clip adaptive", "offered for dp='global' only"),
        ("--dp global --clip adaptive --per-layer", "per_layer must be False"),
        ("--dp global --clip adaptive --clip-quantile 2", "--clip-quantile must be in [0, 1]"),
        ("--dp global --clip adaptive --clip-lr 0", "--clip-lr must be > 0"),
        ("--dp global --aggregator median", "aggregator must be 'mean'"),
        ("--clients 0", "--clients must be a whole number >= 1"),
        ("--lr 0", "--lr must be > 0"),
        ("--dp local --ldp-epsilon 0", "--ldp-epsilon must be in (0, 50], got 0.0"),
        (
            "--dp local --ldp-mechanism duchi --ldp-bound wide",
            "--ldp-bound must be a number > 0 or 'init', got 'wide'",
        ),
        ("--dp local --ldp-mechanism duchi --ldp-bound -1", "--ldp-bound must be > 0"),
        ("--dp local --epsilon 8", "--epsilon needs dp='global' or dp='client'"),
        ("--dp local --secure-mode", "secure_mode=True secures the Gaussian noise"),
        ("--dp none --secure-mode", "got dp='none'"),
    ],
)
def test_bad_arguments_name_the_flag(argv, message, capsys):
    parser, fed = _parser()
    args = parser.parse_args(["federated", *argv.split()])
    with pytest.raises(SystemExit):
        config_from_args(args, fed.error)
    err = " ".join(capsys.readouterr().err.split())
    assert message in err, err


def test_unknown_partition_is_refused(capsys):
    parser, _ = _parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["federated", "--partition", "by_magic"])
    assert "invalid choice: 'by_magic'" in capsys.readouterr().err


def test_tiny_run_writes_a_results_file(tmp_path, capsys):
    data, printed = _run(
        tmp_path,
        capsys,
        "--clients",
        "10",
        "--train-subset",
        "1000",
        "--clients-per-round",
        "4",
        "--rounds",
        "2",
        "--hidden",
        "16",
        "--dp",
        "global",
        "--epsilon",
        "20",
        "--delta-max",
        "1e-3",
    )
    assert "test accuracy =" in printed and "epsilon =" in printed
    for key in [
        "dataset",
        "partition",
        "clients",
        "clients_per_round",
        "rounds",
        "mechanism",
        "noise_multiplier",
        "clip",
        "epsilon",
        "delta",
        "accountant",
        "test_accuracy",
        "seconds",
        "history",
    ]:
        assert key in data
    assert data["mechanism"] == "global_dp" and data["rounds"] == 2
    assert 0 < data["epsilon"] <= 20 and len(data["history"]) == 2


def test_local_dp_run_reports_the_budget_per_coordinate_upload_and_total(tmp_path, capsys):
    data, printed = _run(
        tmp_path,
        capsys,
        "--clients",
        "5",
        "--train-subset",
        "500",
        "--clients-per-round",
        "5",
        "--sampling",
        "fixed_size",
        "--partition",
        "iid",
        "--rounds",
        "2",
        "--model",
        "cnn2",
        "--dp",
        "local",
        "--ldp-mechanism",
        "pnpm",
        "--ldp-epsilon",
        "0.5",
    )
    d = 21_840  # pnpm_cnn(depth=2): 21,750 kernel weights + 90 biases, all perturbed
    assert data["mechanism"] == "ldp_pnpm" and data["num_coordinates"] == d
    assert data["epsilon_per_coordinate"] == 0.5
    # PNPM leaves magnitudes unprotected: no finite eps per upload or per client ...
    assert data["epsilon_per_upload"] is None and data["epsilon_total_per_client"] is None
    assert data["epsilon_per_upload_is_infinite"] is True
    assert "magnitude" in data["epsilon_infinite_reason"]
    # ... and d x eps is a figure for the signs only
    assert data["epsilon_per_upload_sign_only"] == pytest.approx(0.5 * d)
    # every client took part in both rounds: two uploads each
    assert data["privacy"]["local_dp"]["max_participations"] == 2
    assert data["epsilon_total_per_client_sign_only"] == pytest.approx(2 * 0.5 * d)
    assert data["epsilon"] is None  # no central guarantee is claimed
    assert "per upload (d = 21840): eps = inf" in printed
    assert "signs only: eps = 10920 per upload" in printed
    assert "SIGN of each weight only" in printed


def test_client_dp_run_prints_the_replace_one_upload_epsilon(tmp_path, capsys):
    from dpfl_tf.federated.local_dp import gaussian_upload_report

    data, printed = _run(
        tmp_path,
        capsys,
        "--clients",
        "5",
        "--train-subset",
        "500",
        "--clients-per-round",
        "5",
        "--sampling",
        "fixed_size",
        "--partition",
        "iid",
        "--rounds",
        "2",
        "--hidden",
        "16",
        "--dp",
        "client",
        "--noise-multiplier",
        "1.0",
        "--accountant",
        "rdp",
        "--delta-max",
        "1e-5",
    )
    srv = data["privacy"]["against_server"]
    want = gaussian_upload_report(1.0, 2, delta=1e-5, accountant="rdp")  # 2 uploads each
    assert srv["epsilon"] == pytest.approx(want.accountant_epsilon_total, rel=1e-12)
    assert srv["relation"] == "replace-one (one client's update replaced)"
    assert data["privacy"]["relation"] == "replace-one client (fixed-size client sampling)"
    assert (
        f"against the server: epsilon = {want.accountant_epsilon_total:.4f} per client" in printed
    )
    assert "replace-one (one client's update replaced)" in printed


def test_adaptive_clip_run_reports_both_releases(tmp_path, capsys):
    data, printed = _run(
        tmp_path,
        capsys,
        "--clients",
        "10",
        "--train-subset",
        "1000",
        "--clients-per-round",
        "5",
        "--rounds",
        "2",
        "--hidden",
        "16",
        "--dp",
        "global",
        "--clip",
        "adaptive",
        "--clip-count-stddev",
        "2",
        "--noise-multiplier",
        "1.0",
        "--accountant",
        "rdp",
        "--delta-max",
        "1e-3",
    )
    privacy = data["privacy"]
    assert privacy["round_event"].startswith("Poisson(q=0.5) [Gaussian(sigma=")
    assert privacy["round_event"].endswith("+ Gaussian(sigma=4)] (add/remove-one)")
    assert privacy["clipping"]["initial_clip"] == 0.1
    assert [h["info"]["clip"] for h in data["history"]][0] == 0.1
    assert "adaptive clip: 0.1 ->" in printed


def test_secure_mode_run(tmp_path, capsys):
    data, _ = _run(
        tmp_path,
        capsys,
        "--clients",
        "10",
        "--train-subset",
        "1000",
        "--clients-per-round",
        "4",
        "--rounds",
        "1",
        "--hidden",
        "16",
        "--dp",
        "global",
        "--secure-mode",
        "--delta-max",
        "1e-3",
    )
    assert data["config"]["secure_mode"] is True and data["privacy"]["secure_mode"] is True
    assert data["rounds"] == 1 and data["epsilon"] > 0


def test_a_refusal_is_one_line_without_the_usage_block(tmp_path, capsys):
    from dpfl_tf.cli import main

    (tmp_path / "afile").write_text("x")
    for argv, message in [
        (["--clients", "10", "-m", "20"], "--clients-per-round (m=20) must be <= the number"),
        (["--output", str(tmp_path / "afile" / "r.json")], "is a file, not a directory"),
        (["--dp", "local", "--epsilon", "8"], "--epsilon needs dp='global'"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(
                ["federated", *argv, "--output", str(tmp_path / "r.json")]
                if "--output" not in argv
                else ["federated", *argv]
            )
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "usage:" not in err, err
        assert err.startswith("dpfl-tf federated: error: ") and message in err, err
    with pytest.raises(SystemExit):  # arguments that do not parse keep argparse's usage
        main(["federated", "--clients", "many"])
    assert "usage:" in capsys.readouterr().err


def test_local_dp_run_prints_no_tensorflow_start_up_lines_and_counts_as_integers(tmp_path):
    """`federated --dp local` built its config through the local-DP module, which
    imported TensorFlow before the CLI had quieted it (absl / oneDNN lines).  Its
    output goes to a directory that does not exist yet: the run creates it (and its
    parent) for the results and the figure."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "new" / "deeper" / "r.json"
    argv = [
        "federated",
        "--dp",
        "local",
        "--clients",
        "4",
        "-m",
        "4",
        "--train-subset",
        "400",
        "--hidden",
        "8",
        "--rounds",
        "2",
        "--output",
        str(out),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    run = subprocess.run(
        [sys.executable, "-m", "dpfl_tf", *argv],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    for noise in (
        *("absl", "I0000", "E0000", "W0000", "oneDNN", "cuda"),
        *("Error occurred when finalizing", "Traceback"),
    ):
        assert noise not in run.stderr, run.stderr
    data = json.loads(out.read_text())
    assert data["status"] == "completed" and data["rounds"] == 2
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    # the progress (not a terminal: one line per tenth of the run) counts clients as integers
    assert "round 1/2 - clients 4 - acc " in run.stdout, run.stdout
    assert "4.0000" not in run.stdout
    assert "local DP report" in run.stdout and "after 2 rounds (ldp_pnpm" in run.stdout


def _result(dp, history, **config):
    from dpfl_tf.federated.runner import FederatedConfig

    c = FederatedConfig(dp=dp, **config).to_dict()
    eps = history[-1]["epsilon"]
    return {
        "mechanism": {"none": "fedavg", "global": "global_dp", "local": "ldp_pnpm"}[dp],
        "dataset": "mnist",
        "clients_per_round": 100.0,
        "rounds": len(history),
        "epsilon": eps,
        "delta": c["delta_max"],
        "history": history,
        "config": c,
        **({"epsilon_per_coordinate": c["ldp_epsilon"]} if dp == "local" else {}),
    }


def test_figures_say_what_they_show(tmp_path):
    from dpfl_tf.federated.cli import figure_title, save_round_figure

    rows = [{"round": t, "accuracy": 0.1 + 0.01 * t, "epsilon": 0.5 * t} for t in (1, 2, 3)]
    glob = _result("global", rows, target_epsilon=8.0)
    assert figure_title(glob) == (
        "Global DP (server noise): sigma = 1, S = 1.0; epsilon 1.5 at delta = 1e-05 "
        "(target 8); mnist, K = 1000, m = 100 (poisson), 3 rounds"
    )
    fig = save_round_figure([glob], str(tmp_path / "g.png"))
    acc, eps = fig.axes
    assert acc.get_ylim() == (0.0, 1.0)  # chance-level wiggles are not blown up
    assert fig._suptitle.get_text() == figure_title(glob)
    # local DP: labelled as local DP with its epsilon; one panel (no empty epsilon plot)
    local = _result("local", [{"round": 1, "accuracy": 0.5, "epsilon": None}])
    fig = save_round_figure([local], str(tmp_path / "l.png"))
    assert len(fig.axes) == 1 and fig.axes[0].get_ylim() == (0.0, 1.0)
    assert fig.axes[0].lines[0].get_label() == "ldp_pnpm (local DP, eps 2 per coordinate)"
    assert len(fig.axes[0].lines[0].get_xdata()) == 1 and fig.axes[0].lines[0].get_marker() == "o"
    assert figure_title(local).startswith("local DP: pnpm, epsilon 2 per coordinate (no central")
    assert "1 round" in figure_title(local) and "1 rounds" not in figure_title(local)
    none = _result("none", [{"round": 1, "accuracy": 0.5, "epsilon": None}])
    assert figure_title(none).startswith("fedavg, no DP (epsilon = inf)")
    assert (tmp_path / "l.png").read_bytes()[:4] == b"\x89PNG"
