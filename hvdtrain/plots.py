"""Pictures a run leaves behind (drawn off-screen; written through RunDir, so by rank 0 only)."""
from __future__ import annotations

import os
import tempfile

import numpy as np

from hvdtrain.rundir import nearest_existing


NOT_CURVES = frozenset({"epoch", "samples_per_sec", "train_seconds", "epoch_seconds",
                        "cpu_seconds", "first_step_seconds", "resident_mb", "learning_rate",
                        "skipped_samples", "workers", "input_wait_seconds", "compute_seconds"})
"""Columns of metrics.json that are timings, memory or bookkeeping, not training metrics."""


def curve_names(rows: list[dict]) -> list[str]:
    """The training metrics that get a panel (each with its val_ twin when there is one)."""
    return [k for k in rows[0] if k not in NOT_CURVES and not k.startswith("val_")] if rows else []


def plot_curves(rows: list[dict], path: str, title: str = "") -> None:
    save_figure(curves_figure(rows, title), path)


def curves_figure(rows: list[dict], title: str = ""):
    """One panel per metric (training and validation) and one for the learning rate when
    metrics.json has it, against whole epochs; ``title`` above them (what ran: curves_title)."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    names = curve_names(rows)
    learning_rates = [row.get("learning_rate", np.nan) for row in rows]
    panels = [*names, *(["learning_rate"] if not np.all(np.isnan(learning_rates)) else [])]
    figure, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 3.8),
                                squeeze=False)
    epochs = [row["epoch"] for row in rows]
    for axis, name in zip(axes[0], panels):
        if name == "learning_rate":
            axis.plot(epochs, learning_rates, marker="o", color="tab:gray")
            axis.set_title("learning rate (end of epoch)")
            axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        else:
            axis.plot(epochs, [row.get(name, np.nan) for row in rows], marker="o",
                      label=f"train {name}")
            if f"val_{name}" in rows[0]:
                axis.plot(epochs, [row.get(f"val_{name}", np.nan) for row in rows], marker="o",
                          label=f"validation {name}")
            axis.set_title(name)
            axis.legend()
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
        axis.set_xlabel("epoch")
        axis.grid(alpha=0.3)
    if title:
        figure.suptitle(title, fontsize=10)
    return figure


def curves_title(run_name: str, rows: list[dict], global_batch_size: int,
                 num_workers: int) -> str:
    """What ran, for the curves' title: the run, its workers and global batch (first -> now
    when a resumed run ran on another number of workers; the batch per worker stays)."""
    per_worker = global_batch_size // max(1, num_workers)
    first = rows[0].get("workers", num_workers) if rows else num_workers
    if first == num_workers:
        return f"{run_name}: {num_workers} worker(s), global batch {global_batch_size}"
    return (f"{run_name}: {first} -> {num_workers} worker(s), global batch "
            f"{first * per_worker} -> {global_batch_size}")


def plot_reconstructions(originals: np.ndarray, reconstructions: np.ndarray, title: str,
                         path: str) -> None:
    """Inputs in the top row, the model's reconstructions below (the autoencoder article's grid)."""
    plt = pyplot()
    count = len(originals)
    figure, axes = plt.subplots(2, count, figsize=(1.2 * count, 2.8), squeeze=False)
    for column in range(count):
        for row, images in enumerate((originals, reconstructions)):
            image = np.asarray(images[column], dtype=np.float32)
            if image.max() > 1.0:
                image = image / 255.0
            axis = axes[row][column]
            axis.imshow(image.squeeze(-1) if image.shape[-1] == 1 else image,
                        cmap="gray" if image.shape[-1] == 1 else None, vmin=0, vmax=1)
            axis.set_xticks([])
            axis.set_yticks([])
    axes[0][0].set_ylabel("input")
    axes[1][0].set_ylabel("output")
    figure.suptitle(title, fontsize=9)
    save_figure(figure, path)


def pyplot():
    if "MPLCONFIGDIR" not in os.environ and not _writable_config_home():
        # A read-only home (a container image's /root, some compute nodes): matplotlib would
        # say so in four lines and use a directory of its own; the process' temporary directory
        # (the rank's scratch, removed at exit) says nothing.
        os.environ["MPLCONFIGDIR"] = os.path.join(tempfile.gettempdir(), "matplotlib")
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    return plt


def _writable_config_home() -> bool:
    """Whether matplotlib's default configuration directory is (or can be made) writable."""
    config = os.path.join(os.environ.get("XDG_CONFIG_HOME")
                          or os.path.join(os.path.expanduser("~"), ".config"), "matplotlib")
    existing = nearest_existing(config)
    return existing is not None and os.access(existing, os.W_OK)


def save_figure(figure, path: str) -> None:
    """Write the figure as a PNG and free it (figures are never shown; pyplot keeps them)."""
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")
    pyplot().close(figure)
