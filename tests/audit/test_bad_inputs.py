"""A catalogue of bad inputs across the public API and the `dpfl-tf` command
line.  Every row must raise a clear error -- the expected exception, with a
message that names the problem -- and leave nothing behind in the output
directory (each row runs inside an empty directory, and CLI rows pass
``--output`` into it), so no half-written results file survives a failure.

Rows are grouped by what is wrong: shapes, dtypes, empty data, unknown names,
data missing offline, out-of-range privacy parameters, budget already spent.
"""

import dataclasses
from typing import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.audit import (
    AttackFeatures,
    AttackKind,
    attack_features,
    epsilon_lower_bound,
    features_from_outputs,
    run_attacks_on_features,
)
from dpfl_tf.data import DatasetNotFoundError, load_dataset
from dpfl_tf.federated.runner import FederatedConfig
from dpfl_tf.keras import DPSGD, DPModel
from dpfl_tf.keras.checkpoint import DPCheckpoint
from dpfl_tf.privacy import (
    BudgetExceededError,
    PrivacyBudget,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
    dp_sgd_event,
)
from dpfl_tf.recipes.mnist import MnistConfig, train_mnist
from tests.keras.helpers import loss, mlp, mnist_slice


@dataclasses.dataclass
class Ctx:
    tmp: object  # pytest tmp_path (inputs may be created here)
    out: str  # a results path inside the checked output directory
    empty: str  # an empty directory (no datasets anywhere)
    monkeypatch: object

    def offline_without_data(self):
        """No copy of any dataset reachable, downloads disabled."""
        from dpfl_tf.data import locate

        for var in ("DPFL_DATA_DIR", "HOME", "KERAS_HOME"):
            self.monkeypatch.setenv(var, self.empty)
        self.monkeypatch.setenv("DPFL_NO_DOWNLOAD", "1")
        self.monkeypatch.setattr(locate, "SYSTEM_DATA_DIRS", (self.empty,))


@dataclasses.dataclass
class Row:
    id: str
    problem: str  # wrong shape | wrong dtype | empty | unknown name | missing offline
    #                       | out of range | budget spent
    call: Callable[[Ctx], object]
    error: type
    message: str  # must appear in the error message (CLI: in stderr)


ROWS: list[Row] = []


def row(id, problem, error, message):
    def register(fn):
        ROWS.append(Row(id, problem, fn, error, message))
        return fn

    return register


def _data(n=200):
    return mnist_slice(n, features=60)


def _dp(noise=1.0):
    m = DPModel(mlp(hidden=8))
    m.compile(optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=noise), loss=loss())
    return m


def _cli(ctx, *argv):
    from dpfl_tf.cli import main

    return main([*argv, "--output", ctx.out])


# -- DPModel / DP optimizers ---------------------------------------------------------
@row(
    "fit/feature-dim",
    "wrong shape",
    ValueError,
    "x has per-example shape (59,) but the model takes (60,)",
)
def _(ctx):
    x, y = _data()
    _dp().fit(x[:, :59], y, lot_size=50, verbose=0)


@row("fit/rank", "wrong shape", ValueError, "x has per-example shape (6, 10)")
def _(ctx):
    x, y = _data()
    _dp().fit(x.reshape(200, 6, 10), y, lot_size=50, verbose=0)


@row("fit/x-y-length", "wrong shape", ValueError, "disagree on the number of examples")
def _(ctx):
    x, y = _data()
    _dp().fit(x[:100], y, lot_size=50, verbose=0)


@row("fit/y-scalar", "wrong shape", ValueError, "y must have one label per example")
def _(ctx):
    x, _ = _data()
    _dp().fit(x, np.int64(3), lot_size=50, verbose=0)


@row("fit/x-strings", "wrong dtype", ValueError, "x must be numeric (float, int or bool)")
def _(ctx):
    x, y = _data()
    _dp().fit(x.astype(str), y, lot_size=50, verbose=0)


