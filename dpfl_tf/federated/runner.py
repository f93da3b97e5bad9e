"""One validated configuration -> one federated run -> one result dict.

Shared by the ``dpfl-tf federated`` command, ``experiments/federated_dp.py``
and the notebook, so the three run exactly the same code.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, Sequence

import numpy as np

from dpfl_tf._runs import peak_rss_mb, result_status  # noqa: F401 -- re-exported
from dpfl_tf._seeds import derive_rng, derive_seed
from dpfl_tf._validation import ChoiceEnum, check_count, check_number
from dpfl_tf.federated.partition import PartitionScheme, make_partition
from dpfl_tf.federated.settings import (
    MAX_EPSILON,
    DistributedMechanism,
    MechanismKind,
    check_clients_per_round,
    check_delta_max,
)
from dpfl_tf.privacy.choices import AccountantKind, SamplingMethod
from dpfl_tf.secure_random import refuse_seed

__all__ = [
    "AggregatorKind",
    "DPMode",
    "FederatedConfig",
    "MODELS",
    "build_model",
    "build_server",
    "fully_connected_model",
    "local_dp_upload",
    "peak_rss_mb",
    "result_status",
    "run_federated",
]


class DPMode(ChoiceEnum):
    __argument__ = "dp"
    NONE = "none"  # plain FedAvg / FedMedian
    GLOBAL = "global"  # Geyer et al.: server clips and noises the sum
    CLIENT = "client"  # DP-FedAvg with client-side noise
    LOCAL = "local"  # local DP: every client perturbs its model before upload
    DISTRIBUTED = "distributed"  # distributed DP: discrete noise shares + secure sum
    # the server clips and adds noise correlated across rounds; cyclic cohorts of clients
    # (dpfl_tf.privacy.matrix_factorization, docs/concepts/correlated-noise.md)
    FTRL = "ftrl"  # DP-FTRL, tree aggregation (Kairouz et al. 2021)
    BANDED_MF = "banded_mf"  # banded matrix factorization (Choquette-Choo et al. 2023)
    BLT = "blt"  # buffered linear Toeplitz (McMahan et al. 2024)


class AggregatorKind(ChoiceEnum):
    __argument__ = "aggregator"
    MEAN = "mean"  # FedAvg
    MEDIAN = "median"  # FedMedian (no DP mode)


#: The models a config can name (`build_model`).
MODELS = ("mlp", "cnn2", "cnn3")
#: How a round's clients can be chosen (`dpfl_tf.federated.server.ClientSampling`).
CLIENT_SAMPLING = (SamplingMethod.POISSON, SamplingMethod.FIXED_SIZE, SamplingMethod.CYCLIC_POISSON)
#: the correlated-noise modes, and the mechanism each builds
CORRELATED_DP = {DPMode.FTRL: "tree", DPMode.BANDED_MF: "banded", DPMode.BLT: "blt"}
#: the modes whose server adds central Gaussian noise (global, client, correlated)
#: dp mode -> the noise multiplier used when none is given.  Global DP: sigma = 1 with
#: m = 100 of K = 1000 (Geyer et al. 2017's K = 1000 setting; McMahan et al. 2018 use
#: z = 1 as well): noise sigma S / m = 0.01 per coordinate.  Client-side noise: z = 0.2
#: per upload, so the released mean of m = 100 uploads carries z sqrt(m) = 2, i.e.
#: multiplier 1 on the replace-one sensitivity 2S of fixed-size sampling, the Global DP
#: default's sigma (epsilon 14 vs 8.9 after 100 rounds: no Poisson amplification).
#: none / local: 0 (no Gaussian noise).
#: Distributed DP: z = 2 on the sum (fixed-size sampling, replace-one sensitivity 2S:
#: multiplier 1, as for the client-side noise default).
DEFAULT_NOISE_MULTIPLIER = {
    "none": 0.0,
    "global": 1.0,
    "client": 0.2,
    "local": 0.0,
    "distributed": 2.0,
    "ftrl": 1.0,
    "banded_mf": 1.0,
    "blt": 1.0,
}
#: The modes whose noise is Gaussian or discrete and accounted centrally (target_epsilon,
#: delta_max, secure_mode apply).
ACCOUNTED_MODES = (DPMode.GLOBAL, DPMode.CLIENT, DPMode.DISTRIBUTED, *CORRELATED_DP)


def fully_connected_model(
    input_shape: Sequence[int] = (28, 28),
    hidden: Sequence[int] = (600, 100),
    num_classes: int = 10,
    *,
    use_bias: bool = False,
    seed: int | None = None,
):
    """The small fully connected net of Geyer et al.'s code (784-600-100-10, ReLU,
    no biases by default), returning logits.  `seed`: the kernels from
    `dpfl_tf.models.glorot_uniform_kernels` (the weights ``keras.utils.set_random_seed``
    gave; no global random state is read or set); None: Keras's global state."""
    import keras

    from dpfl_tf.models import glorot_uniform_kernels

    kernel = glorot_uniform_kernels(seed)
    dense = keras.layers.Dense
    layers = [keras.Input(tuple(input_shape)), keras.layers.Flatten()]
    layers += [
        dense(int(h), activation="relu", use_bias=use_bias, kernel_initializer=kernel())
        for h in hidden
    ]
    layers.append(dense(int(num_classes), use_bias=use_bias, kernel_initializer=kernel()))
    return keras.Sequential(layers)


