"""Model architectures used by the paper's experiments and their successors."""

from __future__ import annotations

import keras

__all__ = ["mlp", "tanh_cnn", "cifar_convnet"]


def mlp(input_dim: int = 60, hidden: int = 1000, classes: int = 10,
        activation: str = "relu") -> keras.Model:
    """Abadi et al. 2016, section 5.2: (PCA input) -> Dense(hidden, ReLU) -> softmax.
    Returns logits (use a from_logits loss)."""
    return keras.Sequential([keras.Input((input_dim,)),
                             keras.layers.Dense(hidden, activation=activation, name="hidden"),
                             keras.layers.Dense(classes, name="logits")], name="mnist_mlp")


def tanh_cnn(input_shape=(28, 28, 1), classes: int = 10) -> keras.Model:
    """The small CNN of Papernot et al. 2021 ("Tempered sigmoid activations for
    deep learning with differential privacy"): tanh activations bound the
    gradients that DP-SGD clips.  Conv 16x8x8/2, max-pool 2/1, conv 32x4x4/2,
    max-pool 2/1, dense 32, logits."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input(input_shape),
        layers.Conv2D(16, 8, strides=2, padding="same", activation="tanh"),
        layers.MaxPooling2D(2, strides=1),
        layers.Conv2D(32, 4, strides=2, padding="valid", activation="tanh"),
        layers.MaxPooling2D(2, strides=1),
        layers.Flatten(),
        layers.Dense(32, activation="tanh"),
        layers.Dense(classes)], name="tanh_cnn")


def cifar_convnet(input_shape=(24, 24, 3), classes: int = 10) -> keras.Model:
    """Abadi et al. 2016, section 5.3: two 5x5x64 conv + 2x2 max-pool layers,
    Dense 384, Dense 384, logits."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input(input_shape),
        layers.Conv2D(64, 5, padding="same", activation="relu", name="conv1"),
        layers.MaxPooling2D(2, name="pool1"),
        layers.Conv2D(64, 5, padding="same", activation="relu", name="conv2"),
        layers.MaxPooling2D(2, name="pool2"),
        layers.Flatten(name="flatten"),
        layers.Dense(384, activation="relu", name="fc1"),
        layers.Dense(384, activation="relu", name="fc2"),
        layers.Dense(classes, name="logits")], name="cifar_convnet")
