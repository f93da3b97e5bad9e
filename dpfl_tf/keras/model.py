"""`DPModel`: DP-SGD training for any Keras 3 model (Abadi et al. 2016, Algorithm 1).

    model = keras.Sequential([...])                       # or functional / subclassed
    dp_model = dpfl_tf.keras.DPModel(model)                                 # 1
    dp_model.compile(optimizer=dpfl_tf.keras.DPSGD(0.1, l2_norm_clip=4.0,   # 2
                                                   noise_multiplier=2.0),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                     metrics=["accuracy"])
    dp_model.fit(x, y, lot_size=600, epochs=10, target_epsilon=2.0)         # 3

One Keras step is one *lot* (the privacy unit): the lot is drawn by the
`LotSampler` (Poisson by default, rate q = L/N), walked in physical batches
of `batch_size` examples (memory), the clipped per-example gradients of all its
batches are summed, Gaussian noise is added **once per lot** and the update is
(sum + noise) / L.

Privacy counts computations, not weights.  Two counters move with every
released lot:

* ``lots_computed`` -- every noised lot this model has ever released.  It lives
  outside the Keras weights, so restoring earlier weights
  (``EarlyStopping(restore_best_weights=True)``, ``BackupAndRestore``,
  ``set_weights``) cannot move it back; the `PrivacyLedger` records exactly this
  count (a saved ``.keras`` model keeps it in its config, so a resumed run
  neither loses nor double-counts).
* ``lots_applied`` -- a weight: the lots behind the current weights.  It moves
  back with a rollback, which refunds nothing.

The budget guard is part of the computation: a lot beyond the lot limit is
skipped in-graph (nothing computed, noised, applied or counted), so the stop
holds under XLA and with ``steps_per_execution > 1``; training then ends
cleanly and says that the budget is spent.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import dp_accounting
import keras
import numpy as np
import tensorflow as tf

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.keras.lot import LotStep
from dpfl_tf.keras.mixing import (
    PROBE_HALF,
    probe_batch_mixing,
    refuse_batch_mixing_layers,
    refuse_batch_mixing_loss,
)
from dpfl_tf.keras.multiworker import is_multi_worker, lot_shares
from dpfl_tf.keras.optimizers import DPOptimizer
from dpfl_tf.keras.per_example import PerExampleGradients, _leaf_layers, default_loss_scale
from dpfl_tf.keras.sampling import LotSampler
from dpfl_tf.keras.sources import IndexedReader, SourceError, end_failed_pipeline, make_reader
from dpfl_tf.keras.users import (
    USER_LEVEL_LABEL,
    PerUserGradients,
    refuse_mixed_units,
    user_level_sampler,
)
from dpfl_tf.privacy.accountants import compute_epsilon
from dpfl_tf.privacy.events import (
    SamplingMethod,
    describe_event,
    gaussian_step_event,
    shuffle_epoch_event,
)
from dpfl_tf.privacy.ledger import BudgetExceededError, PrivacyBudget, PrivacyLedger
from dpfl_tf.sanitizer import GaussianSanitizer

__all__ = ["DPModel"]

_NO_LIMIT = np.iinfo(np.int64).max
PROBE_LOTS = 4  # lots read at most for the cross-example probe's 2h examples
PROBE_CHUNK = 64  # examples of a lot the probe copies at a time
XLA_PAD = 64  # under XLA, lots are padded to a multiple of 64 examples (few shapes to compile)
MAX_DEFAULT_BATCH = 1024
MATERIALISED_BYTES = 2**30  # default physical batch: at most 1 GiB of per-example gradients


AUTO_CALLS_PER_EPOCH = 10  # "auto" steps_per_execution: at least this many calls an epoch


def auto_steps_per_execution(lots_per_epoch: int, *, distributed: bool = False) -> int:
    """The "auto" steps_per_execution: the largest divisor of the epoch's lots
    that still leaves >= 10 calls of the training function an epoch (progress,
    callbacks and interrupts every tenth of an epoch or sooner); 1 under a
    distribution strategy or eagerly.  Each call of Keras's training function
    costs Python work (~0.5-1 ms here) that a small model's lot does not hide:
    the paper's MNIST MLP (lot 600, 100 lots an epoch, 10 per call) trains an
    epoch ~15% faster than one lot per call."""
    if distributed or lots_per_epoch < 2 * AUTO_CALLS_PER_EPOCH:
        return 1
    cap = lots_per_epoch // AUTO_CALLS_PER_EPOCH
    return max(d for d in range(1, cap + 1) if lots_per_epoch % d == 0)


def default_batch_size(sampler: LotSampler, materialised_parameters: int, multiple: int = 8) -> int:
    """The default physical batch: the whole lot in one pass when memory allows.

    `LotSampler.lot_examples_bound` examples (a Poisson lot: L + 5 standard
    deviations, which covers all but ~3e-7 of lots), so nearly every lot is one
    pass (a larger lot takes more passes; the result is the same).  Capped at
    1024 examples, and so that per-example gradients the fast rules cannot avoid
    (the generic path, `materialised_parameters` floats per example) take <= 1 GiB."""
    lot = sampler.lot_examples_bound()
    size = min(-(-lot // multiple) * multiple, MAX_DEFAULT_BATCH)
    if materialised_parameters:
        size = min(size, MATERIALISED_BYTES // (4 * materialised_parameters))
    return max(1, size)


@keras.saving.register_keras_serializable(package="dpfl_tf")
class DPModel(keras.Model):
    """Wraps a Keras model for DP-SGD training; inference is the inner model's.

    Args:
      model: the Keras model (Sequential, functional or subclassed).
      accountant: default accountant of the ledger ("moments", "rdp", "pld").
      fast_gradients: use the fast per-example paths for Dense / Conv2D /
        Embedding layers of Sequential and functional models (exactly equal to
        the generic path; set False to force the generic Jacobian path).
      ledger: a `PrivacyLedger` (or its dict) to continue from.
    """

    def __init__(
        self,
        model: keras.Model,
        *,
        accountant: str = "moments",
        fast_gradients: bool = True,
        ledger: PrivacyLedger | dict | None = None,
        recorded_lots: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"model must be a Keras model, got {type(model).__name__}")
        self.model = model
        self.fast_gradients = bool(fast_gradients)
        if isinstance(ledger, dict):
            ledger = PrivacyLedger.from_dict(ledger)
        self.ledger = ledger if ledger is not None else PrivacyLedger(accountant)
        self._lots_applied = self.add_weight(
            shape=(), dtype="int64", initializer="zeros", trainable=False, name="dp_lots_applied"
        )
        self._recorded_lots = int(recorded_lots)
        # monotonic counters outside the weights (see module docstring)
        self._counters = _Counters(self._recorded_lots)
        self._lot_limits: dict[str, int | None] = {}
        self._step_event = None  # event of one lot with the current fit settings
        self._epoch_event = None  # shuffle sampling: one Gaussian per epoch
        self._lots_per_epoch = None
        self._fit_start_lots = 0
        self._recorded_epochs = 0
        self._dp_loss = None
        self._sanitizer = None
        self._correlated = None  # a correlated-noise run (DPOptimizer(correlated_noise=))
        self._groups = None
        self._batch_size = None
        self._expected_lot = None
        self._pad_to_batch = False
        self._log_metrics = True
        self._ledger_label = "dpsgd"  # user-level lots: users.USER_LEVEL_LABEL
        self.stop_reason = None
        self.calibration = None  # the last fit's noise calibration (dict), if any

    # -- Keras plumbing -------------------------------------------------------
    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def build(self, input_shape):
        if not self.model.built:
            self.model.build(input_shape)
        self.built = True

    def compile(self, optimizer=None, loss=None, *, steps_per_execution="auto", **kwargs):
        """Keras's `compile` with a DP optimizer and a per-example loss.

        `steps_per_execution`: lots per call of the compiled training function.
        "auto" (the default) picks it per `fit` (`auto_steps_per_execution`:
        several lots per call when an epoch has many, so Keras's per-call
        Python work is paid once for them; 1 under a distribution strategy).
        An integer must divide the lots of an epoch.  Callbacks then see one
        batch end per call (Keras's meaning of steps_per_execution).  Set it
        here: each `fit` sets the ``steps_per_execution`` attribute itself."""
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise TypeError(
                "pass the DP optimizer itself, not a LossScaleOptimizer: under a mixed "
                "precision policy DPModel scales the per-example losses itself and clips, "
                "noises and applies float32 gradients"
            )
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(
                "DPModel must be compiled with a DP optimizer (dpfl_tf.keras.DPSGD, DPAdam or "
                f"DPOptimizer(inner, ...)); got {type(optimizer).__name__}: a plain optimizer "
                "would train without privacy"
            )
        if loss is None:
            raise ValueError("DPModel.compile needs a loss (one value per example)")
        refuse_batch_mixing_layers(self.model)
        _refuse_regularizers(self.model)
        self._dp_loss = keras.losses.get(loss) if isinstance(loss, str) else loss
        if isinstance(self._dp_loss, (list, dict)):
            raise ValueError("DPModel supports a single loss")
        refuse_batch_mixing_loss(self._dp_loss)
        self._mixing_probed = False  # the cross-example probe runs at the next fit
        # Keras would wrap the optimizer in a LossScaleOptimizer under mixed_float16;
        # the per-example path scales and unscales the loss itself (a static scale,
        # `default_loss_scale`), so norms, clipping and noise see true gradients
        kwargs["auto_scale_loss"] = False
        if steps_per_execution != "auto":
            steps_per_execution = check_count("steps_per_execution", steps_per_execution, minimum=1)
        super().compile(
            optimizer=optimizer, loss=loss, steps_per_execution=steps_per_execution, **kwargs
        )
        # "auto" stays in the compile config (a loaded model compiles with it again);
        # the value in force is set by each fit (`_prepare`), 1 until then
        self._auto_steps = steps_per_execution == "auto"
        if self._auto_steps:
            self.steps_per_execution = 1

    def get_compile_config(self):
        return super().get_compile_config()

    def compile_from_config(self, config):
        """Recompiles a loaded model with its DP optimizer and loss."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built or self.model.built:  # the optimizer's saved state loads into these
            self.optimizer.build(self.model.trainable_variables)

    # -- privacy bookkeeping ----------------------------------------------------
    @property
    def lots_applied(self) -> int:
        """Lots behind the current weights (a weight: moves back with a rollback)."""
        return int(keras.ops.convert_to_numpy(self._lots_applied))

    @property
    def lots_computed(self) -> int:
        """Every noised lot this model has released (monotonic; what the ledger counts)."""
        return self._counters.computed_value()

    @property
    def dropped_examples(self) -> int:
        """Examples whose gradient was non-finite and was zeroed (dropped) so far.

        An un-noised count over private lots: a NON-PRIVATE statistic (whether a
        NaN record was sampled), like the training loss; not logged with
        ``fit(log_train_metrics=False)``."""
        return self._counters.dropped_value()

    @property
    def privacy_ledger(self) -> PrivacyLedger:
        """The ledger, brought up to date with the lots computed so far."""
        self._sync_ledger()
        return self.ledger

    def epsilon(self, delta: float, accountant: str | None = None) -> float:
        """Epsilon spent so far at `delta` (the ledger's accountant by default)."""
        return self.privacy_ledger.epsilon(delta, accountant)

    def _sync_ledger(self) -> None:
        computed = self.lots_computed
        pending = computed - self._recorded_lots
        if pending <= 0:
            return
        if self._step_event is None:
            raise RuntimeError(
                f"{pending} lots were applied (restored from weights) but the privacy "
                "settings that produced them are unknown here; call fit() with the same "
                "settings to resume, or load the full model (.keras) which keeps its ledger"
            )
        if self._epoch_event is not None:  # shuffle: one Gaussian per epoch touched
            epochs = math.ceil((computed - self._fit_start_lots) / self._lots_per_epoch)
            self.ledger.record(
                self._epoch_event, epochs - self._recorded_epochs, label=self._ledger_label
            )
            self._recorded_epochs = epochs
        else:
            self.ledger.record(self._step_event, pending, label=self._ledger_label)
        self._recorded_lots = computed

    def set_lot_limit(self, limit: int | None, reason: str = "budget") -> None:
        """In-graph guard: once `lots_computed` reaches `limit`, further lots are
        skipped (nothing computed, applied or counted) -- also inside a call of
        several lots (steps_per_execution > 1), which a callback cannot stop.
        Each `reason` (the budget; a planned end of training) sets its own
        limit, None removes it; the guard is the smallest."""
        self._lot_limits[reason] = None if limit is None else int(limit)
        limits = [v for v in self._lot_limits.values() if v is not None]
        self._counters.set_limit(min(limits) if limits else _NO_LIMIT)

    # -- training -----------------------------------------------------------
    def fit(
        self,
        x=None,
        y=None,
        *,
        lot_size: int,
        batch_size: int | None = None,
        epochs: int = 1,
        sampling: SamplingMethod | str = SamplingMethod.POISSON,
        target_epsilon: float | None = None,
        target_delta: float = 1e-5,
        accountant: str | None = None,
        verbose="auto",
        callbacks=None,
        validation_data=None,
        initial_epoch: int = 0,
        preprocess=None,
        sampling_seed: int | None = None,
        log_train_metrics: bool = True,
        user_ids=None,
        max_examples_per_user: int | None = None,
        **kwargs,
    ):
        """DP-SGD training on arrays or a random-access source.

        Args:
          x, y: arrays (or tensors / dicts / tuples of arrays for x) of N
            examples; `np.memmap` arrays are read lot by lot.  Or x is a
            random-access source (``__len__`` and ``__getitem__(i) -> (x, y)``,
            optionally ``__getitems__``) and y is None; see
            `dpfl_tf.keras.sources`.
          lot_size: L, the expected lot size (privacy unit); q = L / N.
          batch_size: physical batch size B (memory only; default: the whole lot
            in one pass when memory allows, `default_batch_size`).  User-level
            lots are cut between users: a batch holds whole users, at most B
            examples (a larger user alone).
          epochs: epochs of N / L lots each.
          sampling: "poisson" (default), "fixed_size" or "shuffle".
          target_epsilon, target_delta: stop before the lot that would exceed
            (target_epsilon, target_delta); epsilon is logged either way.  When
            the budget stops training, `stop_reason` (and the History's
            ``stop_reason``) is "budget_spent".  If the optimizer's
            noise_multiplier is unset (None), fit first calibrates it: the
            smallest sigma whose `epochs` of lots, on top of what the ledger
            already holds, stay within the target under `accountant`
            (`_calibrate_noise`; stored on the optimizer, in `calibration`);
            with correlated noise, the run's one event (a fit that continues
            a run keeps its sigma).
          accountant: accountant for the budget and the logs (default: ledger's).
          preprocess: a function applied to each lot's x inside tf.data (e.g.
            augmentation; it must act on each example independently).
          sampling_seed: seeds lot sampling (tests only; default OS entropy).
          log_train_metrics: the loss and metrics of the training lots, and the
            count of dropped examples, are computed on private data without
            noise: they are NON-PRIVATE statistics.  Set False to not compute or
            log them (epsilon and the lots released are still logged).
          user_ids: user-level DP-SGD (`dpfl_tf.keras.users`): the user of every
            example (N ids, or a partition); the unit of privacy is then a user,
            `lot_size` is the expected number of USERS per lot (Poisson over
            users), each user's summed gradient is clipped and the ledger
            counts user-level lots.
          max_examples_per_user: with `user_ids`, at most this many examples of
            a user per lot (a fresh random subset each lot).

        Examples whose gradient is NaN or inf are dropped (zeroed; the lot is
        applied and counted) and counted in `dropped_examples`, with a warning.
        """
        for name in (
            "validation_split",
            "sample_weight",
            "class_weight",
            "shuffle",
            "steps_per_epoch",
            "validation_steps",
        ):
            if kwargs.pop(name, None) is not None:
                raise ValueError(
                    f"DPModel.fit does not support {name}: lots are sampled by the DP sampler"
                )
        if kwargs:
            raise TypeError(f"DPModel.fit got unexpected arguments {sorted(kwargs)}")
        if self.optimizer is None or self._dp_loss is None:
            raise RuntimeError("compile the DPModel with a DP optimizer before fit()")
        reader = make_reader(x, y)
        _check_input_shape(self.model, reader, check_shape=preprocess is None)
        optimizer: DPOptimizer = self.optimizer
        first_lot = max(self.lots_computed, self.lots_applied)
        if user_ids is None and max_examples_per_user is None:
            refuse_mixed_units(self.ledger, user_level=False)
            sampler = LotSampler(
                reader.size,
                lot_size,
                sampling,
                seed=sampling_seed,
                secure_mode=optimizer.secure_mode,
                first_lot=first_lot,
                cycle_length=_cycle_length(optimizer, sampling),
            )
        else:  # user-level DP-SGD
            if getattr(optimizer, "correlated_noise", None) is not None:
                raise ValueError(
                    "user_ids: user-level DP-SGD with correlated_noise="
                    f"{optimizer.correlated_noise!r} is not supported (the correlated "
                    "mechanism's participation is declared per example); use a DP optimizer "
                    "without correlated_noise"
                )
            sampler = user_level_sampler(
                self,
                reader.size,
                lot_size,
                sampling=sampling,
                user_ids=user_ids,
                max_examples_per_user=max_examples_per_user,
                seed=sampling_seed,
                first_lot=first_lot,
            )
        if batch_size is not None:
            batch_size = check_count("batch_size", batch_size, minimum=1)
        check_count("epochs", epochs, minimum=1)
        target_delta = check_number(
            "target_delta", target_delta, low=0.0, high=1.0, low_open=True, high_open=True
        )

        from dpfl_tf.keras.callbacks import CountsProgbarLogger, PrivacyCallback

        callbacks = list(callbacks or [])
        privacy_cb = next((c for c in callbacks if isinstance(c, PrivacyCallback)), None)
        if privacy_cb is None:
            privacy_cb = PrivacyCallback(
                target_epsilon=target_epsilon, delta=target_delta, accountant=accountant
            )
        elif target_epsilon is not None:
            raise ValueError("pass target_epsilon either to fit() or to the PrivacyCallback")
        self._log_metrics = bool(log_train_metrics)
        replicas = self.distribute_strategy.num_replicas_in_sync
        correlated = getattr(optimizer, "correlated_noise", None)
        if replicas > 1 and correlated is not None:  # before anything is recorded
            raise ValueError(
                f"correlated_noise is not supported under a distribution strategy with "
                f"{replicas} replicas (each replica would advance the noise state); train "
                "on one replica"
            )
        lots = (epochs - initial_epoch) * sampler.lots_per_epoch
        running = getattr(optimizer, "correlated_run", None)
        if (
            correlated is not None
            and optimizer.noise_multiplier is None
            and running is not None
            and running.continues(sampler, sampler.first_lot, lots)
        ):  # the run in progress keeps its noise (and its recorded event)
            optimizer.noise_multiplier = running.mechanism.noise_multiplier
        self._correlated = None
        if correlated is None or optimizer.noise_multiplier is not None:
            # else planned once the noise is calibrated (`_calibrate_noise`)
            self._correlated = optimizer.plan_correlated_run(
                sampler, lots=lots, first_lot=sampler.first_lot
            )
        self._prepare(
            sampler, batch_size, calibrate_for=(privacy_cb, epochs - initial_epoch, verbose)
        )
        self._check_accountants(privacy_cb, target_delta)
        self._begin_correlated_run(privacy_cb, target_delta)
        if replicas > 1 and optimizer.secure_mode:
            raise ValueError(
                f"secure_mode=True is not supported under a distribution strategy with "
                f"{replicas} replicas: the replicas' all-reduce adds float32 partial sums "
                "after the noise, a second rounding that secure mode's one-rounding "
                "defence does not cover (this mode is refused)"
            )
        if replicas > 1 and self.jit_compile:
            raise ValueError(
                f"jit_compile must be False under a distribution strategy with {replicas} "
                "replicas: XLA cannot read the replicas' privacy counters across devices "
                "(this mode is not supported, so it is refused)"
            )
        if is_multi_worker(self.distribute_strategy):
            # every worker the chief's lots, each replica its own share (multiworker.py)
            data = lot_shares(
                self.distribute_strategy, sampler, reader, preprocess=preprocess
            )  # endless
        else:
            pad_to = (XLA_PAD if self.jit_compile else 1) * replicas
            data = sampler.dataset(
                reader,
                pad_to=pad_to,
                preprocess=preprocess,  # endless
                prefetch=2 * int(self.steps_per_execution),
            )
        callbacks = [privacy_cb] + [c for c in callbacks if c is not privacy_cb]
        has_bar = any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks)
        if verbose != 0 and not has_bar:
            callbacks.append(CountsProgbarLogger())  # counts shown as integers
        self.stop_reason = None
        dropped_before = self.dropped_examples
        try:
            self._probe_batch_mixing(data)  # reads the first lot: a bad record is said here
            self._build_state_before_tracing(data.element_spec)
            history = super().fit(
                data,
                epochs=epochs,
                initial_epoch=initial_epoch,
                steps_per_epoch=sampler.lots_per_epoch,
                verbose=verbose,
                callbacks=callbacks,
                validation_data=validation_data,
                shuffle=False,
            )
        except BaseException as e:  # a bad record, a callback's error, Ctrl-C
            if isinstance(reader, IndexedReader):
                end_failed_pipeline(e)  # its reads in flight end here, not in a reader thread
            if isinstance(e, (tf.errors.OpError, SourceError)):
                reader.raise_pending()  # a record that could not be read: say which
            raise
        finally:
            self._log_metrics = True  # evaluate() and later calls report metrics again
        self.stop_reason = self.stop_reason or "completed"
        if history is not None:
            history.stop_reason = self.stop_reason
        dropped = self.dropped_examples - dropped_before
        if dropped:
            warnings.warn(
                f"{dropped} training examples had a NaN or inf gradient and were dropped "
                "(their contribution zeroed; the lots were applied and counted): check the "
                "data and the loss",
                RuntimeWarning,
                stacklevel=2,
            )
        return history

    def _probe_batch_mixing(self, data) -> None:
        """Refuses, before any lot is trained, a model or loss whose per-example
        losses depend on other examples (`mixing.probe_batch_mixing`), on the
        first 2h distinct real examples of the first lots `data` yields (this process's
        share under a MultiWorkerMirroredStrategy): records the training reads
        anyway, `preprocess`ed as in training.  Once per compile."""
        if getattr(self, "_mixing_probed", True):
            return
        local = self.distribute_strategy.experimental_local_results
        xs, ys, seen = [], [], set()
        lots = iter(data)
        try:
            for _ in range(PROBE_LOTS):
                x, y, mask, *_ = next(lots)  # (user slots)
                x, y = tf.nest.map_structure(lambda t: local(t)[0], x), local(y)[0]
                real = tf.where(local(mask)[0] > 0)[:, 0]
                del mask
                # distinct records only: lots that repeat examples (full-batch lots, a
                # small dataset) would make the probe's two halves equal and blind it.
                # The lot is read in chunks, not copied whole: a lot can be a GB
                # (CIFAR-10's scattering recipes peaked 5 GB higher for that copy)
                for start in range(0, int(tf.size(real)), PROBE_CHUNK):
                    rows = real[start : start + PROBE_CHUNK]
                    xc = tf.nest.map_structure(lambda t: tf.gather(t, rows), x)
                    yc = tf.gather(y, rows)
                    for i in range(int(tf.size(rows))):
                        record = tf.nest.map_structure(lambda t: t[i], xc)
                        key = b"".join(
                            np.asarray(t).tobytes() for t in tf.nest.flatten((record, yc[i]))
                        )
                        if key not in seen:
                            seen.add(key)
                            xs.append(record)
                            ys.append(yc[i])
                        if len(xs) >= 2 * PROBE_HALF:
                            break
                    if len(xs) >= 2 * PROBE_HALF:
                        break
                del x, y
                if len(xs) >= 2 * PROBE_HALF:
                    break
        finally:
            del lots  # its lots read ahead go before training reads its own
        if len(xs) < 2:
            return  # lots too small to compare; probed at the next fit
        loss = self._dp_loss
        name = getattr(loss, "name", None) or getattr(loss, "__name__", type(loss).__name__)
        probe_batch_mixing(
            self.model,
            loss,
            tf.nest.map_structure(lambda *t: tf.stack(t, 0), *xs),
            tf.stack(ys, 0),
            loss_name=f"loss {name!r} ({type(loss).__name__})",
        )
        self._mixing_probed = True

    def _check_accountants(self, privacy_cb, delta: float) -> None:
        """Refuses, before any lot, an accountant of this fit (the callback's, else
        the ledger's) that cannot analyse this fit's lots."""
        from dpfl_tf.privacy.accountants import AccountantKind

        kind = privacy_cb.accountant or self.ledger.accountant
        if not _accounts(self._step_event, delta, kind):
            allowed = [k.value for k in AccountantKind if _accounts(self._step_event, delta, k)]
            raise ValueError(
                f"accountant {kind.value!r} cannot account for lots of "
                f"{describe_event(self._step_event)}; pass accountant= one of {allowed}, or "
                "use another sampling (nothing was trained)"
            )

    def _prepare(self, sampler: LotSampler, batch_size: int, calibrate_for=None) -> None:
        """Fixes the settings of this fit: sanitizer, groups, the lot's event (and
        the noise multiplier, if unset: `_calibrate_noise` with `calibrate_for`)."""
        restored = self.lots_applied > self.lots_computed
        if not restored:
            self._sync_ledger()  # lots of an earlier fit are recorded with their own event
        optimizer: DPOptimizer = self.optimizer
        if not self.model.built:
            raise RuntimeError("build the model first (give it an Input or call it once)")
        variables = self.model.trainable_variables
        if not variables:
            raise ValueError("the model has no trainable variables")
        layer_of = {
            id(v): layer.name
            for layer in _leaf_layers(self.model)
            for v in layer.trainable_variables
        }
        self._groups, bounds = optimizer.clip_groups(variables, layer_of)
        self.calibration = None
        if optimizer.noise_multiplier is None and calibrate_for is not None:
            self._calibrate_noise(sampler, bounds, *calibrate_for)
        self._sanitizer = optimizer.make_sanitizer(bounds)
        self._counters.create(self.distribute_strategy)
        self._expected_lot = float(sampler.lot_size)
        self._pad_to_batch = bool(self.jit_compile)
        self._ledger_label = getattr(sampler, "ledger_label", "dpsgd")
        per_example = PerExampleGradients
        if self._ledger_label == USER_LEVEL_LABEL:  # clipped by the user's norm
            per_example = PerUserGradients
        self._per_example = per_example(
            self.model,
            self._dp_loss,
            fast=self.fast_gradients,
            loss_scale=default_loss_scale(self.model),
        )
        self._set_steps_per_execution(sampler.lots_per_epoch)
        self._batch_size = batch_size or default_batch_size(
            sampler,
            self._per_example.materialised_parameters(),
            multiple=XLA_PAD if self.jit_compile else 8,
        )
        # before the events: they are computed from the sanitizer the graph uses
        self._keep_or_reset_train_function(variables)
        num_groups = max(self._groups) + 1
        if self._correlated is not None:
            if restored:  # their lots would be recorded as this run's no-op lots
                raise ValueError(
                    f"the weights carry {self.lots_applied - self.lots_computed} lots this "
                    "model did not compute, and a correlated-noise fit cannot tell what "
                    "they cost: load the full .keras model (its ledger), or pass the ledger "
                    "and recorded_lots to DPModel, and restore the run's state with "
                    "DPOptimizer.restore_correlated_run (nothing was trained)"
                )
            # the run's event is recorded once, before its first lot
            # (`_begin_correlated_run`); its lots are covered by it
            self._correlated.build(variables)
            self._epoch_event = None
            self._step_event = dp_accounting.NoOpDpEvent()
        elif sampler.sampling is SamplingMethod.SHUFFLE:
            self._epoch_event = _release_event(
                sampler, self._sanitizer.effective_noise_multiplier(num_groups)
            )
            self._step_event = self._epoch_event
            self._lots_per_epoch = sampler.lots_per_epoch
            self._fit_start_lots = self.lots_computed
            self._recorded_epochs = 0
        else:
            self._epoch_event = None
            self._step_event = _release_event(
                sampler, self._sanitizer.effective_noise_multiplier(num_groups)
            )
        self.sampler = sampler
        if restored:
            self._adopt_restored_lots(stacklevel=4)

    def _keep_or_reset_train_function(self, variables) -> None:
        """Retraces the training function only when a setting it was traced with
        changed: a new fit with the same settings reuses it (and the sanitizer
        and per-example objects it holds), so fits in one process do not each
        leave a traced function behind.  A correlated-noise run always retraces
        (its noise state is built per run)."""
        key = (
            tuple(id(v) for v in variables),
            id(self._dp_loss),
            type(self._per_example),
            self.fast_gradients,
            repr(sorted(self._sanitizer.get_config().items())),
            tuple(self._groups),
            self._batch_size,
            self._expected_lot,
            self._pad_to_batch,
            self._log_metrics,
            self.steps_per_execution,
            self._ledger_label,
            id(self.distribute_strategy),
            id(self.optimizer),
            self._per_example.loss_scale,
            self.jit_compile,
            bool(self.run_eagerly),
        )
        if (
            self._correlated is None
            and self.train_function is not None
            and key == getattr(self, "_traced_key", None)
        ):
            self._sanitizer, self._per_example = self._traced_objects
            return
        self.train_function = None  # retrace with the new settings
        self._traced_key = None if self._correlated is not None else key
        self._traced_objects = (self._sanitizer, self._per_example)

    def _calibrate_noise(
        self, sampler: LotSampler, bounds, privacy_cb, epochs: int, verbose
    ) -> None:
        """Sets the optimizer's unset noise multiplier to the smallest sigma whose
        planned releases (`epochs` x the lots of an epoch; shuffle: `epochs`
        epochs; correlated noise: the run's one event for the fit's
        participation), composed with what the ledger already holds (e.g. a DP-PCA
        release), stay within (target_epsilon, delta) under the fit's accountant
        (the ledger's by default): `privacy.calibrate_noise_multiplier`.  The
        sigma is stored on the optimizer (its config keeps it), in
        `self.calibration`, and printed unless verbose=0."""
        from dpfl_tf.privacy.calibration import calibrate_noise_multiplier

        optimizer: DPOptimizer = self.optimizer
        target, delta = privacy_cb.target_epsilon, privacy_cb.delta
        if target is None:
            raise ValueError(
                "noise_multiplier is unset (None) and fit got no target_epsilon: pass "
                "target_epsilon= (and epochs=) to calibrate it, or set noise_multiplier on "
                "the optimizer (nothing was trained)"
            )
        if self.lots_applied > self.lots_computed:
            raise ValueError(
                f"noise_multiplier is unset (None) but the weights carry "
                f"{self.lots_applied - self.lots_computed} lots whose settings are unknown: "
                "set the noise_multiplier that produced them (nothing was trained)"
            )
        kind = privacy_cb.accountant or self.ledger.accountant
        # sigma_eff is linear in sigma (per-layer bounds and noise allocation fixed)
        per_unit = GaussianSanitizer(
            bounds, 1.0, noise_allocation=optimizer.noise_allocation
        ).effective_noise_multiplier(max(self._groups) + 1)
        correlated = getattr(optimizer, "correlated_noise", None)
        # independent noise on shuffled epochs: one event an epoch; else counted in lots
        per_epoch = correlated is None and sampler.sampling is SamplingMethod.SHUFFLE
        count = epochs if per_epoch else epochs * sampler.lots_per_epoch
        unit = "epochs" if per_epoch else "lots"
        mechanism = None
        if correlated is not None:  # one event for the run, its strategy built once
            mechanism = correlated.build(sampler.participation(count), 1.0)
        prior = [self.ledger.event] if len(self.ledger) else []
        spent = compute_epsilon(prior[0], delta, kind) if prior else 0.0
        if spent >= target:
            raise ValueError(
                f"target_epsilon={target:g} is already spent: the ledger holds epsilon "
                f"{spent:.4g} at delta {delta:g} ({kind.value}); no noise multiplier leaves "
                "room for a lot (nothing was trained)"
            )

        def release(sigma: float):
            """What the fit releases at `sigma`: the correlated run's one event,
            or `count` lots' (or epochs') events."""
            if mechanism is not None:
                scaled = dataclasses.replace(mechanism, noise_multiplier=per_unit * sigma)
                return self.ledger.admit(scaled.event())
            step = self.ledger.admit(_release_event(sampler, per_unit * sigma))
            return dp_accounting.SelfComposedDpEvent(step, count)

        def planned(sigma: float):
            return dp_accounting.ComposedDpEvent(prior + [release(sigma)])

        sigma, eps = calibrate_noise_multiplier(target, delta, planned, kind)
        optimizer.noise_multiplier = sigma
        if mechanism is not None:
            self._correlated = optimizer.plan_correlated_run(
                sampler, lots=count, first_lot=sampler.first_lot, built=mechanism
            )
        self.calibration = {
            "noise_multiplier": sigma,
            "epsilon": eps,
            "delta": delta,
            "target_epsilon": target,
            "accountant": kind.value,
            unit: count,
            "epsilon_before": spent,
        }
        if verbose != 0:
            print(
                f"calibrated noise_multiplier = {sigma:.4g}: "
                + (
                    f"{count} lots of correlated noise, one release of "
                    f"{describe_event(release(sigma))}"
                    if mechanism is not None
                    else f"{count} {unit} of "
                    f"{describe_event(_release_event(sampler, per_unit * sigma))}"
                )
                + f"{f' after epsilon {spent:.4g} already spent' if prior else ''} reach "
                f"epsilon {eps:.4g} <= {target:g} at delta {delta:g} ({kind.value})"
            )

    def _begin_correlated_run(self, privacy_cb, delta: float) -> None:
        """Correlated noise: records the run's event before its first lot
        (refusing, with nothing recorded, a run that would exceed the fit's
        budget), and stops lots at the mechanism's horizon in the graph."""
        run = self._correlated
        if run is None:
            self.set_lot_limit(None, reason="mechanism")
            return
        event = self._sanitizer.event(max(self._groups) + 1)
        if not run.recorded:
            target = privacy_cb.target_epsilon
            if target is not None:
                trial = PrivacyLedger.from_dict(self.ledger.to_dict())
                trial.record(event, label="mf")
                kind = privacy_cb.accountant or self.ledger.accountant
                spent = trial.epsilon(delta, kind)
                if spent > target:
                    raise BudgetExceededError(
                        f"the correlated-noise run ({run.mechanism.describe()}) would bring "
                        f"epsilon to {spent:.4g} > target_epsilon={target:g} at delta="
                        f"{delta:g}; nothing was trained (raise noise_multiplier or train "
                        "fewer epochs)"
                    )
            self.ledger.record(event, label="mf")
            run.recorded = True
        self.set_lot_limit(self.lots_computed + run.remaining, reason="mechanism")

    def _set_steps_per_execution(self, lots_per_epoch: int) -> None:
        """Lots per call of the training function for this fit: the "auto"
        choice, or the integer given to `compile`, which must divide the
        epoch's lots (Keras runs whole calls: 4 lots per call over 6 lots an
        epoch would train 8 lots an epoch, more than asked) and be 1 under a
        distribution strategy.  Keras builds its evaluate and predict
        functions for the value in force when they are first traced (a
        predict function made for 1 step keeps one batch of every call), so
        a new value drops them too."""
        # a model made under a strategy's scope (any strategy, one replica too)
        distributed = (
            getattr(self, "_distribute_strategy", None) is not None or tf.distribute.has_strategy()
        )
        if getattr(self, "_auto_steps", False):
            steps = auto_steps_per_execution(
                lots_per_epoch, distributed=distributed or bool(self.run_eagerly)
            )
        else:
            steps = int(self.steps_per_execution or 1)
            if distributed and steps > 1:
                replicas = self.distribute_strategy.num_replicas_in_sync
                raise ValueError(
                    f"steps_per_execution must be 1 under a distribution strategy "
                    f"({replicas} replica{'s' if replicas > 1 else ''}), got {steps}: "
                    "TensorFlow cannot run the lot's loop over physical batches inside the "
                    "multi-step loop of replicated training (this mode is not supported, so "
                    "it is refused)"
                )
            if lots_per_epoch % steps:
                raise ValueError(
                    f"steps_per_execution={steps} does not divide the {lots_per_epoch} lots "
                    f"of an epoch: Keras would run {-(-lots_per_epoch // steps) * steps} lots "
                    f"an epoch. Compile with a divisor of {lots_per_epoch}, or 'auto' (the "
                    "default)"
                )
        if steps != self.steps_per_execution:
            self.test_function = self.predict_function = None
            self._eval_epoch_iterator = None
        self.steps_per_execution = steps

    def _adopt_restored_lots(self, stacklevel: int = 3) -> None:
        """Weights restored from elsewhere carry more lots than this model has
        computed (a weights-only checkpoint, BackupAndRestore in a new process):
        those lots were spent and are recorded now, with the current settings."""
        pending = self.lots_applied - self.lots_computed
        if pending <= 0:
            return
        warnings.warn(
            f"{pending} lots restored with the weights are recorded in the privacy ledger "
            f"as {describe_event(self._step_event)} (the settings of this fit): resume "
            "with the settings that produced them, or load the full .keras model, whose "
            "ledger keeps its own history",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
        if self._epoch_event is not None:
            # shuffle: the restored lots came from permutations of their own; they
            # are ceil(pending / lots per epoch) epochs, and this fit's lots start a
            # new epoch (one accounting epoch never straddles two permutations)
            self.ledger.record(
                self._epoch_event,
                math.ceil(pending / self._lots_per_epoch),
                label=self._ledger_label,
            )
            self._counters.set_computed(self.lots_applied)
            self._recorded_lots = self.lots_computed
            self._fit_start_lots = self.lots_computed
            self._recorded_epochs = 0
            return
        self._counters.set_computed(self.lots_applied)
        self._sync_ledger()

    def _no_lot_message(self, budget: PrivacyBudget) -> str:
        """Why `budget` allows no further release with this fit's settings: what
        one more costs under each accountant that can analyse it, and what to
        change (one line)."""
        from dpfl_tf.privacy.accountants import epsilon_by_accountant
        from dpfl_tf.privacy.calibration import calibrate_noise_multiplier

        unit = "epoch of shuffled lots" if self._epoch_event is not None else "lot"
        prior = [self.ledger.event] if len(self.ledger) else []
        step = self.ledger.admit(self._step_event)
        costs = epsilon_by_accountant(dp_accounting.ComposedDpEvent(prior + [step]), budget.delta)
        listed = ", ".join(f"{eps:.4g} ({kind.value})" for kind, eps in costs.items())
        cost = (
            (
                f"one more brings epsilon to {listed} (spent so far: "
                f"{self.ledger.epsilon(budget.delta, budget.accountant):.4g})"
            )
            if prior
            else f"one costs epsilon {listed}"
        )
        fits = sorted((eps, k.value) for k, eps in costs.items() if eps <= budget.epsilon)
        advice = (
            [f"fit(accountant={fits[0][1]!r}) (a tighter analysis of the same lots)"]
            if fits
            else []
        )
        sigma = self.optimizer.noise_multiplier
        num_groups = max(self._groups) + 1
        per_unit = self._sanitizer.effective_noise_multiplier(num_groups) / sigma if sigma else None
        if per_unit and not (
            prior and self.ledger.epsilon(budget.delta, budget.accountant) >= budget.epsilon
        ):
            try:
                needed, _ = calibrate_noise_multiplier(
                    budget.epsilon,
                    budget.delta,
                    lambda s: dp_accounting.ComposedDpEvent(
                        prior + [self.ledger.admit(_release_event(self.sampler, per_unit * s))]
                    ),
                    budget.accountant,
                )
                advice.append(f"noise_multiplier >= {needed:.3g} (now {sigma:g}) for one {unit}")
            except ValueError:
                pass
        advice.append(
            "noise_multiplier=None on the optimizer to calibrate it to "
            "target_epsilon over the planned epochs"
        )
        return (
            f"the privacy budget (epsilon={budget.epsilon:g}, delta={budget.delta:g}, "
            f"{budget.accountant.value}) allows no {unit} of {describe_event(step)}: "
            f"{cost}; nothing was trained. Use "
            + "; or ".join(advice)
            + "; or a larger target_epsilon"
        )

    @property
    def lot_event(self):
        """The event one lot of the current settings records (None before fit)."""
        return self._step_event

    def steps_within_budget(self, budget: PrivacyBudget, limit: int | None = None) -> int:
        """Lots the budget still allows with the current settings; with `limit`, at
        most about that many (at least min(allowed, limit)): a fit asks for no more
        than it can run, which a large budget answers in one evaluation."""
        self._sync_ledger()
        ledger = PrivacyLedger.from_dict({**self.ledger.to_dict(), "budget": budget.to_dict()})
        if self._correlated is not None:
            # the run's event is recorded already: the budget allows all its lots
            # (or none), and its horizon is a limit of its own ("mechanism")
            within = ledger.epsilon(budget.delta, budget.accountant) <= budget.epsilon
            return _UNLIMITED_BY_BUDGET if within else 0
        if self._epoch_event is not None:
            epoch_limit = None if limit is None else -(-limit // self._lots_per_epoch) + 1
            epochs = ledger.steps_within_budget(self._epoch_event, epoch_limit)
            done = self.lots_computed - self._fit_start_lots
            partial = done % self._lots_per_epoch
            # the current partial epoch is already recorded as a whole epoch
            return epochs * self._lots_per_epoch + (
                (self._lots_per_epoch - partial) if partial else 0
            )
        return ledger.steps_within_budget(self._step_event, limit)

    def train_step(self, data):
        x, y, mask, *segments = data  # user-level lots: the user slot of every example
        if segments:
            self._per_example.segments = segments[0]
        counters = self._counters
        variables = self.model.trainable_variables
        # The budget guard is a branch of the computation, not an assert (XLA drops
        # asserts): a lot at or beyond the limit is skipped -- its data is not read,
        # no noise is drawn, nothing is counted.
        allowed = counters.computed < counters.limit
        if tf.distribute.has_strategy():  # also with one replica: apply merges
            # Under a distribution strategy the optimizer's update is a
            # synchronisation point (its all-reduce; with one replica its
            # merge_call), which TensorFlow does not allow inside a branch
            # (and a branch around the lot breaks inside steps_per_execution's loop):
            # the lot is computed, then multiplied away -- a skipped lot releases a
            # zero gradient (no noise, nothing counted; weights move only by optimizer
            # state such as momentum, a function of earlier noised updates).
            gate = tf.cast(allowed, tf.float32)
            grads, loss_sum, count, dropped = self._dp_lot(x, y, mask, gate=gate)
            grads = [tf.where(allowed, g, tf.zeros_like(g)) for g in grads]
            dropped = dropped * tf.cast(allowed, tf.int64)
            self.optimizer.apply_noised_gradients(grads, variables)
        else:
            grads, loss_sum, count, dropped = tf.cond(
                allowed,
                lambda: self._dp_lot(x, y, mask),
                lambda: (
                    [tf.zeros(v.shape, v.dtype) for v in variables],
                    tf.constant(0.0),
                    tf.constant(0.0),
                    tf.constant(0, tf.int64),
                ),
            )
            tf.cond(allowed, lambda: self._apply(grads, variables), lambda: tf.constant(False))
        step = tf.cast(allowed, tf.int64)
        with tf.control_dependencies(grads):
            counters.dropped.assign_add(dropped)
            counters.computed.assign_add(step)
            self._lots_applied.assign_add(step)
        if not self._log_metrics:  # only the (public) count of lots released
            return self._step_outputs({"lots": tf.identity(counters.computed)})
        self._loss_tracker.update_state(loss_sum / tf.maximum(count, 1.0), sample_weight=count)
        return self._step_outputs(self.get_metrics_result())

    def test_step(self, data):
        return self._step_outputs(super().test_step(data))

    def _step_outputs(self, logs):
        """A step's logs as Keras reduces them across replicas.  Under a
        MultiWorkerMirroredStrategy Keras 3 averages each log over the cluster
        with ``reduce(MEAN, axis=0)``, which a scalar does not have (every
        ``fit`` fails, keras-team/keras#20585): there each log is a vector of
        one value, and the average of these is the scalar (metric values are
        all-reduced, so equal on every replica)."""
        if not is_multi_worker(self.distribute_strategy):
            return logs
        return tf.nest.map_structure(lambda t: tf.reshape(t, [1]) if t.shape.rank == 0 else t, logs)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        """Keras 3 builds metrics from one input batch, which under a
        MultiWorkerMirroredStrategy it first reduces across the cluster as a
        whole (x, y, mask) structure -- which that strategy cannot
        (keras-team/keras#20585).  Only the batch's shapes are used: take this
        worker's first replica's share instead (no collective)."""
        strategy = self.distribute_strategy
        if iterator is not None and data_batch is None and is_multi_worker(strategy):
            for _, _, it in iterator:
                data_batch = tf.nest.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0], next(it)
                )
                break
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _build_state_before_tracing(self, element_spec) -> None:
        """Creates the optimizer's slots and the compiled metrics' variables now,
        from the shapes of a lot and of the model's output.  Without a
        distribution strategy Keras 3 leaves both to the first trace of the
        training step, and a `tf.function` that creates variables is traced a
        second time: every fit paid two traces of the per-example step (about a
        third of a small model's first fit).  The slots are built as Keras's
        `Optimizer.apply` builds them (an optimizer with an `apply` of its own
        builds them there); a model whose output cannot be computed
        symbolically builds its metrics in the trace (Keras's way)."""
        if self._distribute_strategy is not None or tf.distribute.has_strategy():
            return  # Keras's symbolic build makes them, under the strategy
        inner = getattr(self.optimizer, "inner_optimizer", None)
        if (
            inner is not None
            and not inner.built
            and type(inner).apply is keras.optimizers.Optimizer.apply
        ):
            with keras.name_scope(inner.name, caller=inner):
                inner.build(self.model.trainable_variables)
            inner.built = True
        metrics = self._compile_metrics
        if metrics is None or metrics.built:
            return
        try:  # DPModel.call on placeholders, as Keras's own symbolic build runs it
            x, y = tf.nest.map_structure(
                lambda s: keras.KerasTensor(s.shape, s.dtype.name), tuple(element_spec[:2])
            )
            metrics.build(y, self.compute_output_spec(x, training=False))
        except Exception:  # built in the first trace instead
            return

    def train_on_batch(self, *args, **kwargs):
        raise NotImplementedError(
            "DPModel.train_on_batch is not supported: a lot must be sampled by the DP "
            "sampler; use fit(x, y, lot_size=...) (the privacy analysis assumes its lots)"
        )

    def get_metrics_result(self):
        if not self._log_metrics and not getattr(self, "_evaluating", False):
            return {}  # fit(log_train_metrics=False): nothing computed on the lots
        return super().get_metrics_result()

    def evaluate(self, *args, **kwargs):
        """`keras.Model.evaluate`; its metrics are reported also inside a fit
        that logs no training metrics (its validation data)."""
        outer, self._evaluating = getattr(self, "_evaluating", False), True
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._evaluating = outer

    def _apply(self, grads, variables):
        self.optimizer.apply_noised_gradients(grads, variables)
        return tf.constant(True)

    def _dp_lot(self, x, y, mask, gate=None):
        """One lot (`LotStep`: clip and accumulate, add noise, scale) with this
        fit's settings; returns (noised gradient / L, loss sum, examples kept,
        examples dropped).  Lot t draws noise at stream position t."""
        lot = LotStep(
            self.model.trainable_variables,
            self._per_example,
            self._sanitizer,
            self._groups,
            batch_size=self._batch_size,
            expected_lot=self._expected_lot,
            pad_to_batch=self._pad_to_batch,
            update_metrics=self._update_metrics if self._log_metrics else None,
        )
        return lot(x, y, mask, step=self._counters.computed, gate=gate)

    def _update_metrics(self, y, y_pred, kept) -> None:
        """The compiled metrics of a physical batch's kept rows (`kept`: 1 for an
        example of the lot whose loss is finite, 0 for a padding row, a row of a
        skipped lot or a dropped example).  Keras passes a sample weight to its
        `weighted_metrics` only (its `metrics` count every row given), and `fit`
        takes no sample weights of its own, so every compiled metric gets `kept`
        as its weight here.  The rows not kept are zeroed first: a metric weighs
        its values by multiplying, and a dropped example's NaN times 0 is NaN."""
        metrics = self._compile_metrics
        if metrics is None:
            return
        keep = kept > 0

        def zero_dropped(t):
            t = tf.convert_to_tensor(t)
            shape = tf.concat([tf.shape(keep), tf.ones([t.shape.rank - 1], tf.int32)], 0)
            return tf.where(tf.reshape(keep, shape), t, tf.zeros_like(t))

        y, y_pred = tf.nest.map_structure(zero_dropped, (y, y_pred))
        if not metrics.built:
            metrics.build(y, y_pred)
        flat = getattr(metrics, "_flat_metrics", None)
        weighted = getattr(metrics, "_flat_weighted_metrics", None)
        if flat is None or weighted is None:  # another Keras: its own rule
            metrics.update_state(y, y_pred, sample_weight=kept)
            return
        y_true, y_pred = metrics._flatten_y(y), metrics._flatten_y(y_pred)
        for group in (flat, weighted):
            for m, y_t, y_p in zip(group, y_true, y_pred):
                if m:
                    m.update_state(y_t, y_p, sample_weight=kept)

    # -- serialisation ----------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        try:
            self._sync_ledger()
        except RuntimeError:
            pass  # settings unknown: keep the ledger as recorded
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.model),
            "fast_gradients": self.fast_gradients,
            "ledger": self.ledger.to_dict(),
            "recorded_lots": self._recorded_lots,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects
        )
        return cls(model, **config)

    def summary_privacy(self, delta: float = 1e-5) -> str:
        ledger = self.privacy_ledger
        lines = [
            f"lots computed (released): {self.lots_computed}; behind the current "
            f"weights: {self.lots_applied}; examples dropped as non-finite: "
            f"{self.dropped_examples}"
        ]
        lines += [f"  {e['count']} x {e['event']}" for e in ledger.entries]
        lines.append(
            f"epsilon = {ledger.epsilon(delta):.4f} at delta = {delta:g} "
            f"({ledger.accountant.value})"
        )
        return "\n".join(lines)


