"""Loss curves to CSV (always) and PNG (when matplotlib is installed: the ``demo`` extra).

Why both: the CSV is the record a test or a person can diff; the PNG is for
looking. Several named series (e.g. "reference" and "dp2_tp2") share one plot.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union


def write_loss_csv(path: Union[str, Path], series: Dict[str, Sequence[float]]) -> Path:
    """Columns: step, then one per series (empty where a series is shorter)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(series)
    n = max((len(v) for v in series.values()), default=0)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *names])
        for i in range(n):
            w.writerow([i, *(repr(float(series[k][i])) if i < len(series[k]) else "" for k in names)])
    return path


def read_loss_csv(path: Union[str, Path]) -> Dict[str, List[float]]:
    """Inverse of ``write_loss_csv``."""
    with Path(path).open(newline="") as f:
        rows = list(csv.reader(f))
    names = rows[0][1:]
    return {k: [float(r[j + 1]) for r in rows[1:] if r[j + 1] != ""] for j, k in enumerate(names)}


def plot_losses(path: Union[str, Path], series: Dict[str, Sequence[float]], title: str = "training loss") -> Path:
    """PNG of the series against step (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    styles = ["-", "--", ":", "-."]
    for i, (name, ys) in enumerate(series.items()):
        ax.plot(range(len(ys)), list(ys), styles[i % len(styles)], label=name, linewidth=1.6)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def save_loss_curves(prefix: Union[str, Path], series: Dict[str, Sequence[float]],
                     title: str = "training loss") -> List[Path]:
    """Write ``<prefix>.csv`` and, if matplotlib is importable, ``<prefix>.png``; returns the paths."""
    prefix = Path(prefix)
    out = [write_loss_csv(prefix.with_suffix(".csv"), series)]
    try:
        out.append(plot_losses(prefix.with_suffix(".png"), series, title))
    except ImportError:
        pass
    return out
