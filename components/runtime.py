"""Process-level settings applied at the start of a workflow."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

__all__ = ["tune_allocator", "as_bool"]

logger = logging.getLogger(__name__)

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def as_bool(value: bool | int | str, name: str = "value") -> bool:
    """A config flag as a bool: ``python -m monai.bundle run --amp false`` passes the string "false" (truthy),
    so bundle configs read every flag through this. Anything but a clear yes/no raises, naming ``name``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{name} must be true or false, got {value!r}.")


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def tune_allocator(enabled: bool = True, keep_bytes: int = 1 << 30, top_pad: int = 64 << 20) -> bool:
    """Keeps freed memory inside the process on Linux/glibc, so large CPU activations are not mmap'ed, freed and
    page-faulted again every iteration.

    glibc serves allocations above its mmap threshold (at most 32 MB) with fresh ``mmap`` calls and returns
    them on free; a 3D transformer step then spends more time in the kernel than in its own math. Disabling
    mmap allocations (``M_MMAP_MAX=0``) and raising the trim threshold makes freed blocks reusable. PyTorch
    has no setting for this (its caching allocator is CUDA-only). Returns True when applied; a no-op
    elsewhere (macOS, Windows, musl) and when ``enabled`` is False, the opt-out a config id controls.
    """
    if not enabled or platform.system() != "Linux":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.info("tune_allocator: no glibc mallopt here; allocator left as it is.")
        return False
    applied = mallopt(_M_MMAP_MAX, 0) == 1
    applied &= mallopt(_M_TRIM_THRESHOLD, int(keep_bytes)) == 1
    applied &= mallopt(_M_TOP_PAD, int(top_pad)) == 1
    logger.info("tune_allocator: glibc keeps freed memory in the process (applied=%s).", applied)
    return bool(applied)
