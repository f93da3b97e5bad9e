"""CIFAR-10 with frozen pretrained convolutional layers: Abadi et al. 2016, section 5.3.

The paper's recipe: the convnet of `dpfl_tf.models.cifar_convnet` (conv 5x5x64
+ max-pool, twice; Dense 384, Dense 384, softmax) on 24x24 crops with the
distortions of `dpfl_tf.recipes.augment`.  The convolutional layers are
trained non-privately on *public* data and frozen; the dense layers start
from the same pretrained network; DP-SGD then trains the softmax layer alone,
the top dense layers, or all dense layers (``trained_layers``) on the
*private* data, with per-layer clip bounds (the softmax layer's about twice
the others'), lots of 600 / 2000 / 4000 and delta = 1e-5.

Public data (``PretrainConfig.public_data``):

* ``"cifar10_split"`` (default, the offline substitute): a fixed, seeded,
  class-stratified split of the 50,000 CIFAR-10 training images into
  ``public_size`` (10,000) *public* images, used only for pretraining, and the
  other 40,000 *private* images, used only for (DP) training.  The 10,000
  test images are used only for evaluation.  This is an *in-distribution*
  public set, easier than the paper's CIFAR-100: results say so in their
  ``pretraining`` field.
* ``"cifar100"`` (the paper's setting, where CIFAR-100 is available): the
  same architecture trained on the 50,000 CIFAR-100 training images; all
  50,000 CIFAR-10 training images are then private.  The conv and the two
  hidden dense layers are transferred; the softmax layer (100 outputs there)
  is freshly initialised for the 10 CIFAR-10 classes.

Data: the images are read through random-access sources
(`dpfl_tf.data.cifar.cifar10_sources`): DP-SGD reads the private images lot
by lot (``DPModel.fit(source, ...)``), pretraining and the non-private
baselines batch by batch, and evaluation sets are read again at every
evaluation, so with the JPEG copy no step holds the dataset's images in
memory (only labels and file names).  The canonical pickles and CIFAR-100
are read whole (a pickle of 10,000 images cannot be read in part).

Unit of privacy: one private training image (add/remove-one neighbours,
Poisson-sampled lots, the moments accountant by default).  Pretrained weights
carry the split they were trained on (`save_pretrained` stores it in the
file); `train_cifar10` refuses weights whose public split is not the one it
is about to treat as the complement of its private data, since images of the
private set must never have been seen by non-private pretraining.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from typing import Sequence

import keras
import numpy as np

from dpfl_tf._validation import ChoiceEnum, check_count, check_number
from dpfl_tf.data import ArraySource, SourceDataset, load_dataset
from dpfl_tf.data.cifar import cifar10_sources
from dpfl_tf.data.sources import IndexedSource
from dpfl_tf.keras import DPModel, DPSGD
from dpfl_tf.models import cifar_convnet
from dpfl_tf.privacy import (AccountantKind, calibrate_noise_multiplier, dp_sgd_event,
                             gaussian_step_event, max_steps)
from dpfl_tf.recipes.augment import Augmentation, Normalization, eval_dataset, train_dataset
from dpfl_tf.recipes.common import (EpochHistory, LotStopper, RunCheckpoint, accuracy,
                                    comparable_config, mark_run_finished, paper_learning_rate,
                                    privacy_summary, resumable_run_state, resume_seed,
                                    sampling_seed_for)

__all__ = ["CifarConfig", "Init", "PAPER_TARGETS", "PretrainConfig", "PublicData",
           "TrainedLayers", "build_private_model", "clip_bounds_for", "load_pretrained",
           "pretrain_public", "pretrain_split", "public_private_split", "read_pretrained_record",
           "save_pretrained", "stratified_split", "train_cifar10"]

CONV_LAYERS = ("conv1", "conv2")
DENSE_LAYERS = ("fc1", "fc2", "logits")
SOFTMAX_LAYER = "logits"
#: Abadi et al. 2016, section 5.3 (CIFAR-100 pretraining, delta = 1e-5).
PAPER_TARGETS = {"eps2": 0.67, "eps4": 0.70, "eps8": 0.73, "nonprivate_dense": 0.80,
                 "nonprivate_whole_net": 0.86}
_METADATA_KEY = "dpfl_tf_pretrained"


class PublicData(ChoiceEnum):
    """Where the pretraining (public) images come from."""

    __argument__ = "public_data"
    CIFAR10_SPLIT = "cifar10_split"
    CIFAR100 = "cifar100"


class TrainedLayers(ChoiceEnum):
    """Which layers are trained on the private data; all others are frozen."""

    __argument__ = "trained_layers"
    SOFTMAX = "softmax"    # logits only
    TOP = "top"            # fc2 + logits
    DENSE = "dense"        # fc1 + fc2 + logits
    ALL = "all"            # the whole net, convolutions included

    @property
    def layers(self) -> tuple[str, ...]:
        return {"softmax": (SOFTMAX_LAYER,), "top": ("fc2", SOFTMAX_LAYER),
                "dense": DENSE_LAYERS, "all": CONV_LAYERS + DENSE_LAYERS}[self.value]


class Init(ChoiceEnum):
    """How the network is initialised before private training."""

    __argument__ = "init"
    PRETRAINED = "pretrained"   # every layer from the pretrained net (softmax too if it fits)
    CONVS = "convs"             # conv layers pretrained, dense layers freshly initialised
    SCRATCH = "scratch"         # nothing pretrained (trained_layers must be "all")


# ---------------------------------------------------------------------- splits


def stratified_split(labels, first_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (first, rest): `first_size` examples drawn per class in
    proportion to the class counts (largest remainders, ties to the lower
    class), uniformly within each class from ``np.random.default_rng(seed)``.

    Both index arrays are sorted, disjoint and together cover every example.
    """
    labels = np.asarray(labels).reshape(-1)
    n = len(labels)
    first_size = check_count("first_size", first_size)
    if first_size > n:
        raise ValueError(f"first_size must be <= the number of examples ({n}), "
                         f"got {first_size}")
    check_count("seed", seed)
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * (first_size / n) if n else counts * 0.0
    take = np.floor(exact).astype(np.int64)
    remainder = exact - take
    for i in np.argsort(-remainder, kind="stable")[:first_size - int(take.sum())]:
        take[i] += 1
    rng = np.random.default_rng(seed)
    first = []
    for cls, k in zip(classes, take):
        members = np.flatnonzero(labels == cls)
        first.append(members[rng.permutation(len(members))[:k]])
    first = np.sort(np.concatenate(first)) if first else np.zeros(0, np.int64)
    rest = np.setdiff1d(np.arange(n), first, assume_unique=True)
    return first, rest


