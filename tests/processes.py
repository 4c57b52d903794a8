"""The process tree below a process, read from Linux ``/proc``: what the tests that stop a command check is gone."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

#: whether this system has the /proc these helpers read
HAS_PROC = Path("/proc/self/stat").is_file()


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, then the parent's PID)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return _stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``: children, their children, and so on."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = _stat(stat.parent.name)
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return {p for p in found if alive(p)}


def command_line(pid: int) -> str:
    """The command line of process ``pid`` ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def signal_each(processes: dict, trees: Iterable[set[int]], exit_timeout: float, gone_timeout: float) -> dict:
    """Sends each process of ``processes`` (signal -> ``subprocess.Popen``) its signal, waits up to ``exit_timeout``
    seconds for each to exit, then up to ``gone_timeout`` for every process of ``trees`` to be gone; returns each
    signal's exit code (``subprocess.TimeoutExpired`` when a process outlives its wait)."""
    for sig, process in processes.items():
        process.send_signal(sig)
    codes = {sig: process.wait(timeout=exit_timeout) for sig, process in processes.items()}
    pids = set().union(*trees)
    deadline = time.monotonic() + gone_timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return codes