class _Counters:
    """Monotonic lot and drop counters, kept outside the Keras weights (so that
    no weight rollback moves them) and outside Keras tracking.

    ``computed`` and ``limit`` are the same on every replica (first replica's
    value); ``dropped`` is summed over replicas when read."""

    def __init__(self, computed: int = 0):
        self._initial = int(computed)
        self._limit_value = _NO_LIMIT
        self.computed = self.limit = self.dropped = None
        self._strategy = None

    def create(self, strategy) -> None:
        if self.computed is not None and self._strategy is strategy:
            return
        initial = self.computed_value() if self.computed is not None else self._initial
        dropped = self.dropped_value() if self.dropped is not None else 0
        first = tf.VariableAggregation.ONLY_FIRST_REPLICA
        with strategy.scope():
            self.computed = tf.Variable(
                initial, dtype=tf.int64, trainable=False, aggregation=first, name="dp_lots_computed"
            )
            self.limit = tf.Variable(
                self._limit_value,
                dtype=tf.int64,
                trainable=False,
                aggregation=first,
                name="dp_lot_limit",
            )
            self.dropped = tf.Variable(
                dropped,
                dtype=tf.int64,
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
                name="dp_dropped_examples",
            )
        self._strategy = strategy

    def computed_value(self) -> int:
        return self._initial if self.computed is None else int(self.computed.numpy())

    def dropped_value(self) -> int:
        return 0 if self.dropped is None else int(self.dropped.numpy())

    def set_computed(self, value: int) -> None:
        if self.computed is None:
            self._initial = int(value)
        else:
            self.computed.assign(int(value))

    def set_limit(self, value: int) -> None:
        self._limit_value = int(value)
        if self.limit is not None:
            self.limit.assign(self._limit_value)


