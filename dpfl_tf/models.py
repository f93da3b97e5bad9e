"""Model architectures used by the paper's experiments and their successors."""

from __future__ import annotations

import keras

__all__ = ["mlp", "tanh_cnn", "cifar_convnet", "conv_net", "pnpm_cnn"]


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


def conv_net(input_shape=(28, 28, 1), classes: int = 10, *, filters=(16, 32, 64),
             kernel_size: int = 3, padding: str = "same", dense=(32,),
             activation: str = "relu", name: str = "conv_net") -> keras.Model:
    """Conv(f, k x k) + 2x2 max-pool for each f in `filters`, then Dense layers
    of `dense` units, then logits.  A 2-D `input_shape` (H, W) gets a channel
    axis added in the model."""
    layers = keras.layers
    stack = [keras.Input(tuple(input_shape))]
    if len(input_shape) == 2:
        stack.append(layers.Reshape((*input_shape, 1)))
    for f in filters:
        stack += [layers.Conv2D(int(f), kernel_size, padding=padding, activation=activation),
                  layers.MaxPooling2D(2)]
    stack.append(layers.Flatten())
    stack += [layers.Dense(int(u), activation=activation) for u in dense]
    stack.append(layers.Dense(classes))
    return keras.Sequential(stack, name=name)


def pnpm_cnn(input_shape=(28, 28, 1), classes: int = 10, *, depth: int = 3) -> keras.Model:
    """The CNNs of the PNPM local-DP experiments (Ren et al. 2022), rebuilt from
    their weight counts (kernels only, biases not counted):

    * ``depth=2`` (MNIST): conv 10 and 20 filters 5x5 'valid', each + max-pool,
      Dense 50, logits -- 250 + 5,000 + 16,000 + 500 = 21,750 kernel weights.
    * ``depth=3`` (Fashion-MNIST, CIFAR-10): conv 16, 32, 64 filters 3x3
      'same', each + max-pool, Dense 32, logits -- 41,936 kernel weights on
      28x28x1 and 56,560 on 32x32x3.
    """
    if depth == 2:
        return conv_net(input_shape, classes, filters=(10, 20), kernel_size=5,
                        padding="valid", dense=(50,), name="pnpm_cnn2")
    if depth == 3:
        return conv_net(input_shape, classes, filters=(16, 32, 64), kernel_size=3,
                        padding="same", dense=(32,), name="pnpm_cnn3")
    raise ValueError(f"depth must be 2 or 3, got {depth!r}")
