#!/usr/bin/env python3
"""Tokens/s of a Hugging Face transformers training step (forward + backward of the causal-LM loss) under
attn_implementation="sdpa" and "fa2tune" (fa2tune.integrations.transformers).

The model: a 2-layer Llama with random weights, hidden 2048, 16 query heads over 4 key/value heads (GQA, head_dim
128), vocabulary 32000, in bfloat16; the batch: 4 rows of 2048 random tokens. --pad F pads a fraction F of every
row (even rows on the left, odd rows on the right), which runs fa2tune's varlen path; tokens/s counts the unpadded
tokens. Each implementation runs --warmup steps, then --steps timed ones: the median step time and its spread.

    python scripts/bench_hf_training.py
    python scripts/bench_hf_training.py --pad 0.25 --steps 20

Needs torch, transformers and fa2tune only. Without a GPU it runs on the CPU through Triton's interpreter when
TRITON_INTERPRET=1 is set (tiny shapes only: the tests' smoke run).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import torch
import transformers

from fa2tune.integrations import transformers as fa2tune_hf

IMPLEMENTATIONS = ("sdpa", "fa2tune")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_model(args: argparse.Namespace, device: torch.device) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or round(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=max(args.seqlen, 128),
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=DTYPES[args.dtype]).train()


def make_batch(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """Random tokens; a fraction args.pad of each row padded (even rows on the left, odd on the right)."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    padded = int(args.pad * args.seqlen)
    if padded:
        attention_mask[0::2, :padded] = 0
        attention_mask[1::2, args.seqlen - padded :] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    return {name: tensor.to(device) for name, tensor in batch.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model, batch: dict, implementation: str, warmup: int, steps: int) -> tuple[list[float], float]:
    """(seconds of each timed step, the loss of the last) of forward + backward under `implementation`."""
    model.set_attn_implementation(implementation)
    device = batch["input_ids"].device
    seconds, loss = [], float("nan")
    for index in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        _synchronize(device)
        start = time.perf_counter()
        out = model(**batch)
        out.loss.backward()
        _synchronize(device)
        if index >= warmup:
            seconds.append(time.perf_counter() - start)
        loss = out.loss.item()
    return seconds, loss


def versions(device: torch.device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    names = ("torch", "triton", "transformers", "fa2tune")  # fa2tune may run from a checkout, not installed
    return where + ", " + ", ".join(f"{name} {importlib.import_module(name).__version__}" for name in names)


def report(args: argparse.Namespace, results: dict[str, tuple[list[float], float]], tokens: int) -> None:
    print(f"{'attn_implementation':<20} {'ms/step':>9} {'spread':>17} {'tokens/s':>11} {'loss':>8}")
    for name, (seconds, loss) in results.items():
        median = statistics.median(seconds)
        spread = f"{min(seconds) * 1e3:.2f}-{max(seconds) * 1e3:.2f}"
        print(f"{name:<20} {median * 1e3:>9.2f} {spread:>17} {tokens / median:>11,.0f} {loss:>8.4f}")
    if "sdpa" in results and "fa2tune" in results:
        ratio = statistics.median(results["sdpa"][0]) / statistics.median(results["fa2tune"][0])
        print(f"fa2tune speed / sdpa speed: {ratio:.3f}x")


def add_model_arguments(parser: argparse.ArgumentParser, *, hidden: int, heads: int, kv_heads: int) -> None:
    """The Llama's sizes and dtype (build_model's arguments) and the implementations to compare."""
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=hidden, help="hidden size")
    parser.add_argument("--intermediate", type=int, default=0, help="MLP width (default 2.75 x hidden)")
    parser.add_argument("--heads", type=int, default=heads, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=kv_heads, help="key/value heads (GQA)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="the model's dtype")
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS), help="comma-separated, in order")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="rows per step")
    parser.add_argument("--seqlen", type=int, default=2048, help="tokens per row")
    parser.add_argument("--pad", type=float, default=0.0, help="fraction of each row that is padding, 0 <= F < 1")
    add_model_arguments(parser, hidden=2048, heads=16, kv_heads=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles fa2tune's kernels)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    args = parser.parse_args(argv)
    if not 0.0 <= args.pad < 1.0:
        parser.error(f"--pad must be in [0, 1), got {args.pad}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def device_for(script: str) -> torch.device | None:
    """The GPU, or the CPU under Triton's interpreter; None (and why, on stderr) without either."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return torch.device("cpu")
    print(f"{script} needs a CUDA GPU (or TRITON_INTERPRET=1 for a tiny CPU run)", file=sys.stderr)
    return None


def start(script: str) -> torch.device | None:
    """A benchmark's device (device_for), fa2tune registered with transformers and the versions line printed; None
    without a device."""
    device = device_for(script)
    if device is not None:
        fa2tune_hf.register()
        print(f"# {versions(device)}")
    return device


def model_summary(args: argparse.Namespace) -> str:
    """The model add_model_arguments describes, as the benchmarks' header line opens."""
    return f"Llama {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, {args.dtype}"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = start("bench_hf_training.py")
    if device is None:
        return 2
    model, batch = build_model(args, device), make_batch(args, device)
    tokens = int(batch["attention_mask"].sum())
    print(f"# {model_summary(args)}; batch {args.batch} x {args.seqlen}, {tokens} unpadded tokens; forward + backward")
    results = {}
    for name in args.implementations.split(","):
        results[name] = time_steps(model, batch, name, args.warmup, args.steps)
    report(args, results, tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