def _release_event(sampler: LotSampler, sigma_eff: float):
    """What one release of this sampling records: a lot (Poisson, fixed size,
    full batch) or an epoch of shuffled lots, noised at `sigma_eff`."""
    if sampler.sampling is SamplingMethod.SHUFFLE:
        return shuffle_epoch_event(sigma_eff)
    if sigma_eff == 0:
        return dp_accounting.NonPrivateDpEvent()
    return gaussian_step_event(sigma_eff, sampler.sampling, **sampler.sampling_args())


_UNLIMITED_BY_BUDGET = 10**8  # as `max_steps`' limit


def _cycle_length(optimizer, sampling) -> int | None:
    """Cyclic Poisson lots cycle over the banded strategy's bands."""
    if SamplingMethod.parse(sampling) is not SamplingMethod.CYCLIC_POISSON:
        return None
    config = getattr(optimizer, "correlated_noise", None)
    if config is None or config.bands is None:
        raise ValueError(
            "sampling='cyclic_poisson' needs a DP optimizer with "
            "correlated_noise=CorrelatedNoiseConfig('banded', bands=b) (b is the "
            f"cycle length), got correlated_noise={config!r}"
        )
    return config.bands


def _refuse_regularizers(model) -> None:
    """Regularisation losses are not part of the per-example loss that is clipped
    and noised (an activity regulariser even depends on the data): refuse them
    rather than drop them silently."""
    for layer in _leaf_layers(model):
        for attr_name in (
            "kernel_regularizer",
            "bias_regularizer",
            "embeddings_regularizer",
            "activity_regularizer",
            "depthwise_regularizer",
            "pointwise_regularizer",
            "recurrent_regularizer",
            "beta_regularizer",
            "gamma_regularizer",
        ):
            if getattr(layer, attr_name, None) is not None:
                raise ValueError(
                    f"layer {layer.name!r} has {attr_name}={getattr(layer, attr_name)!r}: "
                    "DPModel clips and noises the per-example loss only, so a regularisation "
                    "loss would be silently ignored. For weight decay use the inner "
                    "optimizer's weight_decay= (it acts on the weights, not the data); "
                    "remove activity regularisers"
                )


def _accounts(event, delta: float, kind) -> bool:
    from dpfl_tf.privacy.accountants import compute_epsilon

    try:
        compute_epsilon(event, delta, kind)
        return True
    except Exception:
        return False


def _check_input_shape(model, reader, check_shape: bool = True) -> None:
    """A clear error, before any lot is drawn, when (single-input models, no
    `preprocess` that may reshape) the per-example shape of the data does not
    match the model's input."""
    if not check_shape:
        return
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return  # subclassed model: no declared input
    leaves, _ = reader.element_shapes()
    if not inputs or len(inputs) != 1 or len(leaves) != 1:
        return
    want, got = tuple(inputs[0].shape[1:]), tuple(leaves[0])
    if len(want) != len(got) or any(w is not None and w != g for w, g in zip(want, got)):
        raise ValueError(f"x has per-example shape {got} but the model takes {want}")
