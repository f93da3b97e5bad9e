"""What `dpfl-tf train` runs by default: each model's settings from its paper,
and what they reach (measured by the experiment named, with these settings).

Pure data, no TensorFlow: the command line reads it for its defaults and for
``--help``; `train_config` turns it into the recipe's config.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "TrainDefaults",
    "TRAIN_DEFAULTS",
    "PAPER_NOISE",
    "MIRROR_VIEWS_BATCH",
    "defaults_for",
    "models_for",
    "paper_noise",
    "train_config",
]

#: Abadi et al. 2016, section 5.2: (sigma of DP-SGD, sigma of DP-PCA) by the budget
#: (small noise for eps >= 5, medium for eps >= 1, large below)
PAPER_NOISE = {"small_noise": (2.0, 4.0), "medium_noise": (4.0, 7.0), "large_noise": (8.0, 16.0)}


def paper_noise(epsilon: float) -> str:
    """The paper's noise setting for a target epsilon."""
    if epsilon >= 5:
        return "small_noise"
    return "medium_noise" if epsilon >= 1 else "large_noise"


@dataclasses.dataclass(frozen=True)
class TrainDefaults:
    """One model's recipe.  `noise`: "paper" (sigma by the budget, `PAPER_NOISE`)
    or "calibrated" (the smallest sigma with which `epochs` epochs spend the
    budget).  `final_learning_rate` None: the learning rate is constant;
    `decay_epochs` > 0: linear decay to it over that many epochs."""

    source: str
    lot_size: int
    l2_norm_clip: float
    learning_rate: float
    epochs: int
    accountant: str
    batch_size: int
    noise: str = "calibrated"
    final_learning_rate: float | None = None
    decay_epochs: int = 0
    momentum: float = 0.0
    eval_every: int = 5
    feature_norm: str | None = None
    mirror_views: bool = False
    #: what the defaults reach at the default epsilon (2), where measured
    reaches: str = "not measured yet"

    def describe(self) -> str:
        lr = f"lr {self.learning_rate:g}"
        if self.final_learning_rate is not None and self.decay_epochs:
            lr += f" -> {self.final_learning_rate:g} over {self.decay_epochs} epochs"
        parts = [f"lot {self.lot_size}", f"clip {self.l2_norm_clip:g}", lr]
        if self.momentum:
            parts.append(f"momentum {self.momentum:g}")
        parts.append(f"{'up to ' if self.noise == 'paper' else ''}{self.epochs} epochs")
        parts.append(
            "sigma 2/4/8 by the budget"
            if self.noise == "paper"
            else "sigma calibrated for the epochs"
        )
        parts.append(f"{self.accountant} accountant")
        if self.mirror_views:
            parts.append("mirror views")
        if self.feature_norm == "dp_stats":
            parts.append("DP feature statistics")
        return ", ".join(parts)


_ABADI = TrainDefaults(
    "Abadi et al. 2016: DP-PCA 60 + Dense 1000",
    lot_size=600,
    l2_norm_clip=4.0,
    learning_rate=0.1,
    final_learning_rate=0.052,
    decay_epochs=10,
    epochs=1000,
    accountant="moments",
    batch_size=1024,
    noise="paper",
)
_PAPERNOT = TrainDefaults(
    "Papernot et al. 2021: tanh CNN",
    lot_size=256,
    l2_norm_clip=0.1,
    learning_rate=4.0,
    epochs=40,
    accountant="pld",
    batch_size=256,
)
_TRAMER_BONEH = TrainDefaults(
    "Tramer & Boneh 2021: ScatterNet features",
    lot_size=4096,
    l2_norm_clip=0.1,
    learning_rate=8.0,
    momentum=0.9,
    epochs=60,
    accountant="pld",
    batch_size=4096,
    feature_norm="group",
)
_TRAMER_BONEH_CIFAR = dataclasses.replace(
    _TRAMER_BONEH, lot_size=8192, learning_rate=4.0, feature_norm="dp_stats", mirror_views=True
)
#: the physical batch of a scattering model with mirror views (two views hold
#: twice the activations).  Memory only: the lots, and so the privacy, do not
#: depend on it.  CIFAR-10 scatter_cnn peaks at 9.8 / 6.4 / 5.2 GB with 1024 /
#: 512 / 256 at the same speed (79-83 s an epoch); scatter_linear at 4.9 GB
MIRROR_VIEWS_BATCH = {"scatter_linear": 2048, "scatter_cnn": 256}

#: (dataset, model) -> the defaults; dataset "mnist" also serves "fashion_mnist"
TRAIN_DEFAULTS = {
    ("mnist", "mlp"): dataclasses.replace(
        _ABADI, reaches="94.5% in ~5 min (experiments/mnist_dpsgd.py: 94.2%)"
    ),
    ("mnist", "tanh_cnn"): dataclasses.replace(
        _PAPERNOT, reaches="97.7% in ~19 min (experiments/mnist_dpsgd.py --group beyond)"
    ),
    ("mnist", "scatter_linear"): dataclasses.replace(
        _TRAMER_BONEH, reaches="98.4% in ~13 min (experiments/mnist_dpsgd.py --group beyond)"
    ),
    ("mnist", "scatter_cnn"): dataclasses.replace(
        _TRAMER_BONEH,
        reaches="98.2% in ~15 min, 3.0 GB (results/recipe_memory.json, one run, seed 0)",
    ),
    ("cifar10", "convnet"): TrainDefaults(
        "Abadi et al. 2016: frozen pretrained convolutions",
        lot_size=2000,
        l2_norm_clip=3.0,
        learning_rate=0.05,
        epochs=30,
        accountant="moments",
        batch_size=1000,
        eval_every=1,
        reaches="71.8-72.6% in ~4-8 min with models/cifar10_public_convnet.weights.h5 "
        "(experiments/cifar10_dpsgd.py)",
    ),
    ("cifar10", "scatter_linear"): dataclasses.replace(
        _TRAMER_BONEH_CIFAR,
        reaches="66.8% in ~11 min (experiments/cifar10_dpsgd.py --group scatternet)",
    ),
    ("cifar10", "scatter_cnn"): dataclasses.replace(
        _TRAMER_BONEH_CIFAR,
        reaches="68.9% in ~69 min, 5.6 GB (results/recipe_memory.json, one run, seed 0); "
        "69.8% at epsilon 3 (experiments/cifar10_dpsgd.py --group scatternet)",
    ),
}
#: the model of each dataset when none is given
DEFAULT_MODEL = {"mnist": "mlp", "fashion_mnist": "mlp", "cifar10": "convnet"}


