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
from typing import Sequence

import keras
import numpy as np

from dpfl_tf._seeds import derive_seed
from dpfl_tf._validation import ChoiceEnum, check_count, check_number
from dpfl_tf.data.cifar import cifar10_sources
from dpfl_tf.models import cifar_convnet
from dpfl_tf.privacy import AccountantKind
from dpfl_tf.recipes.augment import Augmentation, Normalization, eval_dataset
from dpfl_tf.recipes.common import accuracy
from dpfl_tf.recipes.pretrain import (
    PretrainConfig,
    PublicData,
    _check_optional_count,
    check_public_split,
    jsonable,
    load_pretrained,
    pretrain_public,
    pretrain_split,
    pretraining_description,
    public_private_split,
    read_pretrained_record,
    save_pretrained,
    stratified_split,
    subset,
)
from dpfl_tf.recipes.run import Inputs, Recipe, run_recipe

__all__ = [
    "CifarConfig",
    "Init",
    "PAPER_TARGETS",
    "PretrainConfig",
    "PublicData",
    "TrainedLayers",
    "build_private_model",
    "clip_bounds_for",
    "load_pretrained",
    "pretrain_public",
    "pretrain_split",
    "public_private_split",
    "read_pretrained_record",
    "save_pretrained",
    "stratified_split",
    "train_cifar10",
]

CONV_LAYERS = ("conv1", "conv2")
DENSE_LAYERS = ("fc1", "fc2", "logits")
SOFTMAX_LAYER = "logits"
#: Abadi et al. 2016, section 5.3 (CIFAR-100 pretraining, delta = 1e-5).
PAPER_TARGETS = {
    "eps2": 0.67,
    "eps4": 0.70,
    "eps8": 0.73,
    "nonprivate_dense": 0.80,
    "nonprivate_whole_net": 0.86,
}


class TrainedLayers(ChoiceEnum):
    """Which layers are trained on the private data; all others are frozen."""

    __argument__ = "trained_layers"
    SOFTMAX = "softmax"  # logits only
    TOP = "top"  # fc2 + logits
    DENSE = "dense"  # fc1 + fc2 + logits
    ALL = "all"  # the whole net, convolutions included

    @property
    def layers(self) -> tuple[str, ...]:
        return {
            "softmax": (SOFTMAX_LAYER,),
            "top": ("fc2", SOFTMAX_LAYER),
            "dense": DENSE_LAYERS,
            "all": CONV_LAYERS + DENSE_LAYERS,
        }[self.value]


class Init(ChoiceEnum):
    """How the network is initialised before private training."""

    __argument__ = "init"
    PRETRAINED = "pretrained"  # every layer from the pretrained net (softmax too if it fits)
    CONVS = "convs"  # conv layers pretrained, dense layers freshly initialised
    SCRATCH = "scratch"  # nothing pretrained (trained_layers must be "all")


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
    final_learning_rate: float | None = None  # None: constant learning rate
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
            raise ValueError(
                f"init='scratch' trains from random weights, so trained_layers "
                f"must be 'all', got {self.trained_layers.value!r}"
            )
        if self.accountant == "strong" and self.private:
            raise ValueError(
                "accountant must be 'moments', 'rdp' or 'pld' for training, got 'strong'"
            )
        if self.noise_multiplier is not None:
            set_(
                "noise_multiplier",
                check_number("noise_multiplier", self.noise_multiplier, low=0.0, low_open=True),
            )
        elif self.private and self.target_epsilon is None:
            raise ValueError(
                "noise_multiplier=None calibrates the noise for target_epsilon; "
                "give a target_epsilon or a noise_multiplier"
            )
        set_(
            "l2_norm_clip", check_number("l2_norm_clip", self.l2_norm_clip, low=0.0, low_open=True)
        )
        set_(
            "softmax_clip_ratio",
            check_number("softmax_clip_ratio", self.softmax_clip_ratio, low=0.0, low_open=True),
        )
        check_count("lot_size", self.lot_size, minimum=1)
        _check_optional_count("batch_size", self.batch_size)
        set_(
            "learning_rate",
            check_number("learning_rate", self.learning_rate, low=0.0, low_open=True),
        )
        if self.final_learning_rate is not None:
            set_(
                "final_learning_rate",
                check_number("final_learning_rate", self.final_learning_rate, low=0.0),
            )
        check_count("decay_epochs", self.decay_epochs)
        set_("momentum", check_number("momentum", self.momentum, low=0.0, high=1.0, high_open=True))
        if self.target_epsilon is not None:
            set_(
                "target_epsilon",
                check_number("target_epsilon", self.target_epsilon, low=0.0, low_open=True),
            )
        set_(
            "delta",
            check_number("delta", self.delta, low=0.0, high=1.0, low_open=True, high_open=True),
        )
        check_count("epochs", self.epochs, minimum=1)
        check_count("eval_every", self.eval_every, minimum=1)
        check_count("train_eval_size", self.train_eval_size)
        set_(
            "deltas",
            tuple(
                check_number("deltas", d, low=0.0, high=1.0, low_open=True, high_open=True)
                for d in self.deltas
            ),
        )
        if not self.deltas:
            raise ValueError("deltas must list at least one delta")
        _check_optional_count("limit_private", self.limit_private)
        _check_optional_count("limit_test", self.limit_test)

    @property
    def clip_bounds(self) -> dict[str, float]:
        return clip_bounds_for(self.trained_layers, self.l2_norm_clip, self.softmax_clip_ratio)


