"""Model architectures used by the paper's experiments and their successors."""

from __future__ import annotations

import random
from typing import Callable

import keras

from dpfl_tf._validation import check_count

__all__ = [
    "mlp",
    "tanh_cnn",
    "cifar_convnet",
    "conv_net",
    "pnpm_cnn",
    "scatter_linear",
    "scatter_cnn",
    "view_averaged",
    "SelectView",
    "glorot_uniform_kernels",
]


def glorot_uniform_kernels(seed: int | None) -> Callable[[], keras.initializers.Initializer]:
    """The Glorot-uniform kernel initializers of a model, one per call, in the order
    the model constructs its layers, seeded as ``keras.utils.set_random_seed(seed)``
    followed by the build would seed them (Keras 3 gives an unseeded initializer
    ``random.randint(1, 10**9)`` from Python's global `random`:
    ``keras.src.random.seed_generator.make_default_seed``), but from a private
    ``random.Random(seed)``.  The weights are the same, but no other thread drawing
    from the global `random` between two layers (Flower's heartbeat jitter, its
    SecAgg+ workflow) can change them.  ``seed=None``: Keras's own draw."""
    stream = None if seed is None else random.Random(int(seed))

    def kernel() -> keras.initializers.Initializer:
        return keras.initializers.GlorotUniform(
            seed=None if stream is None else stream.randint(1, int(1e9))
        )

    return kernel


def mlp(
    input_dim: int = 60, hidden: int = 1000, classes: int = 10, activation: str = "relu"
) -> keras.Model:
    """Abadi et al. 2016, section 5.2: (PCA input) -> Dense(hidden, ReLU) -> softmax.
    Returns logits (use a from_logits loss)."""
    return keras.Sequential(
        [
            keras.Input((input_dim,)),
            keras.layers.Dense(hidden, activation=activation, name="hidden"),
            keras.layers.Dense(classes, name="logits"),
        ],
        name="mnist_mlp",
    )


def tanh_cnn(input_shape=(28, 28, 1), classes: int = 10) -> keras.Model:
    """The small CNN of Papernot et al. 2021 ("Tempered sigmoid activations for
    deep learning with differential privacy"): tanh activations bound the
    gradients that DP-SGD clips.  Conv 16x8x8/2, max-pool 2/1, conv 32x4x4/2,
    max-pool 2/1, dense 32, logits."""
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input(input_shape),
            layers.Conv2D(16, 8, strides=2, padding="same", activation="tanh"),
            layers.MaxPooling2D(2, strides=1),
            layers.Conv2D(32, 4, strides=2, padding="valid", activation="tanh"),
            layers.MaxPooling2D(2, strides=1),
            layers.Flatten(),
            layers.Dense(32, activation="tanh"),
            layers.Dense(classes),
        ],
        name="tanh_cnn",
    )


def cifar_convnet(input_shape=(24, 24, 3), classes: int = 10) -> keras.Model:
    """Abadi et al. 2016, section 5.3: two 5x5x64 conv + 2x2 max-pool layers,
    Dense 384, Dense 384, logits."""
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input(input_shape),
            layers.Conv2D(64, 5, padding="same", activation="relu", name="conv1"),
            layers.MaxPooling2D(2, name="pool1"),
            layers.Conv2D(64, 5, padding="same", activation="relu", name="conv2"),
            layers.MaxPooling2D(2, name="pool2"),
            layers.Flatten(name="flatten"),
            layers.Dense(384, activation="relu", name="fc1"),
            layers.Dense(384, activation="relu", name="fc2"),
            layers.Dense(classes, name="logits"),
        ],
        name="cifar_convnet",
    )


def conv_net(
    input_shape=(28, 28, 1),
    classes: int = 10,
    *,
    filters=(16, 32, 64),
    kernel_size: int = 3,
    padding: str = "same",
    dense=(32,),
    activation: str = "relu",
    name: str = "conv_net",
    seed: int | None = None,
) -> keras.Model:
    """Conv(f, k x k) + 2x2 max-pool for each f in `filters`, then Dense layers
    of `dense` units, then logits.  A 2-D `input_shape` (H, W) gets a channel
    axis added in the model.  `seed`: the kernels of `glorot_uniform_kernels`
    (None: Keras's global random state)."""
    layers = keras.layers
    kernel = glorot_uniform_kernels(seed)
    stack = [keras.Input(tuple(input_shape))]
    if len(input_shape) == 2:
        stack.append(layers.Reshape((*input_shape, 1)))
    for f in filters:
        stack += [
            layers.Conv2D(
                int(f),
                kernel_size,
                padding=padding,
                activation=activation,
                kernel_initializer=kernel(),
            ),
            layers.MaxPooling2D(2),
        ]
    stack.append(layers.Flatten())
    stack += [
        layers.Dense(int(u), activation=activation, kernel_initializer=kernel()) for u in dense
    ]
    stack.append(layers.Dense(classes, kernel_initializer=kernel()))
    return keras.Sequential(stack, name=name)


