"""Pretrains the CIFAR-10 convnet on public data; saves the weights and a model card.

    python experiments/cifar10_pretrain.py                          # public split of CIFAR-10
    python experiments/cifar10_pretrain.py --public-data cifar100   # the paper's setting
    python experiments/cifar10_pretrain.py --quick --output-dir /tmp/x   # smoke run

Default (offline substitute for the paper's CIFAR-100): a seeded, class-
stratified split of the CIFAR-10 training set into 10,000 public images
(pretraining only) and 40,000 private ones (left for the DP runs of
experiments/cifar10_dpsgd.py, which check they use the same split).  Writes

  models/cifar10_public_convnet.weights.h5   weights + the pretraining record
  models/cifar10_public_convnet.md           model card, from the measured numbers
  results/cifar10_pretrain.json              the record with per-epoch history

With --public-data cifar100 the files are named cifar100_public_convnet.*.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys

from _common import ROOT, commit_of, shown

from dpfl_tf._io import atomic_write_json, atomic_write_text
from dpfl_tf.recipes.cifar10 import (
    PretrainConfig,
    pretrain_public,
    pretraining_description,
    save_pretrained,
)


def model_card(info: dict, *, command: str, weights: str, results: str, quick: bool) -> str:
    """The model card, written from the measured pretraining record."""
    import keras
    import tensorflow as tf

    cfg = info["config"]
    split = ""
    if info["public_data"] == "cifar10_split":
        split = (
            f"- Split: seed {info['split_seed']}, stratified by class: "
            f"{info['public_examples']:,} of the {info['train_examples']:,} training "
            f"images are public (pretraining only); the other "
            f"{info['train_examples'] - info['public_examples']:,} are private "
            f"(DP training only). sha256 of the sorted public indices: "
            f"`{info['public_indices_sha256']}`.\n"
            f"- The DP runs refuse these weights unless they hold out exactly this split.\n"
        )
    limited = ""
    if info["pretrained_on"] != info["public_examples"] or quick:
        limited = (
            f"\n**Smoke run, not the real artifact**: trained on "
            f"{info['pretrained_on']:,} images for {info['epochs']} epochs.\n"
        )
    aug = info["augmentation"]
    commit = commit_of(untracked=True)  # new files count as changes too
    return f"""# {os.path.basename(weights)}
{limited}
`dpfl_tf.models.cifar_convnet` (Abadi et al. 2016, section 5.3: conv 5x5x64 + max-pool 2x2,
twice; Dense 384, Dense 384, softmax {info["classes"]}), trained **non-privately** on public
data, for the CIFAR-10 DP-SGD runs with frozen convolutional layers
(`experiments/cifar10_dpsgd.py`).

## Data
- Public data: {pretraining_description(info)}.
- Source: {info["public_source"]}.
{split}- Trained on {info["pretrained_on"]:,} images; evaluated on {info["test_examples"]:,} test
  images of {info["test_dataset"]} (centre 24x24 crops).

## Training
- {info["epochs"]} epochs, batch {cfg["batch_size"]}, SGD momentum {cfg["momentum"]},
  learning rate {cfg["learning_rate"]} with cosine decay to 0, weight decay
  {cfg["weight_decay"]}; seed {cfg["seed"]}.
- Input: random 24x24 crop, random left-right flip, brightness shift
  U[-{aug["max_brightness"]:.3f}, {aug["max_brightness"]:.3f}], contrast factor
  U{tuple(aug["contrast"])} (per example, per epoch, clipped to [0, 1]), then
  `{aug["normalization"]}` normalisation (`dpfl_tf.recipes.augment`).

## Result
- **Test accuracy: {info["test_accuracy"]:.4f}** ({info["test_dataset"]},
  {info["test_examples"]:,} images).
- Wall time: {info["seconds"] / 60:.1f} min on {os.cpu_count()} CPU cores
  ({platform.processor() or platform.machine()}); TensorFlow {tf.__version__},
  Keras {keras.__version__}.

## Reproduce
```
{command}
```
Made on {datetime.date.today().isoformat()} at commit {commit}; per-epoch history in
`{shown(results)}`.
"""


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--public-data", default="cifar10_split", choices=["cifar10_split", "cifar100"])
    p.add_argument("--public-size", type=int, default=10000)
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds initialisation, shuffling and augmentation (no DP here)",
    )
    p.add_argument("--limit-public", type=int, help="train on a stratified subset (smoke runs)")
    p.add_argument("--limit-test", type=int, help="evaluate on a stratified subset")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 epochs on 500 public images, 500 test images",
    )
    p.add_argument(
        "--output-dir",
        default=None,
        help="write models/ and results/ under this directory instead of the repo",
    )
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)

    if args.quick:
        args.epochs = min(args.epochs, 2)
        args.limit_public = args.limit_public or 500
        args.limit_test = args.limit_test or 500
    base = args.output_dir or ROOT
    stem = (
        "cifar10_public_convnet"
        if args.public_data == "cifar10_split"
        else "cifar100_public_convnet"
    )
    weights = os.path.join(base, "models", stem + ".weights.h5")
    card = os.path.join(base, "models", stem + ".md")
    results = os.path.join(
        base,
        "results",
        "cifar10_pretrain.json" if stem.startswith("cifar10_") else "cifar100_pretrain.json",
    )

    config = PretrainConfig(
        public_data=args.public_data,
        public_size=args.public_size,
        split_seed=args.split_seed,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        seed=args.seed,
        limit_public=args.limit_public,
        limit_test=args.limit_test,
        data_dir=args.data_dir,
    )
    print(f"== pretraining on {args.public_data} ({config.epochs} epochs)", flush=True)
    net, info = pretrain_public(config)
    info["quick"] = bool(args.quick)
    save_pretrained(net, info, weights)
    atomic_write_json(results, info)
    command = "python " + " ".join(
        shlex.quote(a)
        for a in [os.path.relpath(os.path.abspath(__file__), ROOT)]
        + list(sys.argv[1:] if argv is None else argv)
    )
    atomic_write_text(
        card, model_card(info, command=command, weights=weights, results=results, quick=args.quick)
    )
    print(
        f"   test accuracy {info['test_accuracy']:.4f} on {info['test_examples']} "
        f"{info['test_dataset']} test images; {info['seconds']:.0f} s",
        flush=True,
    )
    print(f"wrote {weights}, {card} and {results}")
    return info


if __name__ == "__main__":
    main()
