#!/usr/bin/env python3
"""Opacus (peer library) on the model families of the layers issue, CPU PyTorch.

Run with the interpreter of the separate Opacus environment (torch 2.13.0 CPU,
opacus 1.6.0); experiments/benchmark_layers.py calls it once per
configuration, e.g.

    /work/peer_envs/opacus/bin/python experiments/peers/opacus_layers.py \
        --model transformer --implementation opacus_ghost \
        --examples 25000 --lot-size 256 --epochs 4 --repeats 1 \
        --output /tmp/opacus_transformer_ghost.json

One configuration is measured per process, so the reported peak resident
memory belongs to that configuration alone.  Every repeat builds a fresh
model / optimizer / PrivacyEngine and trains it for ``--epochs`` epochs; the
first epoch of each repeat is a warm-up and is not timed.

The architectures, sizes and the numpy data recipe are those of
experiments/benchmark_layers.py (Keras), layer for layer (the constants and
the data from _peer_common.py, which both import):

  transformer   Embedding + fixed sinusoidal positions, 2 post-LN blocks of
                multi-head self-attention (separate q/k/v/output nn.Linear with
                bias, as Keras's MultiHeadAttention's EinsumDense layers),
                LayerNorm, Linear FFN; mean pooling; Linear(2)
  conv1d_text   Embedding, Conv1d(128, 7, stride 3) x 2, ReLU, global max,
                Linear(128), Linear(2)
  resnet20_gn   ResNet-20, GroupNorm(8), 1x1 projection shortcuts, 32x32x3
                (generated NHWC as in Keras, fed as NCHW)
  lstm          Embedding, LSTM(128) (nn.LSTM without privacy; opacus's
                DPLSTM for Opacus, which cannot take nn.LSTM), Linear(2).
                PyTorch's LSTM has two bias vectors (b_ih, b_hh), Keras's one:
                512 more parameters.

This file is standalone but for _peer_common.py beside it: it must not import
the project's own package.
"""

import argparse
import math
import os
import platform
import sys
import time

import numpy as np

# the architecture of experiments/benchmark_layers.py, every constant (SEQ_LEN too)
from _peer_common import (  # noqa: F401
    BLOCKS,
    CONV_DENSE,
    CONV_FILTERS,
    CONV_KERNEL,
    CONV_STRIDE,
    FFN,
    GN_GROUPS,
    HEADS,
    IMAGE,
    IMAGE_CLASSES,
    L2_NORM_CLIP,
    LEARNING_RATE,
    LSTM_UNITS,
    NOISE_MULTIPLIER,
    RESNET_BLOCKS,
    RESNET_STAGES,
    SEQ_LEN,
    TEXT_CLASSES,
    VOCAB,
    WIDTH,
    check_run_args,
    finish,
    layers_data,
    limit_address_space,
    make_private,
    median_seconds,
    peak_memory_mb,
    positions,
    record_repeat,
    run_guarded,
)

MODELS = ("transformer", "conv1d_text", "resnet20_gn", "lstm")

IMPLEMENTATIONS = {
    "nonprivate": "plain PyTorch SGD loop, shuffled batches of lot size",
    "opacus": (
        "opacus PrivacyEngine.make_private, grad_sample_mode='hooks' "
        "(per-sample gradients), Poisson sampling (default)"
    ),
    "opacus_ghost": (
        "opacus PrivacyEngine.make_private, grad_sample_mode='ghost' "
        "(ghost / fast gradient clipping), Poisson sampling"
    ),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--implementation", choices=sorted(IMPLEMENTATIONS), required=True)
    parser.add_argument("--examples", type=int, default=25_000)
    parser.add_argument(
        "--lot-size", type=int, default=256, help="lot size = expected Poisson batch (default 256)"
    )
    parser.add_argument(
        "--epochs", type=int, default=4, help="epochs per repeat, the first is warm-up (>= 2)"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="time only the first N lots of each epoch and scale the time "
        "to the whole epoch (0 = whole epochs); for the DP modes "
        "whose full-size epochs take up to an hour",
    )
    parser.add_argument("--output", required=True, help="path of the JSON result file")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 2,
        help="torch.set_num_threads (default: all cores, as TensorFlow)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-memory-gb",
        type=float,
        default=20.0,
        help="address-space limit (RLIMIT_AS) so that an over-large "
        "configuration fails with an out-of-memory error instead of "
        "exhausting the machine; 0 = no limit (default 20)",
    )
    args = parser.parse_args(argv)
    check_run_args(parser, args)
    return args


