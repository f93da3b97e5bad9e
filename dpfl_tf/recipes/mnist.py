"""The MNIST experiments of Abadi et al. 2016, section 5.2, as one function.

Paper setting: DP-PCA to 60 dimensions, Dense 1000 ReLU, softmax; lot 600;
clip 4; learning rate 0.1 decaying linearly to 0.052 over 10 epochs, then
constant; delta = 1e-5; train until the target epsilon is spent.  The DP-PCA
release and every DP-SGD lot go into one ledger.  `model="tanh_cnn"` trains
the small tanh CNN of Papernot et al. 2021 end to end on the images instead.

`model="scatter_linear"` is Tramer & Boneh 2021 ("Differentially Private
Learning Needs Better Features"): order-2 scattering features (J=2, L=8:
7x7x81 per image, `dpfl_tf.scattering`) computed once, then per-example
GroupNormalization (27 groups, no parameters) and a linear softmax layer
trained with DP-SGD.  The scattering transform is fixed and data-independent
and the normalisation acts on each example alone, so neither costs privacy:
the ledger holds only the DP-SGD lots.  Their MNIST setting: lot 4096 (ours
4096 or 2048), clip 0.1, momentum 0.9, ~40 epochs, noise calibrated for the
epochs; they report 98.7% at epsilon = 3.  The same model runs on colour
images (``dataset="cifar10"``: 8x8x243 features, every training image
private, no public data); they report 67.0% on CIFAR-10 at epsilon = 3, and
69.3% with `model="scatter_cnn"` (two tanh convolutions on the features).
Their CIFAR-10 runs normalise the features with channel statistics released
under DP instead (``feature_norm="dp_stats"``, `dpfl_tf.normalization`; here
one bound and one noise scale per scattering order); that release goes into
the same ledger before DP-SGD, and the DP-SGD noise is calibrated for what
remains of the budget.  ``mirror_views=True`` (the CLI's default for CIFAR-10)
goes beyond their recipe: every example is its image and its mirror image, the
model averages its logits over both (`dpfl_tf.models.view_averaged`), so it is
mirror-invariant; one example's two views are clipped together, and the
release's per-example record is the mean over both views, so the ledger is
the same as without them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings

import keras
import numpy as np

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.data import load_dataset
from dpfl_tf.models import mlp, scatter_cnn, scatter_linear, tanh_cnn
from dpfl_tf.normalization import DPFeatureNormalization, FeatureNormalization
from dpfl_tf.pca import DPPCA, PCAProjection, RandomProjection, _Projection
from dpfl_tf.privacy import PrivacyLedger, compute_epsilon
from dpfl_tf.recipes.run import Inputs, Recipe, run_recipe
from dpfl_tf.recipes.settings import MIRROR_VIEWS_BATCH, PAPER_NOISE  # noqa: F401 (re-exported)
from dpfl_tf.scattering import Scattering2D, scattering_channels, scattering_orders

__all__ = ["MnistConfig", "train_mnist", "PAPER_SETTINGS", "MODELS"]

MODELS = ("mlp", "tanh_cnn", "scatter_linear", "scatter_cnn")
#: models on scattering features
SCATTER_MODELS = ("scatter_linear", "scatter_cnn")
#: input normalisations of the scattering models
FEATURE_NORMS = ("group", "dp_stats", "stats")
#: colour datasets: the ScatterNet model takes them, the paper models need 28x28 grey images
COLOUR_DATASETS = ("cifar10", "cifar100")
#: how simulated users (`MnistConfig.users`) get their examples (`dpfl_tf.federated.partition`)
USER_SPLITS = ("iid", "unequal", "shards")

#: Abadi et al. 2016, section 5.2: the three noise settings and their budgets
PAPER_SETTINGS = {
    name: {
        "noise_multiplier": PAPER_NOISE[name][0],
        "pca_noise_multiplier": PAPER_NOISE[name][1],
        "target_epsilon": eps,
        "paper_test_accuracy": acc,
    }
    for name, eps, acc in (
        ("small_noise", 8.0, 0.97),
        ("medium_noise", 2.0, 0.95),
        ("large_noise", 0.5, 0.90),
    )
}


@dataclasses.dataclass(frozen=True)
class MnistConfig:
    dataset: str = "mnist"
    setting: str = "custom"
    model: str = "mlp"  # "mlp" | "tanh_cnn" | "scatter_linear" | "scatter_cnn"
    projection: str = "dp_pca"  # "dp_pca" | "pca" | "random" | "none" (mlp only)
    pca_dim: int = 60
    pca_noise_multiplier: float = 7.0
    pca_sample_size: int | None = None  # None: every training example (q_p = 1)
    hidden_units: int = 1000
    private: bool = True
    noise_multiplier: float | None = 4.0  # None: calibrate for target_epsilon in `epochs`
    l2_norm_clip: float = 4.0
    lot_size: int = 600
    batch_size: int | None = None
    learning_rate: float = 0.1
    final_learning_rate: float = 0.052
    decay_epochs: int = 10
    momentum: float = 0.0
    target_epsilon: float | None = 2.0
    delta: float = 1e-5
    accountant: str = "moments"
    epochs: int = 1000  # upper bound when a target is set
    eval_every: int = 1
    deltas: tuple = (1e-2, 1e-3, 1e-4, 1e-5)
    seed: int | None = None
    data_dir: str | None = None
    #: hold out this many training examples (the same draw for every run,
    #: `Dataset.validation_split`) and evaluate on them instead of the test set:
    #: the "test_accuracy" of such a run is the validation accuracy (its result
    #: says ``evaluated_on``); DP-SGD and DP-PCA see only the other examples
    validation: int = 0
    #: instead of `validation`: hold out each training example with this fixed
    #: probability, by its own content (`Dataset.hash_split`: what a private
    #: search needs; `dpfl_tf.recipes.tune`)
    validation_fraction: float = 0.0
    # scattering models: "group" (per-example GroupNorm(27), free), "dp_stats"
    # (channel statistics released under DP, `dpfl_tf.normalization`) or "stats"
    # (exact statistics: private=False only)
    feature_norm: str = "group"
    #: sigma of each of the 6 noised sums (mean and second moment of scattering
    #: orders 0, 1, 2): jointly 8 / sqrt(2), the cost of Tramer & Boneh's release
    feature_norm_noise_multiplier: float = 8.0 * 3**0.5
    #: L2 bounds per scattering order (0, 1, 2) on each example's channel means
    #: and second moments, per colour plane (times sqrt(colours)); order 0 is the
    #: local mean of pixels in [0, 1], so 1 bounds it for any image; orders 1 and
    #: 2 were set once, by looking at CIFAR-10's TRAINING features, near their
    #: 99th percentile: a data-dependent hyperparameter choice outside the
    #: accounting, like the clip and the learning rate (see the README)
    feature_norm_clips: tuple = ((1.0, 0.15, 0.03), (1.0, 0.01, 0.0003))
    #: added to the channel variances before the square root, in the squared
    #: units of the features of pixels in [0, 1] (see `dpfl_tf.normalization`)
    feature_norm_epsilon: float = 1e-5
    #: scattering models: each example is two views, the image and its mirror
    #: image (flipped left to right), and the model averages its logits over
    #: them (`dpfl_tf.models.view_averaged`): mirror-invariant, for data whose
    #: classes do not change in a mirror (CIFAR-10 yes, digits no)
    mirror_views: bool = False
    #: user-level DP-SGD (`dpfl_tf.keras.users`): the unit of privacy is a user,
    #: all of one person's examples, and `lot_size` is the expected number of
    #: USERS in a lot (q = lot_size / users).  `user_ids`: a .npy file of one
    #: user id (integers or strings) per training example, in the training
    #: set's order.  Only releases accounted per user are allowed beside it:
    #: not DP-PCA nor the DP feature statistics (their unit is one example)
    user_ids: str | None = None
    #: or this many simulated users: the training examples dealt to them by
    #: `dpfl_tf.federated.make_partition` with `user_split` ("iid": nearly
    #: equal random shares; "unequal": log-normal sizes, sigma 1; "shards": two
    #: label shards each, McMahan et al. 2017), seeded with `users_seed`
    users: int | None = None
    user_split: str = "iid"
    users_seed: int = 0
    #: user-level: at most this many of a user's examples in a lot (a fresh
    #: random subset every lot); None: all of them
    max_examples_per_user: int | None = None

    @property
    def user_level(self) -> bool:
        return self.user_ids is not None or self.users is not None

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.model not in SCATTER_MODELS and self.dataset in COLOUR_DATASETS:
            raise ValueError(
                f"model={self.model!r} needs 28x28 grey images (mnist, "
                f"fashion_mnist), got dataset={self.dataset!r}; colour images "
                f"take model='scatter_linear' or 'scatter_cnn'"
            )
        if self.feature_norm not in FEATURE_NORMS:
            raise ValueError(
                f"feature_norm must be one of {', '.join(FEATURE_NORMS)}, got {self.feature_norm!r}"
            )
        if self.feature_norm != "group" and self.model not in SCATTER_MODELS:
            raise ValueError(
                f"feature_norm={self.feature_norm!r} is for the scattering "
                f"models ({', '.join(SCATTER_MODELS)}), got model={self.model!r}"
            )
        if self.mirror_views and self.model not in SCATTER_MODELS:
            raise ValueError(
                f"mirror_views is for the scattering models "
                f"({', '.join(SCATTER_MODELS)}), got model={self.model!r}"
            )
        if self.private and self.feature_norm == "stats":
            raise ValueError(
                "feature_norm='stats' is not private; use 'dp_stats' (or private=False)"
            )
        if self.projection not in ("dp_pca", "pca", "random", "none"):
            raise ValueError(
                f"projection must be 'dp_pca', 'pca', 'random' or 'none', got {self.projection!r}"
            )
        if self.private and self.projection == "pca":
            raise ValueError("projection='pca' is not private; use 'dp_pca' (or private=False)")
        object.__setattr__(self, "validation", check_count("validation", self.validation))
        fraction = check_number(
            "validation_fraction", self.validation_fraction, low=0.0, high=1.0, high_open=True
        )
        object.__setattr__(self, "validation_fraction", fraction)
        if fraction and self.validation:
            raise ValueError("give validation (a number) or validation_fraction, not both")
        self._check_user_level()

    def _check_user_level(self) -> None:
        if self.user_ids is not None and self.users is not None:
            raise ValueError(
                f"give user_ids (a file) or users (simulated users), not both; got "
                f"user_ids={self.user_ids!r} and users={self.users!r}"
            )
        if self.users is not None:
            object.__setattr__(self, "users", check_count("users", self.users, minimum=1))
        if self.user_split not in USER_SPLITS:
            raise ValueError(
                f"user_split must be one of {', '.join(USER_SPLITS)}, got {self.user_split!r}"
            )
        if self.max_examples_per_user is not None:
            object.__setattr__(
                self,
                "max_examples_per_user",
                check_count("max_examples_per_user", self.max_examples_per_user, minimum=1),
            )
        if not self.user_level:
            if self.max_examples_per_user is not None:
                raise ValueError(
                    "max_examples_per_user is for user-level runs: give user_ids or users"
                )
            return
        what = "user-level DP-SGD (user_ids or users)"
        if not self.private:
            raise ValueError(f"{what} is for private runs (private=True)")
        if self.model == "mlp" and self.projection == "dp_pca":
            raise ValueError(
                f"{what} cannot run with projection='dp_pca': DP-PCA's release protects one "
                "example, not a user, so no user-level epsilon would cover it; use "
                "model='tanh_cnn', 'scatter_linear' or 'scatter_cnn' (or projection='none' "
                "or 'random')"
            )
        if self.feature_norm == "dp_stats":
            raise ValueError(
                f"{what} cannot run with feature_norm='dp_stats': the DP feature statistics "
                "protect one example, not a user, so no user-level epsilon would cover "
                "them; use feature_norm='group'"
            )
        if self.validation or self.validation_fraction:
            raise ValueError(
                f"{what} cannot hold out validation examples (validation="
                f"{self.validation or self.validation_fraction}): "
                "the held-out examples would cut users in two"
            )


#: part of the features' cache key: bump it when the transform's output changes
FEATURES_VERSION = "kymatio-filters-2"  # 2: summed block by block (last bits)


#: images scattered at a time (the transform's peak memory does not grow with N)
SCATTER_CHUNK = 1024


def _scattering_features(data, mirror: bool = False):
    """(train, test) order-2 scattering features (J=2, L=8) of the images scaled
    to [0, 1]; with `mirror`, [N, 2, ...]: each image's and its mirror image's
    (`Scattering2D.transform`).  The transform is fixed, so each array is
    computed once, `SCATTER_CHUNK` images at a time, straight into the cache
    directory (``$DPFL_CACHE_DIR``, else ``~/.cache/dpfl_tf``) as
    ``scattering/<hash>.npy``, and returned as `dpfl_tf.data.NpyRows`: DP-SGD,
    the DP statistics and evaluation read the rows they need from the file, so
    no run holds the 6.2 GB of CIFAR-10's training features with mirror views
    in memory (nor maps them).  The hash covers the pixels, the settings, the
    filter bank and `FEATURES_VERSION`; a file of another shape or dtype is
    recomputed.  The files are derived from the (private) training images:
    they are written readable by their owner only.  If the cache cannot be
    written (read-only, or no room for the whole file), the features are
    computed in memory, with a warning."""
    return _scattered((data.x_train, data.x_test), mirror)


def _scattered(arrays, mirror: bool = False) -> tuple:
    """The scattering features of each array of images (`_scattering_features`)."""
    from dpfl_tf._io import atomic_path
    from dpfl_tf.data import NpyRows
    from dpfl_tf.data.image_folder import default_cache_dir

    scattering = Scattering2D(J=2, L=8, shape=arrays[0].shape[1:3])
    filters = hashlib.blake2b(digest_size=16)
    for f in (scattering.psi_hat, scattering.phi_hat):
        filters.update(np.ascontiguousarray(f).data)

    def scatter(images, start, stop):
        return scattering.transform(images[start:stop].astype("float32") / 255.0, mirror=mirror)

    out = []
    for x in arrays:
        x = np.ascontiguousarray(x)
        shape = scattering.features_shape(x.shape, mirror)
        digest = hashlib.blake2b(digest_size=16)
        digest.update(
            repr(
                (
                    FEATURES_VERSION,
                    repr(scattering),
                    filters.hexdigest(),
                    bool(mirror),
                    x.shape,
                    x.dtype.str,
                )
            ).encode()
        )
        digest.update(x.data)
        path = os.path.join(default_cache_dir(), "scattering", digest.hexdigest() + ".npy")
        if os.path.exists(path):
            cached = NpyRows(path)
            if cached.shape == shape and cached.dtype == np.float32:
                out.append(cached)
                continue
        try:
            with atomic_path(path, mode=0o600) as tmp:  # never readable by others
                features = NpyRows.create(tmp, shape, np.float32)  # a full disk: OSError
                for i in range(0, len(x), SCATTER_CHUNK):
                    features.write(i, scatter(x, i, i + SCATTER_CHUNK))
                features.close()
        except OSError as e:  # a read-only or full cache: compute in memory
            warnings.warn(
                f"scattering features not cached ({e}); computing them in memory",
                RuntimeWarning,
                stacklevel=3,
            )
            features = np.concatenate(
                [scatter(x, i, i + SCATTER_CHUNK) for i in range(0, len(x), SCATTER_CHUNK)]
            )
            features.setflags(write=False)
            out.append(features)
            continue
        out.append(NpyRows(path))
    return tuple(out)


def _inputs(
    config: MnistConfig, data, ledger: PrivacyLedger | None, projection: np.ndarray | None = None
):
    """(x_train, x_test, the released projection's components or None): pixels
    scaled to [0, 1], then the model's input transform.  `projection`: the
    components of a projection released before (a resumed run); else DP-PCA
    (or a random projection) is fitted here, its release recorded in `ledger`.
    A first run and a resume go through this one function."""
    if config.model in SCATTER_MODELS:  # fixed, data-independent: no privacy cost
        x_train, x_test = _scattering_features(data, config.mirror_views)
        return x_train, x_test, None
    x_train = data.x_train.astype("float32") / 255.0
    x_test = data.x_test.astype("float32") / 255.0
    if config.model == "tanh_cnn":
        return x_train[..., None], x_test[..., None], None
    if config.projection == "none":
        return x_train.reshape(len(x_train), -1), x_test.reshape(len(x_test), -1), None
    if projection is not None:
        proj = _SavedProjection(projection)
    elif config.projection == "dp_pca":
        proj = DPPCA(
            config.pca_dim,
            config.pca_noise_multiplier,
            config.pca_sample_size or len(x_train),
            seed=config.seed,
        )
    elif config.projection == "pca":
        proj = PCAProjection(config.pca_dim)
    else:
        proj = RandomProjection(config.pca_dim, seed=0)
    if projection is None:
        proj.fit(x_train, ledger=ledger)
    released = (
        proj.components if isinstance(proj, (DPPCA, RandomProjection, _SavedProjection)) else None
    )
    return proj.transform(x_train), proj.transform(x_test), released


def input_features(config: "MnistConfig", images, projection: np.ndarray | None = None):
    """`images` through the model's input transform, as `_inputs` gives the test
    set: pixels scaled to [0, 1], then the scattering features, or the channel
    axis (tanh_cnn), or the released projection (`projection`: its components;
    mlp with a projection)."""
    if config.model in SCATTER_MODELS:
        return _scattered((images,), config.mirror_views)[0]
    x = np.asarray(images).astype("float32") / 255.0
    if config.model == "tanh_cnn":
        return x[..., None]
    if config.projection == "none":
        return x.reshape(len(x), -1)
    if projection is None:
        raise ValueError(
            f"projection={config.projection!r} needs the released projection's components"
        )
    return _SavedProjection(projection).transform(x)


def input_release_event(config: "MnistConfig", num_examples: int):
    """The DP release the inputs of a private run of `config` make before DP-SGD
    on `num_examples` training examples (DP-PCA, or the DP feature statistics),
    known before any data is read; None if they release nothing."""
    if config.model == "mlp" and config.projection == "dp_pca":
        return DPPCA(
            config.pca_dim,
            config.pca_noise_multiplier,
            config.pca_sample_size or num_examples,
            seed=config.seed,
        ).planned_event(num_examples)
    if config.model in SCATTER_MODELS and config.feature_norm == "dp_stats":
        return feature_norm_release(config).planned_event()
    return None


def _feature_norm_layer(config: MnistConfig, x_train, ledger: PrivacyLedger | None):
    """The scattering models' input normalisation (None: per-example GroupNorm);
    a DP release is recorded in `ledger`."""
    if config.feature_norm == "group":
        return None
    if config.feature_norm == "stats":
        return (
            FeatureNormalization(epsilon=config.feature_norm_epsilon).fit(x_train, ledger).layer()
        )
    colours = x_train.shape[-1] // scattering_channels(2, 8)
    return feature_norm_release(config, colours).fit(x_train, ledger).layer()


def feature_norm_release(config: MnistConfig, colours: int = 1) -> DPFeatureNormalization:
    """The DP release of `feature_norm="dp_stats"` for features of `colours`
    colour planes (its event does not depend on them: one group per order)."""
    means, seconds = (tuple(c * colours**0.5 for c in clips) for clips in config.feature_norm_clips)
    return DPFeatureNormalization(
        config.feature_norm_noise_multiplier,
        means,
        seconds,
        channel_groups=scattering_orders(2, 8, colours),
        seed=config.seed,
        epsilon=config.feature_norm_epsilon,
    )


def read_user_ids(path: str, num_examples: int) -> np.ndarray:
    """The user ids of a .npy file: one per training example (`num_examples`),
    integers or strings; errors name the file."""
    try:
        ids = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"user_ids {path}: no such file") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"user_ids {path}: not a .npy array of user ids ({e})") from None
    if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iuUSf":
        raise ValueError(
            f"user_ids {path}: user ids must be integers or strings, got "
            f"{getattr(ids, 'dtype', type(ids).__name__)}"
        )
    if ids.ndim != 1 or len(ids) != num_examples:
        raise ValueError(
            f"user_ids {path}: holds {ids.shape[0] if ids.ndim == 1 else ids.shape} ids, "
            f"the training set has {num_examples} examples: give one user id per "
            "training example, in the training set's order"
        )
    return ids


class _SavedProjection(_Projection):
    def __init__(self, components):
        self.components = components


class MnistRecipe(Recipe):
    """`train_mnist` on the shared life cycle (`dpfl_tf.recipes.run`)."""

    default_config = None  # set below, once MnistConfig's defaults are known
    #: the ids file may move: a resume checks the users it holds (a digest of the
    #: grouping, `dpfl_tf.recipes.run`), not its path
    resumable_changes = (*Recipe.resumable_changes, "user_ids")

    def check(self) -> None:
        config = self.config
        if (
            config.private
            and config.feature_norm == "dp_stats"
            and config.target_epsilon is not None
        ):  # before any data is read
            cost = compute_epsilon(
                feature_norm_release(config).planned_event(), config.delta, config.accountant
            )
            if cost >= config.target_epsilon:
                raise ValueError(
                    f"the DP feature statistics alone cost epsilon = {cost:.3f} "
                    f"(feature_norm_noise_multiplier={config.feature_norm_noise_multiplier:g}"
                    f"), which leaves nothing of target_epsilon = {config.target_epsilon:g} "
                    "for DP-SGD: raise feature_norm_noise_multiplier or use "
                    "feature_norm='group'"
                )

    def inputs(self, ledger, releases) -> Inputs:
        config = self.config
        #: the dataset as loaded (its test set also when `validation` holds some out)
        self.full = self.data = load_dataset(config.dataset, data_dir=config.data_dir)
        if config.validation:
            self.data = self.data.validation_split(config.validation)
        elif config.validation_fraction:
            self.data = self.data.hash_split(config.validation_fraction)
        saved = (releases or {}).get("projection")
        x_train, x_test, released = _inputs(config, self.data, ledger, saved)
        #: the components of the projection the inputs went through (mlp), or None
        self.projection = saved if saved is not None else released
        y_train = self.data.y_train.astype("int64")
        return Inputs(
            x_train,
            y_train,
            x_test,
            self.data.y_test.astype("int64"),
            examples=len(y_train),
            x_train_eval=x_train,
            y_train_eval=y_train,
            releases={} if released is None or saved is not None else {"projection": released},
            user_ids=self._user_ids(y_train),
            max_examples_per_user=config.max_examples_per_user,
        )

    def _user_ids(self, y_train: np.ndarray):
        """The user of every training example (a user-level run), or None."""
        config, n = self.config, len(y_train)
        if config.users is not None:
            from dpfl_tf.federated.partition import make_partition

            if config.users > n:
                raise ValueError(
                    f"users ({config.users}) exceeds the {n} training examples: every "
                    "simulated user needs one"
                )
            if config.user_split == "shards" and 2 * config.users > n:
                raise ValueError(
                    f"users ({config.users}) of user_split 'shards' hold two label shards "
                    f"each: at most {n // 2} users for the {n} training examples"
                )
            return make_partition(y_train, config.users, config.user_split, seed=config.users_seed)
        if config.user_ids is None:
            return None
        return read_user_ids(config.user_ids, n)

    def network(self, inputs, ledger) -> keras.Model:
        config, x_train = self.config, inputs.x_train
        if config.model == "tanh_cnn":
            return tanh_cnn(x_train.shape[1:])
        if config.model in SCATTER_MODELS:
            norm = _feature_norm_layer(config, x_train, ledger)
            build = scatter_cnn if config.model == "scatter_cnn" else scatter_linear
            views = 2 if config.mirror_views else 1
            return build(x_train.shape[1 + (views > 1) :], normalization=norm, views=views)
        return mlp(x_train.shape[1], config.hidden_units)

    def too_few_examples(self, n: int) -> str:
        return (
            f"lot_size ({self.config.lot_size}) exceeds the dataset size: "
            f"{self.config.dataset} has {n} training examples"
        )

    def fields(self, run, model) -> dict:
        config = self.config
        return {
            **dataclasses.asdict(config),
            "deltas": list(config.deltas),
            "pca_noise_multiplier": (
                config.pca_noise_multiplier
                if config.projection == "dp_pca" and config.model == "mlp"
                else None
            ),
            "dataset_source": getattr(getattr(self.data, "source", None), "label", config.dataset),
            "evaluated_on": (
                f"validation ({len(self.data.y_test)} training examples held out)"
                if config.validation or config.validation_fraction
                else "test"
            ),
        }


MnistRecipe.default_config = MnistConfig()


def train_mnist(
    config: MnistConfig,
    *,
    verbose: bool = True,
    checkpoint_dir: str | None = None,
    checkpoint_every_epoch: bool = True,
    on_epoch=None,
    should_stop=None,
    on_resume=None,
    callbacks=(),
    return_model: bool = False,
):
    """Trains one configuration; returns a JSON-ready result with per-epoch history
    (and the trained model too if `return_model`).

    checkpoint_dir: if it holds a checkpoint of the same configuration, training
      resumes from it exactly (weights, ledger, lot counter, optimizer state and
      so the learning-rate schedule, the DP-PCA projection, the history) and
      ends after the same number of lots as an uninterrupted run; checkpoints
      are written there after every epoch (`checkpoint_every_epoch`) or only
      when `should_stop` ends the run early.
    on_epoch(result): called after every epoch with everything measured so far.
    should_stop(): polled after every call of the training function; True ends
      training there (``stop_reason`` "interrupted"; a checkpoint is written).
    on_resume(info): called once when resuming ({"directory", "lots", "epoch",
      "epsilon"}).
    """
    result, model = run_recipe(
        MnistRecipe(config),
        verbose=verbose,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every_epoch=checkpoint_every_epoch,
        on_epoch=on_epoch,
        should_stop=should_stop,
        on_resume=on_resume,
        callbacks=callbacks,
    )
    return (result, model) if return_model else result
