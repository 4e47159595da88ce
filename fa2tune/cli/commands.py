"""The commands that read and report: check, inspect, plan, codegen and show (`fa2tune tune` is tune_command.py).

Each imports what it needs when it runs: the parser imports this module, and `fa2tune tune` starts its helper
processes before torch is imported.
"""

from __future__ import annotations

import argparse
import json
import os

from .common import device_info, fail, note_interpreter, resolve_device, to_json


def check(args: argparse.Namespace) -> int:
    """`fa2tune check`: the forward against a float64 reference on odd shapes, every mask, each dtype asked; a
    table (or --json), exit code 1 if any case failed."""
    device = resolve_device(args.device)
    note_interpreter(device)
    results = _check_results(device, args.dtype.split(","))
    failed = sum(not r["passed"] for r in results)
    if args.json:
        print(to_json({"device": device, "passed": not failed, "failed": failed, "results": results}))
        return 1 if failed else 0
    print(f"{'batch,hq,hkv,nq,nk,d':>24} {'dtype':>9} {'mask':>14} {'rel err O':>10} {'rel err lse':>11}  result")
    for r in results:
        print(f"{','.join(map(str, r['shape'])):>24} {r['dtype']:>9} {r['mask']:>14} {r['rel_err']:>10.1e} "
              f"{r['lse_rel_err']:>11.1e}  {'ok' if r['passed'] else 'FAIL'}")  # fmt: skip
    print("all checks passed" if not failed else f"{failed} checks FAILED")
    return 1 if failed else 0


