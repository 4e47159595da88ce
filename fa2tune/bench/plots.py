"""TFLOP/s plots of benchmark rows: one PNG per head dim and mode (and dtype and heads, where the rows hold
several), TFLOP/s against the sequence length, a line per provider, dashed where causal. Needs matplotlib (the
`bench` extra); report.can_plot says whether it is there."""

from __future__ import annotations

from pathlib import Path

from .report import complete


def _group(row: dict) -> tuple:
    return row["mode"], row["dtype"], row["head_dim"], row["heads"], row["heads_kv"]


def _file_name(group: tuple, groups: set[tuple]) -> str:
    """d<d>-<mode>.png, with the dtype and heads added only where another group shares the rest of the name."""
    mode, dtype, head_dim, heads, heads_kv = group
    name = f"d{head_dim}-{mode.replace('+', '_')}"
    if len({g[1] for g in groups}) > 1:
        name += f"-{dtype}"
    if len({g[3:] for g in groups if g[:3] == group[:3]}) > 1:
        name += f"-h{heads}" + (f"kv{heads_kv}" if heads_kv != heads else "")
    return name + ".png"


def _x_label(rows: list[dict]) -> str:
    tokens = {r["batch"] * r["seqlen"] for r in rows}
    batches = {r["batch"] for r in rows}
    if len(batches) == 1:
        return f"sequence length N (batch {batches.pop()})"
    return f"sequence length N (batch·N = {tokens.pop()} tokens)" if len(tokens) == 1 else "sequence length N"


def write_plots(rows: list[dict], outdir: str | Path, title: str = "") -> list[Path]:
    """The PNGs for `rows` in outdir (made if missing); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = [complete(r) for r in rows]
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    groups = {_group(r) for r in rows}
    written = []
    for group in sorted(groups):
        members = [r for r in rows if _group(r) == group]
        mode, dtype, head_dim, heads, heads_kv = group
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, provider in enumerate(sorted({r["provider"] for r in members})):
            for causal in (False, True):
                points = sorted((r["seqlen"], r["tflops"]) for r in members
                                if r["provider"] == provider and r["causal"] == causal)  # fmt: skip
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, marker="o", color=f"C{i}", linestyle="--" if causal else "-",
                            label=f"{provider}{' causal' if causal else ''}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel(_x_label(members))
        ax.set_ylabel("TFLOP/s")
        gqa = f" H={heads}/{heads_kv}" if heads != heads_kv else ""
        ax.set_title(f"{title} d={head_dim}{gqa} {mode}".strip() if title else f"{dtype} d={head_dim}{gqa} {mode}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        path = outdir / _file_name(group, groups)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