@row("fit/y-strings", "wrong dtype", ValueError, "y must be numeric (float, int or bool)")
def _(ctx):
    x, y = _data()
    _dp().fit(x, y.astype(str), lot_size=50, verbose=0)


@row("fit/x-objects", "wrong dtype", ValueError, "x must be numeric")
def _(ctx):
    _, y = _data()
    _dp().fit(np.array([None] * 200), y, lot_size=50, verbose=0)


@row(
    "fit/labels-out-of-range",
    "out of range",
    tf.errors.InvalidArgumentError,
    "outside the valid range of [0, 10)",
)
def _(ctx):
    x, y = _data()
    _dp().fit(x, y + 10, lot_size=50, verbose=0)


@row(
    "fit/fixed-size-with-moments",
    "out of range",
    ValueError,
    "accountant 'moments' cannot account for lots of",
)
def _(ctx):  # refused before any lot (a NaN example, by contrast, is dropped and counted)
    x, y = _data()
    model = _dp()
    try:
        model.fit(x, y, lot_size=50, epochs=1, verbose=0, sampling="fixed_size")
    finally:
        assert model.lots_computed == 0


@row("compile/regularizer", "out of range", ValueError, "a regularisation loss would be silently")
def _(ctx):
    inner = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(1e-3))]
    )
    DPModel(inner).compile(
        optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss()
    )


@row("fit/secure-mode-with-seed", "out of range", ValueError, "secure_mode=True refuses a seed")
def _(ctx):
    DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=3, secure_mode=True)


@row("fit/tf.data", "no random access", TypeError, "needs random access to the training records")
def _(ctx):
    x, y = _data()
    _dp().fit(tf.data.Dataset.from_tensor_slices((x, y)), lot_size=50)


@row("fit/empty", "empty", ValueError, "the training data is empty (0 examples)")
def _(ctx):
    x, y = _data()
    _dp().fit(x[:0], y[:0], lot_size=1, verbose=0)


@row("fit/lot-size-0", "out of range", ValueError, "lot_size must be a whole number >= 1, got 0")
def _(ctx):
    _dp().fit(*_data(), lot_size=0, verbose=0)


@row(
    "fit/lot-size>N",
    "out of range",
    ValueError,
    "lot_size must be <= the number of examples (200), got 201",
)
def _(ctx):
    _dp().fit(*_data(), lot_size=201, verbose=0)


@row("fit/target-delta", "out of range", ValueError, "target_delta must be in (0, 1), got 0")
def _(ctx):
    _dp().fit(*_data(), lot_size=50, verbose=0, target_delta=0)


@row("fit/target-epsilon", "out of range", ValueError, "epsilon must be > 0, got -1")
def _(ctx):
    _dp().fit(*_data(), lot_size=50, verbose=0, target_epsilon=-1)


@row(
    "fit/sampling",
    "unknown name",
    ValueError,
    "sampling must be one of poisson, fixed_size, shuffle, full_batch, in_order, "
    "cyclic_poisson, got 'bootstrap'",
)
def _(ctx):
    _dp().fit(*_data(), lot_size=50, verbose=0, sampling="bootstrap")


@row(
    "fit/budget-spent",
    "budget spent",
    BudgetExceededError,
    "allows no lot of Poisson(q=0.25) Gaussian(sigma=1) (add/remove-one): one more brings "
    "epsilon to",
)
def _(ctx):
    x, y = _data()
    model = _dp()
    model.fit(x, y, lot_size=50, epochs=1, verbose=0)
    model.fit(x, y, lot_size=50, epochs=1, verbose=0, target_epsilon=0.5 * model.epsilon(1e-5))


@row("DPSGD/clip", "out of range", ValueError, "l2_norm_clip must be > 0")
def _(ctx):
    DPSGD(0.1, l2_norm_clip=-1.0, noise_multiplier=1.0)


@row("DPSGD/noise-nan", "out of range", ValueError, "noise_multiplier must be >= 0, got nan")
def _(ctx):
    DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=float("nan"))


