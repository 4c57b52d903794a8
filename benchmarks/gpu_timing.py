"""The helpers of ``benchmarks/gpu_check.py`` and ``benchmarks/gpu_health.py``: device synchronisation, peak memory,
a timed loop with a deadline, a bundle trainer's timed iterations, :class:`Record`, a part's figures rewritten to its
file at every change (a part killed at the end of its share leaves what it had measured), :func:`run_in_share`,
which runs a part in a child process and kills it at the end of its share, and the command line and JSON header the
two runners share (:func:`budget_parser`, :func:`chosen`, :func:`run_header`)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from machine import REPO, git_commit, machine_info


def device_in_use() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronizer(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """Peak GPU memory allocated since the last reset, GiB; None on the CPU."""
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def release(device: torch.device) -> None:
    """Frees what the previous measurement left (an ignite engine holds reference cycles) before the next one."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def significant(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def step_figures(seconds: float, flops: int, device: torch.device, peak_gib: float | None) -> dict:
    """ms per step, FLOPs, TFLOP/s (and its share of the device's datasheet bf16 peak where known), peak GiB."""
    from ssl_step import bf16_peak_tflops

    tflops = flops / seconds / 1e12
    peak_tflops, _ = bf16_peak_tflops(device)
    return {
        "ms_per_step": round(seconds * 1000, 2),
        "flops_per_step": flops,
        "tflops_per_s": significant(tflops),
        "share_of_bf16_peak": significant(tflops / peak_tflops) if peak_tflops else None,
        "peak_gpu_memory_gib": peak_gib,
    }


def time_loop(step: Callable[[], None], device: torch.device, warmup: int, iters: int, deadline: float) -> dict:
    """A plain loop: its first step counted for its FLOPs, ``warmup - 1`` more untimed steps, then up to ``iters``
    timed ones (at least one; fewer when ``deadline``, a ``time.time()``, comes first)."""
    from ssl_step import count_flops

    sync = synchronizer(device)
    flops = count_flops(step)
    for _ in range(warmup - 1):
        step()
    sync()
    reset_peak(device)
    start, steps = time.perf_counter(), 0
    while steps < iters and (steps == 0 or time.time() < deadline):
        step()
        steps += 1
    sync()
    seconds = (time.perf_counter() - start) / steps
    figures = step_figures(seconds, flops, device, peak_gib(device))
    return {**figures, "warmup_steps": max(warmup, 1), "steps_timed": steps}


def time_trainer(trainer, warmup: int, iters: int) -> dict:
    """A bundle's ignite trainer run free for ``warmup + iters`` iterations (``warmup`` >= 1), timed over the last
    ``iters`` from the end of iteration ``warmup``; its first iteration is counted for its FLOPs."""
    from ignite.engine import Events
    from ssl_step import _checkpointing_applied
    from torch.utils.flop_counter import FlopCounterMode

    device = torch.device(trainer.state.device)
    sync = synchronizer(device)
    counter = FlopCounterMode(display=False)
    marks: dict[str, float] = {}
    last = warmup + iters

    def started(engine) -> None:  # added last: after the bundle's own ITERATION_STARTED handlers
        if engine.state.iteration == 1:
            counter.__enter__()

    def completed(engine) -> None:  # added last: after the bundle's own ITERATION_COMPLETED handlers
        iteration = engine.state.iteration
        if iteration == 1:
            counter.__exit__(None, None, None)
        if iteration == warmup:
            sync()
            reset_peak(device)
            marks["start"] = time.perf_counter()
        elif iteration == last:
            sync()
            marks["end"], marks["peak"] = time.perf_counter(), peak_gib(device)
            engine.terminate()

    trainer.add_event_handler(Events.ITERATION_STARTED, started)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, completed)
    trainer.state.max_epochs = math.ceil(last / len(trainer.data_loader)) + 1
    trainer.run()
    seconds = (marks["end"] - marks["start"]) / iters
    figures = step_figures(seconds, int(counter.get_total_flops()), device, marks["peak"])
    loader = trainer.data_loader
    return {**figures, "warmup_steps": warmup, "steps_timed": iters, "iterations_per_epoch": len(loader),
            "num_workers": loader.num_workers, "use_checkpoint_applied": _checkpointing_applied(trainer.network)}


def autocast_for(device: torch.device) -> Callable:
    """The research code's ``torch.cuda.amp.autocast()``: float16 on CUDA, nothing on a CPU."""
    return lambda: torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda")


def ratio(reference: dict, bundle: dict) -> float:
    return round(reference["ms_per_step"] / bundle["ms_per_step"], 3)


