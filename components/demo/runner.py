"""Runs the bundles of this collection as a user does: ``python -m monai.bundle run`` in a subprocess.

The demo, the low-data benchmark and the command line share it, so every step they report on is a real bundle
run with command-line overrides only (no configuration a user could not type).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["BUNDLES_DIR", "bundle_dir", "bundle_command", "fresh_run_dir", "run_bundle", "read_scalars"]


def _bundles_dir() -> Path:
    """The folder of the named bundles: ``bundles/`` of the clone this package lives in (a clone, or an editable
    install of it), else the copy an installed wheel carries as package data (``components/bundles``)."""
    package = Path(__file__).resolve().parents[1]  # components/, above this demo/ package
    clone = package.parent
    if (clone / "pyproject.toml").is_file() and (clone / "bundles").is_dir():
        return clone / "bundles"
    return package / "bundles"


BUNDLES_DIR = _bundles_dir()


def bundle_dir(bundle: str | Path) -> Path:
    """A bundle's folder: ``bundle`` itself when it is a folder holding ``configs/``, else the bundle of that name
    in :data:`BUNDLES_DIR`.

    Raises:
        FileNotFoundError: neither exists; the message lists the bundles this package carries.

    Example::

        bundle_dir("swin_unetr_btcv_finetune")  # <clone or site-packages>/.../swin_unetr_btcv_finetune
    """
    for root in (Path(bundle), BUNDLES_DIR / str(bundle)):
        if (root / "configs").is_dir():
            return root
    known = sorted(configs.parent.name for configs in BUNDLES_DIR.glob("*/configs"))
    raise FileNotFoundError(f"no bundle at {str(bundle)!r}: not a folder with configs/, and not one of the bundles in {BUNDLES_DIR}: {known}.")

_PROGRESS_MARKS = ("Epoch: ", "Metrics -- ", "loaded ", "best value", "Saving")


def _cli_value(value: object) -> str:
    """An override as ``monai.bundle run`` (python-fire) parses it back: JSON for lists, Python for bool/None."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return str(value)


_EVAL_NOTICE = "ignore:parsing config_file:UserWarning"


def bundle_command(bundle: str | Path, configs: Sequence[str] = ("train.json",), overrides: Mapping | None = None) -> list[str]:
    """The ``python -m monai.bundle run`` command line for ``bundle`` (a name under ``bundles/`` or a path)."""
    root = bundle_dir(bundle)
    files = [str(root / "configs" / c) for c in configs]
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", json.dumps(files) if len(files) > 1 else files[0]]
    cmd += ["--meta_file", str(root / "configs" / "metadata.json"), "--logging_file", str(root / "configs" / "logging.conf")]
    for key, value in {"bundle_root": str(root), **(overrides or {})}.items():
        cmd += [f"--{key}", _cli_value(value)]
    return cmd


def run_bundle(
    bundle: str | Path,
    configs: Sequence[str] = ("train.json",),
    overrides: Mapping | None = None,
    log: Path | None = None,
    echo: bool = True,
    threads: int | None = None,
) -> float:
    """Runs a bundle in a subprocess and returns the seconds it took. The full output goes to ``log``; with
    ``echo``, its progress lines (epochs, metrics, loading, saving) are printed as they come; ``threads`` caps the
    run's CPU threads (``OMP_NUM_THREADS``), for several runs side by side.

    Raises:
        RuntimeError: when the run fails, with its command line and the end of its output.
    """
    cmd = bundle_command(bundle, configs, overrides)
    start = time.perf_counter()
    lines: list[str] = []
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
    sink = open(log, "w", buffering=1) if log else None  # line-buffered: the log can be followed while it runs
    try:
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        # `monai.bundle run` warns, before any bundle code loads, that configs are eval()'ed: a notice for configs of
        # unknown origin; this runner runs this collection's own bundles, so the notice is filtered for its runs
        env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), _EVAL_NOTICE) if w)
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
            for line in proc.stdout:
                lines.append(line)
                if sink:
                    sink.write(line)
                if echo and any(mark in line for mark in _PROGRESS_MARKS):
                    print("    " + line.split(" - ")[-1].strip(), flush=True)
            code = proc.wait()
    finally:
        if sink:
            sink.close()
    if code != 0:
        tail = "".join(lines[-30:])
        raise RuntimeError(f"bundle run failed (exit {code}): {' '.join(cmd)}\n{tail}")
    return time.perf_counter() - start


def fresh_run_dir(run_dir: Path) -> Path:
    """Empties ``run_dir`` (created if missing) before a run that must start fresh: :func:`read_scalars` merges every
    events file of a folder, so an earlier run's events left there would mix into the new run's (a longer earlier
    run's last Dice would even win, having the highest step)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    return run_dir


def read_scalars(events_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar the bundle runs logged to TensorBoard under ``events_dir``: tag -> [(step, value)] by step, merged
    over the folder's events files (a resumed run continues in a new file); see :func:`fresh_run_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(events_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return {tag: sorted(points.items()) for tag, points in out.items()}
