"""The model-zoo fuzzer (experiments/fuzz_models.py) on a small seeded set:
every model `fit` accepts trains exactly (one noiseless lot against a
per-example GradientTape loop) or is refused with a clear error before any lot
is applied.  Models whose wrong result the library's coming refusals address
(a Dense subclass overriding `call`, a layer or loss mixing the batch) are
expected failures until then.  The long run is the experiment itself."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

# what XLA and TensorFlow compile here stays until the process ends (+0.4 GB in a
# whole-suite worker): the file runs in a process of its own (tests/isolation.py)
pytestmark = pytest.mark.isolated

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
if str(ROOT / "experiments") not in sys.path:  # as when the script runs (its _common)
    sys.path.insert(0, str(ROOT / "experiments"))
_spec = importlib.util.spec_from_file_location(
    "fuzz_models", ROOT / "experiments" / "fuzz_models.py"
)
fuzz = sys.modules["fuzz_models"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

# chosen to cover every feature of the generator: tied heads, LoRA, KerasHub layers,
# masks, reuse, sub-models, subclassed models, custom layers, mixed precision,
# physical batches, the generic path, refusals (BatchNormalization, a scalar loss)
SEEDS = [0, 2, 3, 4, 5, 7, 10, 11, 12, 17, 19, 20, 23, 34, 41, 60, 89]


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzzed_model_trains_exactly_or_is_refused(seed):
    row = fuzz.run_case(seed)
    if row["outcome"] in ("WRONG", "CRASH") and row["expected_fix"]:
        pytest.xfail(f"{row['outcome']}, to be fixed by: {row['expected_fix']}")
    assert row["outcome"] in ("exact", "refused"), row
    if row["outcome"] == "refused":
        assert row["weights_unchanged"] and row["ledger_empty"], row
        assert len(row["message"]) > 40, row  # says what is wrong, not only a type
    else:
        assert row["error"] <= row["tolerance"]
        assert row["plan"], row


def test_the_generator_is_seeded():
    a, b = fuzz.generate(20), fuzz.generate(20)
    assert a.description == b.description
    for v, w in zip(a.model.trainable_variables, b.model.trainable_variables):
        np.testing.assert_array_equal(v, w)
    np.testing.assert_array_equal(a.y, b.y)
    assert fuzz.generate(21).description != a.description


def test_a_wrong_rule_is_caught():
    # a rule that halves the clipped sum of the custom Gate layer (seed 89
    # uses it): the fuzzer must say WRONG
    from dpfl_tf.keras import layer_rules

    gate = fuzz._custom_layers()[0]

    class HalvedRule(layer_rules.PerLayerJacobianRule):
        def gradients(self, layer, calls):
            return [
                (
                    v,
                    layer_rules.VariableGradients(
                        g.sq_norms, lambda c, g=g: 0.5 * g.clipped_sum(c)
                    ),
                )
                for v, g in super().gradients(layer, calls)
            ]

    layer_rules.register_rule(gate, HalvedRule())
    try:
        row = fuzz.run_case(89)
    finally:
        layer_rules.unregister_rule(gate)
    assert "custom_layer" in row["features"]
    assert row["outcome"] == "WRONG" and row["error"] > 1e-3, row
