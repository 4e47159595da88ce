#!/usr/bin/env python3
"""Decode speed of Hugging Face transformers' batched generate() from left-padded prompts, under
attn_implementation="sdpa" and "fa2tune" (fa2tune.integrations.transformers).

The model: a Llama with random weights (bench_hf_training.py's builder), by default 2 layers, hidden 4096, 32 query
heads over 8 key/value heads (head_dim 128), bfloat16; the prompts: --batch rows of --prompt random tokens, row r
left-padded by round(pad · prompt · r / (batch − 1)) tokens, so the rows' lengths differ as a serving batch's do.
A step of such a batch is where fa2tune's integration reads the cache in place (docs/API.md, "Hugging Face
transformers"). The decode time per step is (time of generate(max_new_tokens = 1 + N) − time of generate(1)) / N:
the prefill cancels out. Each is the median of --repeats runs. The generated tokens of each implementation are
compared with the first's (random weights in 16-bit floats can make a greedy choice flip on a near tie, so the
match is reported, not required). generate() runs eagerly: transformers compiles a static cache's decode step by
default, and fa2tune's calls then run through its custom ops, the keys gathered; --compile times that instead.

    python scripts/bench_hf_generate.py
    python scripts/bench_hf_generate.py --batch 64 --prompt 8192 --new-tokens 32 --cache static
    python scripts/bench_hf_generate.py --cache static --compile     # transformers' default for a static cache

Needs torch, transformers and fa2tune. Without a GPU it runs on the CPU through Triton's interpreter when
TRITON_INTERPRET=1 is set (tiny shapes only: the tests' smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_hf_training import add_model_arguments, build_model, model_summary, start


def make_prompts(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """Random tokens, row r left-padded by round(pad · prompt · r / (batch − 1)) tokens (pad id 0)."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(args.batch):
        padded = round(args.pad * args.prompt * row / max(args.batch - 1, 1))
        attention_mask[row, :padded] = 0
        input_ids[row, :padded] = 0
    return dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))


def _generate(model, prompts: dict, new_tokens: int, args: argparse.Namespace) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(**prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, cache_implementation=args.cache,
                              disable_compile=not args.compile)  # fmt: skip


def _seconds(run, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def time_decode(model, prompts: dict, implementation: str, args: argparse.Namespace) -> tuple[float, torch.Tensor]:
    """(seconds a decode step, the tokens generated) under `implementation`."""
    model.set_attn_implementation(implementation)
    device = prompts["input_ids"].device
    tokens = _generate(model, prompts, 1 + args.new_tokens, args)  # warm-up: compiles fa2tune's kernels
    prefill = statistics.median(_seconds(lambda: _generate(model, prompts, 1, args), device)
                                for _ in range(args.repeats))  # fmt: skip
    whole = statistics.median(_seconds(lambda: _generate(model, prompts, 1 + args.new_tokens, args), device)
                              for _ in range(args.repeats))  # fmt: skip
    return max(whole - prefill, 0.0) / args.new_tokens, tokens[:, args.prompt :]


def report(args: argparse.Namespace, results: dict[str, tuple[float, torch.Tensor]]) -> None:
    first = next(iter(results.values()))[1]
    print(f"{'attn_implementation':<20} {'ms/step':>9} {'tokens/s':>11} {'tokens as ' + next(iter(results)):>18}")
    for name, (step, tokens) in results.items():
        match = (tokens == first).float().mean().item()
        rate = args.batch / step if step > 0 else float("nan")
        print(f"{name:<20} {step * 1e3:>9.3f} {rate:>11,.0f} {match:>18.1%}")
    if "sdpa" in results and "fa2tune" in results:
        # a step is whole generate() minus its prefill: on a busy host with few repeats that can read 0 (clamped)
        sdpa, ours = results["sdpa"][0], results["fa2tune"][0]
        ratio = f"{sdpa / ours:.3f}x" if sdpa > 0 and ours > 0 else "not measured (a step read 0 s; raise --repeats)"
        print(f"fa2tune speed / sdpa speed: {ratio}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="prompts generated together")
    parser.add_argument("--prompt", type=int, default=4096, help="tokens a prompt, its padding included")
    parser.add_argument("--pad", type=float, default=0.5, help="the last row's fraction of padding, 0 <= F < 1")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed")
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic", help="transformers' KV cache")
    parser.add_argument("--compile", action="store_true",
                        help="let generate() compile the decode step where transformers would (a static cache)")
    add_model_arguments(parser, hidden=4096, heads=32, kv_heads=8)  # Llama-3-8B's attention
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each generate(); the median counts")
    args = parser.parse_args(argv)
    if not 0.0 <= args.pad < 1.0:
        parser.error(f"--pad must be in [0, 1), got {args.pad}")
    for name in ("batch", "prompt", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.seqlen = args.prompt + args.new_tokens + 1  # the model's positions (bench_hf_training's builder reads it)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = start("bench_hf_generate.py")
    if device is None:
        return 2
    model, prompts = build_model(args, device).eval(), make_prompts(args, device)
    kept = int(prompts["attention_mask"].sum())
    print(f"# {model_summary(args)}; batch {args.batch} x {args.prompt} prompt tokens, {kept} unpadded; "
          f"{args.cache} cache{', compiled' if args.compile else ''}; {args.new_tokens} decode steps")  # fmt: skip
    results = {name: time_decode(model, prompts, name, args) for name in args.implementations.split(",")}
    report(args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