def make_data(model_name, n):
    """_peer_common.layers_data: int64 token ids (PyTorch's), images NCHW."""
    return layers_data(model_name, n, token_dtype=np.int64, nchw=True)


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def build_model(torch, model_name, private):
    nn = torch.nn
    F = torch.nn.functional

    class Attention(nn.Module):
        """Keras MultiHeadAttention: q/k/v/output projections with bias."""

        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

        def forward(self, x):
            b, s, _ = x.shape
            heads = [
                t(x).view(b, s, HEADS, WIDTH // HEADS).transpose(1, 2)
                for t in (self.q, self.k, self.v)
            ]
            scores = heads[0] @ heads[1].transpose(-1, -2) / math.sqrt(WIDTH // HEADS)
            out = (scores.softmax(-1) @ heads[2]).transpose(1, 2).reshape(b, s, WIDTH)
            return self.o(out)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = Attention()
            self.norm1 = nn.LayerNorm(WIDTH, eps=1e-5)
            self.fc1, self.fc2 = nn.Linear(WIDTH, FFN), nn.Linear(FFN, WIDTH)
            self.norm2 = nn.LayerNorm(WIDTH, eps=1e-5)

        def forward(self, x):
            x = self.norm1(x + self.attention(x))
            return self.norm2(x + self.fc2(F.relu(self.fc1(x))))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(VOCAB, WIDTH)
            self.register_buffer("positions", torch.from_numpy(positions()))
            self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
            self.head = nn.Linear(WIDTH, TEXT_CLASSES)

        def forward(self, tokens):
            x = self.blocks(self.embedding(tokens) + self.positions)
            return self.head(x.mean(dim=1))

    class ConvText(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(VOCAB, WIDTH)
            self.conv1 = nn.Conv1d(WIDTH, CONV_FILTERS, CONV_KERNEL, stride=CONV_STRIDE)
            self.conv2 = nn.Conv1d(CONV_FILTERS, CONV_FILTERS, CONV_KERNEL, stride=CONV_STRIDE)
            self.fc = nn.Linear(CONV_FILTERS, CONV_DENSE)
            self.head = nn.Linear(CONV_DENSE, TEXT_CLASSES)

        def forward(self, tokens):
            x = self.embedding(tokens).transpose(1, 2)
            x = F.relu(self.conv2(F.relu(self.conv1(x))))
            return self.head(F.relu(self.fc(x.amax(dim=-1))))

    class LSTMText(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(VOCAB, WIDTH)
            if private:
                from opacus.layers import DPLSTM  # pylint: disable=import-outside-toplevel

                self.lstm = DPLSTM(WIDTH, LSTM_UNITS, batch_first=True)
            else:
                self.lstm = nn.LSTM(WIDTH, LSTM_UNITS, batch_first=True)
            self.head = nn.Linear(LSTM_UNITS, TEXT_CLASSES)

        def forward(self, tokens):
            _, (h, _) = self.lstm(self.embedding(tokens))
            return self.head(h[-1])

    def conv_gn(cin, cout, stride):
        return [
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
            nn.GroupNorm(GN_GROUPS, cout, eps=1e-5),
        ]

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(
                *conv_gn(cin, cout, stride), nn.ReLU(), *conv_gn(cout, cout, 1)
            )
            self.shortcut = (
                nn.Identity()
                if stride == 1 and cin == cout
                else nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                    nn.GroupNorm(GN_GROUPS, cout, eps=1e-5),
                )
            )

        def forward(self, x):
            return F.relu(self.body(x) + self.shortcut(x))

    class ResNet20(nn.Module):
        def __init__(self):
            super().__init__()
            layers = [*conv_gn(IMAGE[-1], RESNET_STAGES[0], 1), nn.ReLU()]
            cin = RESNET_STAGES[0]
            for stage, cout in enumerate(RESNET_STAGES):
                for block in range(RESNET_BLOCKS):
                    layers.append(BasicBlock(cin, cout, 2 if stage > 0 and block == 0 else 1))
                    cin = cout
            self.features = nn.Sequential(*layers)
            self.head = nn.Linear(cin, IMAGE_CLASSES)

        def forward(self, x):
            return self.head(self.features(x).mean(dim=(2, 3)))

    return {
        "transformer": Transformer,
        "conv1d_text": ConvText,
        "lstm": LSTMText,
        "resnet20_gn": ResNet20,
    }[model_name]()


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def run_repeats(torch, args, features, labels, warmup, timed, extra):
    """Trains args.repeats fresh models; appends epoch times in place."""
    from torch.utils.data import DataLoader, TensorDataset  # pylint: disable=import-outside-toplevel

    dataset = TensorDataset(torch.from_numpy(features), torch.from_numpy(labels))
    private = args.implementation != "nonprivate"
    for repeat in range(args.repeats):
        torch.manual_seed(args.seed + repeat)
        model = build_model(torch, args.model, private)
        criterion = torch.nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        generator = torch.Generator().manual_seed(args.seed + repeat)
        loader = DataLoader(dataset, batch_size=args.lot_size, shuffle=True, generator=generator)
        extra["trainable_parameters"] = int(
            sum(p.numel() for p in model.parameters() if p.requires_grad)
        )
        if private:
            mode = "ghost" if args.implementation == "opacus_ghost" else "hooks"
            _, model, optimizer, criterion, loader = make_private(
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
                    "clipping": "flat",
                    "optimizer_class": type(optimizer).__name__,
                    "model_wrapper": type(model).__name__,
                }
            )
        model.train()
        times, sizes = [], []
        lots_per_epoch = len(loader)
        for _ in range(args.epochs):
            start, steps = time.perf_counter(), 0
            for inputs, targets in loader:
                optimizer.zero_grad(set_to_none=True)
                loss = criterion(model(inputs), targets)
                loss.backward()
                optimizer.step()
                sizes.append(len(targets))
                steps += 1
                if args.max_steps and steps >= args.max_steps:
                    break
            # a partial epoch (--max-steps) is scaled to the epoch's lots
            times.append((time.perf_counter() - start) * lots_per_epoch / steps)
        extra["lots_per_epoch"] = lots_per_epoch
        record_repeat(repeat, times, warmup, timed)
        extra["batch_size_min_mean_max"] = [min(sizes), float(np.mean(sizes)), max(sizes)]
        del model, optimizer, loader


def main(argv=None):
    args = parse_args(argv)
    limit_address_space(args.max_memory_gb)
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    import torch  # pylint: disable=import-outside-toplevel

    torch.set_num_threads(args.threads)
    features, labels, data_desc = make_data(args.model, args.examples)
    warmup, timed, extra = [], [], {}
    error = run_guarded(run_repeats, torch, args, features, labels, warmup, timed, extra)

    private = args.implementation != "nonprivate"
    settings = {
        "l2_norm_clip": L2_NORM_CLIP if private else None,
        "noise_multiplier": NOISE_MULTIPLIER if private else None,
        "learning_rate": LEARNING_RATE,
        "optimizer": "SGD",
        "sampling": (
            "Poisson (opacus DPDataLoader, sample_rate = lot/N)"
            if private
            else "DataLoader(shuffle=True, batch_size=lot)"
        ),
        "epochs_per_repeat": args.epochs,
        "repeats": args.repeats,
        "timed_lots_per_epoch": args.max_steps or "all (whole epochs)",
        "epoch_seconds_are": (
            "the time of the first --max-steps lots x lots per epoch / --max-steps"
            if args.max_steps
            else "measured whole epochs"
        ),
        "warmup_epoch_seconds": warmup,
        "loss": "CrossEntropyLoss (mean)",
        "data": data_desc,
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
        "library": "opacus" if private else "torch",
        "library_version": metadata.version("opacus") if private else torch.__version__,
        "seconds_per_epoch": median_seconds(timed, error),
        "epoch_seconds": timed,
        "warmup_seconds": warmup,
        "peak_memory_mb": peak_memory_mb(),
        "examples": args.examples,
        "lot_size": args.lot_size,
        "settings": settings,
    }
    return finish(args.output, result, error)


if __name__ == "__main__":
    sys.exit(main())
