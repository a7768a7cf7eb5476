"""Plots of benchmark results (matplotlib, the ``bench`` extra; no GPU, torch or triton needed,
so results can be redrawn anywhere).

- :func:`plot_lines`: one panel per value of a key, one line per implementation.
- :func:`plot_bars`: grouped bars, one group per case, one bar per implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_lines(path: Path, rows: Sequence[dict], *, panel: str, x: str, y: str, line: str,
               title: str, xlabel: str, ylabel: str, hline: float | None = None,
               hline_label: str = "", panel_title: str = "{panel} {value}") -> None:
    """One panel per value of ``panel``; in each, ``y`` against ``x`` with one line per value
    of ``line`` (log2 x axis). ``hline``: a reference level drawn in every panel;
    ``panel_title``: each panel's title, formatted with ``panel`` and ``value``."""
    plt = _pyplot()
    panels = list(dict.fromkeys(r[panel] for r in rows))
    names = list(dict.fromkeys(r[line] for r in rows))
    color = {name: f"C{i % 10}" for i, name in enumerate(names)}   # same colour in every panel
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False)
    for ax, p in zip(axes.flat, panels):
        sub = [r for r in rows if r[panel] == p and r.get(y) is not None]
        for name in dict.fromkeys(r[line] for r in sub):
            pts = sorted((r[x], r[y]) for r in sub if r[line] == name)
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=name,
                    color=color[name])
        if hline is not None:
            ax.axhline(hline, color="gray", linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_title(panel_title.format(panel=panel, value=p))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=color[n], marker="o", label=n) for n in names]
    if hline is not None:
        handles.append(plt.Line2D([], [], color="gray", linestyle="--", label=hline_label))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(path: Path, cases: Sequence[str], series: dict[str, Sequence[float | None]], *,
              title: str, ylabel: str, hline: float | None = None, hline_label: str = "",
              log: bool = False, annotate: bool = False) -> None:
    """Grouped bars: for each of ``cases`` one bar per ``series`` name (its values in the order
    of ``cases``; None draws nothing). ``hline``: a reference level; ``log``: log y axis;
    ``annotate``: print each bar's value above it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(cases) + 2), 4))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(cases))]
        bars = ax.bar(xs, [v or 0 for v in values], width, label=name)
        if annotate:
            for bar, v in zip(bars, values):
                if v:
                    ax.annotate(f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v),
                                ha="center", va="bottom", fontsize=8)
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", label=hline_label)
    if log:
        ax.set_yscale("log")
    ax.set_xticks(range(len(cases)), cases, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
