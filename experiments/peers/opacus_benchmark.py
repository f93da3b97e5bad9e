#!/usr/bin/env python3
"""Speed benchmark of Opacus (peer library) DP-SGD on CPU PyTorch.

Run with the interpreter of the separate Opacus environment (torch 2.13.0 CPU,
opacus 1.6.0), e.g.

    /work/peer_envs/opacus/bin/python experiments/peers/opacus_benchmark.py \
        --model mnist_mlp --implementation opacus \
        --examples 6000 --lot-size 600 --epochs 3 --repeats 3 \
        --output results/opacus_mnist_mlp.json

One configuration is measured per process, so the reported peak resident
memory belongs to that configuration alone.  Every repeat builds a fresh
model / optimizer / PrivacyEngine and trains it for ``--epochs`` epochs; the
first epoch of each repeat is a warm-up and is not timed.

The models and data recipes match experiments/peers/tfp_benchmark.py (the
data from _peer_common.benchmark_data, the images generated NHWC as there and
transposed to NCHW).
This file is standalone but for _peer_common.py beside it: it must not import
the project's own package.
"""

import argparse
import platform
import sys
import time

import numpy as np
from _peer_common import (
    L2_NORM_CLIP,
    LEARNING_RATE,
    MNIST_FEATURES,
    NOISE_MULTIPLIER,
    NUM_CLASSES,
    benchmark_data,
    check_run_args,
    finish,
    limit_address_space,
    make_private,
    median_seconds,
    peak_memory_mb,
    record_repeat,
    run_guarded,
)

MODELS = ("mnist_mlp", "cifar_frozen_conv", "cifar_full_conv")