def _check_results(device: str, dtype_names: list[str]) -> list[dict]:
    """One result per shape, dtype and mask (full, causal, a window, causal packed sequences), in table order."""
    from ..config.inputs import DTYPES_BY_NAME
    from ..config.types import Mask
    from ..tune import verification

    results = []
    for shape in verification.default_shapes(on_gpu=device != "cpu"):
        left = max(8, shape[4] // 4)  # a window that leaves whole K tiles out at the larger lengths
        masks = [("full", Mask(), False), ("causal", Mask(causal=True), False),
                 (f"window {left},0", Mask(causal=True, window=(left, -1)), False),
                 ("causal varlen", Mask(causal=True), True)]  # fmt: skip
        for name in dtype_names:
            for mask_name, mask, varlen in masks:
                r = verification.check_forward(shape, dtype=DTYPES_BY_NAME[name], causal=mask, device=device,
                                               varlen=varlen)  # fmt: skip
                results.append({"shape": list(r.shape), "dtype": name, "mask": mask_name, "rel_err": r.rel_err,
                                "lse_rel_err": r.lse_rel_err, "passed": r.passed})  # fmt: skip
    return results


def inspect(args: argparse.Namespace) -> int:
    """`fa2tune inspect`: what the GPU offers, as the planner reads it."""
    info = device_info(args)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    for key, value in info.to_dict().items():
        print(f"{key:>16}  {value}")
    return 0


def plan(args: argparse.Namespace) -> int:
    """`fa2tune plan`: which configs fit the GPU, and why the others do not."""
    from ..config import planner
    from ..config.inputs import DTYPES_BY_NAME

    info = device_info(args)
    dtype = DTYPES_BY_NAME[args.dtype]
    kernels = ["bwd_dkdv", "bwd_dq"] if args.kernel == "bwd" else [args.kernel]
    plans = [planner.plan(info, args.head_dim, dtype, kernel) for kernel in kernels]
    if args.json:
        out = [
            {
                "device": {**info.to_dict(), "smem_per_block": info.smem_per_block},
                "kernel": p.kernel,
                "head_dim": p.head_dim,
                "dtype": args.dtype,
                # params, not to_dict: every row of a table has every column, switches off included
                "accepted": [{**cfg.params(), "sram_bytes": need} for cfg, need in p.accepted],
                "rejected": [{**cfg.params(), "sram_bytes": need, "reason": why} for cfg, need, why in p.rejected],
            }
            for p in plans
        ]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
        return 0
    for p in plans:
        print(
            f"{p.kernel} on {info.name} ({info.smem_per_block:,} B shared memory per block), "
            f"head_dim {p.head_dim}, {args.dtype}: {len(p.accepted)} accepted, {len(p.rejected)} rejected"
        )
        print(f"  {'block_m':>7} {'block_n':>7} {'warps':>5} {'stages':>6} {'SRAM (B)':>10}  switches")
        for cfg, need in sorted(p.accepted, key=lambda a: -a[1]):
            print(f"  {cfg.block_m:>7} {cfg.block_n:>7} {cfg.num_warps:>5} {cfg.num_stages:>6} {need:>10,}  "
                  f"{_switches(cfg)}")  # fmt: skip
        print("  rejected:")
        for cfg, _need, why in p.rejected:
            print(f"  {cfg.block_m:>7} {cfg.block_n:>7} {cfg.num_warps:>5} {cfg.num_stages:>6}  {_switches(cfg)} {why}")
    return 0


def _switches(cfg) -> str:
    """The config's template switches and schedule in words ("" for the plain Triton template)."""
    schedule = cfg.schedule
    words = [("pipeline_qk", cfg.pipeline_qk), ("warpspec", cfg.warp_specialized), ("ping-pong", cfg.pingpong),
             ("fused dQ", cfg.fused_dq), ("drained before dQ", cfg.drain_before_dq),
             ("split roles", cfg.split_roles), ("head dim padded", cfg.pad_head_dim),
             ("persistent", schedule.persistent),
             (", two programs an SM", schedule.programs_an_sm == 2),
             (", no split tail", not schedule.split_tail)]  # fmt: skip
    return " ".join(word for word, on in words if on).replace(" ,", ",")


def _codegen_switch_templates() -> dict[str, tuple[str, ...]]:
    """The templates whose code each of codegen's switches changes (types.SWITCH_TEMPLATES, Variant.for_template's
    rules; --two-an-sm turns off stage_stats): given for another, it would be dropped without a word and the source
    printed would not be the one asked for. Ragged tails and the interpreter's fp32 dots are the Triton templates'
    (the warpspec ones bound tiles by TMA), the head-dim chunks the warpspec ones'."""
    from ..config.types import SWITCH_TEMPLATES
    from ..kernels.codegen import WARPSPEC_TEMPLATE_OF

    triton, warpspec = ("fwd", "bwd"), tuple(WARPSPEC_TEMPLATE_OF.values())
    named = {flag: SWITCH_TEMPLATES[flag] for flag in ("pingpong", "fused_dq", "split_roles", "persistent")}
    return {"ragged": triton, "interpret": triton, "two_an_sm": SWITCH_TEMPLATES["stage_stats"],
            "pad_head_dim": warpspec, **named}  # fmt: skip


def codegen(args: argparse.Namespace) -> int:
    """`fa2tune codegen`: one template variant's generated source."""
    from ..config import head_chunks
    from ..config.types import Variant
    from ..kernels import codegen

    for switch, templates in _codegen_switch_templates().items():
        if getattr(args, switch) and args.template not in templates:
            fail(f"--{switch.replace('_', '-')} is a switch of --template {' or '.join(templates)}, "
                 f"got --template {args.template}")  # fmt: skip
    if args.drain_before_dq and not (args.fused_dq and args.template == "bwd_ws"):
        fail("--drain-before-dq is a switch of --template bwd_ws with --fused-dq (KernelConfig.drain_before_dq)")
    if args.split_roles and (args.fused_dq or args.two_an_sm):
        fail("--split-roles takes neither --fused-dq nor --two-an-sm (KernelConfig.combination_error: split roles "
             "never fuse dQ and never stage the statistics)")  # fmt: skip
    if args.pad_head_dim and not head_chunks.pads(args.head_dim):
        fail(f"--pad-head-dim changes no chunk at --head-dim {args.head_dim} (head_chunks.pads: d = 97-112, "
             "161-176, 193-240)")  # fmt: skip
    variant = Variant.for_template(
        args.template, causal=args.causal, banded=False, varlen=False, even_m=not args.ragged,
        even_n=not args.ragged, dot_fp32=args.interpret, pingpong=args.pingpong, persistent=args.persistent,
        fused_dq=args.fused_dq, split_roles=args.split_roles, stage_stats=not args.two_an_sm,
        drain_before_dq=args.drain_before_dq, pad_head_dim=args.pad_head_dim, head_dim=args.head_dim,
    )  # fmt: skip
    print(codegen.render(args.template, variant), end="")
    return 0


def show(args: argparse.Namespace) -> int:
    """`fa2tune show`: the entries stored for the GPU, in search-path order (a later file's entry for a key is
    shadowed), and, on the card, what attention resolves now for the common head dims."""
    from ..api import selection
    from ..config import store

    if args.gpu:
        info = device_info(args)
    else:
        device_name = resolve_device(args.device)
        note_interpreter(device_name)
        info = selection.device_info(device_name)
    slug = info.slug
    rows = _stored_rows(slug, info)
    if not args.gpu:  # what the attention_kernel resolves now, including planner defaults
        grouped = {r["head_dim"] for r in rows if r.get("gqa")}  # and for GQA calls where grouped entries exist
        rows += _resolved_rows(sorted({r["head_dim"] for r in rows if "head_dim" in r} | {64, 128}), device_name,
                               grouped)  # fmt: skip
    if args.json:
        print(to_json({"slug": slug, "search_path": [str(d) for d in store.config_dirs()], "rows": rows}))
        return 0
    print(f"tuned configs for {slug}; search path: " + " -> ".join(str(d) for d in store.config_dirs()))
    for r in rows:
        print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))
    return 0