@dataclasses.dataclass(frozen=True)
class FederatedConfig:
    """Everything one federated run needs.  Checked in ``__post_init__``.

    ``model``: "mlp" (`fully_connected_model` with ``hidden``), "cnn2" or
    "cnn3" (`dpfl_tf.models.pnpm_cnn` of depth 2 or 3).

    Local DP (``dp="local"``): every client perturbs its local model with
    ``ldp_mechanism`` at ``ldp_epsilon`` per coordinate before upload.
    Mechanisms with a bounded domain (all but PNPM) clip each weight tensor to
    [-r, r] with ``ldp_bound`` = r, or "init": r = ``ldp_bound_margin`` x the
    largest |w| of that tensor in the initial global model (public: the server
    draws and broadcasts it); a zero-initialised tensor (a bias) takes the
    bound of the tensor before it.

    Distributed DP (``dp="distributed"``, `dpfl_tf.federated.distributed_dp`):
    every client clips, rotates, scales and rounds its update, adds a discrete
    noise share (``ddp_mechanism``: "discrete_gaussian" or "skellam") and
    wraps it at ``bits`` bits; a (simulated) secure aggregation reveals only the
    sum.  ``noise_multiplier`` is the noise std over ``clip`` of the sum of
    ``min_clients`` shares (the fewest uploads the secure aggregation finishes a
    round with; default m); ``dropout_rate`` simulates clients that drop out
    before uploading (needs ``min_clients``).  Fixed-size sampling only.

    Privacy arguments: ``dp`` (none | global | client | local | distributed),
    ``clip`` (S > 0, or
    "adaptive": DP adaptive clipping, Andrew et al. 2021, global DP with flat
    clipping only: the bound starts at ``clip_initial`` and moves each round
    towards the ``clip_quantile`` quantile of the update norms at rate
    ``clip_lr``, from a count released with noise std ``clip_count_stddev``
    (default 0.05 x the expected clients per round); ``noise_multiplier`` is
    then the round's joint multiplier, see `GlobalDPAggregator`),
    ``per_layer`` (one bound S per layer, the S given for each), ``noise_multiplier``
    (sigma or z), ``target_epsilon`` and ``delta_max`` (stop rule),
    ``accountant``, ``secure_mode`` (dp global or client: secure noise and
    client sampling from the OS's secure source, `dpfl_tf.secure_random`;
    refuses ``noise_seed``; ``seed`` then seeds only the data partition, the
    initial model and local batch order, none of which a privacy claim rests on).

    Local step: ``learning_rate`` eta, constant, or with ``lr_decay_rounds`` R
    decayed exponentially with the round, eta_t = eta x ``lr_decay_rate`` ^ (t / R)
    for round t = 0, 1, ... (t = 0 is the first round; Geyer et al.'s code: 0.1,
    falling ten-fold every 27,000 local steps, i.e. R = 675 rounds of E = 4
    epochs of 10 batches).

    Server optimiser (`dpfl_tf.federated.server_optimizers`, post-processing of
    each round's released aggregate): ``server_optimizer`` ("sgd", "adagrad",
    "adam", "yogi"), ``server_lr`` (eta), ``server_momentum`` (beta or beta1;
    None: 0 for sgd, 0.9 for the adaptive rules), ``server_beta2`` and
    ``server_tau`` (adam, yogi, adagrad).  The default is FedAvg's w + Delta.
    ``model_average`` (beta in (0, 1), or None): the server's result (its
    evaluation, `released_weights`) is the exponential moving average of the
    global models after each round (`ModelAverage`; post-processing too); the
    clients still train the global model.
    """

    dataset: str = "mnist"
    clients: int = 1000
    partition: PartitionScheme = PartitionScheme.SHARDS
    dirichlet_alpha: float = 0.5
    clients_per_round: int | None = None
    fraction: float | None = None
    sampling: SamplingMethod | None = None
    cohorts: int | None = None
    rounds: int = 100
    local_epochs: int = 1
    local_batch_size: int = 10
    learning_rate: float = 0.2
    lr_decay_rounds: float | None = None
    lr_decay_rate: float = 0.1
    momentum: float = 0.0
    aggregator: AggregatorKind = AggregatorKind.MEAN
    dp: DPMode = DPMode.NONE
    clip: float | str = 1.0
    clip_initial: float = 0.1
    clip_quantile: float = 0.5
    clip_lr: float = 0.2
    clip_count_stddev: float | None = None
    per_layer: bool = False
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta_max: float | None = None
    accountant: AccountantKind | None = None
    hidden: tuple[int, ...] = (32,)
    model: str = "mlp"
    ldp_mechanism: str = "pnpm"
    ldp_epsilon: float = 2.0
    ldp_bound: float | str = "init"
    ldp_bound_margin: float = 2.0
    seed: int = 0
    noise_seed: int | None = None
    secure_mode: bool = False
    ddp_mechanism: str = "discrete_gaussian"
    bits: int = 16
    min_clients: int | None = None
    dropout_rate: float = 0.0
    eval_every: int = 1
    train_subset: int | None = None
    server_optimizer: str = "sgd"
    server_lr: float = 1.0
    server_momentum: float | None = None
    server_beta2: float = 0.99
    server_tau: float = 1e-3
    model_average: float | None = None

    def __post_init__(self):
        s = object.__setattr__
        s(self, "clients", check_count("clients", self.clients, minimum=1))
        s(self, "partition", PartitionScheme.parse(self.partition))
        s(self, "dp", DPMode.parse(self.dp))
        correlated = self.dp in CORRELATED_DP
        if self.sampling is None:  # client-side noise is accounted for fixed size only
            s(
                self,
                "sampling",
                SamplingMethod.FIXED_SIZE
                if self.dp in (DPMode.CLIENT, DPMode.DISTRIBUTED)
                else SamplingMethod.CYCLIC_POISSON
                if correlated
                else SamplingMethod.POISSON,
            )
        s(self, "sampling", SamplingMethod.parse(self.sampling))
        if correlated != (self.sampling is SamplingMethod.CYCLIC_POISSON):
            raise ValueError(
                f"dp={self.dp.value!r} goes with sampling "
                f"{'cyclic_poisson' if correlated else 'poisson or fixed_size'}, "
                f"got sampling={self.sampling.value!r}"
            )
        if correlated:  # b cohorts take turns; fraction = q within the cohort (default all)
            if self.cohorts is None or self.clients_per_round is not None:
                raise ValueError(
                    f"dp={self.dp.value!r} takes cohorts (b, the rounds between "
                    "two turns of a client) and optionally fraction (within the "
                    f"cohort), got cohorts={self.cohorts!r}, clients_per_round="
                    f"{self.clients_per_round!r}"
                )
            s(self, "cohorts", check_count("cohorts", self.cohorts, minimum=1))
            if self.fraction is None:
                s(self, "fraction", 1.0)
        elif self.cohorts is not None:
            raise ValueError(
                f"cohorts is for dp='ftrl', 'banded_mf' or 'blt', got "
                f"cohorts={self.cohorts!r} with dp={self.dp.value!r}"
            )
        if self.sampling not in CLIENT_SAMPLING:
            raise ValueError(
                "sampling must be one of "
                f"{', '.join(m.value for m in CLIENT_SAMPLING)}, got "
                f"{self.sampling.value!r}"
            )
        if self.accountant is None:  # fixed-size sampling: only "rdp" reads the event
            s(
                self,
                "accountant",
                AccountantKind.RDP
                if self.sampling is SamplingMethod.FIXED_SIZE
                else AccountantKind.MOMENTS,
            )
        s(self, "accountant", AccountantKind.parse(self.accountant))
        s(self, "rounds", check_count("rounds", self.rounds))
        s(self, "local_epochs", check_count("local_epochs", self.local_epochs, minimum=1))
        s(
            self,
            "local_batch_size",
            check_count("local_batch_size", self.local_batch_size, minimum=1),
        )
        s(
            self,
            "learning_rate",
            check_number("learning_rate", self.learning_rate, low=0.0, low_open=True),
        )
        s(
            self,
            "lr_decay_rate",
            check_number("lr_decay_rate", self.lr_decay_rate, low=0.0, high=1.0, low_open=True),
        )
        if self.lr_decay_rounds is None:
            if self.lr_decay_rate != 0.1:
                raise ValueError(
                    f"lr_decay_rate {self.lr_decay_rate!r} decays nothing without "
                    "lr_decay_rounds (the rounds over which the step falls by that factor)"
                )
        else:
            s(
                self,
                "lr_decay_rounds",
                check_number("lr_decay_rounds", self.lr_decay_rounds, low=0.0, low_open=True),
            )
            last = float(self.local_learning_rate()(self.rounds - 1))
            if not last > 0.0:  # refused now, not at the round where it underflows
                raise ValueError(
                    f"lr_decay_rounds {self.lr_decay_rounds!r} with lr_decay_rate "
                    f"{self.lr_decay_rate!r} makes the local learning rate underflow to 0 "
                    f"by round {self.rounds}"
                )
        s(
            self,
            "momentum",
            check_number("momentum", self.momentum, low=0.0, high=1.0, high_open=True),
        )
        s(self, "aggregator", AggregatorKind.parse(self.aggregator))
        if self.dp is not DPMode.NONE and self.aggregator is not AggregatorKind.MEAN:
            raise ValueError(
                "the DP modes average clipped updates; aggregator must be 'mean' "
                f"with dp={self.dp.value!r}, got {self.aggregator.value!r}"
            )
        if self.clients_per_round is None and self.fraction is None:
            s(self, "fraction", 0.1)
        if self.fraction is not None:
            s(
                self,
                "fraction",
                check_number("fraction", self.fraction, low=0.0, high=1.0, low_open=True),
            )
        if self.clients_per_round is not None:
            s(
                self,
                "clients_per_round",
                check_clients_per_round(
                    check_count("clients_per_round", self.clients_per_round, minimum=1),
                    self.clients,
                ),
            )
        if self.clip == "median":
            raise ValueError(
                "clip='median' (the median of the round's raw update norms, read "
                "without noise: not differentially private) is no longer offered; "
                "use clip='adaptive' (DP adaptive clipping, Andrew et al. 2021)"
            )
        if isinstance(self.clip, str) and self.clip != "adaptive":
            try:
                s(self, "clip", float(self.clip))
            except ValueError:
                raise ValueError(
                    f"clip must be a number > 0 or 'adaptive', got {self.clip!r}"
                ) from None
        if not isinstance(self.clip, str):
            s(self, "clip", check_number("clip", self.clip, low=0.0, low_open=True))
        elif self.dp is not DPMode.GLOBAL:
            raise ValueError(
                "clip='adaptive' (DP adaptive clipping) is offered for "
                f"dp='global' only, got dp={self.dp.value!r}"
            )
        elif self.per_layer:
            raise ValueError("clip='adaptive' adapts one flat bound; per_layer must be False")
        s(
            self,
            "clip_initial",
            check_number("clip_initial", self.clip_initial, low=0.0, low_open=True),
        )
        s(
            self,
            "clip_quantile",
            check_number("clip_quantile", self.clip_quantile, low=0.0, high=1.0),
        )
        s(self, "clip_lr", check_number("clip_lr", self.clip_lr, low=0.0, low_open=True))
        if self.clip_count_stddev is not None:
            s(
                self,
                "clip_count_stddev",
                check_number("clip_count_stddev", self.clip_count_stddev, low=0.0),
            )
        if self.noise_multiplier is None:
            s(self, "noise_multiplier", DEFAULT_NOISE_MULTIPLIER[self.dp.value])
        s(
            self,
            "noise_multiplier",
            check_number("noise_multiplier", self.noise_multiplier, low=0.0),
        )
        if self.dp in ACCOUNTED_MODES and self.delta_max is None:
            s(self, "delta_max", min(1e-5, 0.1 / self.clients))
        if self.delta_max is not None:
            s(
                self,
                "delta_max",
                check_delta_max(
                    check_number(
                        "delta_max",
                        self.delta_max,
                        low=0.0,
                        high=1.0,
                        low_open=True,
                        high_open=True,
                    ),
                    self.clients,
                ),
            )
        if self.target_epsilon is not None:
            s(
                self,
                "target_epsilon",
                check_number("target_epsilon", self.target_epsilon, low=0.0, low_open=True),
            )
            if self.dp in (DPMode.NONE, DPMode.LOCAL):
                raise ValueError(
                    "target_epsilon needs dp='global' or dp='client' (or "
                    "'distributed'; local DP has a per-coordinate ldp_epsilon "
                    "instead)"
                )
        if self.dp is DPMode.CLIENT and self.sampling is not SamplingMethod.FIXED_SIZE:
            raise ValueError(
                "dp='client' (client-side noise) needs sampling='fixed_size': "
                "the released sum's noise depends on the number of uploads"
            )
        if not isinstance(self.secure_mode, bool):
            raise ValueError(f"secure_mode must be True or False, got {self.secure_mode!r}")
        if self.secure_mode:
            if self.dp not in ACCOUNTED_MODES:
                raise ValueError(
                    "secure_mode=True secures the Gaussian noise and the client "
                    "sampling of dp='global', 'client', 'ftrl', 'banded_mf' and "
                    "'blt', and the discrete noise of dp='distributed'; got "
                    f"dp={self.dp.value!r}"
                )
            refuse_seed(True, self.noise_seed, "noise_seed")
        self._check_distributed()
        if self.train_subset is not None:
            s(self, "train_subset", check_count("train_subset", self.train_subset, minimum=1))
        opt = self.build_server_optimizer()  # validates (server_momentum None: the rule's default)
        s(self, "server_optimizer", opt.kind)
        s(self, "server_lr", opt.learning_rate)
        s(self, "server_beta2", opt.beta2)
        s(self, "server_tau", opt.tau)
        if self.server_momentum is not None:
            s(self, "server_momentum", opt.momentum)
        if self.model_average is not None:
            s(self, "model_average", self.build_model_average().beta)
        s(self, "hidden", tuple(check_count("hidden", h, minimum=1) for h in self.hidden))
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.dp is DPMode.LOCAL:
            s(self, "ldp_mechanism", MechanismKind.parse(self.ldp_mechanism).value)
            s(
                self,
                "ldp_epsilon",
                check_number(
                    "ldp_epsilon", self.ldp_epsilon, low=0.0, high=MAX_EPSILON, low_open=True
                ),
            )
            if self.ldp_bound != "init":
                try:
                    bound = float(self.ldp_bound)
                except (TypeError, ValueError):
                    raise ValueError(
                        f"ldp_bound must be a number > 0 or 'init', got {self.ldp_bound!r}"
                    ) from None
                s(self, "ldp_bound", check_number("ldp_bound", bound, low=0.0, low_open=True))
            s(
                self,
                "ldp_bound_margin",
                check_number("ldp_bound_margin", self.ldp_bound_margin, low=0.0, low_open=True),
            )

    def _check_distributed(self) -> None:
        """The rules of dp='distributed' (and that its settings go with it alone)."""
        s = object.__setattr__
        try:
            s(self, "ddp_mechanism", DistributedMechanism.parse(self.ddp_mechanism).value)
        except ValueError:
            raise ValueError(
                "ddp_mechanism must be one of "
                f"{', '.join(m.value for m in DistributedMechanism)}, got "
                f"{self.ddp_mechanism!r}"
            ) from None
        bits = check_count("bits", self.bits, minimum=2)
        if bits > 30:
            raise ValueError(f"bits must be in [2, 30], got {self.bits!r}")
        s(self, "bits", bits)
        s(
            self,
            "dropout_rate",
            check_number("dropout_rate", self.dropout_rate, low=0.0, high=1.0, high_open=True),
        )
        if self.dp is not DPMode.DISTRIBUTED:
            for name, unset in (("min_clients", None), ("dropout_rate", 0.0)):
                if getattr(self, name) != unset:
                    raise ValueError(
                        f"{name} is a setting of dp='distributed' (its secure "
                        f"aggregation), got {name}={getattr(self, name)!r} with "
                        f"dp={self.dp.value!r}"
                    )
            return
        if self.sampling is not SamplingMethod.FIXED_SIZE:
            raise ValueError(
                "dp='distributed' needs sampling='fixed_size': with Poisson "
                "sampling the number of noise shares would depend on whether a "
                "client took part"
            )
        if self.per_layer:
            raise ValueError(
                "dp='distributed' clips the whole update to one bound; per_layer must be False"
            )
        if self.noise_multiplier <= 0:
            raise ValueError(
                f"noise_multiplier must be > 0 with dp='distributed', got {self.noise_multiplier!r}"
            )
        m = (
            self.clients_per_round
            if self.clients_per_round is not None
            else max(1, int(round(self.fraction * self.clients)))
        )
        if self.min_clients is None:
            if self.dropout_rate > 0:
                raise ValueError(
                    f"dropout_rate={self.dropout_rate:g} needs min_clients: the "
                    "fewest uploads the secure aggregation finishes a round with "
                    "(the privacy accounting assumes only their noise shares)"
                )
            s(self, "min_clients", m)
        n_min = check_count("min_clients", self.min_clients, minimum=1)
        if n_min > m:
            raise ValueError(f"min_clients must be <= the clients per round (m={m}), got {n_min}")
        s(self, "min_clients", n_min)

    def build_model_average(self):
        """The `ModelAverage` of the released models (None without ``model_average``)."""
        from dpfl_tf.federated.server_optimizers import ModelAverage

        return None if self.model_average is None else ModelAverage(self.model_average)

    def local_learning_rate(self):
        """The clients' step: ``learning_rate``, or its exponential decay over the
        rounds (a `keras.optimizers.schedules.ExponentialDecay` of the round index)."""
        if self.lr_decay_rounds is None:
            return self.learning_rate
        import keras

        return keras.optimizers.schedules.ExponentialDecay(
            self.learning_rate, self.lr_decay_rounds, self.lr_decay_rate
        )

    def build_server_optimizer(self):
        """The `ServerOptimizer` of ``server_*`` (post-processing of each round's release)."""
        from dpfl_tf.federated.server_optimizers import ServerOptimizer

        return ServerOptimizer(
            self.server_optimizer,
            self.server_lr,
            self.server_momentum,
            beta2=self.server_beta2,
            tau=self.server_tau,
        )

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, enum.Enum):
                out[k] = v.value
        out["hidden"] = list(self.hidden)
        return out


