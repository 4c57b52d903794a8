"""The demo pipeline on synthetic data, each step a real ``python -m monai.bundle run`` of a bundle here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import synthetic

__all__ = ["BUNDLES_DIR", "bundle_command", "run_bundle", "run_demo"]

BUNDLES_DIR = Path(__file__).resolve().parent.parent / "bundles"
SSL_BUNDLE = "swin_unetr_ssl_pretrain"
CT_BUNDLE = "swin_unetr_btcv_finetune"


def _cli_value(value: object) -> str:
    """An override as ``monai.bundle run`` (python-fire) parses it back: JSON for lists, Python for bool/None."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return str(value)


def bundle_command(bundle: str | Path, configs: Sequence[str] = ("train.json",), overrides: Mapping | None = None) -> list[str]:
    """The ``python -m monai.bundle run`` command line for ``bundle`` (a name under ``bundles/`` or a path)."""
    root = Path(bundle) if Path(bundle).is_dir() else BUNDLES_DIR / str(bundle)
    if not (root / "configs").is_dir():
        raise FileNotFoundError(f"no bundle at {str(root)!r} (expected a configs/ folder).")
    files = [str(root / "configs" / c) for c in configs]
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", json.dumps(files) if len(files) > 1 else files[0]]
    cmd += ["--meta_file", str(root / "configs" / "metadata.json"), "--logging_file", str(root / "configs" / "logging.conf")]
    for key, value in {"bundle_root": str(root), **(overrides or {})}.items():
        cmd += [f"--{key}", _cli_value(value)]
    return cmd


def run_bundle(
    bundle: str | Path, configs: Sequence[str] = ("train.json",), overrides: Mapping | None = None, log: Path | None = None
) -> float:
    """Runs a bundle in a subprocess, showing its progress lines (the full output goes to ``log``); returns the
    seconds taken. Raises with the end of the output when the run fails."""
    cmd = bundle_command(bundle, configs, overrides)
    start = time.perf_counter()
    lines: list[str] = []
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
    sink = open(log, "w") if log else None
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()) as proc:
            for line in proc.stdout:
                lines.append(line)
                if sink:
                    sink.write(line)
                if _is_progress(line):
                    print("    " + line.split(" - ")[-1].strip(), flush=True)
            code = proc.wait()
    finally:
        if sink:
            sink.close()
    if code != 0:
        tail = "".join(lines[-30:])
        raise RuntimeError(f"bundle run failed (exit {code}): {' '.join(cmd)}\n{tail}")
    return time.perf_counter() - start


def _is_progress(line: str) -> bool:
    return any(mark in line for mark in ("Epoch: ", "Metrics -- ", "loaded ", "best value", "Saving"))


