#!/usr/bin/env python3
"""Opacus (peer library) on the KerasHub models of experiments/benchmark_hub.py, CPU PyTorch.

Run with the interpreter of a separate Opacus environment, made with

    python3 -m venv /work/peer_envs/opacus
    /work/peer_envs/opacus/bin/pip install "torch==2.13.0+cpu"   # the CPU wheel
    /work/peer_envs/opacus/bin/pip install opacus transformers   # 1.6.0, 5.24.0

one configuration per process, e.g.

    /work/peer_envs/opacus/bin/python experiments/peers/opacus_hub.py \
        --model gpt2 --implementation opacus_ghost --lora off \
        --output /tmp/opacus_hub_gpt2_ghost.json
    ... --quick          # smoke test: the QUICK sizes; timings mean nothing

Implementations:

  torch_nonprivate  plain PyTorch SGD loop, shuffled batches of lot size
  opacus_ghost      PrivacyEngine().make_private(..., grad_sample_mode="ghost",
                    criterion=...): ghost / fast gradient clipping, the loss
                    wrapped in DPLossFastGradientClipping (two backward passes)
  opacus            PrivacyEngine().make_private(..., grad_sample_mode="hooks"):
                    per-sample gradients instantiated (the fallback where ghost
                    clipping cannot run)

Both Opacus modes run with poisson_sampling=False: fixed lots of lot_size
(Opacus's batch), shuffled each epoch, flat clipping at L2_NORM_CLIP,
Gaussian noise NOISE_MULTIPLIER, SGD(LEARNING_RATE), loss_reduction "mean".
Where Opacus cannot handle a model (tied embeddings in ghost mode, a trainable
layer with buffers, ...) the row carries "error": "<one line>" instead of
timings, and the exit status is 3.

Models: HuggingFace transformers classes built from configs (random
initialisation, nothing downloaded), at the sizes of benchmark_hub.py's FULL
and QUICK dicts (copied below; keep them in step), parameter for parameter the
counts of the KerasHub models (checked against results/benchmark_hub_quick.json):

  bert   BertForSequenceClassification: 2 layers, hidden h, 4 heads, FFN 4h,
         positions = seq, 2 segments, pooler + Linear(2) (KerasHub
         BertBackbone + BertTextClassifier)
  gpt2   GPT2LMHeadModel: 2 layers, hidden h, 4 heads, FFN 4h, positions = seq,
         LM head tied to the token table (GPT2CausalLM).  transformers' GPT-2
         uses its own Conv1D layer (x @ W + b), for which Opacus has no rule;
         each is replaced by the equivalent nn.Linear (W transposed) and the
         fused q/k/v projection by three nn.Linear whose outputs are
         concatenated, the same function, so that Opacus's Linear rules
         (ghost norms) apply and LoRA can reach the query and value alone
  gemma  GemmaForCausalLM (--gemma-class gemma): 2 layers, hidden h, 4 query /
         1 key-value heads of h/4, RoPE, GeGLU FFN of width h (KerasHub's
         GemmaBackbone takes intermediate_dim = 2h and uses half of it), tied
         head, embeddings scaled by sqrt(h).  Opacus rejects it (transformers'
         GemmaTextScaledWordEmbedding holds a buffer), so the default
         (--gemma-class llama) is LlamaForCausalLM with the same gemma-like
         config (same shapes, GeGLU via hidden_act gelu_pytorch_tanh, tied
         head); it differs only by the embedding scale and the RMSNorm's
         (1 + w), which change no cost
  llama  LlamaForCausalLM: 2 layers, hidden h, 4 query / 2 key-value heads,
         RoPE, SwiGLU FFN 2h, untied head
  vit    ViTForImageClassification: 32x32x3 images (QUICK 16x16x3), patches
         4x4, 2 layers, hidden h, 4 heads, MLP 2h, class token, Linear(10)

LoRA (--lora on) is written by hand as Keras's EinsumDense.enable_lora, which
KerasHub's backbone.enable_lora(4) applies to the attention's query and value
projections: the kernel (in, heads, head_dim) gets a trainable delta
A (in, heads, rank) @ B (rank, head_dim) (alpha = rank, so scale 1; A He-uniform,
B zeros); here A = nn.Linear(in, heads * rank) and B = nn.Linear(rank, head_dim)
shared by the heads (applied to a [batch, seq * heads, rank] view), so that
Opacus sees plain Linear layers.  As in KerasHub, every backbone weight is
frozen except these A/B and the query and value biases; the classifier heads
(bert, vit), outside the backbone, stay trainable.

Data (numpy default_rng(0), the same draws as benchmark_hub.build): token ids
Zipf-like (p ~ 1/rank) over 1 .. vocab-1, sequences of seq + 1 tokens; causal
LMs predict the next token at every position (cross-entropy averaged over the
positions of a sequence; one privacy unit = one sequence); bert random binary
labels; vit uniform [0, 1) images (generated NHWC, fed NCHW) and 10 random
labels.

The first epoch is warm-up; seconds_per_epoch is the median of the others;
peak_memory_mb is the process's ru_maxrss.  torch runs 2 threads (--threads):
run it on an idle machine, since PyTorch's 2 threads on 2 shared cores slow
down by tens of times (a smoke epoch 0.18 s with 1 thread, 11.7 s with 2,
beside another process using both cores).  --check-norms compares, before
training, Opacus's per-example gradient norms on 4 examples against a plain
per-example backward pass (is Opacus's clipping exact on this model?).

Standalone but for _peer_common.py beside it: it must not import the
project's own package.
"""