def build_server(config: FederatedConfig, dataset=None, *, progress: bool = True):
    """(server, dataset) for a config; `dataset` defaults to ``load_dataset(config.dataset)``."""
    from dpfl_tf.data import load_dataset
    from dpfl_tf.federated.aggregators import (
        ClientNoiseDPAggregator,
        GlobalDPAggregator,
        MeanAggregator,
        MedianAggregator,
    )
    from dpfl_tf.federated.client import LocalTrainer, layer_groups
    from dpfl_tf.federated.server import ClientSampling, FederatedServer
    from dpfl_tf.sanitizer import GaussianSanitizer

    c = config
    ds = dataset if dataset is not None else load_dataset(c.dataset)
    x, y = ds.x_train, ds.y_train
    if c.train_subset is not None:
        keep = derive_rng(c.seed, "train-subset").permutation(len(y))[: c.train_subset]
        x, y = x[np.sort(keep)], y[np.sort(keep)]
    kwargs = {"alpha": c.dirichlet_alpha} if c.partition is PartitionScheme.DIRICHLET else {}
    partition = make_partition(
        y, c.clients, c.partition, seed=derive_seed(c.seed, "partition"), **kwargs
    )
    model = build_model(c, ds.input_shape, ds.num_classes)
    trainer = LocalTrainer(
        model,
        x,
        y,
        local_epochs=c.local_epochs,
        batch_size=c.local_batch_size,
        learning_rate=c.local_learning_rate(),
        momentum=c.momentum,
    )
    local_dp = None
    sampling = ClientSampling(
        c.sampling,
        clients_per_round=c.clients_per_round,
        fraction=c.fraction if c.clients_per_round is None else None,
        cohorts=c.cohorts,
    )
    if c.dp is DPMode.DISTRIBUTED:
        aggregator = _distributed_aggregator(c, trainer, sampling)
    elif c.dp in (DPMode.NONE, DPMode.LOCAL):
        # local DP: the server is not trusted with n_k (client data no mechanism
        # protects), so the mean is unweighted
        aggregator = (
            MeanAggregator(weighted=c.dp is DPMode.NONE)
            if c.aggregator == "mean"
            else MedianAggregator()
        )
        if c.dp is DPMode.LOCAL:
            local_dp = local_dp_upload(c, trainer.get_weights())
    else:
        groups = layer_groups(model) if c.per_layer else None
        n_layers = (max(groups) + 1) if groups else 1
        adaptive = c.clip == "adaptive"
        bound = c.clip_initial if adaptive else c.clip
        clip_arg = [bound] * n_layers if c.per_layer else bound
        allocation = "proportional" if c.per_layer else "global"
        if c.dp in CORRELATED_DP:
            from dpfl_tf.correlated_noise import CorrelatedSanitizer
            from dpfl_tf.privacy.matrix_factorization import CorrelatedNoiseConfig

            mechanism = CorrelatedNoiseConfig(CORRELATED_DP[c.dp]).build(
                sampling.participation(c.rounds), c.noise_multiplier
            )
            seed = None if c.noise_seed is None else derive_seed(c.noise_seed, "mf-noise")
            sanitizer = CorrelatedSanitizer(
                clip_arg,
                mechanism,
                noise_allocation=allocation,
                seed=seed,
                secure_mode=c.secure_mode,
            )
        else:
            sanitizer = GaussianSanitizer(
                clip_arg, c.noise_multiplier, noise_allocation=allocation, secure_mode=c.secure_mode
            )
        if c.dp is DPMode.GLOBAL and adaptive:
            count_stddev = (
                c.clip_count_stddev
                if c.clip_count_stddev is not None
                else 0.05 * sampling.expected_clients(c.clients)
            )
            try:
                aggregator = GlobalDPAggregator(
                    sanitizer,
                    clip="adaptive",
                    groups=groups,
                    target_quantile=c.clip_quantile,
                    clip_learning_rate=c.clip_lr,
                    count_stddev=count_stddev,
                    secure_mode=c.secure_mode,
                )
            except ValueError as e:
                if c.clip_count_stddev is None and "count_stddev" in str(e):
                    raise ValueError(
                        f"{e} (the default clip_count_stddev is 0.05 x the "
                        "expected clients per round; set clip_count_stddev)"
                    ) from None
                raise
        elif c.dp is DPMode.GLOBAL or c.dp in CORRELATED_DP:
            aggregator = GlobalDPAggregator(sanitizer, groups=groups, secure_mode=c.secure_mode)
        else:
            aggregator = ClientNoiseDPAggregator(
                sanitizer, groups=groups, secure_mode=c.secure_mode
            )
    server = FederatedServer(
        trainer,
        partition,
        aggregator,
        sampling=sampling,
        test_data=(ds.x_test, ds.y_test),
        target_epsilon=c.target_epsilon,
        delta_max=c.delta_max,
        accountant=c.accountant,
        seed=c.seed,
        noise_seed=c.noise_seed,
        eval_every=c.eval_every,
        progress=progress,
        local_dp=local_dp,
        secure_mode=c.secure_mode,
        server_optimizer=c.build_server_optimizer(),
        model_average=c.build_model_average(),
    )
    if c.noise_seed is not None and c.dp is not DPMode.NONE:
        from dpfl_tf.sanitizer import deployment_note

        server._notice(deployment_note(c.noise_seed))  # in the log and the results' notices
    return server, ds


