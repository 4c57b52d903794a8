"""Cold reads without root: what a benchmark needs to read a folder's files from disk and to show that it did.

- :func:`drop_page_cache` writes back and evicts the cached pages of each file (``posix_fadvise`` with
  ``POSIX_FADV_DONTNEED``: any user may do it for files they can open; pages some process still maps stay cached);
- :func:`resident_bytes` says how much of the files is in the page cache (``mincore`` on a fresh mapping, which
  reads nothing), so the eviction can be checked before the timed read;
- :func:`read_bytes` is this process's bytes fetched from storage so far (``/proc/self/io``: counted when the read
  reaches the block layer, page faults of memory-mapped files included), so a timed pass shows what it read;
- :func:`mapped_files` counts the files of a folder this process maps (``/proc/self/maps``): what a reader keeps
  open across items;
- :func:`storage` names the filesystem and device a folder is on, with the device's read-ahead: a page fault in a
  memory-mapped file reads up to that much around it, so a cold read may move more than the chunks it needs.

Linux only: elsewhere the counts are None and the eviction is skipped, which the caller records.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["MECHANISM", "drop_page_cache", "mapped_files", "read_bytes", "resident_bytes", "storage", "store_files"]

MECHANISM = "fsync, then posix_fadvise(POSIX_FADV_DONTNEED) on every file"


def store_files(folder: Path) -> list[Path]:
    """Every regular file under ``folder``, sorted."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def drop_page_cache(files: Iterable[Path]) -> bool:
    """Evicts ``files`` from the page cache (dirty pages are written back first: they cannot be evicted); False
    where the platform has no ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def _resident(libc, path: Path, page: int) -> int:
    size = path.stat().st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, 0x1, 0x1, fd, 0)  # PROT_READ, MAP_SHARED
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(address, size, pages):
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return min(size, page * sum(p & 1 for p in pages))


def resident_bytes(files: Iterable[Path]) -> int | None:
    """Bytes of ``files`` in the page cache (whole pages, at most each file's size); None off Linux."""
    if not os.path.exists("/proc/self/maps"):
        return None
    libc, page = _libc(), os.sysconf("SC_PAGE_SIZE")
    return sum(_resident(libc, Path(p), page) for p in files)


def read_bytes() -> int | None:
    """This process's bytes read from storage so far (``read_bytes`` of ``/proc/self/io``), None where the platform
    does not count them."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "read_bytes":
            return int(value)
    return None


def mapped_files(folder: Path) -> int | None:
    """How many distinct files under ``folder`` this process maps now; None off Linux."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    prefix = f"{Path(folder).resolve()}{os.sep}"
    fields = (line.split(None, 5) for line in lines)
    return len({f[5] for f in fields if len(f) == 6 and f[5].startswith(prefix)})


def storage(folder: Path) -> dict:
    """The filesystem type, device and the device's read-ahead in KiB (None where ``/sys`` does not say) of the
    mount that holds ``folder``."""
    import psutil

    resolved = Path(folder).resolve()
    mounts = [p for p in psutil.disk_partitions(all=True) if resolved.is_relative_to(p.mountpoint)]
    mount = max(mounts, key=lambda p: len(p.mountpoint), default=None)
    dev = os.stat(resolved).st_dev
    queue = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    read_ahead = None
    for candidate in (queue / "queue" / "read_ahead_kb", queue / ".." / "queue" / "read_ahead_kb"):
        if candidate.is_file():
            read_ahead = int(candidate.read_text())
            break
    return {"filesystem": mount.fstype if mount else None, "device": mount.device if mount else None,
            "read_ahead_kb": read_ahead}