@row(
    "DPModel/plain-optimizer",
    "wrong dtype",
    TypeError,
    "DPModel must be compiled with a DP optimizer",
)
def _(ctx):
    DPModel(mlp()).compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())


@row("DPCheckpoint/restore-empty", "missing offline", FileNotFoundError, "no DPCheckpoint in")
def _(ctx):
    DPCheckpoint.restore(ctx.empty)


@row("DPCheckpoint/plain-model", "wrong dtype", TypeError, "DPCheckpoint checkpoints a DPModel")
def _(ctx):
    x, y = _data()
    plain = mlp(hidden=8)
    plain.compile(optimizer="sgd", loss=loss())
    plain.fit(x, y, epochs=1, verbose=0, callbacks=[DPCheckpoint(ctx.tmp / "ckpt")])


# -- privacy accounting -------------------------------------------------------------------
@row("compute_epsilon/delta", "out of range", ValueError, "delta must be in (0, 1), got 0.0")
def _(ctx):
    compute_epsilon(dp_sgd_event(1.0, 100, sampling_rate=0.01), 0.0)


@row("dp_sgd_event/q", "out of range", ValueError, "sampling_rate must be in (0, 1], got 1.5")
def _(ctx):
    dp_sgd_event(1.0, 100, sampling_rate=1.5)


@row("dp_sgd_event/steps", "out of range", ValueError, "steps must be a whole number >= 0")
def _(ctx):
    dp_sgd_event(1.0, -1, sampling_rate=0.5)


@row(
    "accountant/name",
    "unknown name",
    ValueError,
    "accountant must be one of moments, rdp, pld, strong, got 'magic'",
)
def _(ctx):
    compute_epsilon(dp_sgd_event(1.0, 100, sampling_rate=0.01), 1e-5, "magic")


@row("PrivacyBudget/epsilon", "out of range", ValueError, "epsilon must be > 0, got 0")
def _(ctx):
    PrivacyBudget(0, 1e-5)


@row("PrivacyBudget/delta", "out of range", ValueError, "delta must be in (0, 1), got 1.5")
def _(ctx):
    PrivacyBudget(1.0, 1.5)


@row("PrivacyLedger/spend", "budget spent", BudgetExceededError, "would exceed the budget")
def _(ctx):
    PrivacyLedger("moments", PrivacyBudget(0.1, 1e-5)).spend(
        dp_sgd_event(1.0, 100, sampling_rate=0.01), 1000
    )


@row("calibrate/unreachable", "out of range", ValueError, "no noise multiplier <= ")
def _(ctx):
    calibrate_noise_multiplier(
        1e-6, 1e-5, lambda s: dp_sgd_event(s, 10**6, sampling_rate=1.0), "moments"
    )


# -- data -------------------------------------------------------------------------------------
@row(
    "load_dataset/unknown", "unknown name", ValueError, "unknown dataset 'nosuch'; known datasets:"
)
def _(ctx):
    load_dataset("nosuch")


@row("load_dataset/offline", "missing offline", DatasetNotFoundError, "download disabled")
def _(ctx):
    ctx.offline_without_data()
    load_dataset("mnist", data_dir=ctx.empty)


# -- recipes and configs ------------------------------------------------------------------------
@row(
    "MnistConfig/model",
    "unknown name",
    ValueError,
    "model must be one of mlp, tanh_cnn, scatter_linear, scatter_cnn, got 'resnet'",
)
def _(ctx):
    MnistConfig(model="resnet")


@row(
    "MnistConfig/feature_norm",
    "unknown name",
    ValueError,
    "feature_norm must be one of group, dp_stats, stats, got 'batch'",
)
def _(ctx):
    MnistConfig(model="scatter_linear", feature_norm="batch")