def _distributed_aggregator(c: FederatedConfig, trainer, sampling):
    """dp='distributed': the `DistributedDP` of the config for the model's parameters,
    in a `DistributedDPAggregator` (simulated secure sum and dropouts)."""
    from dpfl_tf.federated.aggregators import DistributedDPAggregator
    from dpfl_tf.federated.distributed_dp import DistributedDP

    dimension = int(sum(int(np.prod(v.shape)) for v in trainer.variables))
    mechanism = DistributedDP(
        c.ddp_mechanism,
        c.bits,
        c.clip,
        c.noise_multiplier,
        sampling.clients_for(c.clients),
        dimension,
        min_clients=c.min_clients,
    )
    return DistributedDPAggregator(
        mechanism,
        dropout_rate=c.dropout_rate,
        dropout_seed=derive_seed(c.seed, "dropout"),
        rotation_key=(None if c.noise_seed is None else derive_seed(c.noise_seed, "rotation")),
        secure_mode=c.secure_mode,
    )


def build_model(config: FederatedConfig, input_shape: Sequence[int], num_classes: int):
    """The config's model, initialised from the stream (``config.seed``, "model-init"),
    32 bits, as ``keras.utils.set_random_seed`` of it would (the weights of earlier
    versions), without touching the process's global random state: a Flower
    ServerApp builds it in a thread while Flower's own threads draw from Python's
    `random` (`dpfl_tf.models.glorot_uniform_kernels`)."""
    seed = derive_seed(config.seed, "model-init") >> 31
    if config.model == "mlp":
        return fully_connected_model(input_shape, config.hidden, num_classes, seed=seed)
    from dpfl_tf.models import pnpm_cnn

    return pnpm_cnn(
        tuple(input_shape), num_classes, depth=2 if config.model == "cnn2" else 3, seed=seed
    )


