"""Per-epoch logs of a training run: JSONL, CSV, TensorBoard (when installed), a PNG of the curves.

The files are rewritten from the full history after every epoch (atomically), so a
resumed run continues one consistent log instead of appending duplicates.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

from .checkpoint import atomic_write, atomic_write_text, json_text


def write_history(out_dir: Path, history: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "log.jsonl", "".join(json_text(row) + "\n" for row in history))
    keys: list[str] = []
    for row in history:
        keys += [k for k in row if k not in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    w.writerows(history)
    atomic_write_text(out_dir / "log.csv", buf.getvalue())


class TensorBoard:
    """Scalars to ``out_dir/tb`` when the tensorboard package is installed; otherwise a no-op."""

    def __init__(self, out_dir: Path, enabled: bool = True):
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # tensorboard not installed
            return
        self.writer = SummaryWriter(str(out_dir / "tb"))

    def epoch(self, row: dict) -> None:
        if self.writer is None:
            return
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "epoch":
                self.writer.add_scalar(k, v, row["epoch"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def plot_curves(history: list[dict], path: Path, title: str = "") -> Path | None:
    """Loss, top-1 accuracy and learning rate per epoch (matplotlib, Agg backend)."""
    if not history:
        return None
    try:
        plt = pyplot()
    except ImportError:
        return None
    ep = [r["epoch"] for r in history]

    def series(key):
        pts = [(e, r[key]) for e, r in zip(ep, history) if isinstance(r.get(key), (int, float))]
        return ([p[0] for p in pts], [p[1] for p in pts]) if pts else None

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    # fixed margins, not tight_layout: it measured every label again, 40% of the drawing's time
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.14, top=0.88 if title else 0.95, wspace=0.25)
    for ax, keys, label in ((axes[0], ("train_loss", "val_loss"), "loss"),
                            (axes[1], ("train_acc1", "val_acc1", "ema_val_acc1"), "top-1 accuracy (%)"),
                            (axes[2], ("lr",), "learning rate (end of epoch)")):
        for key in keys:
            s = series(key)
            if s:
                ax.plot(*s, marker="o", ms=3, label=key)
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, dpi=110)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` atomically (temp file + rename) and close it."""
    import matplotlib.pyplot as plt

    fmt = Path(path).suffix.lstrip(".") or None
    try:
        return atomic_write(path, lambda f: fig.savefig(f, dpi=dpi, format=fmt))
    finally:
        plt.close(fig)