def public_private_split(labels, public_size: int = 10000, seed: int = 0
                         ) -> tuple[np.ndarray, np.ndarray]:
    """The offline substitute for CIFAR-100: (public, private) indices into the
    CIFAR-10 training set; a fixed seeded split stratified by class."""
    return stratified_split(labels, public_size, seed)


def _indices_digest(indices: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(indices, dtype="<i8").tobytes()).hexdigest()


# ---------------------------------------------------------------------- configs


def _check_optional_count(name, value, minimum=1):
    return None if value is None else check_count(name, value, minimum=minimum)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    """Non-private pretraining of `cifar_convnet` on the public data.

    Defaults: SGD with momentum 0.9 and decoupled weight decay 5e-4, batch 128,
    learning rate 0.05 with cosine decay to 0 over `epochs`, the augmentation of
    `dpfl_tf.recipes.augment`.  `limit_public` / `limit_test` cut the data to
    stratified subsets (smoke runs and tests only).
    """

    public_data: PublicData | str = PublicData.CIFAR10_SPLIT
    public_size: int = 10000            # cifar10_split only
    split_seed: int = 0                 # cifar10_split only
    cifar100_label_mode: str = "fine"   # cifar100 only: "fine" (100) or "coarse" (20)
    epochs: int = 100
    batch_size: int = 128
    learning_rate: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    normalization: Normalization | str = Normalization.STANDARDIZE
    eval_every: int = 5
    limit_public: int | None = None
    limit_test: int | None = None
    seed: int | None = None
    data_dir: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "public_data", PublicData.parse(self.public_data))
        object.__setattr__(self, "normalization", Normalization.parse(self.normalization))
        check_count("public_size", self.public_size, minimum=1)
        check_count("split_seed", self.split_seed)
        if self.cifar100_label_mode not in ("fine", "coarse"):
            raise ValueError(f"cifar100_label_mode must be 'fine' or 'coarse', got "
                             f"{self.cifar100_label_mode!r}")
        check_count("epochs", self.epochs, minimum=1)
        check_count("batch_size", self.batch_size, minimum=1)
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 -- frozen
        set_("learning_rate", check_number("learning_rate", self.learning_rate, low=0.0,
                                           low_open=True))
        set_("momentum", check_number("momentum", self.momentum, low=0.0, high=1.0,
                                      high_open=True))
        set_("weight_decay", check_number("weight_decay", self.weight_decay, low=0.0))
        check_count("eval_every", self.eval_every, minimum=1)
        _check_optional_count("limit_public", self.limit_public)
        _check_optional_count("limit_test", self.limit_test)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CifarConfig:
    """One CIFAR-10 training run (non-private baseline or DP-SGD).

    Model and data:
      trained_layers: "softmax" | "top" | "dense" | "all" (`TrainedLayers`);
        the other layers are frozen (run forward only).
      init: "pretrained" (default) | "convs" | "scratch" (`Init`).
      pretrained_weights: a file written by `save_pretrained`
        (``experiments/cifar10_pretrain.py``); None pretrains in-process with
        `pretrain` (not saved).  Its public split must match `pretrain`'s.
      pretrain: the public data and split (and, when pretraining in-process,
        the pretraining settings).
      limit_private, limit_test: stratified subsets (smoke runs, tests).

    Privacy (ignored when ``private=False``):
      noise_multiplier: sigma; None calibrates it so that `epochs` epochs
        spend exactly `target_epsilon` (accountant `accountant`).
      l2_norm_clip: the per-layer clip bound of the hidden layers;
        the softmax layer's bound is ``softmax_clip_ratio`` times it (paper: ~2).
      lot_size: L (Poisson sampling, q = L / N_private); batch_size is the
        physical batch (memory only).
      target_epsilon, delta: the budget; training stops before exceeding it.
    """

    setting: str = "custom"
    private: bool = True
    trained_layers: TrainedLayers | str = TrainedLayers.TOP
    init: Init | str = Init.PRETRAINED
    pretrained_weights: str | None = None
    pretrain: PretrainConfig = dataclasses.field(default_factory=PretrainConfig)
    noise_multiplier: float | None = None
    l2_norm_clip: float = 3.0
    softmax_clip_ratio: float = 2.0
    lot_size: int = 2000
    batch_size: int | None = 500
    learning_rate: float = 0.05
    final_learning_rate: float | None = None   # None: constant learning rate
    decay_epochs: int = 0
    momentum: float = 0.0
    target_epsilon: float | None = 4.0
    delta: float = 1e-5
    accountant: str = "moments"
    epochs: int = 30
    eval_every: int = 1
    train_eval_size: int = 5000
    normalization: Normalization | str = Normalization.STANDARDIZE
    deltas: tuple = (1e-5,)
    limit_private: int | None = None
    limit_test: int | None = None
    seed: int | None = None
    data_dir: str | None = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 -- frozen
        set_("trained_layers", TrainedLayers.parse(self.trained_layers))
        set_("init", Init.parse(self.init))
        set_("normalization", Normalization.parse(self.normalization))
        set_("accountant", AccountantKind.parse(self.accountant).value)
        if not isinstance(self.pretrain, PretrainConfig):
            raise ValueError(f"pretrain must be a PretrainConfig, got {self.pretrain!r}")
        if not isinstance(self.private, bool):
            raise ValueError(f"private must be True or False, got {self.private!r}")
        if self.init is Init.SCRATCH and self.trained_layers is not TrainedLayers.ALL:
            raise ValueError(f"init='scratch' trains from random weights, so trained_layers "
                             f"must be 'all', got {self.trained_layers.value!r}")
        if self.accountant == "strong" and self.private:
            raise ValueError("accountant must be 'moments', 'rdp' or 'pld' for training, "
                             "got 'strong'")
        if self.noise_multiplier is not None:
            set_("noise_multiplier", check_number("noise_multiplier", self.noise_multiplier,
                                                  low=0.0, low_open=True))
        elif self.private and self.target_epsilon is None:
            raise ValueError("noise_multiplier=None calibrates the noise for target_epsilon; "
                             "give a target_epsilon or a noise_multiplier")
        set_("l2_norm_clip", check_number("l2_norm_clip", self.l2_norm_clip, low=0.0,
                                          low_open=True))
        set_("softmax_clip_ratio", check_number("softmax_clip_ratio", self.softmax_clip_ratio,
                                                low=0.0, low_open=True))
        check_count("lot_size", self.lot_size, minimum=1)
        _check_optional_count("batch_size", self.batch_size)
        set_("learning_rate", check_number("learning_rate", self.learning_rate, low=0.0,
                                           low_open=True))
        if self.final_learning_rate is not None:
            set_("final_learning_rate", check_number("final_learning_rate",
                                                     self.final_learning_rate, low=0.0))
        check_count("decay_epochs", self.decay_epochs)
        set_("momentum", check_number("momentum", self.momentum, low=0.0, high=1.0,
                                      high_open=True))
        if self.target_epsilon is not None:
            set_("target_epsilon", check_number("target_epsilon", self.target_epsilon,
                                                low=0.0, low_open=True))
        set_("delta", check_number("delta", self.delta, low=0.0, high=1.0, low_open=True,
                                   high_open=True))
        check_count("epochs", self.epochs, minimum=1)
        check_count("eval_every", self.eval_every, minimum=1)
        check_count("train_eval_size", self.train_eval_size)
        set_("deltas", tuple(check_number("deltas", d, low=0.0, high=1.0, low_open=True,
                                          high_open=True) for d in self.deltas))
        if not self.deltas:
            raise ValueError("deltas must list at least one delta")
        _check_optional_count("limit_private", self.limit_private)
        _check_optional_count("limit_test", self.limit_test)

    @property
    def clip_bounds(self) -> dict[str, float]:
        return clip_bounds_for(self.trained_layers, self.l2_norm_clip, self.softmax_clip_ratio)