def local_dp_upload(config: FederatedConfig, initial_weights: Sequence[Any]):
    """The clients' `LocalDPUpload` for ``dp="local"`` (see `FederatedConfig`)."""
    from dpfl_tf.federated.local_dp import (
        DomainPolicy,
        LocalDPUpload,
        MechanismKind,
        make_mechanism,
    )

    c = config
    kind = MechanismKind.parse(c.ldp_mechanism)
    mechanism = make_mechanism(
        kind, c.ldp_epsilon, **({"seed": c.noise_seed} if c.noise_seed is not None else {})
    )
    if mechanism.input_domain() is None:  # PNPM: any finite weight
        return LocalDPUpload(mechanism)
    if c.ldp_bound == "init":
        bounds, previous = [], 1.0
        for w in initial_weights:
            top = float(np.max(np.abs(np.asarray(w)))) if np.size(w) else 0.0
            previous = c.ldp_bound_margin * top if top > 0 else previous
            bounds.append(previous)
        policy = DomainPolicy.clip(tuple(bounds))
    else:
        policy = DomainPolicy.clip(float(c.ldp_bound))
    return LocalDPUpload(mechanism, policy)


def _local_summary(local: dict) -> dict:
    """The local-DP budget fields of a result (per client, basic composition).

    From the report's JSON-ready dict: an infinite figure is None with
    ``epsilon_per_upload_is_infinite`` and the reason (PNPM: magnitudes are
    not randomised); the sign-only figures are then given under their own names."""
    out = {
        "epsilon_per_coordinate": local["epsilon_per_coordinate"],
        "epsilon_per_upload": local["epsilon_per_upload"],
        "epsilon_total_per_client": local["epsilon_total"],
        "epsilon_per_upload_is_infinite": "epsilon_per_upload" in local["infinite_fields"],
        "num_coordinates": local["num_coordinates"],
    }
    if local.get("epsilon_infinite_reason"):
        out["epsilon_infinite_reason"] = local["epsilon_infinite_reason"]
    if local.get("epsilon_per_upload_sign_only") is not None:
        out["epsilon_per_upload_sign_only"] = local["epsilon_per_upload_sign_only"]
        out["epsilon_total_per_client_sign_only"] = local["epsilon_total_sign_only"]
    return out


