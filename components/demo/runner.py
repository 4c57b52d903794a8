"""Runs the bundles of this collection as a user does: ``python -m monai.bundle run`` in a subprocess.

The demo, the low-data benchmark and the command line share it, so every step they report on is a real bundle
run with command-line overrides only (no configuration a user could not type). A run in progress ends with the
process that started it: stopped by SIGINT (Ctrl-C) or SIGTERM, or by any error, :func:`run_bundle` ends its bundle
run before it returns (Python's default SIGTERM would end this process at once and leave the bundle training).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..config.running import run_config_files

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
    """The ``python -m monai.bundle run`` command line for ``bundle`` (a name under ``bundles/`` or a path): its
    ``configs``, the shared config first with ``train.json`` (:func:`~components.config.running.run_config_files`)."""
    root = bundle_dir(bundle)
    files = [str(f) for f in run_config_files(root, configs)]
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", json.dumps(files) if len(files) > 1 else files[0]]
    cmd += ["--meta_file", str(root / "configs" / "metadata.json"), "--logging_file", str(root / "configs" / "logging.conf")]
    for key, value in {"bundle_root": str(root), **(overrides or {})}.items():
        cmd += [f"--{key}", _cli_value(value)]
    return cmd


#: seconds a bundle run asked to stop (SIGTERM) has to end before it is killed
STOP_GRACE_S = 30.0


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(143)`` here for the ``with`` block (as SIGINT raises ``KeyboardInterrupt``), so that
    the block's cleanup runs; signal handlers belong to the main thread, elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _end(proc: subprocess.Popen, name: str) -> None:
    """Ends a bundle run still going: SIGTERM, then SIGKILL after :data:`STOP_GRACE_S` seconds."""
    if proc.poll() is not None:
        return
    print(f"stopping: ending the {name} run (pid {proc.pid})", file=sys.stderr, flush=True)
    proc.terminate()
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
    run's CPU threads (``OMP_NUM_THREADS``), for several runs side by side. The run is ended (SIGTERM, then SIGKILL)
    when this call is interrupted: SIGINT, SIGTERM (in the main thread) or any other exception, which then propagates.

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
        with _sigterm_raises(), subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                 env=env) as proc:  # fmt: skip
            try:
                for line in proc.stdout:
                    lines.append(line)
                    if sink:
                        sink.write(line)
                    if echo and any(mark in line for mark in _PROGRESS_MARKS):
                        print("    " + line.split(" - ")[-1].strip(), flush=True)
                code = proc.wait()
            except BaseException:
                _end(proc, Path(str(bundle)).name)
                raise
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