def pnpm_cnn(
    input_shape=(28, 28, 1), classes: int = 10, *, depth: int = 3, seed: int | None = None
) -> keras.Model:
    """The CNNs of the PNPM local-DP experiments (Ren et al. 2022), rebuilt from
    their weight counts (kernels only, biases not counted):

    * ``depth=2`` (MNIST): conv 10 and 20 filters 5x5 'valid', each + max-pool,
      Dense 50, logits -- 250 + 5,000 + 16,000 + 500 = 21,750 kernel weights.
    * ``depth=3`` (Fashion-MNIST, CIFAR-10): conv 16, 32, 64 filters 3x3
      'same', each + max-pool, Dense 32, logits -- 41,936 kernel weights on
      28x28x1 and 56,560 on 32x32x3.

    `seed`: as for `conv_net`.
    """
    if depth == 2:
        return conv_net(
            input_shape,
            classes,
            filters=(10, 20),
            kernel_size=5,
            padding="valid",
            dense=(50,),
            name="pnpm_cnn2",
            seed=seed,
        )
    if depth == 3:
        return conv_net(
            input_shape,
            classes,
            filters=(16, 32, 64),
            kernel_size=3,
            padding="same",
            dense=(32,),
            name="pnpm_cnn3",
            seed=seed,
        )
    raise ValueError(f"depth must be 2 or 3, got {depth!r}")


# -- several views of each example ------------------------------------------


@keras.saving.register_keras_serializable(package="dpfl_tf")
class SelectView(keras.layers.Layer):
    """``x[:, index]``: view `index` of examples given as [batch, views, ...]."""

    def __init__(self, index: int, **kwargs):
        super().__init__(**kwargs)
        self.index = check_count("index", index, minimum=0)

    def call(self, x):
        return x[:, self.index]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], *input_shape[2:])

    def get_config(self):
        return {**super().get_config(), "index": self.index}


def view_averaged(head: keras.Model, views: int, name: str | None = None) -> keras.Model:
    """A model on examples given as `views` views, [batch, views, *view_shape]:
    `head` runs on every view with the same weights and the logits are averaged,

        f(x) = (1 / V) sum_v head(x_v).

    f does not depend on the order of the views, so with views (image, mirror
    image) it gives an image and its mirror image the same logits: for a linear
    head, a linear model on the mean of the two views' features.  On CIFAR-10's
    ScatterNet features the same DP-SGD noise then buys more accuracy (README).

    Privacy: the unit is still one example, with all its views.  Its gradient
    is the sum over the views' uses of the shared weights, and DP-SGD clips
    that sum once (a layer called V times: `dpfl_tf.keras.per_example`), so the
    sensitivity and the accounting do not change."""
    views = check_count("views", views, minimum=1)
    if views == 1:
        return head
    if not isinstance(head.input_shape, tuple) or not all(
        isinstance(d, (int, type(None))) for d in head.input_shape
    ):
        raise ValueError(
            f"head must be a built model with one input, got input_shape {head.input_shape!r}"
        )
    inputs = keras.Input((views, *head.input_shape[1:]), name="views")
    logits = [head(SelectView(v, name=f"view_{v}")(inputs)) for v in range(views)]
    return keras.Model(
        inputs, keras.layers.Average(name="average")(logits), name=name or f"{head.name}_x{views}"
    )


# -- Tramer & Boneh 2021's models on ScatterNet features ----------------------


def _input_normalisation(normalization, groups: int):
    """The model's first layer: a given (frozen) layer, or per-example
    GroupNormalization(groups) without parameters (costs no privacy)."""
    if normalization is not None:
        return normalization
    return keras.layers.GroupNormalization(groups, center=False, scale=False, name="group_norm")


def scatter_linear(
    input_shape=(7, 7, 81),
    classes: int = 10,
    *,
    groups: int = 27,
    normalization=None,
    views: int = 1,
) -> keras.Model:
    """Tramer & Boneh 2021's ScatterNet + linear model, on precomputed
    scattering features (`dpfl_tf.scattering`): an input normalisation,
    Flatten, Dense logits (the only trainable layer).

    input_shape: the features of one view (H', W', K).
    normalization: a frozen Keras layer, e.g. the DP-released channel
      statistics of `dpfl_tf.normalization.DPFeatureNormalization.layer()`
      (their CIFAR-10 setting); None is GroupNormalization(groups) without
      parameters, each example's channel groups normalised to zero mean and unit
      variance -- per example, so it costs no privacy (their Fashion-MNIST
      setting).
    views: > 1 takes [views, H', W', K] per example and averages the logits
      over the views (`view_averaged`): with the features of an image and of
      its mirror image, a linear model on their mean."""
    layers = keras.layers
    head = keras.Sequential(
        [
            keras.Input(tuple(input_shape)),
            _input_normalisation(normalization, groups),
            layers.Flatten(name="flatten"),
            layers.Dense(classes, name="logits"),
        ],
        name="scatter_linear",
    )
    return view_averaged(head, views)


def scatter_cnn(
    input_shape=(8, 8, 243),
    classes: int = 10,
    *,
    groups: int = 27,
    normalization=None,
    channels: int = 64,
    views: int = 1,
) -> keras.Model:
    """Tramer & Boneh 2021's ScatterNet + CNN for CIFAR-10 scattering features
    (8x8xK): the input normalisation (as `scatter_linear`), Conv 3x3 `channels`
    tanh, MaxPool 2, Conv 3x3 `channels` tanh, Flatten, Dense logits; `views`
    as `scatter_linear`."""
    layers = keras.layers
    head = keras.Sequential(
        [
            keras.Input(tuple(input_shape)),
            _input_normalisation(normalization, groups),
            layers.Conv2D(channels, 3, padding="same", activation="tanh", name="conv1"),
            layers.MaxPooling2D(2, name="pool1"),
            layers.Conv2D(channels, 3, padding="same", activation="tanh", name="conv2"),
            layers.Flatten(name="flatten"),
            layers.Dense(classes, name="logits"),
        ],
        name="scatter_cnn",
    )
    return view_averaged(head, views)
