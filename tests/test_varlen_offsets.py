"""Packed sequences' offsets the host check cannot see: changed after their check where the version counter does not
count (`cu.data[i] = ...`, a NumPy view), or between the forward and the backward. Whatever cu_seqlens holds, no
kernel may read or write outside its tensors (templates/_common.py.jinja, _sequence_rows): each sequence's ends are
clamped to [0, total tokens] with end >= start and its length to max_seqlen. Rows no clamped sequence covers are not
written; rows covered once hold the attention of their clamped sequence.

Such calls read out of bounds before the clamp — an InterpreterError, then heap corruption that aborted the process
on a later call (`double free or corruption`) — so they run in a child process: a regression fails the test
instead of taking pytest down."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fa2tune
from fa2tune.api import attention, ops
from fa2tune.launch import launcher
from fa2tune.tune.reference import naive_attention, naive_attention_varlen

TOTAL, MAX_LEN, OFFSETS = 10, 4, (0, 3, 7, 10)  # three sequences of 3, 4 and 3 tokens
# (name, index, value): offsets a check would refuse, written behind the version counter
BAD_OFFSETS = [
    ("past the end", 2, 1000),
    ("negative", 1, -5),
    ("decreasing", 2, 1),  # clamped sequences overlap: rows 1-2 are the first's and the third's
    ("huge", 1, 2**31 - 1),
    ("last huge", 3, 2**31 - 1),  # clamped back to the token count: the offsets as they were
    ("first negative", 0, -3),
]


def clamped_rows(offsets: list[int], total: int, max_len: int) -> list[tuple[int, int]]:
    """(first row, length) of each sequence as the kernels take it (_sequence_rows)."""
    rows = []
    for a, b in itertools.pairwise(offsets):
        start = min(max(a, 0), total)
        end = min(max(b, start), total)
        rows.append((start, min(end - start, max_len)))
    return rows


def _covered_once(rows: list[tuple[int, int]], total: int) -> torch.Tensor:
    count = torch.zeros(total, dtype=torch.int64)
    for start, n in rows:
        count[start : start + n] += 1
    return count == 1


def _expected(q, k, v, do, rows):
    """O, dQ, dK, dV of attention over each clamped sequence alone (same rows of q and k/v), float64; zero where no
    sequence is."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    out = torch.zeros_like(leaves[0])
    for start, n in rows:
        if n:
            part = slice(start, start + n)
            o, _ = naive_attention(*(t[part].transpose(0, 1) for t in leaves))
            out = out.index_put((torch.arange(start, start + n),), o.transpose(0, 1), accumulate=True)
    grads = torch.autograd.grad(out, leaves, do.double().cpu())
    return out.detach(), grads


def _close(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor, what: str) -> None:
    got, want = got.detach().double().cpu()[rows], want[rows]
    err = (got - want).abs().max().item() if rows.any() else 0.0
    assert err < 1e-4, f"{what}: largest error {err:.2e} on the rows one clamped sequence covers"


def _inputs(device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(TOTAL, 2, 16, generator=gen).to(device) for _ in range(4)]