IMPLEMENTATIONS = {
    "nonprivate": "plain PyTorch SGD loop, shuffled batches of lot size",
    "opacus": (
        "opacus PrivacyEngine.make_private, grad_sample_mode='hooks' "
        "(per-sample gradients), Poisson sampling (default)"
    ),
    "opacus_ghost": (
        "extra: opacus PrivacyEngine.make_private with grad_sample_mode="
        "'ghost' (ghost / fast gradient clipping), Poisson sampling"
    ),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--implementation", choices=sorted(IMPLEMENTATIONS))
    parser.add_argument(
        "--examples", type=int, default=6000, help="number of training examples (default 6000)"
    )
    parser.add_argument(
        "--lot-size", type=int, default=600, help="lot size = expected Poisson batch (default 600)"
    )
    parser.add_argument(
        "--epochs", type=int, default=3, help="epochs per repeat, the first is warm-up (>= 2)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="fresh model builds, each trained --epochs epochs"
    )
    parser.add_argument("--output", help="path of the JSON result file")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument(
        "--mnist-path",
        default=None,
        help="mnist.npz; default: $DPFL_DATA_DIR, "
        "../shared/data next to the repo, ~/.keras/datasets",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-memory-gb",
        type=float,
        default=16.0,
        help="address-space limit (RLIMIT_AS) so that an "
        "over-large configuration fails with an OOM "
        "error instead of exhausting the machine; "
        "0 = no limit (default 16)",
    )
    parser.add_argument(
        "--list-implementations", action="store_true", help="print implementation names and exit"
    )
    args = parser.parse_args(argv)
    if not args.list_implementations:
        check_run_args(parser, args, required=("model", "implementation", "output"))
    return args


# --------------------------------------------------------------------------
# PyTorch side
# --------------------------------------------------------------------------


def build_model(nn, model_name):
    if model_name == "mnist_mlp":
        return nn.Sequential(
            nn.Linear(MNIST_FEATURES, 1000),
            nn.ReLU(),
            nn.Linear(1000, NUM_CLASSES),
        )
    model = nn.Sequential(
        nn.Conv2d(3, 64, kernel_size=5, stride=1, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, kernel_size=5, stride=1, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(6 * 6 * 64, 384),
        nn.ReLU(),
        nn.Linear(384, 384),
        nn.ReLU(),
        nn.Linear(384, NUM_CLASSES),
    )
    if model_name == "cifar_frozen_conv":
        for module in (model[0], model[3]):
            for param in module.parameters():
                param.requires_grad_(False)
    return model


def run_repeats(torch, args, features, labels, warmup, timed, extra):
    """Trains args.repeats fresh models; appends epoch times in place."""
    from torch import nn  # pylint: disable=import-outside-toplevel
    from torch.utils.data import DataLoader, TensorDataset  # pylint: disable=import-outside-toplevel

    dataset = TensorDataset(torch.from_numpy(features), torch.from_numpy(labels))
    private = args.implementation != "nonprivate"
    for repeat in range(args.repeats):
        torch.manual_seed(args.seed + repeat)
        model = build_model(nn, args.model)
        criterion = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE
        )
        generator = torch.Generator().manual_seed(args.seed + repeat)
        loader = DataLoader(
            dataset, batch_size=args.lot_size, shuffle=True, drop_last=False, generator=generator
        )
        extra["trainable_parameters"] = int(
            sum(p.numel() for p in model.parameters() if p.requires_grad)
        )
        if private:
            mode = "ghost" if args.implementation == "opacus_ghost" else "hooks"
            engine, model, optimizer, criterion, loader = make_private(
                model,
                optimizer,
                criterion,
                loader,
                ghost=mode == "ghost",
                noise_multiplier=NOISE_MULTIPLIER,
                max_grad_norm=L2_NORM_CLIP,
            )
            extra.update(
                {
                    "grad_sample_mode": mode,
                    "poisson_sampling": True,
                    "sample_rate": getattr(loader, "sample_rate", None),
                    "expected_batch_size": getattr(optimizer, "expected_batch_size", None),
                    "clipping": "flat",
                    "accountant": engine.accountant.mechanism(),
                    "optimizer_class": type(optimizer).__module__ + "." + type(optimizer).__name__,
                    "model_wrapper": type(model).__module__ + "." + type(model).__name__,
                }
            )
        model.train()
        times, batch_sizes = [], []
        for _ in range(args.epochs):
            start = time.perf_counter()
            sizes = []
            for inputs, targets in loader:
                optimizer.zero_grad(set_to_none=True)
                loss = criterion(model(inputs), targets)
                loss.backward()
                optimizer.step()
                sizes.append(len(targets))
            times.append(time.perf_counter() - start)
            batch_sizes.append(sizes)
        record_repeat(repeat, times, warmup, timed)
        extra.setdefault("steps_per_epoch", len(batch_sizes[-1]))
        extra.setdefault("batch_sizes_seen", []).extend(b for sizes in batch_sizes for b in sizes)
        del model, optimizer, loader


def main(argv=None):
    args = parse_args(argv)
    if args.list_implementations:
        for name, desc in IMPLEMENTATIONS.items():
            print(f"{name}\t{desc}")
        return 0

    limit_address_space(args.max_memory_gb)
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    import torch  # pylint: disable=import-outside-toplevel

    torch.set_num_threads(args.threads)
    features, labels, data_desc = benchmark_data(
        args.model, args.examples, args.mnist_path, nchw=True
    )

    warmup, timed, extra = [], [], {}
    error = run_guarded(run_repeats, torch, args, features, labels, warmup, timed, extra)

    peak_mb = peak_memory_mb()
    sizes = extra.pop("batch_sizes_seen", [])
    private = args.implementation != "nonprivate"
    settings = {
        "l2_norm_clip": L2_NORM_CLIP if private else None,
        "noise_multiplier": NOISE_MULTIPLIER if private else None,
        "learning_rate": LEARNING_RATE,
        "batch_size": args.lot_size,
        "sampling": (
            "Poisson (opacus DPDataLoader, sample_rate = lot/N); batch sizes vary"
            if private
            else "DataLoader(shuffle=True, batch_size=lot)"
        ),
        "batch_size_min_mean_max": (
            [min(sizes), float(np.mean(sizes)), max(sizes)] if sizes else None
        ),
        "epochs_per_repeat": args.epochs,
        "repeats": args.repeats,
        "timed_epochs": len(timed),
        "warmup_epoch_seconds": warmup,
        "loss": "CrossEntropyLoss (mean)",
        "data": data_desc,
        "threads": args.threads,
        "torch_num_threads": torch.get_num_threads(),
        "seed": args.seed,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "max_memory_gb": args.max_memory_gb or None,
    }
    settings.update(extra)
    result = {
        "model": args.model,
        "implementation": args.implementation,
        "library": "opacus",
        "library_version": metadata.version("opacus"),
        "seconds_per_epoch": median_seconds(timed, error),
        "epoch_seconds": timed,
        "peak_memory_mb": peak_mb,
        "examples": args.examples,
        "lot_size": args.lot_size,
        "settings": settings,
    }
    return finish(args.output, result, error)


if __name__ == "__main__":
    sys.exit(main())