def clip_bounds_for(trained_layers: TrainedLayers | str, l2_norm_clip: float,
                    softmax_clip_ratio: float = 2.0) -> dict[str, float]:
    """Per-layer clip bounds {layer: C}: `l2_norm_clip` for every trained layer,
    ``softmax_clip_ratio * l2_norm_clip`` for the softmax layer (the paper
    observed softmax gradients about twice as large and kept that ratio)."""
    layers = TrainedLayers.parse(trained_layers).layers
    return {name: float(l2_norm_clip * (softmax_clip_ratio if name == SOFTMAX_LAYER else 1.0))
            for name in layers}


# ---------------------------------------------------------------------- data


def _subset(source: IndexedSource, limit: int | None, seed: int) -> IndexedSource:
    """A stratified subset of `limit` records of `source` (all of it if None)."""
    if limit is None or limit >= len(source):
        return source
    keep, _ = stratified_split(source.labels, limit, seed)
    return source.subset(keep)


def _public_data(config: PretrainConfig) -> tuple[dict, SourceDataset]:
    """Public training images (a source), the dataset (for its test set), and
    the split record."""
    if config.public_data is PublicData.CIFAR100:
        # canonical pickles only, read whole (public data: no privacy concern)
        c100 = load_dataset("cifar100", data_dir=config.data_dir,
                            label_mode=config.cifar100_label_mode)
        data = SourceDataset(ArraySource(c100.x_train, c100.y_train),
                             ArraySource(c100.x_test, c100.y_test),
                             num_classes=c100.num_classes, class_names=c100.class_names,
                             name=c100.name, source=c100.source)
        record = {"public_data": PublicData.CIFAR100.value, "public_source": data.source.label,
                  "public_examples": int(len(data.y_train)),
                  "cifar100_label_mode": config.cifar100_label_mode,
                  "classes": int(data.num_classes)}
        return {"source": data.train, "record": record}, data
    data = cifar10_sources(config.data_dir)
    public, _ = public_private_split(data.y_train, config.public_size, config.split_seed)
    record = {"public_data": PublicData.CIFAR10_SPLIT.value, "public_source": data.source.label,
              "public_examples": int(len(public)), "public_size": int(config.public_size),
              "split_seed": int(config.split_seed), "train_examples": int(len(data.y_train)),
              "public_indices_sha256": _indices_digest(public), "classes": 10}
    return {"source": data.train.subset(public), "record": record}, data