def check_offsets_changed_unseen(device: str) -> None:
    """The child process's work: every bad offset, written both ways, after a checked call and between forward and
    backward; then correct calls, compared with the reference."""
    ways = ["data", "numpy"] if device == "cpu" else ["data"]  # a CUDA tensor has no NumPy view
    for seed, (name, index, value) in enumerate(BAD_OFFSETS):
        way = ways[seed % len(ways)]
        label = f"{name} via {way}"
        q, k, v, do = _inputs(device, seed)
        cu = torch.tensor(OFFSETS, dtype=torch.int32, device=device)
        fa2tune.attention_varlen(q, k, v, cu, cu, MAX_LEN, MAX_LEN)  # checked: the check is kept for this tensor
        version = cu._version
        if way == "data":
            cu.data[index] = value
        else:
            cu.numpy()[index] = value
        assert cu._version == version and cu[index].item() == value, label  # unseen by the version counter
        rows = clamped_rows(cu.tolist(), TOTAL, MAX_LEN)
        once = _covered_once(rows, TOTAL)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fa2tune.attention_varlen(*leaves, cu, cu, MAX_LEN, MAX_LEN)
        grads = torch.autograd.grad(o, leaves, do)
        want_o, want_grads = _expected(q, k, v, do, rows)
        _close(o, want_o, once, f"{label}: O")
        # the backward reads the forward's logsumexp: exact wherever no clamped sequences share a row
        if once.sum().item() == sum(n for _, n in rows):
            for got, want, grad in zip(grads, want_grads, "qkv", strict=True):
                _close(got, want, once, f"{label}: d{grad}")

        # the forward's own rows: not written where no sequence is (a poisoned buffer keeps its poison)
        poison = torch.full_like(q, 7.0)
        packing = launcher.Packing(cu, cu, MAX_LEN, MAX_LEN)
        ops.forward(q, k, v, causal=False, scale=0.25, packing=packing, out=poison)
        covered = torch.zeros(TOTAL, dtype=torch.bool)
        for start, n in rows:
            covered[start : start + n] = True
        assert (poison.cpu()[~covered] == 7.0).all(), f"{label}: rows outside every sequence were written"

        # changed between forward and backward: the backward reads what the tensor holds then
        cu = torch.tensor(OFFSETS, dtype=torch.int32, device=device)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fa2tune.attention_varlen(*leaves, cu, cu, MAX_LEN, MAX_LEN)
        cu.data[index] = value
        grads = torch.autograd.grad(o, leaves, do)
        assert [g.shape for g in grads] == [t.shape for t in (q, k, v)], label
        if name == "last huge":  # clamped to the token count: the offsets the forward had
            want_grads = _expected(q, k, v, do, clamped_rows(list(OFFSETS), TOTAL, MAX_LEN))[1]
            for got, want, grad in zip(grads, want_grads, "qkv", strict=True):
                _close(got, want, torch.ones(TOTAL, dtype=torch.bool), f"{label}, after the forward: d{grad}")

    # the process is healthy: correct offsets, forward and backward, against the reference
    q, k, v, do = _inputs(device, 99)
    cu = torch.tensor(OFFSETS, dtype=torch.int32, device=device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = fa2tune.attention_varlen(*leaves, cu, cu, MAX_LEN, MAX_LEN)
    grads = torch.autograd.grad(o, leaves, do)
    ref, _ = naive_attention_varlen(q.double(), k.double(), v.double(), cu, cu)
    everywhere = torch.ones(TOTAL, dtype=torch.bool)
    _close(o, ref.cpu(), everywhere, "a correct call after them: O")
    for got, want, grad in zip(grads, _expected(q, k, v, do, clamped_rows(list(OFFSETS), TOTAL, MAX_LEN))[1], "qkv",
                               strict=True):  # fmt: skip
        _close(got, want, everywhere, f"a correct call after them: d{grad}")
    print("healthy")


def test_offsets_changed_unseen_stay_in_bounds_and_give_the_clamped_sequences(device):
    # Unclamped, such offsets give an InterpreterError or a `double free or corruption` abort (CPU), an illegal
    # address (GPU).
    root = Path(__file__).resolve().parent.parent
    script = (
        f"from tests.test_varlen_offsets import check_offsets_changed_unseen; check_offsets_changed_unseen({device!r})"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=root, env=dict(os.environ), capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("healthy"), out.stderr[-4000:]


def test_clamped_rows_follow_the_kernels_rule():
    assert clamped_rows([0, 3, 7, 10], 10, 4) == [(0, 3), (3, 4), (7, 3)]
    assert clamped_rows([0, 1000, 7, 10], 10, 4) == [(0, 4), (10, 0), (7, 3)]
    assert clamped_rows([-3, -5, 2**31 - 1, 10], 10, 4) == [(0, 0), (0, 4), (10, 0)]


@pytest.mark.parametrize("replace", ["data", "set_"])
def test_an_offsets_tensor_given_new_memory_is_checked_again(replace, device):
    # `cu.data = other` keeps the version counter: the check's record names the memory too, so the new values are
    # read (here one sequence of 5 tokens, above max_seqlen 4) and refused with the check's own message.
    q, k, v, _ = _inputs(device, 1)
    cu = torch.tensor(OFFSETS, dtype=torch.int32, device=device)
    fa2tune.attention_varlen(q, k, v, cu, cu, MAX_LEN, MAX_LEN)
    other = torch.tensor([0, 5, 7, 10], dtype=torch.int32, device=device)
    if replace == "data":
        cu.data = other
    else:
        cu.set_(other)
    with pytest.raises(ValueError, match="max_seqlen_q=4 is below the longest sequence in cu_seqlens_q \\(5\\)"):
        fa2tune.attention_varlen(q, k, v, cu, cu, MAX_LEN, MAX_LEN)


@pytest.mark.parametrize("path", ["eager", "op"])
def test_offsets_written_in_place_between_forward_and_backward_are_refused(path, device):
    # The forward's offsets are saved for the backward on both paths: an in-place write (seen by the version counter)
    # is autograd's error, not gradients of other sequences than the forward's.
    q, k, v, do = _inputs(device, 2)
    cu = torch.tensor(OFFSETS, dtype=torch.int32, device=device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    packing = launcher.Packing(cu, cu, MAX_LEN, MAX_LEN)
    apply = attention.apply_eager if path == "eager" else ops.apply_op
    o, _ = apply(*leaves, fa2tune.Mask(), 0.25, None, packing)
    cu[1] = 2
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(o, leaves, do)


def test_offsets_given_other_memory_between_forward_and_backward_are_checked_again(device):
    # `cu.data = shorter` keeps the version counter; the backward checks the offsets again (its record names the
    # memory), so the kernels never read past the shorter tensor.
    q, k, v, do = _inputs(device, 3)
    cu_q = torch.tensor(OFFSETS, dtype=torch.int32, device=device)
    cu_k = torch.tensor(OFFSETS, dtype=torch.int32, device=device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = fa2tune.attention_varlen(*leaves, cu_q, cu_k, MAX_LEN, MAX_LEN)
    cu_k.data = torch.tensor([0, 10], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="one length"):
        torch.autograd.grad(o, leaves, do)


def test_offsets_are_not_read_back_while_a_cuda_graph_is_captured(monkeypatch, device):
    # A host read during capture is an error (torch.compile's "reduce-overhead" captures the op's launches): the
    # values go unchecked there — the kernels keep them in bounds — and are checked again outside the capture
    from fa2tune.config import inputs

    q, k, _, _ = _inputs(device, 1)
    bad = torch.tensor([0, 5, 7, 10], dtype=torch.int32, device=device)  # a sequence of 5, above max_seqlen 4
    reads = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or [])
    monkeypatch.setattr(inputs, "capturing_cuda_graph", lambda: True)
    inputs.check_offsets(bad, bad, MAX_LEN, MAX_LEN, q.shape[0], k.shape[0])
    assert reads == []
    monkeypatch.undo()
    with pytest.raises(ValueError, match="max_seqlen_q=4 is below the longest sequence in cu_seqlens_q \\(5\\)"):
        inputs.check_offsets(bad, bad, MAX_LEN, MAX_LEN, q.shape[0], k.shape[0])