def clip_bounds_for(
    trained_layers: TrainedLayers | str, l2_norm_clip: float, softmax_clip_ratio: float = 2.0
) -> dict[str, float]:
    """Per-layer clip bounds {layer: C}: `l2_norm_clip` for every trained layer,
    ``softmax_clip_ratio * l2_norm_clip`` for the softmax layer (the paper
    observed softmax gradients about twice as large and kept that ratio)."""
    layers = TrainedLayers.parse(trained_layers).layers
    return {
        name: float(l2_norm_clip * (softmax_clip_ratio if name == SOFTMAX_LAYER else 1.0))
        for name in layers
    }


def build_private_model(
    pretrained: keras.Model | None,
    trained_layers: TrainedLayers | str,
    init: Init | str = Init.PRETRAINED,
    *,
    input_shape=(24, 24, 3),
    classes: int = 10,
) -> tuple[keras.Model, list[str]]:
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
                raise ValueError(
                    f"pretrained layer {name!r} has weights "
                    f"{[w.shape for w in src]}, the model needs "
                    f"{[tuple(w.shape) for w in dst.weights]}"
                )
    for name in CONV_LAYERS + DENSE_LAYERS:
        net.get_layer(name).trainable = name in trained_layers.layers
    return net, copied


def _weights_digest(net: keras.Model, names: Sequence[str]) -> str:
    """sha256 of the weights of the layers `names` (to show frozen layers unchanged)."""
    digest = hashlib.sha256()
    for name in names:
        for w in net.get_layer(name).get_weights():
            digest.update(np.ascontiguousarray(w).tobytes())
    return digest.hexdigest()