import argparse
import math
import os
import platform
import statistics
import sys
import time
import traceback

import numpy as np
from _peer_common import limit_address_space, make_private, peak_memory_mb, write_result

MODELS = ("bert", "gpt2", "gemma", "llama", "vit")
IMPLEMENTATIONS = ("torch_nonprivate", "opacus_ghost", "opacus")
CAUSAL = ("gpt2", "gemma", "llama")

# experiments/benchmark_hub.py's settings and sizes (CLIP, NOISE, LR, RANK,
# FULL, QUICK), copied: this file may not import the project
L2_NORM_CLIP, NOISE_MULTIPLIER, LEARNING_RATE, LORA_RANK = 1.0, 1.0, 0.05, 4
FULL = dict(
    examples=2048, lot_size=128, seq=128, hidden=128, layers=2, vocab=8000, image=32, epochs=3
)
QUICK = dict(examples=256, lot_size=64, seq=32, hidden=32, layers=2, vocab=500, image=16, epochs=2)
HEADS, PATCH, TEXT_CLASSES, IMAGE_CLASSES = 4, 4, 2, 10
LORA_TARGETS = ("query", "value", "q_proj", "v_proj")  # GPT-2's split c_attn: "query", "value"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--implementation", choices=IMPLEMENTATIONS, required=True)
    parser.add_argument("--lora", choices=("on", "off"), required=True)
    parser.add_argument("--quick", action="store_true", help="QUICK sizes (smoke test)")
    parser.add_argument("--output", required=True, help="path of the JSON result file")
    parser.add_argument(
        "--gemma-class",
        choices=("llama", "gemma"),
        default="llama",
        help="transformers class of --model gemma: a gemma-like LlamaForCausalLM "
        "(default) or GemmaForCausalLM (which Opacus rejects without LoRA)",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="time only the first N lots of each epoch and scale the time to "
        "the whole epoch (0 = whole epochs)",
    )
    parser.add_argument(
        "--check-norms",
        action="store_true",
        help="before training, compare Opacus's per-example gradient norms on 4 "
        "examples with a plain per-example backward pass",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (2)")
    parser.add_argument(
        "--max-memory-gb",
        type=float,
        default=20.0,
        help="address-space limit (RLIMIT_AS); 0 = none (default 20)",
    )
    args = parser.parse_args(argv)
    if args.max_steps < 0:
        parser.error("--max-steps must be >= 0")
    args.lora = args.lora == "on"
    return args


def make_data(name, size):
    """(inputs, targets, description): benchmark_hub.build's numpy draws."""
    rng = np.random.default_rng(0)
    n = size["examples"]
    if name == "vit":
        s = size["image"]
        x = rng.random((n, s, s, 3), dtype=np.float32)
        y = rng.integers(0, IMAGE_CLASSES, n)
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        return x, y.astype(np.int64), f"{n} uniform [0,1) images {s}x{s}x3 (NHWC, fed NCHW)"
    ranks = np.arange(1, size["vocab"])
    p = 1.0 / ranks
    ids = rng.choice(ranks, size=(n, size["seq"] + 1), p=p / p.sum()).astype(np.int64)
    inputs, nexts = np.ascontiguousarray(ids[:, :-1]), np.ascontiguousarray(ids[:, 1:])
    desc = (
        f"{n} sequences of {size['seq']} Zipf-like token ids (p ~ 1/rank) "
        f"over 1..{size['vocab'] - 1}"
    )
    if name == "bert":
        return (
            inputs,
            rng.integers(0, TEXT_CLASSES, n).astype(np.int64),
            desc + ", random binary labels",
        )
    return inputs, nexts, desc + ", targets the next tokens"


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def build_model(torch, transformers, name, size, gemma_class):
    """(model, transformers class name) at `size`, random init."""
    h, layers, vocab, seq = size["hidden"], size["layers"], size["vocab"], size["seq"]
    t = transformers
    if name == "bert":
        config = t.BertConfig(
            vocab_size=vocab,
            hidden_size=h,
            num_hidden_layers=layers,
            num_attention_heads=HEADS,
            intermediate_size=4 * h,
            max_position_embeddings=seq,
            type_vocab_size=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout=0.0,
            num_labels=TEXT_CLASSES,
        )
        return t.BertForSequenceClassification(config)
    if name == "gpt2":
        config = t.GPT2Config(
            vocab_size=vocab,
            n_positions=seq,
            n_embd=h,
            n_layer=layers,
            n_head=HEADS,
            n_inner=4 * h,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,  # transformers' default 50256 lies outside the vocabulary
            eos_token_id=None,
            use_cache=False,
            tie_word_embeddings=True,
        )
        model = t.GPT2LMHeadModel(config)
        _gpt2_to_linear(torch, model)
        return model
    if name == "gemma" and gemma_class == "gemma":
        config = t.GemmaConfig(
            vocab_size=vocab,
            hidden_size=h,
            intermediate_size=h,  # KerasHub's intermediate_dim 2h, halved
            num_hidden_layers=layers,
            num_attention_heads=HEADS,
            num_key_value_heads=1,
            head_dim=h // HEADS,
            max_position_embeddings=seq,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            use_cache=False,
        )
        return t.GemmaForCausalLM(config)
    if name in ("gemma", "llama"):
        gemma = name == "gemma"
        config = t.LlamaConfig(
            vocab_size=vocab,
            hidden_size=h,
            intermediate_size=h if gemma else 2 * h,
            num_hidden_layers=layers,
            num_attention_heads=HEADS,
            num_key_value_heads=1 if gemma else 2,
            head_dim=h // HEADS,
            max_position_embeddings=seq,
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            tie_word_embeddings=gemma,
            use_cache=False,
        )
        return t.LlamaForCausalLM(config)
    s = size["image"]
    config = t.ViTConfig(
        image_size=s,
        patch_size=PATCH,
        num_channels=3,
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        intermediate_size=2 * h,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=IMAGE_CLASSES,
    )
    return t.ViTForImageClassification(config)


def _gpt2_to_linear(torch, model):
    """transformers' Conv1D (x @ W + b) -> nn.Linear (W^T); c_attn -> q, k, v."""
    nn = torch.nn
    from transformers.pytorch_utils import Conv1D  # pylint: disable=import-outside-toplevel

    def linear(conv, lo=None, hi=None):
        w, b = conv.weight[:, lo:hi], conv.bias[lo:hi]
        layer = nn.Linear(w.shape[0], w.shape[1])
        with torch.no_grad():
            layer.weight.copy_(w.t())
            layer.bias.copy_(b)
        return layer

    class SplitQKV(nn.Module):
        """The fused q/k/v projection as three Linear layers, outputs concatenated."""

        def __init__(self, conv):
            super().__init__()
            d = conv.weight.shape[0]
            self.query, self.key, self.value = (linear(conv, i * d, (i + 1) * d) for i in range(3))

        def forward(self, x):
            return torch.cat([self.query(x), self.key(x), self.value(x)], dim=-1)

    for block in model.transformer.h:
        block.attn.c_attn = SplitQKV(block.attn.c_attn)
        for owner, attr in ((block.attn, "c_proj"), (block.mlp, "c_fc"), (block.mlp, "c_proj")):
            conv = getattr(owner, attr)
            assert isinstance(conv, Conv1D), type(conv)
            setattr(owner, attr, linear(conv))
    assert not any(isinstance(m, Conv1D) for m in model.modules())


def apply_lora(torch, model, name, head_dim, rank):
    """KerasHub's backbone.enable_lora(rank) (see the docstring); returns the
    names of the wrapped projections."""
    nn = torch.nn

    class LoRALinear(nn.Module):
        """base(x) + (x A) B per head: Keras's EinsumDense LoRA, A (in, heads, r),
        B (r, head_dim); the base kernel frozen, its bias trainable."""

        def __init__(self, base):
            super().__init__()
            self.base = base
            self.heads = base.out_features // head_dim
            self.lora_a = nn.Linear(base.in_features, self.heads * rank, bias=False)
            self.lora_b = nn.Linear(rank, head_dim, bias=False)
            nn.init.kaiming_uniform_(self.lora_a.weight, a=0.0)  # Keras HeUniform
            nn.init.zeros_(self.lora_b.weight)

        def forward(self, x):
            b, s, _ = x.shape
            delta = self.lora_b(self.lora_a(x).reshape(b, s * self.heads, rank))
            return self.base(x) + delta.reshape(b, s, self.heads * head_dim)

    for p in model.parameters():
        p.requires_grad_(False)
    targets = [
        (n, m)
        for n, m in model.named_modules()
        if n.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(m, nn.Linear)
    ]
    for module_name, base in targets:
        parent_name, attr = module_name.rsplit(".", 1)
        wrapped = LoRALinear(base)
        if base.bias is not None:
            base.bias.requires_grad_(True)
        setattr(model.get_submodule(parent_name), attr, wrapped)
    if name in ("bert", "vit"):  # the task's head, outside the backbone
        for p in model.classifier.parameters():
            p.requires_grad_(True)
    return [n for n, _ in targets]


def forward(model, name, inputs):
    """The logits.  BERT's and GPT-2's learned positions (and BERT's segment
    ids, all 0 as in benchmark_hub) are passed as [batch, seq] contiguous ids:
    transformers' defaults, a [1, seq] slice and a stride-0 expansion of a
    buffer, give Opacus's Embedding rules one "example" for the whole batch
    (a wrong per-example gradient) or a tensor it cannot view."""
    if name == "vit":
        return model(pixel_values=inputs).logits
    kwargs = {}
    if name in ("bert", "gpt2"):
        import torch  # pylint: disable=import-outside-toplevel

        b, s = inputs.shape
        kwargs["position_ids"] = torch.arange(s).repeat(b, 1)
        if name == "bert":
            kwargs["token_type_ids"] = torch.zeros(b, s, dtype=torch.long)
    return model(input_ids=inputs, **kwargs).logits


def loss_of(criterion, name, logits, targets, ghost):
    """Mean cross-entropy; for causal LMs over every position of every sequence
    (for the ghost criterion per sequence first: `shape`, as Opacus asks)."""
    if name not in CAUSAL:
        return criterion(logits, targets)
    flat = logits.reshape(-1, logits.shape[-1])
    if ghost:
        return criterion(flat, targets.reshape(-1), shape=logits.shape)
    return criterion(flat, targets.reshape(-1))


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def check_norms(torch, args, model, optimizer, criterion, inputs, targets, ghost):
    """Opacus's per-example gradient norms on a few examples against a plain
    per-example backward pass (hooks disabled)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = loss_of(criterion, args.model, forward(model, args.model, inputs), targets, ghost)
    loss.backward()
    if ghost:
        opacus_norms = model.per_sample_gradient_norms.detach().clone()
    else:
        per_param = [g.reshape(len(g), -1).norm(2, dim=-1) for g in optimizer.grad_samples]
        opacus_norms = torch.stack(per_param, dim=0).norm(2, dim=0)
    optimizer.zero_grad(set_to_none=True)
    plain = torch.nn.CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    model.disable_hooks()
    try:
        exact = []
        for i in range(len(inputs)):
            out = forward(model, args.model, inputs[i : i + 1])
            value = loss_of(plain, args.model, out, targets[i : i + 1], False)
            grads = torch.autograd.grad(value, params, allow_unused=True)
            exact.append(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))
    finally:
        model.enable_hooks()
    exact = torch.stack(exact).float()
    rel = ((opacus_norms - exact).abs() / exact.clamp(min=1e-12)).max().item()
    for p in model.parameters():  # leave nothing behind for training
        for attr in ("grad_sample", "_norm_sample"):
            if hasattr(p, attr):
                setattr(p, attr, None)
    return {
        "examples": len(inputs),
        "opacus_norms": [round(v, 6) for v in opacus_norms.tolist()],
        "per_example_backward_norms": [round(v, 6) for v in exact.tolist()],
        "max_relative_error": rel,
        "exact": rel < 1e-3,
    }


def train(torch, args, size, data, extra, times):
    """Builds, (makes private,) trains; appends epoch times to `times`."""
    import transformers  # pylint: disable=import-outside-toplevel
    from torch.utils.data import DataLoader, TensorDataset  # pylint: disable=import-outside-toplevel

    torch.manual_seed(0)
    model = build_model(torch, transformers, args.model, size, args.gemma_class)
    extra["hf_class"] = type(model).__name__
    if args.lora:
        extra["lora_wrapped"] = apply_lora(
            torch, model, args.model, size["hidden"] // HEADS, LORA_RANK
        )
    params = list(model.parameters())
    extra["parameters"] = int(sum(p.numel() for p in params))
    extra["trainable_parameters"] = int(sum(p.numel() for p in params if p.requires_grad))
    extra["tied_embeddings"] = bool(
        getattr(model.config, "tie_word_embeddings", False) and args.model in CAUSAL
    )
    extra["attn_implementation"] = getattr(model.config, "_attn_implementation", None)

    inputs, targets, _ = data
    dataset = TensorDataset(torch.from_numpy(inputs), torch.from_numpy(targets))
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(dataset, batch_size=size["lot_size"], shuffle=True, generator=generator)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD([p for p in params if p.requires_grad], lr=LEARNING_RATE)
    ghost = args.implementation == "opacus_ghost"
    if args.implementation != "torch_nonprivate":
        _, model, optimizer, criterion, loader = make_private(
            model,
            optimizer,
            criterion,
            loader,
            ghost=ghost,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=L2_NORM_CLIP,
            poisson_sampling=False,
        )
        extra.update(
            grad_sample_mode="ghost" if ghost else "hooks",
            optimizer_class=type(optimizer).__name__,
            model_wrapper=type(model).__name__,
            criterion_class=type(criterion).__name__,
        )
        if args.check_norms:
            extra["norm_check"] = check_norms(
                torch,
                args,
                model,
                optimizer,
                criterion,
                torch.from_numpy(inputs[:4]),
                torch.from_numpy(targets[:4]),
                ghost,
            )
    model.train()
    lots = len(loader)
    extra["lots_per_epoch"] = lots
    for epoch in range(size["epochs"]):
        start, steps = time.perf_counter(), 0
        for xb, yb in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(criterion, args.model, forward(model, args.model, xb), yb, ghost)
            loss.backward()
            optimizer.step()
            steps += 1
            if args.max_steps and steps >= args.max_steps:
                break
        times.append((time.perf_counter() - start) * lots / steps)
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"loss {value} after epoch {epoch}")
        extra["last_loss"] = value
        print(f"epoch {epoch}: {times[-1]:.3f}s, loss {value:.4f}", file=sys.stderr)


def one_line(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def main(argv=None):
    args = parse_args(argv)
    limit_address_space(args.max_memory_gb)
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    import torch  # pylint: disable=import-outside-toplevel

    torch.set_num_threads(args.threads)
    size = QUICK if args.quick else FULL
    data = make_data(args.model, size)
    times, extra, error = [], {}, None
    try:
        train(torch, args, size, data, extra, times)
    except Exception as exc:  # pylint: disable=broad-except
        error = one_line(exc)
        traceback.print_exc()
        print("FAILED: " + error, file=sys.stderr)
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    row = {
        "model": args.model,
        "lora": args.lora,
        "implementation": args.implementation,
        "seconds_per_epoch": (
            statistics.median(times[1:]) if error is None and len(times) > 1 else None
        ),
        "epoch_seconds": times[1:],
        "warmup_seconds": times[:1],
        "peak_memory_mb": peak_memory_mb(),
        "trainable_parameters": extra.pop("trainable_parameters", None),
        "parameters": extra.pop("parameters", None),
        "torch_version": torch.__version__,
        "opacus_version": metadata.version("opacus"),
        "transformers_version": metadata.version("transformers"),
        "command": " ".join([os.path.relpath(os.path.abspath(sys.argv[0]), root)] + sys.argv[1:]),
        "quick": args.quick,
        "sizes": size,
        "settings": {
            "l2_norm_clip": L2_NORM_CLIP if args.implementation != "torch_nonprivate" else None,
            "noise_multiplier": (
                NOISE_MULTIPLIER if args.implementation != "torch_nonprivate" else None
            ),
            "learning_rate": LEARNING_RATE,
            "optimizer": "SGD",
            "lora_rank": LORA_RANK if args.lora else None,
            "sampling": "DataLoader(shuffle=True, batch_size=lot_size); poisson_sampling=False",
            "loss": "CrossEntropyLoss (mean; causal LMs: over every position)",
            "data": data[2],
            "timed_lots_per_epoch": args.max_steps or "all (whole epochs)",
            "torch_num_threads": torch.get_num_threads(),
            "python_version": platform.python_version(),
            "max_memory_gb": args.max_memory_gb or None,
            **extra,
        },
    }
    if error is not None:
        row["error"] = error
    write_result(args.output, row)
    print(
        f"{args.model} lora={'on' if args.lora else 'off'} {args.implementation}: "
        + (f"ERROR {error}" if error else f"{row['seconds_per_epoch']:.3f} s/epoch")
        + f", {row['peak_memory_mb']:.0f} MB"
    )
    return 0 if error is None else 3


if __name__ == "__main__":
    sys.exit(main())