def pretraining_description(record: dict | None) -> str:
    """The ``pretraining`` field of a result: which public data, in words."""
    if record is None:
        return "none (trained from scratch)"
    if record["public_data"] == PublicData.CIFAR100.value:
        classes = "100 fine" if record.get("cifar100_label_mode", "fine") == "fine" \
            else "20 coarse"
        used = record.get("pretrained_on", record["public_examples"])
        subset = f" ({used:,} used)" if used < record["public_examples"] else ""
        return (f"{record['public_source']}: {record['public_examples']:,} train images"
                f"{subset}, {classes} classes (the paper's public data)")
    text = (f"public split: {record['public_examples']:,} CIFAR-10 train images "
            f"(in-distribution substitute for CIFAR-100)")
    used = record.get("pretrained_on", record["public_examples"])
    if used < record["public_examples"]:
        text += f", pretrained on a {used:,}-image subset of it"
    return text


# ---------------------------------------------------------------------- training


def _fit_nonprivate(net: keras.Model, source: IndexedSource, augmentation: Augmentation, *,
                    batch_size: int, epochs: int, learning_rate, momentum: float,
                    weight_decay: float | None, callbacks: Sequence, seed: int | None) -> None:
    """Ordinary minibatch SGD on the augmented `tf.data` pipeline, batches read
    from `source`."""
    net.compile(optimizer=keras.optimizers.SGD(learning_rate, momentum=momentum,
                                               weight_decay=weight_decay or None),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = train_dataset(source, None, augmentation, batch_size=batch_size, shuffle_seed=seed)
    net.fit(data, epochs=epochs, callbacks=list(callbacks), verbose=0, shuffle=False)


def pretrain_public(config: PretrainConfig | None = None, *, verbose: bool = True
                    ) -> tuple[keras.Model, dict]:
    """Trains `cifar_convnet` non-privately on the public data.

    Returns the trained network (classes of the public data) and a JSON-ready
    record: the public split (with a digest of its indices), accuracy on the
    public dataset's test set, settings, time and per-epoch history.
    """
    config = config or PretrainConfig()
    start = time.perf_counter()
    if config.seed is not None:
        keras.utils.set_random_seed(config.seed)
    public, data = _public_data(config)
    train = _subset(public["source"], config.limit_public, config.split_seed + 1)
    test = _subset(data.test, config.limit_test, config.split_seed + 2)
    y, y_test = train.labels, test.labels
    augmentation = Augmentation(normalization=config.normalization, seed=config.seed)
    net = cifar_convnet(input_shape=augmentation.crop_size + (3,),
                        classes=public["record"]["classes"])
    x_test_in = eval_dataset(test, None, augmentation)  # read and cropped at each evaluation
    steps = config.epochs * int(np.ceil(len(y) / config.batch_size))
    lr = keras.optimizers.schedules.CosineDecay(config.learning_rate, steps)
    history = EpochHistory(x_test_in, y_test, every=config.eval_every,
                           total_epochs=config.epochs, private=False, verbose=verbose)
    _fit_nonprivate(net, train, augmentation, batch_size=config.batch_size,
                    epochs=config.epochs, learning_rate=lr, momentum=config.momentum,
                    weight_decay=config.weight_decay, callbacks=[history], seed=config.seed)
    last = history.rows[-1]
    test_accuracy = (last["test_accuracy"] if "test_accuracy" in last
                     else accuracy(net, x_test_in, y_test))
    info = {
        **public["record"],
        "pretrained_on": int(len(y)),
        "test_dataset": data.source.label,
        "test_examples": int(len(y_test)),
        "test_accuracy": test_accuracy,
        "epochs": last["epoch"],
        "seconds": time.perf_counter() - start,
        "config": _jsonable(dataclasses.asdict(config)),
        "augmentation": augmentation.get_config(),
        "history": history.rows,
    }
    return net, info


def save_pretrained(net: keras.Model, info: dict, path: str | os.PathLike) -> None:
    """Writes the weights (``*.weights.h5``) with `info` (minus the history)
    stored in the file, atomically."""
    import h5py

    path = os.fspath(path)
    if not path.endswith(".weights.h5"):
        raise ValueError(f"path must end with '.weights.h5', got {path!r}")
    meta = json.dumps({k: v for k, v in info.items() if k != "history"},
                      default=_json_default)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".",
                               suffix=".weights.h5")
    os.close(fd)
    try:
        net.save_weights(tmp, overwrite=True)
        with h5py.File(tmp, "a") as h5:
            h5.attrs[_METADATA_KEY] = meta
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_pretrained_record(path: str | os.PathLike) -> dict:
    """The record `save_pretrained` stored in a weights file (public data, split,
    accuracy, settings), without loading the weights."""
    import h5py

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no pretrained weights at {path}; make them with "
            f"'python experiments/cifar10_pretrain.py' (see models/README.md)")
    try:
        with h5py.File(path, "r") as h5:
            raw = h5.attrs.get(_METADATA_KEY)
    except OSError as e:
        raise ValueError(f"{path} is not a weights file (.weights.h5) that can be read: "
                         f"{e}") from None
    if raw is None:
        raise ValueError(f"{path} has no dpfl_tf pretraining record; it was not written by "
                         f"dpfl_tf.recipes.cifar10.save_pretrained")
    return json.loads(raw)


