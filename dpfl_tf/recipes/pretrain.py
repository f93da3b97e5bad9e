"""Non-private pretraining on public data, for the CIFAR-10 recipe of Abadi et
al. 2016, section 5.3 (`dpfl_tf.recipes.cifar10`).

Public data (``PretrainConfig.public_data``):

* ``"cifar10_split"`` (default, the offline substitute): a fixed, seeded,
  class-stratified split of the 50,000 CIFAR-10 training images into
  ``public_size`` (10,000) *public* images, used only for pretraining, and the
  other 40,000 *private* images, used only for (DP) training.  This is an
  *in-distribution* public set, easier than the paper's CIFAR-100: results say
  so in their ``pretraining`` field.
* ``"cifar100"`` (the paper's setting, where CIFAR-100 is available): the
  same architecture trained on the 50,000 CIFAR-100 training images.

Pretrained weights carry the split they were trained on (`save_pretrained`
stores it in the file), so that the private training set can be checked to be
exactly its complement (`check_public_split`).
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

from dpfl_tf._seeds import derive_seed
from dpfl_tf._validation import ChoiceEnum, check_count, check_number
from dpfl_tf.data import ArraySource, SourceDataset, load_dataset
from dpfl_tf.data.cifar import cifar10_sources
from dpfl_tf.data.sources import IndexedSource
from dpfl_tf.models import cifar_convnet
from dpfl_tf.recipes.augment import Augmentation, Normalization, eval_dataset, train_dataset
from dpfl_tf.recipes.common import EpochHistory, accuracy

__all__ = [
    "PretrainConfig",
    "PublicData",
    "load_pretrained",
    "pretrain_public",
    "pretrain_split",
    "pretraining_description",
    "public_private_split",
    "read_pretrained_record",
    "save_pretrained",
    "stratified_split",
    "check_public_split",
    "subset",
    "jsonable",
]

_METADATA_KEY = "dpfl_tf_pretrained"


class PublicData(ChoiceEnum):
    """Where the pretraining (public) images come from."""

    __argument__ = "public_data"
    CIFAR10_SPLIT = "cifar10_split"
    CIFAR100 = "cifar100"


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
        raise ValueError(f"first_size must be <= the number of examples ({n}), got {first_size}")
    check_count("seed", seed)
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * (first_size / n) if n else counts * 0.0
    take = np.floor(exact).astype(np.int64)
    remainder = exact - take
    for i in np.argsort(-remainder, kind="stable")[: first_size - int(take.sum())]:
        take[i] += 1
    rng = np.random.default_rng(seed)
    first = []
    for cls, k in zip(classes, take):
        members = np.flatnonzero(labels == cls)
        first.append(members[rng.permutation(len(members))[:k]])
    first = np.sort(np.concatenate(first)) if first else np.zeros(0, np.int64)
    rest = np.setdiff1d(np.arange(n), first, assume_unique=True)
    return first, rest


def public_private_split(
    labels, public_size: int = 10000, seed: int = 0
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
    public_size: int = 10000  # cifar10_split only
    split_seed: int = 0  # cifar10_split only
    cifar100_label_mode: str = "fine"  # cifar100 only: "fine" (100) or "coarse" (20)
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
            raise ValueError(
                f"cifar100_label_mode must be 'fine' or 'coarse', got {self.cifar100_label_mode!r}"
            )
        check_count("epochs", self.epochs, minimum=1)
        check_count("batch_size", self.batch_size, minimum=1)
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 -- frozen
        set_(
            "learning_rate",
            check_number("learning_rate", self.learning_rate, low=0.0, low_open=True),
        )
        set_("momentum", check_number("momentum", self.momentum, low=0.0, high=1.0, high_open=True))
        set_("weight_decay", check_number("weight_decay", self.weight_decay, low=0.0))
        check_count("eval_every", self.eval_every, minimum=1)
        _check_optional_count("limit_public", self.limit_public)
        _check_optional_count("limit_test", self.limit_test)


# ---------------------------------------------------------------------- data


def subset(source: IndexedSource, limit: int | None, seed: int) -> IndexedSource:
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
        c100 = load_dataset(
            "cifar100", data_dir=config.data_dir, label_mode=config.cifar100_label_mode
        )
        data = SourceDataset(
            ArraySource(c100.x_train, c100.y_train),
            ArraySource(c100.x_test, c100.y_test),
            num_classes=c100.num_classes,
            class_names=c100.class_names,
            name=c100.name,
            source=c100.source,
        )
        record = {
            "public_data": PublicData.CIFAR100.value,
            "public_source": data.source.label,
            "public_examples": int(len(data.y_train)),
            "cifar100_label_mode": config.cifar100_label_mode,
            "classes": int(data.num_classes),
        }
        return {"source": data.train, "record": record}, data
    data = cifar10_sources(config.data_dir)
    public, _ = public_private_split(data.y_train, config.public_size, config.split_seed)
    record = {
        "public_data": PublicData.CIFAR10_SPLIT.value,
        "public_source": data.source.label,
        "public_examples": int(len(public)),
        "public_size": int(config.public_size),
        "split_seed": int(config.split_seed),
        "train_examples": int(len(data.y_train)),
        "public_indices_sha256": _indices_digest(public),
        "classes": 10,
    }
    return {"source": data.train.subset(public), "record": record}, data


def pretraining_description(record: dict | None) -> str:
    """The ``pretraining`` field of a result: which public data, in words."""
    if record is None:
        return "none (trained from scratch)"
    if record["public_data"] == PublicData.CIFAR100.value:
        classes = "100 fine" if record.get("cifar100_label_mode", "fine") == "fine" else "20 coarse"
        used = record.get("pretrained_on", record["public_examples"])
        subset = f" ({used:,} used)" if used < record["public_examples"] else ""
        return (
            f"{record['public_source']}: {record['public_examples']:,} train images"
            f"{subset}, {classes} classes (the paper's public data)"
        )
    text = (
        f"public split: {record['public_examples']:,} CIFAR-10 train images "
        f"(in-distribution substitute for CIFAR-100)"
    )
    used = record.get("pretrained_on", record["public_examples"])
    if used < record["public_examples"]:
        text += f", pretrained on a {used:,}-image subset of it"
    return text


# ---------------------------------------------------------------------- training


def fit_nonprivate(
    net: keras.Model,
    source: IndexedSource,
    augmentation: Augmentation,
    *,
    batch_size: int,
    epochs: int,
    learning_rate,
    momentum: float,
    weight_decay: float | None,
    callbacks: Sequence,
    seed: int | None,
) -> None:
    """Ordinary minibatch SGD on the augmented `tf.data` pipeline, batches read
    from `source`."""
    net.compile(
        optimizer=keras.optimizers.SGD(
            learning_rate, momentum=momentum, weight_decay=weight_decay or None
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    data = train_dataset(source, None, augmentation, batch_size=batch_size, shuffle_seed=seed)
    net.fit(data, epochs=epochs, callbacks=list(callbacks), verbose=0, shuffle=False)


def pretrain_public(
    config: PretrainConfig | None = None, *, verbose: bool = True
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
    train = subset(
        public["source"], config.limit_public, derive_seed(config.split_seed, "public-subset")
    )
    test = subset(data.test, config.limit_test, derive_seed(config.split_seed, "test-subset"))
    y, y_test = train.labels, test.labels
    augmentation = Augmentation(normalization=config.normalization, seed=config.seed)
    net = cifar_convnet(
        input_shape=augmentation.crop_size + (3,), classes=public["record"]["classes"]
    )
    x_test_in = eval_dataset(test, None, augmentation)  # read and cropped at each evaluation
    steps = config.epochs * int(np.ceil(len(y) / config.batch_size))
    lr = keras.optimizers.schedules.CosineDecay(config.learning_rate, steps)
    history = EpochHistory(
        x_test_in,
        y_test,
        every=config.eval_every,
        total_epochs=config.epochs,
        private=False,
        verbose=verbose,
    )
    fit_nonprivate(
        net,
        train,
        augmentation,
        batch_size=config.batch_size,
        epochs=config.epochs,
        learning_rate=lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        callbacks=[history],
        seed=config.seed,
    )
    last = history.rows[-1]
    test_accuracy = (
        last["test_accuracy"] if "test_accuracy" in last else accuracy(net, x_test_in, y_test)
    )
    info = {
        **public["record"],
        "pretrained_on": int(len(y)),
        "test_dataset": data.source.label,
        "test_examples": int(len(y_test)),
        "test_accuracy": test_accuracy,
        "epochs": last["epoch"],
        "seconds": time.perf_counter() - start,
        "config": jsonable(dataclasses.asdict(config)),
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
    meta = json.dumps({k: v for k, v in info.items() if k != "history"}, default=_json_default)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".weights.h5"
    )
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
            f"'python experiments/cifar10_pretrain.py' (see models/README.md)"
        )
    try:
        with h5py.File(path, "r") as h5:
            raw = h5.attrs.get(_METADATA_KEY)
    except OSError as e:
        raise ValueError(
            f"{path} is not a weights file (.weights.h5) that can be read: {e}"
        ) from None
    if raw is None:
        raise ValueError(
            f"{path} has no dpfl_tf pretraining record; it was not written by "
            f"dpfl_tf.recipes.cifar10.save_pretrained"
        )
    return json.loads(raw)


def pretrain_split(record: dict, **settings) -> PretrainConfig:
    """A `PretrainConfig` holding out the public data and split of a pretraining
    `record` (so that the private set is exactly its complement), with `settings`."""
    split = {"public_data": record["public_data"]}
    if record["public_data"] == PublicData.CIFAR10_SPLIT.value:
        split.update(public_size=int(record["public_size"]), split_seed=int(record["split_seed"]))
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


def check_public_split(info: dict, pretrain: PretrainConfig, data: SourceDataset) -> None:
    """Refuses weights pretrained on anything but the public complement of our private set."""
    want = pretrain.public_data.value
    if info.get("public_data") != want:
        raise ValueError(
            f"pretrained weights were trained on public_data="
            f"{info.get('public_data')!r}, but this run uses {want!r}"
        )
    if pretrain.public_data is not PublicData.CIFAR10_SPLIT:
        return
    public, _ = public_private_split(data.y_train, pretrain.public_size, pretrain.split_seed)
    ours = {
        "public_source": data.source.label,
        "public_size": pretrain.public_size,
        "split_seed": pretrain.split_seed,
        "public_indices_sha256": _indices_digest(public),
    }
    theirs = {k: info.get(k) for k in ours}
    if theirs != ours:
        diff = {k: (theirs[k], ours[k]) for k in ours if theirs[k] != ours[k]}
        raise ValueError(
            "the pretrained weights were trained on another public split than the one this "
            f"run holds out (weights vs this run: {diff}); images of the private set may "
            "have been used in non-private pretraining. Pretrain again with the same "
            "public_size, split_seed and CIFAR-10 copy."
        )


# ---------------------------------------------------------------------- helpers


def _json_default(obj):
    if isinstance(obj, ChoiceEnum):
        return obj.value
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def jsonable(obj):
    """Enums -> their values, tuples -> lists (for results and stored records)."""
    return json.loads(json.dumps(obj, default=_json_default))
