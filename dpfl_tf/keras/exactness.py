"""Check a model's per-example gradients against a brute-force loop.

DP-SGD's sensitivity argument needs, for every example i, the exact gradient
g_i = d loss_i / d w and the clipped sum sum_i g_i min(1, C / ||g_i||).
`compare` computes them twice -- with `PerExampleGradients` (the per-layer rules
and their fallbacks, as `DPModel.fit` does) and with one `GradientTape` per
example -- and returns the relative errors and the plan (which rule each layer
used).  Use it on a few examples of your own model before training::

    report = compare(model, x[:8], y[:8], loss)
    assert report.error <= 1e-5, report

`fit_error` checks the whole training step instead: one `DPModel.fit` lot
without noise against the brute-force clipped update.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from dpfl_tf.keras.per_example import PerExampleGradients, per_example_loss, plan_layers

__all__ = [
    "Report",
    "compare",
    "fit_error",
    "fit_once",
    "noiseless_step",
    "plan",
    "reference_gradients",
    "relative_change",
]


def _row(x, i):
    return tf.nest.map_structure(lambda t: tf.convert_to_tensor(t)[i : i + 1], x)


def _call(model, x):
    return model(x, training=True)


def reference_gradients(model, x, y, loss_fn) -> list:
    """Per-example gradients, a list per example of one array per variable
    (float64), from one GradientTape per example."""
    _call(model, _row(x, 0))  # builds a subclassed model's variables
    variables = model.trainable_variables
    out = []
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            li = tf.reduce_sum(per_example_loss(loss_fn, y[i : i + 1], _call(model, _row(x, i))))
        grads = tape.gradient(li, variables)
        out.append(
            [
                np.zeros(v.shape) if g is None else np.asarray(tf.convert_to_tensor(g), np.float64)
                for g, v in zip(grads, variables)
            ]
        )
    return out


def plan(model, per_example: PerExampleGradients | None = None) -> list:
    """[(layer path, layer class, rule class)] of the tapped layers, then the
    layers moved to the whole-model Jacobian (weight used elsewhere) and the
    variables no layer rule covers."""
    excluded = per_example.excluded_layers if per_example is not None else ()
    rows = [
        (layer.path, type(layer).__name__, type(rule).__name__)
        for layer, rule in plan_layers(model, frozenset(id(e) for e in excluded)).values()
    ]
    rows += [(layer.path, type(layer).__name__, "whole-model Jacobian") for layer in excluded]
    planned = {
        id(v)
        for layer, _ in plan_layers(model, frozenset(id(e) for e in excluded)).values()
        for v in layer.trainable_variables
    }
    rows += [
        (v.path, "variable", "whole-model Jacobian")
        for v in model.trainable_variables
        if id(v) not in planned
    ]
    return rows


@dataclasses.dataclass
class Report:
    """Relative errors of the fast path against the per-example loop:
    `norm_error` max_i | ||g_i|| - ||r_i|| | / ||r_i||; `sum_error` and
    `clipped_error` ||S - R|| / ||R|| of the summed and clipped-sum gradients
    (all variables together); `error` the largest of the three."""

    norm_error: float
    sum_error: float
    clipped_error: float
    clip: float
    plan: list

    @property
    def error(self) -> float:
        return max(self.norm_error, self.sum_error, self.clipped_error)


def _fast(per_example, x, y, clip):
    norms = []  # the squared norms per variable, as the clipping rule sees them

    def factors(sq):
        norms.extend(np.asarray(s, np.float64) for s in sq)
        total = tf.sqrt(tf.add_n(sq))
        one = tf.ones_like(total) if clip is None else clip / tf.maximum(total, clip)
        return [one] * len(sq)

    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    sums = per_example.compute(x, tf.convert_to_tensor(y), tf.ones(len(y)), factors)[0]
    return [np.asarray(s, np.float64) for s in sums], norms


def _relative(a: list, b: list) -> float:
    diff = np.sqrt(sum(np.sum((p - q) ** 2) for p, q in zip(a, b)))
    ref = np.sqrt(sum(np.sum(q**2) for q in b))
    return float(diff / ref) if ref > 0 else float(diff)


def compare(model, x, y, loss_fn, clip: float | None = None, **kwargs) -> Report:
    """Norms, sum and clipped sum of `PerExampleGradients(model, loss_fn,
    **kwargs)` against `reference_gradients`; `clip` defaults to the median
    reference norm (about half the examples clipped)."""
    y = np.asarray(y)
    ref = reference_gradients(model, x, y, loss_fn)
    ref_norms = np.array([np.sqrt(sum(np.sum(g**2) for g in r)) for r in ref])
    if clip is None:
        clip = float(np.median(ref_norms)) or 1.0
    per_example = PerExampleGradients(model, loss_fn, **kwargs)
    sums, sq = _fast(per_example, x, y, None)
    norms = np.sqrt(np.sum(sq, axis=0))
    norm_error = float(np.max(np.abs(norms - ref_norms) / np.maximum(ref_norms, 1e-30)))
    sum_error = _relative(sums, [sum(r[j] for r in ref) for j in range(len(sums))])
    clipped, _ = _fast(per_example, x, y, clip)
    factors = np.minimum(1.0, clip / np.maximum(ref_norms, 1e-30))
    expected = [sum(f * r[j] for f, r in zip(factors, ref)) for j in range(len(sums))]
    return Report(
        norm_error, sum_error, _relative(clipped, expected), clip, plan(model, per_example)
    )


def noiseless_step(model, x, y, loss_fn, clip: float | None = None) -> tuple:
    """(expected weight change, clip, learning rate) of one DP-SGD lot without
    noise over all of (x, y): -lr / B sum_i g_i min(1, C / ||g_i||), with g_i
    from `reference_gradients`.  `clip` defaults to the median reference norm;
    lr makes the step as large as the weights (so float32 rounding of the
    weights neither hides nor fakes an error)."""
    y = np.asarray(y)
    n = len(y)
    ref = reference_gradients(model, x, y, loss_fn)
    norms = np.array([np.sqrt(sum(np.sum(g**2) for g in r)) for r in ref])
    if clip is None:
        clip = float(np.median(norms)) or 1.0
    factors = np.minimum(1.0, clip / np.maximum(norms, 1e-30))
    step = [sum(f * r[j] for f, r in zip(factors, ref)) / n for j in range(len(ref[0]))]
    weights = np.sqrt(
        sum(np.sum(np.asarray(w, np.float64) ** 2) for w in model.trainable_variables)
    )
    size = np.sqrt(sum(np.sum(s**2) for s in step))
    learning_rate = float(weights / size) if size and weights else 1.0
    return [-learning_rate * s for s in step], clip, learning_rate


def fit_once(
    dp,
    x,
    y,
    loss_fn,
    clip: float,
    learning_rate: float,
    batch_size: int | None = None,
    **compile_kwargs,
):
    """Compiles the `DPModel` dp with a noiseless `DPSGD` and fits one lot over
    all of (x, y) (``sampling="full_batch"``); returns dp."""
    from dpfl_tf.keras.optimizers import DPSGD

    dp.compile(
        optimizer=DPSGD(learning_rate, l2_norm_clip=clip, noise_multiplier=0.0),
        loss=loss_fn,
        **compile_kwargs,
    )
    dp.fit(x, y, lot_size=len(y), batch_size=batch_size, epochs=1, sampling="full_batch", verbose=0)
    return dp


def fit_error(model, x, y, loss_fn, clip: float | None = None, **fit_kwargs) -> tuple:
    """(relative error, clip) of one noiseless `fit_once` step of
    ``DPModel(model)`` against `noiseless_step`."""
    from dpfl_tf.keras.model import DPModel

    expected, clip, learning_rate = noiseless_step(model, x, y, loss_fn, clip)
    before = [np.asarray(v, np.float64) for v in model.trainable_variables]
    fit_once(DPModel(model), x, y, loss_fn, clip, learning_rate, **fit_kwargs)
    return relative_change(model, before, expected), clip


def relative_change(model, before: list, expected: list) -> float:
    """||(w - before) - expected|| / ||expected|| over the trainable weights."""
    moved = [np.asarray(v, np.float64) - b for v, b in zip(model.trainable_variables, before)]
    return _relative(moved, expected)
