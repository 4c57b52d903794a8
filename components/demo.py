"""The demo pipeline on synthetic data, each step a real ``python -m monai.bundle run`` of a bundle here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from . import synthetic

__all__ = ["BUNDLES_DIR", "bundle_command", "run_bundle", "run_demo"]

BUNDLES_DIR = Path(__file__).resolve().parent.parent / "bundles"


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
    """Runs a bundle in a subprocess, streaming its output (and copying it to ``log``); returns seconds taken.
    Raises with the end of the output when the run fails."""
    cmd = bundle_command(bundle, configs, overrides)
    start = time.perf_counter()
    lines: list[str] = []
    sink = open(log, "w") if log else None
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()) as proc:
            for line in proc.stdout:
                print(line, end="", flush=True)
                lines.append(line)
                if sink:
                    sink.write(line)
            code = proc.wait()
    finally:
        if sink:
            sink.close()
    if code != 0:
        tail = "".join(lines[-30:])
        raise RuntimeError(f"bundle run failed (exit {code}): {' '.join(cmd)}\n{tail}")
    return time.perf_counter() - start


def _best_metric(ckpt_dir: Path) -> float | None:
    path = ckpt_dir / "checkpoint.pt"
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("best_metric")


def run_demo(out: str = "demo_out", num: int = 8, seed: int = 0, epochs: int = 2, roi: int = 64, feature_size: int = 12) -> str:
    """Synthesises a CT set under ``out/data`` and pretrains a tiny SSL model into ``out/ssl_pretrain``;
    prints a table of the steps with their times and key metric. Returns the summary table."""
    out_dir = Path(out).resolve()
    data_dir = out_dir / "data"
    rows: list[tuple[str, str, str]] = []

    print(f"[1/2] synthesising {num} CT volumes into {data_dir}", flush=True)
    start = time.perf_counter()
    synthetic.write_dataset(data_dir, kind="ct", num=num, seed=seed)
    rows.append(("synthesise CT", f"{time.perf_counter() - start:.1f}", "-"))

    ssl_dir = out_dir / "ssl_pretrain"
    print(f"[2/2] SSL pretraining for {epochs} epochs (roi {roi}^3, feature {feature_size}) into {ssl_dir}", flush=True)
    overrides = {
        "dataset_dir": str(data_dir),
        "output_dir": str(ssl_dir / "eval"),
        "ckpt_dir": str(ssl_dir / "models"),
        "device": "cpu",
        "roi_size": [roi] * 3,
        "feature_size": feature_size,
        "num_samples": 1,
        "num_workers": 0,
        "max_epochs": epochs,
        "warmup_iterations": 2,
        "log_interval": 1,
        "amp": False,
        "use_checkpoint": False,
        "seed": seed,
    }
    seconds = run_bundle("swin_unetr_ssl_pretrain", overrides=overrides, log=ssl_dir / "train.log")
    best = _best_metric(ssl_dir / "models")
    rows.append(("SSL pretraining", f"{seconds:.1f}", "-" if best is None else f"val recon L1 {best:.4f}"))

    table = _table(("step", "seconds", "result"), rows)
    print("\n" + table, flush=True)
    (out_dir / "summary.txt").write_text(table + "\n")
    return table


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), "-+-".join("-" * w for w in widths)] + [fmt.format(*r) for r in rows]
    return "\n".join(lines)