@row(
    "train_mnist/dp-statistics-above-budget",
    "budget spent",
    ValueError,
    "the DP feature statistics alone cost epsilon = 0.634",
)
def _(ctx):  # refused before any data is read: no data directory is reachable
    ctx.offline_without_data()
    train_mnist(
        MnistConfig(
            dataset="cifar10",
            model="scatter_linear",
            feature_norm="dp_stats",
            target_epsilon=0.5,
            noise_multiplier=None,
            accountant="pld",
        )
    )


@row(
    "cli/train/feature-norm-without-scatter",
    "unknown name",
    SystemExit,
    "--feature-norm is for --model scatter_linear and scatter_cnn",
)
def _(ctx):
    _cli(ctx, "train", "mnist", "--feature-norm", "dp_stats", "--epochs", "1")


@row(
    "DPFeatureNormalization/clip-per-group",
    "wrong shape",
    ValueError,
    "mean_clip needs one bound per channel group (3), got 2",
)
def _(ctx):
    from dpfl_tf.normalization import DPFeatureNormalization
    from dpfl_tf.scattering import scattering_orders

    DPFeatureNormalization(mean_clip=(1.0, 0.1), channel_groups=scattering_orders(2, 8))


@row("train_mnist/unknown-dataset", "unknown name", ValueError, "unknown dataset 'nosuch'")
def _(ctx):
    train_mnist(MnistConfig(dataset="nosuch"), verbose=False)


@row("FederatedConfig/noise", "out of range", ValueError, "noise_multiplier must be >= 0")
def _(ctx):
    FederatedConfig(dp="global", noise_multiplier=-1.0)


@row(
    "FederatedConfig/target-without-dp",
    "out of range",
    ValueError,
    "target_epsilon needs dp='global' or dp='client'",
)
def _(ctx):
    FederatedConfig(target_epsilon=1.0)


# -- membership audit ---------------------------------------------------------------------------
@row("attack_features/x-y-length", "wrong shape", ValueError, "x and y disagree on the number")
def _(ctx):
    attack_features(mlp(hidden=8), np.zeros((5, 60), "float32"), np.zeros(4, "int64"))


@row("features/labels", "out of range", ValueError, "labels must lie in [0, 10)")
def _(ctx):
    features_from_outputs(np.zeros((3, 10)), [0, 1, 12])


@row("features/float-labels", "wrong dtype", ValueError, "y must hold integer class indices")
def _(ctx):
    features_from_outputs(np.zeros((3, 10)), [0.5, 1.0, 2.0])


@row("features/nan", "out of range", ValueError, "model outputs contain NaN or inf")
def _(ctx):
    features_from_outputs(np.full((3, 10), np.nan), [0, 1, 2])


@row("features/empty", "empty", ValueError, "no examples: y is empty")
def _(ctx):
    features_from_outputs(np.zeros((0, 10)), np.zeros(0, "int64"))


@row("attacks/too-few", "empty", ValueError, "need at least one of the members in each part")
def _(ctx):
    one = AttackFeatures(np.ones(1), np.ones(1), np.ones(1))
    run_attacks_on_features(one, one)


@row("attacks/unknown", "unknown name", ValueError, "attack must be one of loss_threshold")
def _(ctx):
    AttackKind.parse("shadow_models")


@row("epsilon_lower_bound/rates", "out of range", ValueError, "tpr and fpr must be rates")
def _(ctx):
    epsilon_lower_bound(1.2, 0.1, 1e-5)


@row("epsilon_lower_bound/delta", "out of range", ValueError, "delta must be in [0, 1), got 1")
def _(ctx):
    epsilon_lower_bound(0.5, 0.1, 1)


# -- command line: nothing may be written to --output -------------------------------------
@row("cli/privacy/q", "out of range", SystemExit, "--sampling-rate must be in (0, 1]")
def _(ctx):
    from dpfl_tf.cli import main

    main(["privacy", "-q", "1.5", "-s", "1", "-E", "1", "-d", "1e-5"])