def one_line(err: BaseException) -> str:
    """The innermost cause of ``err`` in one line (MONAI's config parser wraps the error of a component it builds)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


class Record:
    """A part's figures so far, rewritten to its file at every change: a part killed at the end of its share leaves
    what it had measured. ``errors``: what failed, one line each."""

    def __init__(self, path: Path) -> None:
        self.path, self.figures, self.errors = path, {}, []

    def __setitem__(self, key: str, value) -> None:
        from components import atomic_write

        self.figures[key] = value
        with atomic_write(self.path, "w") as f:
            f.write(json.dumps(self.figures))

    def fail(self, reason: str) -> None:
        self.errors.append(reason)
        self["errors"] = self.errors

    def measure(self, key: str, measurement: Callable[[], dict]) -> dict | None:
        """``measurement()`` recorded under ``key``; an exception is recorded in one line (its traceback logged) and
        the part goes on: a bundle step that fails still leaves the reference's figures."""
        try:
            value = measurement()
        except Exception as err:
            logging.getLogger("gpu_check").exception("%s failed", key)
            self.fail(f"{key}: {one_line(err)}")
            return None
        self[key] = value
        return value


def run_in_share(cmd: list[str], partial: Path, share: float, log: Path, name: str, workdir: Path) -> dict:
    """Runs ``cmd`` (a part writing its :class:`Record` to ``partial``) in its own session for at most ``share``
    seconds, its output appended to ``log``; at the end of the share the whole process group (its bundle runs and
    loader workers) is killed. Returns the part's status ("done", "failed" with a reason, "timed_out"), share, wall
    time and figures."""
    repo = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])])
    # unbuffered: a killed part's log is whole; its temporary files go where the caller removes them at its end
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "TMPDIR": str(workdir)}
    with log.open("a") as out:
        out.write(f"\n===== {name}: share {share:.0f} s =====\n")
        out.flush()
        offset, start = out.tell(), time.perf_counter()
        child = subprocess.Popen(cmd, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = child.wait(timeout=share)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the part's own process group: its loader workers go with it
            child.wait()
            code = None
    figures = json.loads(partial.read_text()) if partial.is_file() else {}
    wall = round(time.perf_counter() - start, 1)
    entry = {"status": "done" if code == 0 else "failed", "share_s": round(share, 1), "wall_s": wall}
    if code is None:
        entry.update(status="timed_out", reason=f"still running at the end of its share ({share:.0f} s); killed")
    elif code != 0:
        entry["reason"] = "; ".join(figures.pop("errors", [])) or _last_line(log, offset) or f"exit code {code}"
    return {**entry, **figures}


def _last_line(log: Path, offset: int) -> str:
    lines = log.read_bytes()[offset:].decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def budget_parser(description: str, kind: str, names: tuple[str, ...], small_help: str, log_help: str) -> argparse.ArgumentParser:
    """The command line of a runner of ``kind`` parts (``names``, run in turn within one budget): the budget, the
    sizes, the parts, the JSON's folder, the log and the commit, and the hidden options of a part run as a child
    (``--_<kind>``, ``--_partial``, ``--_deadline``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--budget_s", type=float, default=480.0, help="wall-clock seconds for everything (default 480)")
    parser.add_argument("--small", action="store_true", help=small_help)
    parser.add_argument(f"--{kind}s", default=",".join(names), help="comma-separated, run in this order (default: all)")
    parser.add_argument("--out_dir", type=Path, default=REPO / "benchmarks" / "results",
                        help="the JSON's folder (default benchmarks/results)")  # fmt: skip
    parser.add_argument("--log", type=Path, default=None, help=log_help)
    parser.add_argument("--commit", default=None, help="the commit that runs (default: git's HEAD here, which a "
                        "copied checkout may not know)")  # fmt: skip
    parser.add_argument(f"--_{kind}", dest=kind, choices=names, help=argparse.SUPPRESS)
    parser.add_argument("--_partial", dest="partial", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--_deadline", dest="deadline", type=float, help=argparse.SUPPRESS)
    return parser


def chosen(parser: argparse.ArgumentParser, kind: str, value: str, names: tuple[str, ...]) -> list[str]:
    """The parts ``--<kind>s`` names, in its order; the parser's error unless they are distinct names of ``names``."""
    picked = [name.strip() for name in value.split(",") if name.strip()]
    if not picked or set(picked) - set(names) or len(set(picked)) != len(picked):
        parser.error(f"--{kind}s: distinct names from {', '.join(names)}; got {value!r}")
    return picked


def run_header(benchmark: str, device: dict, small: bool, budget_s: float, commit: str | None) -> dict:
    """What a runner's JSON starts with: the benchmark, the device and its facts, the budget, the commit (``commit``
    as given, else git's HEAD here), torch and the machine."""
    return {"benchmark": benchmark, "device": device["name"], "small": small, "budget_s": budget_s,
            "commit": commit or git_commit(), "commit_source": "--commit" if commit else "git here",
            "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": device, "machine": machine_info()}  # fmt: skip
