"""Files written for a user are whole or absent: one helper for every checkpoint, metrics file, package and download;
and one digest of a file's content, for every record that names the file it was made from.

Why not ignite's ``DiskSaver(atomic=True)`` or a plain ``os.replace``: neither ``fsync``-s the data before the rename
nor the directory after it, so a crash shortly after a write can leave an empty file under the final name on some
file systems; and ``DiskSaver`` serves checkpoints only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_write", "file_digest", "sha256_file"]


def temp_prefix(path: Path) -> str:
    """The prefix of :func:`atomic_write`'s temporary files for ``path`` (``.<name>.``): a killed writer leaves
    ``.<name>.<random>.tmp`` beside it, never a partial ``path``."""
    return f".{path.name}."


def fsync_dir(directory: Path) -> None:
    """Flushes a folder's entries (a rename or a new file in it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """A file object whose content replaces ``path`` only when the ``with`` block ends without an exception.

    The content goes to a temporary file in the same folder (created if missing), which is flushed and
    ``fsync``-ed, given the permissions of an existing ``path`` (0644 for a new one) and moved over ``path`` with
    ``os.replace`` (atomic on POSIX and Windows); then the folder is ``fsync``-ed. An exception in the block (a
    failed write, a hash that does not match) removes the temporary file and leaves ``path`` as it was.

    Args:
        path: the final file.
        mode: ``"wb"`` or ``"w"``.
        encoding: for text mode (default UTF-8).

    Example::

        with atomic_write("out/metrics.json", "w") as f:
            json.dump(summary, f)
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write writes whole files: mode must be 'wb' or 'w', got {mode!r}.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=(encoding or "utf-8") if mode == "w" else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, stat.S_IMODE(os.stat(path).st_mode) if path.exists() else 0o644)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_dir(path.parent)


def file_digest(path: str | os.PathLike, hash_type: str = "sha256") -> str:
    """The hex digest of a file's content by ``hash_type`` (a ``hashlib`` name), read in blocks
    (``hashlib.file_digest``); md5 and sha1 as checksums, so also where FIPS mode is on."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.new(hash_type, usedforsecurity=False)).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file's content (:func:`file_digest`)."""
    return file_digest(path, "sha256")