def pretrain_split(record: dict, **settings) -> PretrainConfig:
    """A `PretrainConfig` holding out the public data and split of a pretraining
    `record` (so that the private set is exactly its complement), with `settings`."""
    split = {"public_data": record["public_data"]}
    if record["public_data"] == PublicData.CIFAR10_SPLIT.value:
        split.update(public_size=int(record["public_size"]),
                     split_seed=int(record["split_seed"]))
    else:
        split["cifar100_label_mode"] = record.get("cifar100_label_mode", "fine")
    return PretrainConfig(**split, **settings)


def load_pretrained(path: str | os.PathLike) -> tuple[keras.Model, dict]:
    """(network, info) from a file written by `save_pretrained`."""
    path = os.fspath(path)
    info = read_pretrained_record(path)
    crop = info.get("augmentation", {}).get("crop_size", [24, 24])
    net = cifar_convnet(input_shape=tuple(crop) + (3,), classes=int(info["classes"]))
    net.load_weights(path)
    return net, info


def _check_public_split(info: dict, pretrain: PretrainConfig, data: SourceDataset) -> None:
    """Refuses weights pretrained on anything but the public complement of our private set."""
    want = pretrain.public_data.value
    if info.get("public_data") != want:
        raise ValueError(f"pretrained weights were trained on public_data="
                         f"{info.get('public_data')!r}, but this run uses {want!r}")
    if pretrain.public_data is not PublicData.CIFAR10_SPLIT:
        return
    public, _ = public_private_split(data.y_train, pretrain.public_size, pretrain.split_seed)
    ours = {"public_source": data.source.label, "public_size": pretrain.public_size,
            "split_seed": pretrain.split_seed, "public_indices_sha256": _indices_digest(public)}
    theirs = {k: info.get(k) for k in ours}
    if theirs != ours:
        diff = {k: (theirs[k], ours[k]) for k in ours if theirs[k] != ours[k]}
        raise ValueError(
            "the pretrained weights were trained on another public split than the one this "
            f"run holds out (weights vs this run: {diff}); images of the private set may "
            "have been used in non-private pretraining. Pretrain again with the same "
            "public_size, split_seed and CIFAR-10 copy.")