@row("cli/train/epsilon", "out of range", SystemExit, "--epsilon must be > 0")
def _(ctx):
    _cli(ctx, "train", "mnist", "--epsilon", "-1")


@row("cli/train/delta", "out of range", SystemExit, "--delta must be in (0, 1)")
def _(ctx):
    _cli(ctx, "train", "mnist", "--delta", "2")


@row("cli/train/lot-size", "out of range", SystemExit, "--lot-size must be a whole number >= 1")
def _(ctx):
    _cli(ctx, "train", "mnist", "--lot-size", "0")


@row("cli/train/unknown-dataset", "unknown name", SystemExit, "invalid choice: 'cifar1000'")
def _(ctx):
    _cli(ctx, "train", "cifar1000")


@row(
    "cli/train/model-for-dataset",
    "wrong shape",
    SystemExit,
    "model 'tanh_cnn' does not run on cifar10; cifar10 takes convnet, scatter_linear, scatter_cnn",
)
def _(ctx):
    _cli(ctx, "train", "cifar10", "--model", "tanh_cnn")


@row("cli/train/offline", "missing offline", SystemExit, "download disabled")
def _(ctx):
    ctx.offline_without_data()
    _cli(ctx, "train", "mnist", "--epochs", "1", "--data-dir", ctx.empty)


@row("cli/train/budget-spent", "budget spent", SystemExit, "allows no lot of")
def _(ctx):  # a budget that not even the first lot fits in (the noise given, not calibrated)
    _cli(
        ctx,
        "train",
        "mnist",
        "--model",
        "tanh_cnn",
        "--epsilon",
        "0.0001",
        "--epochs",
        "1",
        "--noise-multiplier",
        "1.1",
    )


@row("cli/federated/unknown-dataset", "unknown name", SystemExit, "unknown dataset 'nosuch'")
def _(ctx):
    _cli(ctx, "federated", "--dataset", "nosuch", "--rounds", "1", "--no-progress")


@row("cli/federated/offline", "missing offline", SystemExit, "download disabled")
def _(ctx):
    ctx.offline_without_data()
    _cli(ctx, "federated", "--rounds", "1", "--no-progress")


@row(
    "cli/federated/budget-spent",
    "budget spent",
    SystemExit,
    "no round was run: privacy budget: round 1 would make delta",
)
def _(ctx):
    _cli(
        ctx,
        "federated",
        "--clients",
        "10",
        "--train-subset",
        "300",
        "--clients-per-round",
        "4",
        "--rounds",
        "2",
        "--hidden",
        "8",
        "--dp",
        "global",
        "--epsilon",
        "0.001",
        "--delta-max",
        "1e-3",
        "--no-progress",
    )


@row("cli/federated/clients", "out of range", SystemExit, "--clients must be a whole number >= 1")
def _(ctx):
    _cli(ctx, "federated", "--clients", "0")


@row("cli/federated/noise", "out of range", SystemExit, "--noise-multiplier must be >= 0")
def _(ctx):
    _cli(ctx, "federated", "--dp", "global", "--noise-multiplier", "-1")


@row(
    "cli/federated/hidden",
    "wrong dtype",
    SystemExit,
    "--hidden must be comma-separated whole numbers",
)
def _(ctx):
    _cli(ctx, "federated", "--hidden", "a,b")


@row("cli/federated/rounds", "wrong dtype", SystemExit, "not a whole number: '2.5'")
def _(ctx):
    _cli(ctx, "federated", "--rounds", "2.5")


@row(
    "cli/federated/ldp-epsilon",
    "out of range",
    SystemExit,
    "--ldp-epsilon must be in (0, 50], got 0.0",
)
def _(ctx):
    _cli(ctx, "federated", "--dp", "local", "--ldp-epsilon", "0")


@row(
    "federated/ldp-pnpm-nan-weight",
    "wrong dtype",
    ValueError,
    "1 of 2 entries of weight tensor 0 (shape [2]) are NaN or inf",
)
def _(ctx):
    from dpfl_tf.federated.local_dp import LocalDPUpload, PNPMMechanism

    upload = LocalDPUpload(PNPMMechanism(1.0, seed=0))
    upload.apply([tf.zeros([2])], [tf.constant([0.1, np.nan])], upload.generator(0, 0))