def defaults_for(dataset: str, model: str | None) -> TrainDefaults:
    """The recipe of `model` (None: the dataset's default model) on `dataset`."""
    model = model or DEFAULT_MODEL[dataset]
    key = ("cifar10" if dataset == "cifar10" else "mnist", model)
    if key not in TRAIN_DEFAULTS:
        raise ValueError(
            f"model {model!r} does not run on {dataset}; "
            f"{dataset} takes {', '.join(models_for(dataset))}"
        )
    return TRAIN_DEFAULTS[key]


def models_for(dataset: str) -> list[str]:
    family = "cifar10" if dataset == "cifar10" else "mnist"
    return [m for d, m in TRAIN_DEFAULTS if d == family]


def train_config(dataset: str, model: str | None = None, *, target_epsilon: float = 2.0, **given):
    """The recipe config `dpfl-tf train <dataset> --model <model>` runs: the
    model's defaults (`TRAIN_DEFAULTS`) with the settings `given` (config
    field names; None means "the default").  Returns a `MnistConfig` (the
    MNIST-family and ScatterNet recipe) or a `CifarConfig` (the frozen convnet).

    cifar10 convnet only: ``trained_layers``, ``pretrained_weights`` (default:
    the shipped weights if found, else a short pretraining on the public split).
    """
    d = defaults_for(dataset, model)
    model = model or DEFAULT_MODEL[dataset]
    given = {k: v for k, v in given.items() if v is not None}
    settings = dict(
        lot_size=d.lot_size,
        l2_norm_clip=d.l2_norm_clip,
        learning_rate=d.learning_rate,
        epochs=d.epochs,
        accountant=d.accountant,
        momentum=d.momentum,
        eval_every=d.eval_every,
        target_epsilon=target_epsilon,
    )
    if model == "convnet":
        from dpfl_tf.recipes.cifar10 import CifarConfig
        from dpfl_tf.recipes.pretrain import PretrainConfig, pretrain_split, read_pretrained_record

        settings.update(given)
        weights = settings.pop("pretrained_weights", None) or default_pretrained_weights()
        pretraining = dict(epochs=30, data_dir=settings.get("data_dir"), seed=settings.get("seed"))
        if weights is not None:  # hold out the public split the weights were trained on
            try:
                pretrain = pretrain_split(read_pretrained_record(weights), **pretraining)
            except (FileNotFoundError, ValueError) as e:
                raise ValueError(f"--pretrained {weights}: {e}") from None
        else:
            pretrain = PretrainConfig(**pretraining)
        settings.setdefault("batch_size", min(settings["lot_size"], d.batch_size))
        return CifarConfig(setting="cli", pretrained_weights=weights, pretrain=pretrain, **settings)
    from dpfl_tf.recipes.mnist import MnistConfig

    settings.update(dataset=dataset, model=model, projection="dp_pca" if model == "mlp" else "none")
    if d.noise == "paper":  # Abadi et al.: sigma (and DP-PCA's) by the budget
        setting = paper_noise(target_epsilon)
        sigma, pca_sigma = PAPER_NOISE[setting]
        settings.update(
            setting=setting if given.get("noise_multiplier") is None else "custom",
            noise_multiplier=sigma,
            pca_noise_multiplier=pca_sigma,
        )
    else:
        settings["noise_multiplier"] = None
    if model in MIRROR_VIEWS_BATCH:  # the scattering models
        settings.update(feature_norm=d.feature_norm, mirror_views=d.mirror_views)
    settings.update(given)
    lr = settings["learning_rate"]
    if d.final_learning_rate is not None:  # the same decay for another learning rate
        settings["final_learning_rate"] = d.final_learning_rate * lr / d.learning_rate
        settings["decay_epochs"] = d.decay_epochs
    else:
        settings.update(final_learning_rate=lr, decay_epochs=0)
    batch = MIRROR_VIEWS_BATCH[model] if settings.get("mirror_views") else d.batch_size
    # in a user-level run the lot size counts users and the batch examples: lot_size
    # examples a batch is then a user or a few, which is also the fastest measured there
    # (the per-user norms cost users x rows a batch: experiments/benchmark_user_level.py)
    settings.setdefault("batch_size", min(settings["lot_size"], batch))
    return MnistConfig(**settings)


def default_pretrained_weights() -> str | None:
    """The shipped public-data weights of the cifar10 convnet
    (``models/cifar10_public_convnet.weights.h5``, in the working directory or
    the project's), or None."""
    import os

    name = os.path.join("models", "cifar10_public_convnet.weights.h5")
    project = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), name
    )
    return next((p for p in (name, project) if os.path.isfile(p)), None)
