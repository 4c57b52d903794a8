"""Peak memory and first-progress time of a bundle command: ``python benchmarks/bundle_memory.py -- CMD ...``.

Runs CMD (e.g. the SSL bundle's tiny CPU command, or its torchrun variant) and samples every process of its tree
(the launcher, torchrun's ranks, their data-loader workers) every ``--interval`` seconds. Prints one JSON object:

- ``peak_tree_rss_gb``: the largest sum of resident memory over the whole tree at one moment (pages that forked
  workers share with their parent are counted in each: an upper bound), and ``peak_tree_pss_gb``, the same with
  shared pages split between their processes (what has to fit in the machine);
- ``peak_process_rss_gb``: the largest single process (what ``/usr/bin/time -v`` reports as "Maximum resident");
- ``peak_process_pss_gb``: the largest single process's PSS (one rank of a torchrun run with no loader workers),
  and both per-process peaks up to the trainer's start line (``..._at_start_line``: before any step);
- ``peak_rank_tree_pss_gb`` / ``peak_rank_tree_rss_gb``: the largest sum over one rank and its descendants (its
  loader workers) at one moment, over the ranks: what one rank costs with its workers. A rank is a process whose
  environment has ``LOCAL_RANK`` (torchrun sets it) and whose parent's does not; without torchrun the command's
  process is the one rank. ``rank_tree_processes``: the most processes one rank's tree had;
- ``start_line_s`` / ``first_iteration_s``: seconds from the launch to the trainer's start line (ignite's "Engine
  run ...") and to the first iteration line ("Iter: "), and ``wall_s``, the exit code and the machine facts.

``measure(..., stop_at="first_iteration")`` (or ``stop_at="iterations"`` with ``iterations=N``: once an "Iter: N/"
line or a later one is logged, or a ``timeout``) ends the run there: the whole process group gets SIGTERM, then
SIGKILL after a grace period; ``stopped`` says why it ended early and ``left_running`` counts the processes of its
tree still alive afterwards (0).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import machine_info  # noqa: E402


def _is_rank(proc: psutil.Process, known: dict[tuple[int, float], bool]) -> bool:
    """Whether ``proc``'s environment has ``LOCAL_RANK`` (remembered per process)."""
    key = (proc.pid, proc.create_time())
    if key not in known:
        known[key] = "LOCAL_RANK" in proc.environ()
    return known[key]


def _tree_memory(root: psutil.Process, known: dict | None = None) -> tuple[int, int, int, int, list[tuple[int, ...]]]:
    """(sum of RSS, sum of PSS, largest RSS, largest PSS) over ``root`` and all its descendants, and per rank (see
    the module docstring) its tree's (sum of RSS, sum of PSS, processes); vanished processes count 0."""
    known = {} if known is None else known
    total = proportional = largest = largest_pss = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, 0, 0, []
    sizes: dict[int, tuple[int, int]] = {}
    parents: dict[int, int] = {}
    ranks: set[int] = set()
    for proc in procs:
        try:
            info = proc.memory_full_info()
            parents[proc.pid] = proc.ppid()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        try:
            if _is_rank(proc, known):
                ranks.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass  # counted with its parent's tree
        pss = getattr(info, "pss", info.rss)
        sizes[proc.pid] = (info.rss, pss)
        total += info.rss
        proportional += pss
        largest, largest_pss = max(largest, info.rss), max(largest_pss, pss)
    tops = {pid for pid in ranks if parents.get(pid) not in ranks} or {root.pid}
    trees = {pid: [0, 0, 0] for pid in tops}
    for pid, (rss, pss) in sizes.items():
        owner = pid
        while owner is not None and owner not in tops:
            owner = parents.get(owner)
        if owner is not None:
            trees[owner][0] += rss
            trees[owner][1] += pss
            trees[owner][2] += 1
    return total, proportional, largest, largest_pss, [tuple(t) for t in trees.values()]


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20.0) -> int:
    """Ends ``proc`` (started with ``start_new_session=True``) and every process of its tree: SIGTERM to its process
    group (torchrun forwards it to the ranks too), then SIGKILL to whatever is left after ``grace_s``; a descendant
    that left the group gets the same signals by its pid. Returns how many processes of the tree are still alive
    afterwards (0 unless one could not be killed)."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        for child in descendants:
            try:
                child.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        try:
            proc.wait(timeout=wait_s)  # Popen reaps its own child, so its exit code stays the signal's
        except subprocess.TimeoutExpired:
            pass
        _, descendants = psutil.wait_procs(descendants, timeout=wait_s)
        if proc.poll() is not None and not descendants:
            return 0
    return len(descendants) + (proc.poll() is None)


def measure(cmd: list[str], interval: float = 0.1, cwd: str | None = None, stop_at: str | None = None,
            timeout: float | None = None, env: dict | None = None, iterations: int = 1) -> dict:  # fmt: skip
    """Runs ``cmd`` and returns its peak memory, timings and exit code (see the module docstring); with ``stop_at``
    ("engine_start", "first_iteration", or "iterations": iteration ``iterations`` logged) the run is ended as soon
    as that line is logged, with ``timeout`` after that many seconds (``stopped`` names which)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
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
            done = re.search(r"Iter: (\d+)/", line)
            if done and int(done.group(1)) >= iterations and "iterations" not in marks:
                marks["iterations"] = now

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak_total = peak_pss = peak_process = peak_process_pss = peak_rank_rss = peak_rank_pss = rank_processes = 0
    at_start_line: tuple[int, int] | None = None
    stopped, left_running, known = None, 0, {}
    try:
        while proc.poll() is None:
            total, proportional, largest, largest_pss, trees = _tree_memory(root, known)
            peak_total, peak_pss = max(peak_total, total), max(peak_pss, proportional)
            for rss, pss, count in trees:
                peak_rank_rss, peak_rank_pss = max(peak_rank_rss, rss), max(peak_rank_pss, pss)
                rank_processes = max(rank_processes, count)
            peak_process, peak_process_pss = max(peak_process, largest), max(peak_process_pss, largest_pss)
            if at_start_line is None and "engine_start" in marks:
                at_start_line = (peak_process, peak_process_pss)
            if stop_at in marks or timeout is not None and time.monotonic() - start > timeout:
                stopped = stop_at if stop_at in marks else "timeout"
                break
            time.sleep(interval)
    finally:
        if proc.poll() is None:
            left_running = stop_process_group(proc)
    reader.join(timeout=10)
    first = marks.get("first_iteration")
    return {
        "command": cmd,
        "exit_code": proc.returncode,
        "stopped": stopped,
        "left_running": left_running,
        "wall_s": round(time.monotonic() - start, 1),
        "peak_tree_rss_gb": round(peak_total / 2**30, 2),
        "peak_tree_pss_gb": round(peak_pss / 2**30, 2),
        "peak_process_rss_gb": round(peak_process / 2**30, 2),
        "peak_process_pss_gb": round(peak_process_pss / 2**30, 3),
        "peak_rank_tree_rss_gb": round(peak_rank_rss / 2**30, 3),
        "peak_rank_tree_pss_gb": round(peak_rank_pss / 2**30, 3),
        "rank_tree_processes": rank_processes,
        "peak_process_rss_gb_at_start_line": at_start_line and round(at_start_line[0] / 2**30, 3),
        "peak_process_pss_gb_at_start_line": at_start_line and round(at_start_line[1] / 2**30, 3),
        "start_line_s": marks.get("engine_start") and round(marks["engine_start"], 1),
        "first_iteration_s": first and round(first, 1),
        "iterations_s": marks.get("iterations") and round(marks["iterations"], 1),
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