@row(
    "federated/ldp-duchi-out-of-domain",
    "out of range",
    ValueError,
    "outside the input range [-1, 1]",
)
def _(ctx):
    from dpfl_tf.federated.local_dp import DuchiMechanism, LocalDPUpload

    upload = LocalDPUpload(DuchiMechanism(1.0, seed=0))  # no policy: never clipped silently
    upload.apply([tf.zeros([2])], [tf.constant([0.5, 3.0])], upload.generator(0, 0))


# -- issue 17: runs that respect a user's time ------------------------------------------------
@row(
    "cli/train/lot-size>N",
    "out of range",
    SystemExit,
    "--lot-size (1000000000) exceeds the dataset size: mnist has 60000 training examples",
)
def _(ctx):
    _cli(ctx, "train", "mnist", "--lot-size", "1e9", "--epochs", "1")


@row("cli/federated/fraction", "out of range", SystemExit, "--fraction must be in (0, 1], got 1.5")
def _(ctx):  # refused from the arguments: with no data reachable, loading would fail otherwise
    ctx.offline_without_data()
    _cli(ctx, "federated", "--fraction", "1.5", "--rounds", "1", "--no-progress")


@row(
    "cli/train/output-parent-is-a-file",
    "wrong dtype",
    SystemExit,
    "/afile/r.json: cannot write there:",
)
def _(ctx):
    ctx.offline_without_data()  # checked before the data is loaded
    (ctx.tmp / "afile").write_text("x")
    from dpfl_tf.cli import main

    main(["train", "mnist", "--epochs", "1", "--output", str(ctx.tmp / "afile" / "r.json")])


@row(
    "cli/train/checkpoint-dir-is-a-file",
    "wrong dtype",
    SystemExit,
    "/afile: cannot write there: it is a file, not a directory",
)
def _(ctx):
    ctx.offline_without_data()
    (ctx.tmp / "afile").write_text("x")
    _cli(ctx, "train", "mnist", "--epochs", "1", "--checkpoint-dir", str(ctx.tmp / "afile"))


@row(
    "cli/train/cifar10-pretrained-missing",
    "missing offline",
    SystemExit,
    "/missing.weights.h5: no pretrained weights at",
)
def _(ctx):
    ctx.offline_without_data()  # the weights' public split is read before the data
    _cli(ctx, "train", "cifar10", "--pretrained", str(ctx.tmp / "missing.weights.h5"))


@row(
    "cli/train/cifar10-pretrained-not-weights",
    "wrong dtype",
    SystemExit,
    "/notes.weights.h5 is not a weights file (.weights.h5) that can be read",
)
def _(ctx):
    ctx.offline_without_data()
    (ctx.tmp / "notes.weights.h5").write_text("not HDF5")
    _cli(ctx, "train", "cifar10", "--pretrained", str(ctx.tmp / "notes.weights.h5"))


@row(
    "cli/federated/output-unwritable",
    "out of range",
    SystemExit,
    "--output /proc/dpfl_out/r.json: cannot write there",
)
def _(ctx):
    ctx.offline_without_data()
    from dpfl_tf.cli import main

    main(["federated", "--rounds", "1", "--output", "/proc/dpfl_out/r.json"])


@row(
    "cli/train/tensorboard-missing",
    "missing offline",
    SystemExit,
    "pip install 'dpfl-tf[tensorboard]'",
)
def _(ctx):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed")
    ctx.offline_without_data()
    _cli(ctx, "train", "mnist", "--epochs", "1", "--tensorboard", str(ctx.tmp / "tb"))


def _damaged_checkpoint(ctx):
    ckpt = ctx.tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "state.json").write_text('{"format": 1, "epoch": ')  # cut off mid-write
    return ckpt


