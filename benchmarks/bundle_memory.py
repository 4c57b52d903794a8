"""Peak memory and first-progress time of a bundle command: ``python benchmarks/bundle_memory.py -- CMD ...``.

Runs CMD (e.g. the SSL bundle's tiny CPU command, or its torchrun variant) and samples every process of its tree
(the launcher, torchrun's ranks, their data-loader workers) every ``--interval`` seconds. Prints one JSON object:

- ``peak_tree_rss_gb``: the largest sum of resident memory over the whole tree at one moment (pages that forked
  workers share with their parent are counted in each: an upper bound), and ``peak_tree_pss_gb``, the same with
  shared pages split between their processes (what has to fit in the machine);
- ``peak_process_rss_gb``: the largest single process (what ``/usr/bin/time -v`` reports as "Maximum resident");
- ``start_line_s`` / ``first_iteration_s``: seconds from the launch to the trainer's start line (ignite's "Engine
  run ...") and to the first iteration line ("Iter: "), and ``wall_s``, the exit code and the machine facts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import machine_info  # noqa: E402


def _tree_memory(root: psutil.Process) -> tuple[int, int, int]:
    """(sum of RSS, sum of PSS, largest RSS) over ``root`` and all its descendants; vanished processes count 0."""
    total = proportional = largest = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, 0
    for proc in procs:
        try:
            info = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += info.rss
        proportional += getattr(info, "pss", info.rss)
        largest = max(largest, info.rss)
    return total, proportional, largest


def measure(cmd: list[str], interval: float = 0.1, cwd: str | None = None) -> dict:
    """Runs ``cmd`` and returns its peak memory, timings and exit code (see the module docstring)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    marks: dict[str, float] = {}
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            now = time.monotonic() - start
            if "SSLTrainer - INFO - Engine run " in line and "engine_start" not in marks:
                marks["engine_start"] = now
            if "Iter: " in line and "first_iteration" not in marks:
                marks["first_iteration"] = now

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak_total = peak_pss = peak_process = 0
    while proc.poll() is None:
        total, proportional, largest = _tree_memory(root)
        peak_total, peak_pss = max(peak_total, total), max(peak_pss, proportional)
        peak_process = max(peak_process, largest)
        time.sleep(interval)
    reader.join(timeout=10)
    first = marks.get("first_iteration")
    return {
        "command": cmd,
        "exit_code": proc.returncode,
        "wall_s": round(time.monotonic() - start, 1),
        "peak_tree_rss_gb": round(peak_total / 2**30, 2),
        "peak_tree_pss_gb": round(peak_pss / 2**30, 2),
        "peak_process_rss_gb": round(peak_process / 2**30, 2),
        "start_line_s": marks.get("engine_start") and round(marks["engine_start"], 1),
        "first_iteration_s": first and round(first, 1),
        "output_tail": "".join(lines[-15:]),
        "machine": machine_info(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between memory samples")
    parser.add_argument("--cwd", default=None, help="folder to run the command in")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the command to measure after --")
    print(json.dumps(measure(cmd, args.interval, args.cwd), indent=2))


if __name__ == "__main__":
    main()