def build_private_model(pretrained: keras.Model | None, trained_layers: TrainedLayers | str,
                        init: Init | str = Init.PRETRAINED, *, input_shape=(24, 24, 3),
                        classes: int = 10) -> tuple[keras.Model, list[str]]:
    """A fresh `cifar_convnet` for CIFAR-10: layers copied from `pretrained`
    per `init` (the softmax layer only if its shape fits), then every layer
    not in `trained_layers` frozen (``trainable=False``).

    Returns (model, names of the layers copied from the pretrained network).
    """
    trained_layers, init = TrainedLayers.parse(trained_layers), Init.parse(init)
    net = cifar_convnet(input_shape=input_shape, classes=classes)
    copied = []
    if init is not Init.SCRATCH:
        if pretrained is None:
            raise ValueError(f"init={init.value!r} needs a pretrained network")
        names = CONV_LAYERS if init is Init.CONVS else CONV_LAYERS + DENSE_LAYERS
        for name in names:
            src = pretrained.get_layer(name).get_weights()
            dst = net.get_layer(name)
            if [w.shape for w in src] == [tuple(w.shape) for w in dst.weights]:
                dst.set_weights(src)
                copied.append(name)
            elif name != SOFTMAX_LAYER:
                raise ValueError(f"pretrained layer {name!r} has weights "
                                 f"{[w.shape for w in src]}, the model needs "
                                 f"{[tuple(w.shape) for w in dst.weights]}")
    for name in CONV_LAYERS + DENSE_LAYERS:
        net.get_layer(name).trainable = name in trained_layers.layers
    return net, copied


def _calibrated_sigma(config: CifarConfig, n: int, lots_per_epoch: int) -> float:
    steps = config.epochs * lots_per_epoch

    def event_for(sigma):
        return dp_sgd_event(sigma, steps, sampling_rate=config.lot_size / n)

    sigma, _ = calibrate_noise_multiplier(config.target_epsilon, config.delta, event_for,
                                          config.accountant, tolerance=1e-3)
    return sigma


#: config fields a resumed run may change (they do not change what is trained)
_RESUMABLE_CHANGES = ("data_dir", "eval_every", "pretrain.data_dir")


def _comparable(config: CifarConfig) -> dict:
    return comparable_config(dataclasses.asdict(config), _RESUMABLE_CHANGES)


def _weights_digest(net: keras.Model, names: Sequence[str]) -> str:
    """sha256 of the weights of the layers `names` (to show frozen layers unchanged)."""
    digest = hashlib.sha256()
    for name in names:
        for w in net.get_layer(name).get_weights():
            digest.update(np.ascontiguousarray(w).tobytes())
    return digest.hexdigest()


