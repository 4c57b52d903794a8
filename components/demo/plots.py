"""The demo's pictures: the pretraining losses, the SSL views, the Dice curves and held-out segmentations, drawn
with matplotlib's file-only Agg backend (no display needed)."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["last_image", "pyplot", "save_plot", "smoothed", "plot_losses", "plot_views", "plot_dice_curves", "plot_segmentations"]


def last_image(events_dir: Path, tag: str) -> Any:
    """The last image logged under ``tag`` (an RGB(A) array), or None."""
    import matplotlib.image as mpimg
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    image = None
    for events in sorted(events_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"images": 0})
        acc.Reload()
        if tag in acc.Tags()["images"]:
            image = mpimg.imread(io.BytesIO(acc.Images(tag)[-1].encoded_image_string), format="png")
    return image


def pyplot() -> Any:
    """matplotlib's ``pyplot`` on the file-only Agg backend (no display needed), imported when first drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str, **legend: Any) -> None:
    """Labels, grid and legend of a one-axes line plot, then writes it to ``path`` and closes it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def smoothed(values: Sequence[float], window: int) -> list[float]:
    """The trailing mean of the last ``window`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_losses(scalars: Mapping[str, list[tuple[int, float]]], names: Mapping[str, str], path: Path, title: str) -> None:
    """A pretraining's loss and its parts per iteration: each scalar tag of ``names`` that was logged, faint as logged
    and smoothed (a trailing mean over a twentieth of the run), with its trivial value (``<tag>_trivial``, what
    predicting nothing reaches on the same batches, smoothed alike) dashed in the same colour where the run logged
    one: a loss on its dashed line has learned nothing."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for tag, name in names.items():
        if not scalars.get(tag):
            continue
        steps, values = zip(*scalars[tag])
        window = max(1, len(values) // 20)
        (line,) = ax.plot(steps, smoothed(values, window), label=name)
        ax.plot(steps, values, color=line.get_color(), alpha=0.25, linewidth=0.8)
        if scalars.get(f"{tag}_trivial"):
            trivial_steps, trivial = zip(*scalars[f"{tag}_trivial"])
            ax.plot(trivial_steps, smoothed(trivial, window), color=line.get_color(), linestyle="--", linewidth=1,
                    label=f"{name}: trivial answer")  # fmt: skip
    save_plot(fig, ax, path, "iteration", "loss", title, fontsize=7)


def plot_views(grid: Any, columns: Sequence[str], title: str, path: Path) -> None:
    """A pretraining bundle's validation picture (middle slices, one row per crop, one column per entry of
    ``columns``) with the columns named."""
    plt = pyplot()
    n = len(columns)
    fig, ax = plt.subplots(figsize=(2.4 * n, 3.2 * grid.shape[0] / (grid.shape[1] / n)))
    ax.imshow(grid[..., 0] if grid.ndim == 3 else grid, cmap="gray", vmin=0, vmax=1)
    width = grid.shape[1] / n
    ax.set_xticks([width * (i + 0.5) for i in range(n)], columns)
    ax.set_yticks([])
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_dice_curves(curves: Mapping[str, Mapping[str, list[tuple[int, float]]]], path: Path) -> None:
    """Validation Dice per epoch for each finetuning arm: the mean over organs (thick) and each organ (thin)."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for style, (arm, per_name) in zip(("-", "--"), curves.items()):
        for name, points in per_name.items():
            if points:
                mean = name == "mean"
                ax.plot(*zip(*points), style, marker="o" if mean else None, linewidth=2.5 if mean else 1.0,
                        color="black" if mean else None, label=f"{arm}: {name}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, 1)
    save_plot(fig, ax, path, "epoch", "validation Dice", "Finetuning the CT bundle on synthetic CT", fontsize=7, ncol=2)


def plot_segmentations(image: Path, label: Path, predictions: Mapping[str, Path], names: list[str], path: Path) -> None:
    """Three axial slices of a held-out volume (rows): the CT, its label and each prediction, coloured by organ
    with a legend; slices are taken through the labeled organs, in RAS as seen from the feet."""
    import nibabel as nib
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    plt = pyplot()

    def ras(p: Path) -> Any:
        return np.asarray(nib.as_closest_canonical(nib.load(str(p))).dataobj)

    ct, lab = ras(image), ras(label)
    segs = {"label": lab, **{name: ras(p) for name, p in predictions.items()}}
    z_with_organs = np.flatnonzero(lab.reshape(-1, lab.shape[2]).any(axis=0))
    zs = z_with_organs[np.linspace(0, len(z_with_organs) - 1, 5).astype(int)[1:4]] if len(z_with_organs) else [ct.shape[2] // 2]
    colours = plt.get_cmap("tab10").colors[: len(names) - 1]
    cmap = ListedColormap(colours)
    fig, axes = plt.subplots(len(zs), len(segs) + 1, figsize=(3.0 * (len(segs) + 1), 3.0 * len(zs) + 0.6), squeeze=False)
    for row, z in enumerate(zs):
        background = np.rot90(ct[:, :, z])
        axes[row, 0].imshow(background, cmap="gray", vmin=-175, vmax=250)
        for col, (name, seg) in enumerate(segs.items(), start=1):
            axes[row, col].imshow(background, cmap="gray", vmin=-175, vmax=250)
            masked = np.ma.masked_equal(np.rot90(seg[:, :, z]), 0) - 1
            axes[row, col].imshow(masked, cmap=cmap, vmin=0, vmax=len(colours) - 1, alpha=0.55, interpolation="nearest")
            if row == 0:
                axes[row, col].set_title(name)
        if row == 0:
            axes[row, 0].set_title("CT (held-out volume)")
        axes[row, 0].set_ylabel(f"slice {z}")
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.legend(handles=[Patch(color=c, label=n) for c, n in zip(colours, names[1:])], loc="lower center", ncol=len(colours))
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
