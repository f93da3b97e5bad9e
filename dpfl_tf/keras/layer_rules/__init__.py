"""Per-layer rules for per-example gradient norms and clipped sums.

One module per layer family; each registers a `LayerRule` for its Keras
classes.  A rule is looked up by the layer's exact type, then along its MRO,
but never by inheritance alone: a subclass that overrides a method the rule
reimplements (`LayerRule.reimplements`, at least `call`) computes another
function and gets no rule from its parent.  A trainable layer without a rule
(or whose rule refuses its configuration) uses `PerLayerJacobianRule`, exact
for any differentiable layer but slower.
Register a rule for your own layer with one call::

    from dpfl_tf.keras.layer_rules import register_rule
    register_rule(MyLayer, MyRule())

The design follows Opacus's ``opacus/grad_sample/`` (one file per layer) and
tensorflow-privacy's ``fast_gradient_clipping/registry_functions/``.
"""

import importlib.util

from dpfl_tf.keras.layer_rules import (
    conv,
    dense,
    einsum_dense,
    embedding,
    lora,
    normalization,
    recurrent,
    reversible_embedding,
)
from dpfl_tf.keras.layer_rules._base import (
    LayerCall,
    LayerRule,
    Taps,
    VariableGradients,
    find_rule,
    ghost_norm_is_smaller,
    kept,
    materialised,
    original_call,
    outer_gradients,
    register_rule,
    register_when_imported,
    scaled,
    stopped,
    unregister_rule,
    watched,
    weighted_sum,
)
from dpfl_tf.keras.layer_rules.fallback import FALLBACK, PerLayerJacobianRule

if importlib.util.find_spec("keras_hub") is not None:  # the [hub] extra
    from dpfl_tf.keras.layer_rules import keras_hub as _keras_hub

    # registered once keras_hub is imported: KerasHub (with TensorFlow Text) takes
    # ~0.5 s to import, which a model without its layers need not pay
    register_when_imported("keras_hub", _keras_hub.register)

__all__ = [
    "LayerRule",
    "Taps",
    "LayerCall",
    "VariableGradients",
    "register_rule",
    "register_when_imported",
    "unregister_rule",
    "find_rule",
    "kept",
    "scaled",
    "weighted_sum",
    "stopped",
    "materialised",
    "outer_gradients",
    "ghost_norm_is_smaller",
    "original_call",
    "watched",
    "PerLayerJacobianRule",
    "FALLBACK",
]