def _mechanism(c: FederatedConfig) -> str:
    if c.dp is DPMode.LOCAL:
        return f"ldp_{c.ldp_mechanism}"
    if c.dp is DPMode.NONE:
        return "fedavg" if c.aggregator == "mean" else "fedmedian"
    if c.dp is DPMode.DISTRIBUTED:
        return f"distributed_{c.ddp_mechanism}"
    if c.dp in CORRELATED_DP:
        return c.dp.value
    return "global_dp" if c.dp is DPMode.GLOBAL else "client_dp"


def run_federated(
    config: FederatedConfig,
    dataset=None,
    *,
    progress: bool = True,
    checkpoint_dir: str | None = None,
    checkpoint_every_round: bool = True,
    should_stop=None,
    on_round=None,
    on_resume=None,
) -> dict[str, Any]:
    """Runs one configuration and returns a JSON-ready result (with history).

    checkpoint_dir: with `checkpoint_every_round`, the run resumes from it and
      checkpoints there after every round; otherwise a checkpoint is written
      there only when `should_stop` ends the run.
    should_stop(): polled before every client; True ends the run after the last
      complete round (``stop_reason`` "interrupted").
    on_round(result): after every round, with everything measured so far.
    on_resume(info): once, when resuming ({"directory", "rounds", "epsilon"}).
    """
    start = time.perf_counter()
    server, ds = build_server(config, dataset, progress=progress)
    every = checkpoint_dir if checkpoint_every_round else None
    if every is not None and server.load_checkpoint(every, missing_ok=True) and on_resume:
        on_resume({"directory": every, "rounds": server.rounds_done, "epsilon": server.epsilon()})
    server.run(
        config.rounds,
        checkpoint_dir=every,
        resume=False,
        should_stop=should_stop,
        on_round=None
        if on_round is None
        else (
            lambda srv: on_round(
                federated_result(config, srv, ds, seconds=time.perf_counter() - start)
            )
        ),
    )
    if server.stop_reason == "interrupted" and checkpoint_dir is not None and every is None:
        server.save_checkpoint(checkpoint_dir)
    return federated_result(config, server, ds, seconds=time.perf_counter() - start)