def _dice_curve(events_dir: Path, tag: str = "val_mean_dice") -> list[tuple[int, float]]:
    """(epoch, value) of a scalar from the TensorBoard event files under ``events_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points: dict[int, float] = {}
    for events in sorted(events_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            points.update({e.step: e.value for e in acc.Scalars(tag)})
    return sorted(points.items())


def _plot_curves(curves: Mapping[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation mean Dice (no background)")
    ax.set_title("Finetuning on synthetic CT: SSL init vs random init")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_overlay(image: Path, label: Path, predictions: Mapping[str, Path], path: Path) -> None:
    """Middle axial slice of a test volume: the image, its label and each prediction overlaid (RAS, as seen
    from the feet)."""
    import matplotlib
    import nibabel as nib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def axial(p: Path) -> np.ndarray:
        volume = nib.as_closest_canonical(nib.load(p)).get_fdata()
        return np.rot90(volume[:, :, volume.shape[2] // 2])

    ct = axial(image)
    panels = {"label": axial(label), **{name: axial(p) for name, p in predictions.items()}}
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(3.2 * (len(panels) + 1), 3.4))
    axes[0].imshow(ct, cmap="gray", vmin=-175, vmax=250)
    axes[0].set_title("CT (middle slice)")
    for ax, (name, seg) in zip(axes[1:], panels.items()):
        ax.imshow(ct, cmap="gray", vmin=-175, vmax=250)
        ax.imshow(np.ma.masked_equal(seg, 0), cmap="tab20", vmin=0, vmax=19, alpha=0.6, interpolation="nearest")
        ax.set_title(name)
    for ax in axes:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mean_dice(metrics_json: Path) -> float | None:
    if not metrics_json.is_file():
        return None
    value = json.loads(metrics_json.read_text()).get("mean")
    return None if value is None else float(value)


def run_demo(
    out: str = "demo_out", num: int = 8, seed: int = 0, epochs: int = 2, roi: int = 64, feature_size: int = 12, finetune_epochs: int = 4
) -> str:
    """Synthesises a CT set, pretrains a tiny SSL model, finetunes the CT bundle from it and from scratch with the
    same budget, evaluates both and segments a test volume; prints a table and writes ``dice_curves.png``,
    ``segmentations.png`` and ``summary.txt`` under ``out``. Returns the table."""
    out_dir = Path(out).resolve()
    data_dir = out_dir / "data"
    rows: list[tuple[str, str, str]] = []
    steps = 5

    print(f"[1/{steps}] synthesising {num} CT volumes into {data_dir}", flush=True)
    start = time.perf_counter()
    synthetic.write_dataset(data_dir, kind="ct", num=num, seed=seed)
    rows.append(("synthesise CT", f"{time.perf_counter() - start:.1f}", "-"))

    common = {"dataset_dir": str(data_dir), "device": "cpu", "feature_size": feature_size, "num_workers": 0, "amp": False,
              "use_checkpoint": False, "seed": seed, "log_interval": 1}
    ssl_dir = out_dir / SSL_BUNDLE
    print(f"[2/{steps}] SSL pretraining, {epochs} epochs (roi {roi}^3, feature {feature_size}) -> {ssl_dir}", flush=True)
    ssl_overrides = {**common, "output_dir": str(ssl_dir / "eval"), "ckpt_dir": str(ssl_dir / "models"),
                     "roi_size": [roi] * 3, "num_samples": 1, "max_epochs": epochs, "warmup_iterations": 2}
    seconds = run_bundle(SSL_BUNDLE, overrides=ssl_overrides, log=ssl_dir / "train.log")
    rows.append(("SSL pretraining", f"{seconds:.1f}", "-"))

    # its own seed: SSLHead and SwinUNETR build swinViT first, so a shared seed would start both runs from the
    # same encoder; a coarse spacing lets one 64^3 crop hold most of a synthetic abdomen
    finetune = {**common, "seed": seed + 1, "roi_size": [roi] * 3, "spacing": [3.0, 3.0, 4.0], "num_samples": 2,
                "max_epochs": finetune_epochs, "val_interval": 1, "warmup_epochs": 1, "learning_rate": 2e-3}
    runs = {"SSL init": str(ssl_dir / "models" / "model.pt"), "random init": None}
    results: dict[str, dict[str, Path]] = {}
    for i, (name, pretrained) in enumerate(runs.items()):
        run_dir = out_dir / ("finetune_ssl" if pretrained else "finetune_scratch")
        print(f"[{3 + i}/{steps}] finetuning the CT bundle, {finetune_epochs} epochs, {name} -> {run_dir}", flush=True)
        paths = {"models": run_dir / "models", "eval": run_dir / "eval", "seg": run_dir / "segmentations"}
        overrides = {**finetune, "pretrained_path": pretrained, "ckpt_dir": str(paths["models"]), "output_dir": str(paths["eval"])}
        seconds = run_bundle(CT_BUNDLE, overrides=overrides, log=run_dir / "train.log")
        run_bundle(CT_BUNDLE, ("train.json", "evaluate.json"), overrides, log=run_dir / "evaluate.log")
        run_bundle(CT_BUNDLE, ("inference.json",), {**overrides, "output_dir": str(paths["seg"])}, log=run_dir / "inference.log")
        results[name] = paths
        dice = _mean_dice(paths["eval"] / "metrics.json")
        rows.append((f"finetune, {name}", f"{seconds:.1f}", "-" if dice is None else f"mean Dice {dice:.4f}"))

    print(f"[{steps}/{steps}] plotting", flush=True)
    _plot_curves({name: _dice_curve(paths["eval"]) for name, paths in results.items()}, out_dir / "dice_curves.png")
    test_case = json.loads((data_dir / "dataset.json").read_text())["test"][0]
    image, label = data_dir / test_case["image"], data_dir / test_case["label"]
    stem = image.name.split(".")[0]
    predictions = {name: next(paths["seg"].glob(f"{stem}*seg*.nii.gz")) for name, paths in results.items()}
    _plot_overlay(image, label, predictions, out_dir / "segmentations.png")

    table = _table(("step", "seconds", "result"), rows)
    note = ("A CPU demo budget shows that every step runs; it is far too small for SSL to pay off (the recipe: "
            "100k iterations on 5k volumes, then finetuning for hours).")
    print(f"\n{table}\n\n{note}\npictures: {out_dir / 'dice_curves.png'}, {out_dir / 'segmentations.png'}", flush=True)
    (out_dir / "summary.txt").write_text(table + "\n")
    return table


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), "-+-".join("-" * w for w in widths)] + [fmt.format(*r) for r in rows]
    return "\n".join(lines)
