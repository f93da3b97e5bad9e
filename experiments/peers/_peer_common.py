"""What the peer benchmark scripts share: the DP-SGD settings, the data
recipes, the checks of their run arguments, and how a run is timed and
written.

    from _peer_common import ...   # in experiments/peers/*.py, run as scripts

Standard library and numpy only: the tensorflow-privacy scripts import it
under TensorFlow 2.15 / Keras 2, the Opacus ones under PyTorch, and
experiments/benchmark_layers.py takes the layers benchmark's architecture and
data recipe from it under current TensorFlow, so that every framework trains
on the same numbers.  It must not import the project's own package.
"""

import json
import os
import resource
import statistics
import sys

import numpy as np

# DP-SGD settings of every peer (as experiments/benchmark_dpsgd.py and
# experiments/benchmark_layers.py: CLIP, NOISE, LR)
L2_NORM_CLIP = 4.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 0.05

# ---------------------------------------------------------------------------
# the MNIST / CIFAR-10 benchmark (experiments/benchmark_dpsgd.py; peers
# opacus_benchmark.py and tfp_benchmark.py)

MNIST_FEATURES = 60
CIFAR_SHAPE = (24, 24, 3)  # generated NHWC
NUM_CLASSES = 10


def find_mnist(explicit):
    """mnist.npz: `explicit`, else in $DPFL_DATA_DIR, ../shared/data beside the
    repository, ~/.keras/datasets (the first that exists)."""
    here = os.path.dirname(os.path.abspath(__file__))
    repo_root = os.path.dirname(os.path.dirname(here))
    candidates = []
    if explicit:
        candidates.append(explicit)
    if os.environ.get("DPFL_DATA_DIR"):
        candidates.append(os.path.join(os.environ["DPFL_DATA_DIR"], "mnist.npz"))
    candidates.append(os.path.join(os.path.dirname(repo_root), "shared", "data", "mnist.npz"))
    candidates.append(os.path.expanduser("~/.keras/datasets/mnist.npz"))
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        "mnist.npz not found; looked in: "
        + ", ".join(candidates)
        + " (pass --mnist-path or set DPFL_DATA_DIR)"
    )


def benchmark_data(model_name, examples, mnist_path, nchw=False):
    """Float32 features, int64 labels and their description.

    mnist_mlp: the first `examples` MNIST training images / 255, flattened,
    times a fixed N(0, 1) 784 x MNIST_FEATURES matrix; the CIFAR models:
    uniform [0, 1) images of CIFAR_SHAPE and random labels, generated NHWC
    (transposed to NCHW for PyTorch with `nchw`).  numpy default_rng(0)."""
    if model_name == "mnist_mlp":
        path = find_mnist(mnist_path)
        with np.load(path) as data:
            images = data["x_train"][:examples]
            labels = data["y_train"][:examples]
        if len(images) < examples:
            raise ValueError(f"{path} has only {len(images)} training rows")
        flat = images.reshape(examples, -1).astype(np.float32) / 255.0
        projection = (
            np.random.default_rng(0)
            .standard_normal((flat.shape[1], MNIST_FEATURES))
            .astype(np.float32)
        )
        features = (flat @ projection).astype(np.float32)
        desc = (
            f"first {examples} MNIST train rows from {path}, /255, "
            f"flattened, times a fixed N(0,1) 784x{MNIST_FEATURES} matrix "
            f"(numpy default_rng(0))"
        )
    else:
        rng = np.random.default_rng(0)
        features = rng.uniform(0.0, 1.0, size=(examples,) + CIFAR_SHAPE).astype(np.float32)
        labels = rng.integers(0, NUM_CLASSES, size=examples)
        if nchw:
            features = np.ascontiguousarray(features.transpose(0, 3, 1, 2))
        layout = "generated NHWC, transposed to NCHW" if nchw else "NHWC"
        desc = (
            f"{examples} random uniform [0,1) images {CIFAR_SHAPE} "
            f"({layout}) and random labels (numpy default_rng(0))"
        )
    return features, labels.astype(np.int64), desc


# ---------------------------------------------------------------------------
# the layers benchmark (experiments/benchmark_layers.py; peers
# opacus_layers.py and tfp_layers.py): architecture and data

VOCAB, SEQ_LEN, WIDTH, HEADS, FFN, BLOCKS = 20_000, 128, 128, 4, 256, 2
CONV_FILTERS, CONV_KERNEL, CONV_STRIDE, CONV_DENSE = 128, 7, 3, 128
LSTM_UNITS = 128
RESNET_STAGES, RESNET_BLOCKS, GN_GROUPS, IMAGE = (16, 32, 64), 3, 8, (32, 32, 3)
TEXT_CLASSES, IMAGE_CLASSES = 2, 10