def federated_result(config: FederatedConfig, server, ds, *, seconds: float) -> dict[str, Any]:
    """The JSON-ready result of `server`'s run so far, on either runtime (in-process
    and `dpfl_tf.federated.flower`, which adds its runtime labels).  `ds` is the
    server's dataset (None: the config's dataset name is the label)."""
    c = config
    last = server.history[-1] if server.history else None
    report = server.privacy_report()
    round_secs = [r.seconds for r in server.history]
    return {
        "dataset": getattr(getattr(ds, "source", None), "label", c.dataset),
        "partition": c.partition.value,
        "clients": c.clients,
        "clients_per_round": server.expected_clients,
        "sampling": c.sampling.value,
        "rounds": server.rounds_done,
        "rounds_requested": c.rounds,
        "mechanism": _mechanism(c),
        "noise_multiplier": c.noise_multiplier if c.dp is not DPMode.NONE else 0.0,
        "clip": c.clip if c.dp is not DPMode.NONE else None,
        "per_layer": c.per_layer,
        "epsilon": report.get("epsilon"),
        "delta": report.get("delta"),
        "accountant": c.accountant.value if c.dp is not DPMode.NONE else None,
        "test_accuracy": last.accuracy if last else None,
        # with a model average, "test_accuracy" is the average's; the global model's too
        **(
            {"global_model_accuracy": server.global_model_accuracy()}
            if server.model_average is not None and last is not None and last.accuracy is not None
            else {}
        ),
        "seconds": seconds,
        "median_round_seconds": float(np.median(round_secs)) if round_secs else None,
        "rounds_per_minute": 60.0 / float(np.median(round_secs)) if round_secs else None,
        "peak_rss_mb": peak_rss_mb(),
        "stop_reason": server.stop_reason,
        "notices": server.notices,
        **(
            {"note": server.notices[-1]}
            if c.noise_seed is not None and c.dp is not DPMode.NONE
            else {}
        ),
        "privacy": report,
        **({"model": c.model} if c.model != "mlp" else {}),
        **(_local_summary(report["local_dp"]) if "local_dp" in report else {}),
        **(
            {"bits": c.bits, "bits_per_parameter": report["distributed"]["bits_per_parameter"]}
            if "distributed" in report
            else {}
        ),
        "local_epochs": c.local_epochs,
        "local_batch_size": c.local_batch_size,
        "learning_rate": c.learning_rate,
        **(
            {"lr_decay_rounds": c.lr_decay_rounds, "lr_decay_rate": c.lr_decay_rate}
            if c.lr_decay_rounds is not None
            else {}
        ),
        "momentum": c.momentum,
        "config": c.to_dict(),
        "history": [r.to_dict() for r in server.history],
    }