def train_cifar10(config: CifarConfig, *, pretrained: tuple[keras.Model, dict] | None = None,
                  verbose: bool = True, return_model: bool = False,
                  checkpoint_dir: str | None = None, checkpoint_every_epoch: bool = True,
                  on_epoch=None, should_stop=None, on_resume=None, callbacks=()):
    """Trains one configuration; returns a JSON-ready result with per-epoch history
    (and the trained Keras model too if ``return_model``).

    Args:
      pretrained: (network, info) from `pretrain_public` / `load_pretrained`;
        overrides ``config.pretrained_weights`` (tests, several runs sharing one).
      checkpoint_dir, checkpoint_every_epoch, on_epoch, should_stop, on_resume,
        callbacks: as for `dpfl_tf.recipes.mnist.train_mnist` (private runs):
        a checkpoint of the same configuration in `checkpoint_dir` is resumed
        exactly (weights, frozen layers included, ledger, lot counter, optimizer
        state and so the learning-rate schedule, the calibrated noise, the
        history; the pretrained weights are not read again), and the run ends
        after the same number of lots as an uninterrupted one.
    """
    from dpfl_tf.keras.checkpoint import DPCheckpoint

    start = time.perf_counter()
    state = resumable_run_state(checkpoint_dir, _comparable(config))
    if config.seed is not None:
        keras.utils.set_random_seed(resume_seed(config.seed, state))
    # the private images are read lot by lot from the source (memory O(lot), not O(N))
    data = cifar10_sources(config.data_dir)
    pre = config.pretrain
    if pre.public_data is PublicData.CIFAR10_SPLIT:
        _, private_idx = public_private_split(data.y_train, pre.public_size, pre.split_seed)
    else:
        private_idx = np.arange(len(data.y_train))
    private = _subset(data.train.subset(private_idx), config.limit_private,
                      pre.split_seed + 3)
    test = _subset(data.test, config.limit_test, pre.split_seed + 2)
    y_priv, y_test = private.labels, test.labels

    info = None
    pretrained_net = None
    if state is not None:   # the weights are in the checkpoint; the split is checked again
        info = state["pretrained_record"]
        if info is not None:
            _check_public_split(info, pre, data)
    elif config.init is not Init.SCRATCH:
        if pretrained is None:
            if config.pretrained_weights is not None:
                pretrained = load_pretrained(config.pretrained_weights)
            else:
                pretrained = pretrain_public(dataclasses.replace(
                    pre, data_dir=pre.data_dir or config.data_dir, seed=config.seed),
                    verbose=verbose)
        pretrained_net, info = pretrained
        _check_public_split(info, pre, data)
    record = {k: v for k, v in info.items() if k != "history"} if info else None

    augmentation = Augmentation(normalization=config.normalization,
                                seed=resume_seed(config.seed, state))
    if state is not None:
        model, _ = DPCheckpoint.restore(checkpoint_dir)
        net, copied = model.model, state["copied"]
    else:
        net, copied = build_private_model(pretrained_net, config.trained_layers, config.init,
                                          input_shape=augmentation.crop_size + (3,))
    frozen = sorted(layer.name for layer in net.layers if layer.weights and not layer.trainable)
    frozen_digest = (state["frozen_digest"] if state is not None
                     else _weights_digest(net, frozen))
    # evaluation sets are read (and centre-cropped) batch by batch at each evaluation
    x_test_in = eval_dataset(test, None, augmentation)
    eval_idx, _ = stratified_split(y_priv, min(config.train_eval_size, len(y_priv)),
                                   pre.split_seed + 4)
    x_train_in = (eval_dataset(private.subset(eval_idx), None, augmentation)
                  if len(eval_idx) else None)
    y_train_eval = y_priv[eval_idx] if len(eval_idx) else None

    n = len(y_priv)
    if config.private and config.lot_size > n:
        raise ValueError(f"lot_size must be <= the number of private examples ({n}), "
                         f"got {config.lot_size}")
    lots_per_epoch = max(1, n // config.lot_size)
    # non-private runs take ceil(n / lot_size) minibatch steps per epoch
    steps_per_epoch = lots_per_epoch if config.private else -(-n // config.lot_size)
    initial_epoch = 0
    if state is not None:
        if state["lots_per_epoch"] != lots_per_epoch:
            raise ValueError(f"{checkpoint_dir} holds a run of {state['lots_per_epoch']} lots "
                             f"per epoch, this data gives {lots_per_epoch} ({n} private "
                             "examples): not the same private data; use another checkpoint "
                             "directory")
        sigma, total_epochs, row0 = (state["noise_multiplier"], state["total_epochs"],
                                     state["row0"])
        initial_epoch = model.lots_applied // lots_per_epoch
        if on_resume is not None:
            on_resume({"directory": checkpoint_dir, "lots": model.lots_applied,
                       "epoch": model.lots_applied / lots_per_epoch,
                       "epsilon": model.epsilon(config.delta)})
    else:
        sigma = config.noise_multiplier
        total_epochs = config.epochs
        if config.private:
            if sigma is None:
                sigma = _calibrated_sigma(config, n, lots_per_epoch)
            if config.target_epsilon is not None:
                lots = max_steps(config.target_epsilon, config.delta,
                                 gaussian_step_event(sigma, sampling_rate=config.lot_size / n),
                                 config.accountant)
                if lots == 0:
                    raise ValueError(f"target_epsilon={config.target_epsilon:g} does not "
                                     f"allow a single lot with noise_multiplier={sigma:g}")
                total_epochs = min(config.epochs,
                                   EpochHistory.estimated_epochs(lots, lots_per_epoch))
        # epoch 0: the starting point (the pretrained network before private training)
        row0 = {"epoch": 0, "seconds": 0.0, "test_accuracy": accuracy(net, x_test_in, y_test)}
        if x_train_in is not None:
            row0["train_accuracy"] = accuracy(net, x_train_in, y_train_eval)
        if config.private:
            row0.update({f"epsilon@{d:g}": 0.0 for d in config.deltas}, epsilon=0.0)

    history = EpochHistory(x_test_in, y_test, x_train_in, y_train_eval,
                           every=config.eval_every, deltas=config.deltas,
                           total_epochs=total_epochs, private=config.private, verbose=verbose)
    seconds_before = 0.0
    if state is not None:
        history.rows = [r for r in state["history"] if r["epoch"] <= initial_epoch]
        seconds_before = state["seconds"]
    stopper = LotStopper(total_epochs * lots_per_epoch, should_stop)

    def result_of(model, final: bool = False) -> dict:
        rows = history.rows
        last = rows[-1] if rows else row0
        evaluated = [r for r in [row0, *rows] if "test_accuracy" in r]
        if "test_accuracy" in last:
            test_acc = last["test_accuracy"]
        else:
            test_acc = (accuracy(model, x_test_in, y_test) if final
                        else evaluated[-1]["test_accuracy"])
        ledger = model.privacy_ledger if config.private else None
        return {
            **_jsonable(dataclasses.asdict(config)),
            "dataset": data.source.label,
            "dataset_path": data.source.path,
            "pretraining": pretraining_description(info),
            "pretrained_weights": config.pretrained_weights,
            "pretrained_record": record,
            "pretrained_test_accuracy": info.get("test_accuracy") if info else None,
            "pretrained_on_cifar10_test": row0["test_accuracy"],
            "initialized_from_pretrained": copied,
            "trained_layers": config.trained_layers.value,
            "trainable_layers": [l.name for l in net.layers if l.trainable and l.weights],
            "frozen_layers": frozen,
            "frozen_layers_unchanged": _weights_digest(net, frozen) == frozen_digest,
            "private_examples": int(n),
            "test_examples": int(len(y_test)),
            "lot_size": config.lot_size,
            "lots_per_epoch": lots_per_epoch,
            "noise_multiplier": sigma if config.private else None,
            "noise_calibrated": bool(config.private and config.noise_multiplier is None),
            "clip_bounds": config.clip_bounds if config.private else None,
            "epsilon": ledger.epsilon(config.delta) if config.private else None,
            "delta": config.delta if config.private else None,
            "accountant": config.accountant if config.private else None,
            "epochs": last["epoch"],
            "lots": (model.lots_applied if config.private
                     else last["epoch"] * steps_per_epoch),
            "test_accuracy": test_acc,
            "train_accuracy": last.get("train_accuracy"),
            "seconds": seconds_before + time.perf_counter() - start,
            "stop_reason": getattr(model, "stop_reason", None) or "running",
            "augmentation": augmentation.get_config(),
            "history": [row0, *rows],
            **privacy_summary(ledger, config.delta, config.seed),
        }

    def run_state() -> dict:
        return {"config": _comparable(config), "noise_multiplier": sigma,
                "total_epochs": total_epochs, "lots_per_epoch": lots_per_epoch,
                "lots": model.lots_applied, "pretrained_record": record, "copied": copied,
                "frozen_digest": frozen_digest, "row0": row0, "history": history.rows,
                "seconds": seconds_before + time.perf_counter() - start, "finished": None}

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    lr = paper_learning_rate(config.learning_rate,
                             config.final_learning_rate if config.final_learning_rate
                             is not None else config.learning_rate,
                             config.decay_epochs, steps_per_epoch)
    if config.private:
        if state is None:  # (a resumed model has its optimizer and schedule)
            model = DPModel(net, accountant=config.accountant)
            model.compile(optimizer=DPSGD(lr, momentum=config.momentum,
                                          l2_norm_clip=config.clip_bounds,
                                          noise_multiplier=sigma, seed=config.seed), loss=loss)
        saver = RunCheckpoint(checkpoint_dir, checkpoint_every_epoch, stopper, run_state,
                              result_of, on_epoch)
        if model.lots_applied < stopper.total_lots:
            model.fit(private, lot_size=config.lot_size, batch_size=config.batch_size,
                      epochs=total_epochs, initial_epoch=initial_epoch,
                      target_epsilon=config.target_epsilon, target_delta=config.delta,
                      preprocess=augmentation, callbacks=[history, stopper, saver, *callbacks],
                      verbose=0, sampling_seed=sampling_seed_for(config.seed, initial_epoch))
        else:
            model.stop_reason = "completed"
        mark_run_finished(checkpoint_dir, run_state, model.stop_reason)
    else:
        model = net
        _fit_nonprivate(net, private, augmentation, batch_size=config.lot_size,
                        epochs=total_epochs, learning_rate=lr, momentum=config.momentum,
                        weight_decay=None, callbacks=[history, *callbacks], seed=config.seed)
        model.stop_reason = "completed"

    result = result_of(model, final=model.stop_reason != "interrupted")
    return (result, model) if return_model else result


# ---------------------------------------------------------------------- helpers


def _json_default(obj):
    if isinstance(obj, ChoiceEnum):
        return obj.value
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def _jsonable(obj):
    """Enums -> their values, tuples -> lists (for results and stored records)."""
    return json.loads(json.dumps(obj, default=_json_default))