def layers_data(model_name, n, token_dtype=np.int32, nchw=False):
    """Synthetic inputs, int64 labels and their description (the content of
    a token or a pixel does not change the cost of a step).

    resnet20_gn: `n` uniform [0, 1) float32 images of IMAGE, generated NHWC
    (transposed to NCHW for PyTorch with `nchw`), IMAGE_CLASSES random labels;
    the text models: `n` sequences of SEQ_LEN token ids of `token_dtype`,
    Zipf-like (p ~ 1 / rank) over 1 .. VOCAB - 1 (id 0, padding, is never
    drawn), TEXT_CLASSES random labels.  numpy default_rng(0)."""
    rng = np.random.default_rng(0)
    if model_name == "resnet20_gn":
        x = rng.uniform(0.0, 1.0, size=(n,) + IMAGE).astype(np.float32)
        y = rng.integers(0, IMAGE_CLASSES, n).astype(np.int64)
        if nchw:
            x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        return (
            x,
            y,
            f"{n} uniform [0,1) images {IMAGE} (NHWC{', fed as NCHW' if nchw else ''}),"
            f" random labels (numpy default_rng(0))",
        )
    p = 1.0 / np.arange(1, VOCAB)
    x = 1 + rng.choice(VOCAB - 1, size=(n, SEQ_LEN), p=p / p.sum())
    y = rng.integers(0, TEXT_CLASSES, n).astype(np.int64)
    return (
        x.astype(token_dtype),
        y,
        f"{n} sequences of {SEQ_LEN} tokens, Zipf-like (p ~ 1/rank) over ids "
        f"1..{VOCAB - 1}, random labels (numpy default_rng(0))",
    )


def positions():
    """The transformer's fixed sinusoidal positions, [SEQ_LEN, WIDTH] float32."""
    pos = np.arange(SEQ_LEN)[:, None]
    i = np.arange(WIDTH // 2)[None, :]
    angle = pos / np.power(10_000.0, 2 * i / WIDTH)
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=-1).astype(np.float32)


# ---------------------------------------------------------------------------
# a run: its arguments, limits, timing and result file


def check_run_args(parser, args, required=()):
    """The checks every peer makes of its parsed arguments; `parser.error`
    (exit status 2) names the first that fails: the `required` options,
    --epochs >= 2 (the first is warm-up), --repeats >= 1, --max-steps >= 0
    where the script has it, 1 <= --lot-size <= --examples."""
    missing = [name for name in required if getattr(args, name) is None]
    if missing:
        parser.error(
            "missing required arguments: " + ", ".join("--" + m.replace("_", "-") for m in missing)
        )
    if args.epochs < 2:
        parser.error("--epochs must be >= 2 (the first epoch is warm-up)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if getattr(args, "max_steps", 0) < 0:
        parser.error("--max-steps must be >= 0 (0 = whole epochs)")
    if args.lot_size < 1 or args.examples < args.lot_size:
        parser.error("need 1 <= --lot-size <= --examples")


def make_private(
    model,
    optimizer,
    criterion,
    loader,
    *,
    ghost,
    noise_multiplier,
    max_grad_norm,
    poisson_sampling=True,
):
    """Opacus's ``PrivacyEngine().make_private`` in ghost-clipping mode (`ghost`,
    which wraps the loss in DPLossFastGradientClipping) or with per-sample hooks:
    (engine, model, optimizer, criterion, loader), the criterion unchanged in
    hooks mode."""
    from opacus import PrivacyEngine  # pylint: disable=import-outside-toplevel

    engine = PrivacyEngine()
    made = engine.make_private(
        module=model,
        optimizer=optimizer,
        criterion=criterion,
        data_loader=loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        poisson_sampling=poisson_sampling,
        grad_sample_mode="ghost" if ghost else "hooks",
    )
    if ghost:
        model, optimizer, criterion, loader = made
    else:
        model, optimizer, loader = made
    return engine, model, optimizer, criterion, loader


def limit_address_space(gigabytes):
    """RLIMIT_AS of this process, so that an over-large configuration fails
    with an out-of-memory error instead of exhausting the machine (0: none)."""
    if gigabytes and gigabytes > 0:
        limit = int(gigabytes * 1024**3)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def peak_memory_mb():
    """This process's peak resident memory so far, in MB (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def record_repeat(repeat, times, warmup, timed):
    """One repeat's epoch times: the first to `warmup`, the others to `timed`
    (in place), and all on stderr."""
    warmup.append(times[0])
    timed.extend(times[1:])
    print(
        f"repeat {repeat}: warm-up {times[0]:.3f}s, epochs "
        + ", ".join(f"{t:.3f}s" for t in times[1:]),
        file=sys.stderr,
    )


def run_guarded(train, *args, describe=None):
    """Calls ``train(*args)``; returns None, or the error it raised in one line
    (``describe(exc)``; default its type and the first 1,500 characters of its
    message), also printed on stderr.  A failed configuration is a result too:
    typically out of memory for per-example gradients."""
    try:
        train(*args)
    except Exception as exc:  # pylint: disable=broad-except
        error = (
            describe(exc) if describe is not None else f"{type(exc).__name__}: {str(exc)[:1500]}"
        )
        print("FAILED: " + error, file=sys.stderr)
        return error
    return None


def median_seconds(timed, error):
    """The row's seconds per epoch: the median of its timed epochs, None for a
    failed run."""
    return statistics.median(timed) if timed and error is None else None


def write_result(path, result):
    """`result` as indented JSON at `path` (its directory made)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
        handle.write("\n")


def finish(path, result, error):
    """Writes the result (with its error, if any), prints its summary line and
    returns the exit status: 0, or 3 for a failed run."""
    if error is not None:
        result["error"] = error
    write_result(path, result)
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("model", "implementation", "seconds_per_epoch", "peak_memory_mb")
            }
        )
    )
    return 0 if error is None else 3
