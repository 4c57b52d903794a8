"""The host allocator of a training process: glibc's malloc tuned so that repeated large allocations stop
page-faulting (``tune_allocator``, opt-in per bundle)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

from ..config.values import as_bool

__all__ = ["tune_allocator"]

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def tune_allocator(enabled: bool | str = True, trim_threshold: int = -1, top_pad: int = 64 << 20) -> bool:
    """Keeps freed memory inside the process on Linux/glibc, so large CPU activations are not mmap'ed, freed and
    page-faulted again every iteration.

    glibc serves allocations above its mmap threshold (at most 32 MB) with fresh ``mmap`` calls and returns
    them on free, and gives the top of the heap back to the system once more than ``M_TRIM_THRESHOLD`` is free; a
    3D transformer step then spends more time in the kernel than in its own math. Disabling mmap allocations
    (``M_MMAP_MAX=0``) and trimming (``trim_threshold=-1``, mallopt's "never") makes freed blocks reusable: after
    the first iterations the heap stops growing and a step page-faults no more. The price is a heap about twice
    the plain peak (fragmentation: with every block on the heap, freed holes of one size do not fit the next
    sizes), measured in ``benchmarks/ssl_step.py``; trimming the heap after every iteration does not bound it (the
    fragmentation is within one iteration). So the bundles leave it off (``tune_allocator`` false): it is an opt-in
    for CPU runs with memory to spare, where it makes a step 2-3x faster. PyTorch has no setting for this (its
    caching allocator is CUDA-only). Returns True when applied; a no-op elsewhere (macOS, Windows, musl) and when
    ``enabled`` is False.

    Args:
        enabled: False leaves the allocator as it is (``"false"`` and the other words of
            :func:`~components.config.values.as_bool` too, as a command line passes them).
        trim_threshold: free bytes at the heap top above which glibc trims; -1 never trims. A positive value
            (at most 2 GiB: mallopt takes an int) bounds the heap at the cost of page faults after every trim.
        top_pad: extra bytes requested whenever the heap grows.
    """
    if not as_bool(enabled, "tune_allocator") or platform.system() != "Linux":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.info("tune_allocator: no glibc mallopt here; allocator left as it is.")
        return False
    applied = mallopt(_M_MMAP_MAX, 0) == 1
    applied &= mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1
    applied &= mallopt(_M_TOP_PAD, int(top_pad)) == 1
    if applied:
        _trim_before_fork(libc)
    logger.info("tune_allocator: glibc keeps freed memory in the process (applied=%s).", applied)
    return bool(applied)


_FORK_HOOKED: list[bool] = []


def _trim_before_fork(libc: ctypes.CDLL) -> None:
    """Gives the free heap back to the system right before every ``fork`` (data-loader workers), once per process.

    A forked worker shares the parent's heap pages copy-on-write; a parent that then reuses its freed blocks (which
    is what the tuning is for) copies every page it writes while workers live: with workers forked each epoch
    after the heap has grown, the trainer's memory doubled. ``malloc_trim(0)`` before the fork releases the free
    blocks, so the parent's next writes land on fresh pages and only live data stays shared; the cost is the page
    faults of one iteration per fork.
    """
    if _FORK_HOOKED or not hasattr(os, "register_at_fork") or not hasattr(libc, "malloc_trim"):
        return
    os.register_at_fork(before=lambda: libc.malloc_trim(0))
    _FORK_HOOKED.append(True)
