"""Model builders: several views of each example, and the ScatterNet models."""

import keras
import numpy as np
import pytest

from dpfl_tf.models import SelectView, scatter_cnn, scatter_linear, view_averaged


def _views(n=5, shape=(8, 8, 6), seed=0):
    return np.random.default_rng(seed).normal(size=(n, 2, *shape)).astype("float32")


def test_a_linear_head_over_views_is_the_linear_model_on_their_mean():
    keras.utils.set_random_seed(0)
    model = scatter_linear((8, 8, 6), normalization=keras.layers.Identity(), views=2)
    x = _views()
    dense = model.get_layer("scatter_linear").get_layer("logits")
    kernel, bias = (np.asarray(w) for w in dense.weights)
    expected = x.mean(axis=1).reshape(len(x), -1) @ kernel + bias
    np.testing.assert_allclose(model(x).numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [scatter_linear, scatter_cnn])
def test_the_model_cannot_tell_the_order_of_the_views(build):
    keras.utils.set_random_seed(1)
    model = build((8, 8, 6), groups=3, views=2)
    x = _views(seed=1)
    np.testing.assert_allclose(model(x).numpy(), model(x[:, ::-1]).numpy(), rtol=1e-5, atol=1e-6)
    # ... but it does see both: changing one view changes the logits
    y = x.copy()
    y[:, 1] += np.random.default_rng(3).normal(size=y[:, 1].shape).astype("float32")
    assert not np.allclose(model(x).numpy(), model(y).numpy(), atol=1e-3)
    assert model.output_shape == (None, 10) and model.input_shape == (None, 2, 8, 8, 6)


def test_one_view_is_the_head_itself_and_bad_counts_are_refused():
    head = scatter_cnn((8, 8, 6), groups=3)
    assert view_averaged(head, 1) is head
    assert head.input_shape == (None, 8, 8, 6)
    with pytest.raises(ValueError, match="views must be"):
        view_averaged(head, 0)
    with pytest.raises(ValueError, match="index must be a whole number >= 0, got -1"):
        SelectView(-1)
    assert SelectView(np.int64(1)).index == 1
    a, b = keras.Input((3,)), keras.Input((3,))
    with pytest.raises(ValueError, match="head must be a built model with one input"):
        view_averaged(keras.Model([a, b], keras.layers.Add()([a, b])), 2)


def test_a_model_over_views_saves_and_loads_with_its_frozen_normalisation(tmp_path):
    keras.utils.set_random_seed(2)
    norm = keras.layers.Normalization(
        axis=-1,
        mean=np.arange(6, dtype="float32"),
        variance=np.full(6, 4.0, "float32"),
        name="feature_norm",
    )
    model = scatter_cnn((8, 8, 6), normalization=norm, channels=4, views=2)
    x = _views(seed=2)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6, atol=1e-6)
    assert [layer.index for layer in loaded.layers if isinstance(layer, SelectView)] == [0, 1]