def _stored_rows(slug: str, info) -> list[dict]:
    """One row per entry of <slug>.yaml in each config directory, then of each file of another GPU of the same chip
    (store.same_chip_gpus; "tuned_on" names that GPU), each file's in its order (lookups read them a length bucket at
    a time across these files: store.find_for_device). "used": whether a call of the
    entry's key on the device (info, a DeviceInfo) runs it — stale entries are skipped, configs the device cannot
    run are passed over, and the first other entry a call reads (store.find_for_device) wins; "why_not" says which
    of these it is. One row per file that cannot be read, with the reason."""
    from ..config import store

    rows = []
    files = [(path, None) for path in store.own_files(slug)]
    files += [(path, gpu.name) for gpu in store.same_chip_gpus(info) for path in gpu.paths]
    for path, tuned_on in files:
        if not path.is_file():
            if os.path.lexists(path):  # a directory, a broken link: lookup skips it with a warning
                rows.append({"file": str(path), "error": "not a readable file"})
            continue
        try:
            _, entries = store.read_file(path)
        except Exception as exc:  # show says why a file is ignored instead of failing
            rows.append({"file": str(path), "error": str(exc)})
            continue
        for e in entries:
            why = _why_not_used(e, path, info)
            rows.append(
                {
                    "file": str(path),
                    **({"tuned_on": tuned_on} if tuned_on else {}),
                    **{k: v for k, v in e.key.__dict__.items()},
                    "config": e.config.to_dict(),
                    "tflops": e.tflops,
                    "used": why is None,
                    **({"why_not": why} if why else {}),
                }
            )
    return rows


def _why_not_used(entry, path, info) -> str | None:
    """Why a call of `entry`'s key on the device `info` does not run the stored `entry` (from the file `path`), or
    None where it does: what selection.resolve / resolve_decode take for that key — the key's own length bucket,
    then "all" (lengths.buckets_for) — compared with it."""
    from ..api import selection
    from ..config import store
    from ..kernels import codegen

    if entry.template_hash != codegen.entry_code_hash(entry.key, entry.config):
        return "stale: tuned against other kernel code"
    reason = selection.unfit(entry, info)
    if reason is not None:
        return f"the planner rejects it here: {reason}"
    keys = selection.lookup_keys(entry.key)
    code_hash = lambda config: codegen.entry_code_hash(keys[0], config)  # the code has no bucket, no dtype
    found = list(store.find_for_device(info, keys, template_hash=code_hash))
    # lookup reads one entry a key in each GPU's files: the first along them
    group = next((gpu.paths for gpu in store.same_chip_gpus(info) if path in gpu.paths), store.own_files(info.slug))
    first = next((f for f in found if f.entry.key == entry.key and f.path in group), None)
    if first is None:
        if entry.key.kernel in store.CHIP_BLIND_KERNELS:
            return f"{entry.key.kernel} entries are read from the GPU's own files only (store.CHIP_BLIND_KERNELS)"
        return "calls of this key on this GPU do not read this file"
    if first.path != path:
        return f"lookup stops at an earlier file's entry for the key ({first.path})"
    pick = next(f for f in found if selection.unfit(f.entry, info) is None)  # resolve's: the first the device runs
    return None if pick is first else f"calls of this key read {pick.source}"


def _resolved_rows(head_dims: list[int], device_name: str, grouped: set[int] = frozenset()) -> list[dict]:
    """What attention resolves on the device for each head dim, bf16, with and without the causal mask; for the
    head dims in `grouped` (those with grouped-query entries) GQA calls' too, in rows with gqa=True."""
    import torch

    from ..api import attention_kernel

    rows = []
    for head_dim, gqa in [(d, False) for d in head_dims] + [(d, True) for d in sorted(grouped)]:
        for causal in (False, True):
            k = attention_kernel.get_kernel(head_dim, device=device_name, dtype=torch.bfloat16, causal=causal,
                                            gqa=gqa)  # fmt: skip
            rows.append(
                {
                    "resolved": True,
                    "head_dim": head_dim,
                    **({"gqa": True} if gqa else {}),
                    "dtype": "bf16",
                    "causal": causal,
                    "fwd": k.config.to_dict(),
                    "source": k.source,
                    "bwd_dkdv": k.bwd_dkdv_config.to_dict(),
                    "bwd_dq": k.bwd_dq_config.to_dict(),
                    "bwd_source": k.bwd_source,
                }
            )
            if (k.short_config, k.short_source) != (k.config, k.source):  # N <= 1024: a "short" entry or default
                rows[-1].update(fwd_short=k.short_config.to_dict(), short_source=k.short_source)
            if (k.medium_config, k.medium_source) != (k.config, k.source):  # 1k < N <= 4k: a "medium" entry or default
                rows[-1].update(fwd_medium=k.medium_config.to_dict(), medium_source=k.medium_source)
    return rows