class CifarRecipe(Recipe):
    """`train_cifar10` on the shared life cycle (`dpfl_tf.recipes.run`)."""

    resumable_changes = ("data_dir", "eval_every", "batch_size", "pretrain.data_dir")

    def __init__(self, config: CifarConfig, pretrained=None, verbose: bool = True):
        super().__init__(config)
        self.pretrained, self.verbose = pretrained, verbose
        self.info = self.record = None
        self.copied, self.frozen, self.frozen_digest = [], [], None

    def comparable(self, config=None) -> dict:
        from dpfl_tf.recipes.common import comparable_config

        return {
            **comparable_config(
                jsonable(dataclasses.asdict(config or self.config)), self.resumable_changes
            ),
            # the data subsets' seeds (`derive_seed`); a checkpoint written with the
            # old split_seed + k subsets does not record it and is not resumed
            "subset_seeds": "derive_seed",
        }

    def inputs(self, ledger, releases) -> Inputs:
        # the private images are read lot by lot from the source (memory O(lot), not O(N))
        config, pre = self.config, self.config.pretrain
        self.data = data = cifar10_sources(config.data_dir)
        if pre.public_data is PublicData.CIFAR10_SPLIT:
            _, private_idx = public_private_split(data.y_train, pre.public_size, pre.split_seed)
        else:
            private_idx = np.arange(len(data.y_train))
        private = subset(
            data.train.subset(private_idx),
            config.limit_private,
            derive_seed(pre.split_seed, "private-subset"),
        )
        test = subset(data.test, config.limit_test, derive_seed(pre.split_seed, "test-subset"))
        # random distortions keyed by the lot number (a resumed run draws the same)
        self.augmentation = Augmentation(normalization=config.normalization, seed=config.seed)
        y_priv = private.labels
        eval_idx, _ = stratified_split(
            y_priv,
            min(config.train_eval_size, len(y_priv)),
            derive_seed(pre.split_seed, "train-eval-subset"),
        )
        # evaluation sets are read (and centre-cropped) batch by batch at each evaluation
        train_eval = (
            eval_dataset(private.subset(eval_idx), None, self.augmentation)
            if len(eval_idx)
            else None
        )
        return Inputs(
            private,
            None,
            eval_dataset(test, None, self.augmentation),
            test.labels,
            examples=len(y_priv),
            x_train_eval=train_eval,
            y_train_eval=y_priv[eval_idx] if len(eval_idx) else None,
            preprocess=self.augmentation,
        )

    def too_few_examples(self, n: int) -> str:
        return f"lot_size ({self.config.lot_size}) exceeds the {n} private training examples"

    def network(self, inputs, ledger) -> keras.Model:
        config, pre = self.config, self.config.pretrain
        pretrained_net = None
        if config.init is not Init.SCRATCH:
            pretrained = self.pretrained
            if pretrained is None:
                if config.pretrained_weights is not None:
                    pretrained = load_pretrained(config.pretrained_weights)
                else:
                    pretrained = pretrain_public(
                        dataclasses.replace(
                            pre, data_dir=pre.data_dir or config.data_dir, seed=config.seed
                        ),
                        verbose=self.verbose,
                    )
            pretrained_net, self.info = pretrained
            check_public_split(self.info, pre, self.data)
        self._set_record()
        net, self.copied = build_private_model(
            pretrained_net,
            config.trained_layers,
            config.init,
            input_shape=self.augmentation.crop_size + (3,),
        )
        self._set_frozen(net)
        self.frozen_digest = _weights_digest(net, self.frozen)
        return net

    def restored(self, state, model) -> None:
        # the weights are in the checkpoint; the split is checked again
        self.info = state["pretrained_record"]
        if self.info is not None:
            check_public_split(self.info, self.config.pretrain, self.data)
        self._set_record()
        self.copied, self.frozen_digest = state["copied"], state["frozen_digest"]
        self._set_frozen(model.model)

    def _set_record(self):
        self.record = {k: v for k, v in self.info.items() if k != "history"} if self.info else None

    def _set_frozen(self, net):
        self.net = net
        self.frozen = sorted(
            layer.name for layer in net.layers if layer.weights and not layer.trainable
        )

    def state(self) -> dict:
        return {
            "pretrained_record": self.record,
            "copied": self.copied,
            "frozen_digest": self.frozen_digest,
        }

    def start_row(self, net, inputs) -> dict:
        """Epoch 0: the starting point (the pretrained network before private training)."""
        row0 = {
            "epoch": 0,
            "seconds": 0.0,
            "test_accuracy": accuracy(net, inputs.x_test, inputs.y_test),
        }
        if inputs.x_train_eval is not None:
            row0["train_accuracy"] = accuracy(net, inputs.x_train_eval, inputs.y_train_eval)
        if self.config.private:
            row0.update({f"epsilon@{d:g}": 0.0 for d in self.config.deltas}, epsilon=0.0)
        return row0

    def l2_norm_clip(self):
        return self.config.clip_bounds

    def fit_nonprivate(self, net, inputs, learning_rate, epochs, callbacks) -> None:
        from dpfl_tf.recipes.pretrain import fit_nonprivate

        fit_nonprivate(
            net,
            inputs.x_train,
            self.augmentation,
            batch_size=self.config.lot_size,
            epochs=epochs,
            learning_rate=learning_rate,
            momentum=self.config.momentum,
            weight_decay=None,
            callbacks=callbacks,
            seed=self.config.seed,
        )

    def fields(self, run, model) -> dict:
        config, net = self.config, self.net
        return {
            **jsonable(dataclasses.asdict(config)),
            "dataset": self.data.source.label,
            "dataset_path": self.data.source.path,
            "pretraining": pretraining_description(self.info),
            "pretrained_weights": config.pretrained_weights,
            "pretrained_record": self.record,
            "pretrained_test_accuracy": self.info.get("test_accuracy") if self.info else None,
            "pretrained_on_cifar10_test": run.start_row["test_accuracy"],
            "initialized_from_pretrained": self.copied,
            "trained_layers": config.trained_layers.value,
            "trainable_layers": [l.name for l in net.layers if l.trainable and l.weights],
            "frozen_layers": self.frozen,
            "frozen_layers_unchanged": _weights_digest(net, self.frozen) == self.frozen_digest,
            "private_examples": int(run.inputs.examples),
            "test_examples": int(len(run.inputs.y_test)),
            "lots_per_epoch": run.lots_per_epoch,
            "noise_calibrated": bool(config.private and config.noise_multiplier is None),
            "clip_bounds": config.clip_bounds if config.private else None,
            "delta": config.delta if config.private else None,
            "accountant": config.accountant if config.private else None,
            "augmentation": self.augmentation.get_config(),
        }


def train_cifar10(
    config: CifarConfig,
    *,
    pretrained: tuple[keras.Model, dict] | None = None,
    verbose: bool = True,
    return_model: bool = False,
    checkpoint_dir: str | None = None,
    checkpoint_every_epoch: bool = True,
    on_epoch=None,
    should_stop=None,
    on_resume=None,
    callbacks=(),
):
    """Trains one configuration; returns a JSON-ready result with per-epoch history
    (and the trained Keras model too if ``return_model``).

    Args:
      pretrained: (network, info) from `pretrain_public` / `load_pretrained`;
        overrides ``config.pretrained_weights`` (tests, several runs sharing one).
      checkpoint_dir, checkpoint_every_epoch, on_epoch, should_stop, on_resume,
        callbacks: as for `dpfl_tf.recipes.run.run_recipe` (private runs): a
        checkpoint of the same configuration in `checkpoint_dir` is resumed
        exactly (weights, frozen layers included, ledger, lot counter, optimizer
        state and so the learning-rate schedule, the calibrated noise, the
        history; the pretrained weights are not read again), and the run ends
        after the same number of lots as an uninterrupted one.
    """
    recipe = CifarRecipe(config, pretrained, verbose)
    result, model = run_recipe(
        recipe,
        verbose=verbose,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every_epoch=checkpoint_every_epoch,
        on_epoch=on_epoch,
        should_stop=should_stop,
        on_resume=on_resume,
        callbacks=callbacks,
    )
    return (result, model) if return_model else result