@row(
    "DPCheckpoint/damaged-state",
    "wrong dtype",
    ValueError,
    "/ckpt/state.json is damaged (not valid JSON",
)
def _(ctx):
    DPCheckpoint.restore(_damaged_checkpoint(ctx))


@row(
    "DPCheckpoint/damaged-model",
    "wrong dtype",
    ValueError,
    "/ckpt/model-000001.keras cannot be loaded",
)
def _(ctx):
    ckpt = ctx.tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(
        '{"format": 1, "epoch": 1, "model": "model-000001.keras", '
        '"lots_applied": 3, "ledger_count": 3, "ledger": []}'
    )
    (ckpt / "model-000001.keras").write_bytes(b"PK\x03\x04 not a zip")
    DPCheckpoint.restore(ckpt)


@row(
    "cli/train/damaged-checkpoint",
    "wrong dtype",
    SystemExit,
    "/ckpt/state.json is damaged (not valid JSON",
)
def _(ctx):
    _cli(ctx, "train", "mnist", "--epochs", "1", "--checkpoint-dir", str(_damaged_checkpoint(ctx)))


@row(
    "cli/federated/damaged-checkpoint",
    "wrong dtype",
    SystemExit,
    "/ckpt/state.json is damaged (not valid JSON",
)
def _(ctx):
    _cli(
        ctx,
        "federated",
        "--clients",
        "10",
        "--train-subset",
        "300",
        "--rounds",
        "1",
        "--hidden",
        "8",
        "--no-progress",
        "--checkpoint-dir",
        str(_damaged_checkpoint(ctx)),
    )


@row(
    "DPModel/train_on_batch",
    "wrong shape",
    NotImplementedError,
    "DPModel.train_on_batch is not supported: a lot must be sampled by the DP sampler; "
    "use fit(x, y, lot_size=...)",
)
def _(ctx):
    x, y = _data()
    model = _dp()
    model.build((None, 60))
    model.train_on_batch(x[:10], y[:10])


@pytest.mark.parametrize("case", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_gives_a_clear_error_and_leaves_no_results_file(
    case, tmp_path, monkeypatch, capsys
):
    out_dir, empty = tmp_path / "out", tmp_path / "empty"
    out_dir.mkdir()
    empty.mkdir()
    monkeypatch.chdir(out_dir)  # results written to a default path would land here too
    ctx = Ctx(tmp_path, str(out_dir / "result.json"), str(empty), monkeypatch)
    with pytest.raises(case.error) as info:
        case.call(ctx)
    if case.error is SystemExit:
        assert info.value.code not in (0, None)
        text = capsys.readouterr().err
    else:
        text = str(info.value)
    assert case.message in " ".join(text.split()), text[-2000:]
    assert sorted(p.name for p in out_dir.rglob("*")) == []
    assert sorted(p.name for p in empty.rglob("*")) == []


def test_catalogue_covers_every_kind_of_problem():
    kinds = {r.problem for r in ROWS}
    assert kinds == {
        "wrong shape",
        "wrong dtype",
        "empty",
        "unknown name",
        "missing offline",
        "out of range",
        "budget spent",
        "no random access",
    }
    assert len({r.id for r in ROWS}) == len(ROWS) >= 50


def test_multi_input_model_takes_its_inputs_as_a_list():
    """Issue 17: a list of input arrays used to fail inside tf.data ("not convertible
    to a tensor ... shape (2, None, None)"); it trains like a tuple now."""
    a, b = keras.Input((4,)), keras.Input((3,))
    out = keras.layers.Dense(10)(keras.layers.Concatenate()([a, b]))
    model = DPModel(keras.Model([a, b], out))
    model.compile(optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss())
    x, y = _data(40)
    model.fit([x[:, :4], x[:, 4:7]], y, lot_size=10, epochs=1, verbose=0)
    assert model.lots_computed == 4 and model.privacy_ledger.count() == 4
