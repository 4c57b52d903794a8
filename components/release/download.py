"""Downloading a bundle release with a hash check, and extracting it safely.

Why this module exists next to ``monai.bundle download``: in MONAI 1.5.1 and 1.6.1 every bundle source of ``download``
(``--url``, ``github``, ``monaihosting``, ``ngc``) calls ``download_url(..., hash_val=None)``, so a bundle zip is
never checked against a hash, and ``monai.bundle.load`` downloads through the same path. A bundle is code (its
configs are evaluated: ``_target_`` and ``$`` expressions) plus weights, so here:

- :func:`fetch` downloads (``http(s)://``, ``file://`` or a plain path) and hashes the bytes as they arrive, writing
  them with :func:`~components.files.atomic_write`, so that the target appears only once its SHA-256 matched. A hash
  is required: the ``sha256`` argument (from a trusted place, e.g. the release notes) or, when it is not given, the
  ``<url>.sha256`` file published next to the zip. The sidecar only guards against corrupt or truncated downloads
  (whoever can replace the zip can replace the sidecar); pass ``sha256`` to guard against tampering. The check is
  ours, not MONAI's ``download_url``'s: a mismatch there is a ``RuntimeError`` that leaves the file in place before
  MONAI 1.6 and a ``HashCheckError`` after, and neither names the hash the file has.
- :func:`extract_zip_safely` checks every member with MONAI's ``safe_extract_member`` (absolute names, paths out of
  the target folder) and refuses what MONAI extracts (``..`` anywhere, symbolic links and special files,
  backslashes, drive letters, duplicates) before MONAI's ``extractall`` writes anything.
- :func:`fetch_bundle` = fetch + verify + safe extraction into ``<bundle_dir>/<name>/``, with the weights listed in
  ``large_files.yml`` fetched the same way once every entry is checked to have a hash, a hash type and a path inside
  the bundle (MONAI's ``download_large_files`` downloads an entry without a hash unchecked, and before 1.6 writes
  wherever its path points); the zip is kept in ``bundle_dir`` so that ``monai.bundle download --source github ...
  --bundle_dir <bundle_dir>`` and ``monai.bundle.load(name, bundle_dir=<bundle_dir>)`` find it afterwards without
  downloading again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath

from monai.apps.utils import extractall, safe_extract_member

from ..errors import UserError
from ..files import atomic_write, file_digest
from .package import LARGE_FILES, _normalize_sha256

__all__ = ["HashMismatchError", "UnsafeArchiveError", "extract_zip_safely", "fetch", "fetch_bundle"]

logger = logging.getLogger(__name__)


#: the hash types a ``large_files.yml`` entry may name (those of MONAI's ``download_url``)
HASH_TYPES = ("md5", "sha1", "sha256", "sha512")


class HashMismatchError(UserError, ValueError):
    """A downloaded file's hash differs from the expected one; the download was discarded."""


class UnsafeArchiveError(ValueError):
    """An archive member would be written outside the target folder, or is a link or special file."""


# ------------------------------------------------------------------------------------------------------------
# fetching


def _is_url(src: str) -> bool:
    scheme = urllib.parse.urlparse(src).scheme
    if len(scheme) <= 1:  # no scheme, or a Windows drive letter
        return False
    if scheme not in ("http", "https", "file", "ftp"):
        raise ValueError(f"unsupported URL scheme {scheme!r} in {src!r} (expected http(s)://, file:// or a path).")
    return True


def _source_name(src: str) -> str:
    if _is_url(src):
        name = PurePosixPath(urllib.parse.unquote(urllib.parse.urlparse(src).path)).name
    else:
        name = Path(src).name
    if not name:
        raise ValueError(f"cannot tell a file name from {src!r}.")
    return name


def _open_source(src: str, timeout: float = 60.0):
    if _is_url(src):
        return urllib.request.urlopen(src, timeout=timeout)  # noqa: S310 (schemes checked in _is_url)
    return open(src, "rb")


def _sidecar_of(src: str) -> str:
    if _is_url(src):
        parts = urllib.parse.urlparse(src)
        return urllib.parse.urlunparse(parts._replace(path=parts.path + ".sha256"))
    return src + ".sha256"


def _read_sidecar(src: str, expected_name: str) -> str:
    sidecar = _sidecar_of(src)
    try:
        with _open_source(sidecar) as f:
            text = f.read(4096).decode("utf-8", "replace")
    except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
        raise ValueError(
            f"no sha256 given for {src} and no hash file at {sidecar} ({e}). Pass sha256=<hex> "
            "(e.g. from the release notes): downloads are never used unchecked."
        ) from e
    fields = text.split("\n", 1)[0].split()
    if not fields:
        raise ValueError(f"{sidecar} is empty; expected '<sha256>  <file name>'.")
    digest = _normalize_sha256(fields[0], sidecar)
    if len(fields) > 1 and fields[1].lstrip("*") != expected_name:
        raise ValueError(f"{sidecar} is the hash of {fields[1].lstrip('*')!r}, not of {expected_name!r}.")
    return digest


def _make_dirs(path: Path) -> list[Path]:
    """Creates ``path`` and missing parents; returns the folders it created, deepest first."""
    created = []
    p = path
    while not p.exists():
        created.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    return created


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def _download_checked(src: str, target: Path, expected: str, hash_type: str) -> None:
    """Streams ``src`` into ``target`` while hashing it; ``target`` is replaced only when the digest is ``expected``.

    Raises:
        HashMismatchError: naming the source, the expected and the actual digest; ``target`` is as it was.
    """
    digest = hashlib.new(hash_type, usedforsecurity=False)  # md5 and sha1 as checksums, also where FIPS is on
    with _open_source(src) as source, atomic_write(target) as out:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
            out.write(block)
        if digest.hexdigest() != expected:
            raise HashMismatchError(
                f"{hash_type} of {src} is {digest.hexdigest()}, not the expected {expected}; the download was "
                "discarded (corrupt, truncated or not the published file)."
            )


def _fetch_to(src: str, target: Path, expected: str, hash_type: str = "sha256") -> None:
    """:func:`_download_checked` of ``src`` to ``target``, unless ``target`` already has the expected digest; on a
    failure the folders this call created are removed again."""
    if target.is_file() and file_digest(target, hash_type) == expected:
        logger.info("fetch: %s already present with %s %s; not downloading", target, hash_type, expected)
        return
    created = _make_dirs(target.parent)
    try:
        _download_checked(src, target, expected, hash_type)
    except BaseException:
        _remove_empty(created)
        raise
    logger.info("fetch: %s -> %s (%s %s verified)", src, target, hash_type, expected)


def fetch(url_or_path: str | os.PathLike, dest: str | os.PathLike, sha256: str | None = None) -> Path:
    """Downloads ``url_or_path`` (``http(s)://``, ``file://`` or a local path) to ``dest`` after checking its SHA-256;
    returns the file's path.

    ``dest`` is the target file, or a folder (existing, or written with a trailing ``/``) to put the file in
    under its own name. A target with the expected hash is kept as it is (no download); one with another hash is
    replaced.

    Args:
        url_or_path: what to download.
        dest: the target file or folder.
        sha256: the expected SHA-256; ``None`` reads it from ``<url_or_path>.sha256`` (``sha256sum`` format, as
            :func:`package_bundle` writes it). MONAI's own bundle download passes no hash at all.

    Raises:
        ValueError: no hash given and no ``.sha256`` file beside the source, or one that is not a SHA-256.
        HashMismatchError: the downloaded bytes have another SHA-256 (the message names both); nothing is left: no
            partial or temporary file, no folder this call created.
    """
    src = os.fspath(url_or_path)
    name = _source_name(src)
    expected = _normalize_sha256(sha256, "sha256") if sha256 is not None else _read_sidecar(src, name)
    as_folder = os.fspath(dest).endswith(("/", os.sep)) or Path(dest).is_dir()
    target = Path(dest) / name if as_folder else Path(dest)
    _fetch_to(src, target, expected)
    return target


# ------------------------------------------------------------------------------------------------------------
# safe extraction


def _member_problem(info: zipfile.ZipInfo, seen: set[str]) -> str | None:
    """Why a member must not be extracted, of what MONAI's ``extractall`` would extract: it normalises a name before
    its check (``b/../x`` passes as ``x``, outside the member's own folder), takes ``C:/x`` and ``a\\..\\b`` as plain
    names on POSIX (they escape on Windows), writes a symbolic link or a device as a regular file (holding the
    link's target), and a second member of a name over the first."""
    name = info.filename
    mode = info.external_attr >> 16
    if not name or "\x00" in name:
        return "has an empty or invalid name"
    if "\\" in name:
        return "contains a backslash (an ambiguous path separator)"
    if re.match(r"^[A-Za-z]:", name):
        return "is an absolute Windows path"
    if ".." in PurePosixPath(name).parts:
        return "has a '..' component"
    if stat.S_ISLNK(mode):
        return "is a symbolic link"
    if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return "is not a regular file or folder"
    if name.rstrip("/") in seen:
        return "appears twice"
    return None


def extract_zip_safely(zip_path: str | os.PathLike, dest: str | os.PathLike) -> list[Path]:
    """Extracts a zip into ``dest`` (new or empty) with MONAI's ``extractall`` after checking every member;
    returns the extracted files' paths.

    MONAI (``safe_extract_member``) refuses absolute names, names that still start with ``..`` once normalised and
    members whose resolved path (following links already under ``dest``) leaves ``dest``, and writes no file mode
    from the archive (no setuid or exec bits); but it checks each member only when it reaches it, after writing the
    ones before. Here every member is checked with MONAI's check before anything is written, and refused as well is
    what MONAI extracts: ``..`` anywhere in a name, symbolic links and other special entries, backslashes and drive
    letters, duplicate names (:func:`_member_problem`).

    Raises:
        UnsafeArchiveError: naming the zip and the member; nothing was written.
        FileExistsError: ``dest`` is not empty (``extractall`` skips a non-empty folder without a word).
    """
    dest = Path(dest)
    with zipfile.ZipFile(zip_path) as zf:
        members = zf.infolist()
    seen: set[str] = set()
    written = []
    for info in members:
        reason = _member_problem(info, seen)
        if reason is None:
            try:
                target = Path(safe_extract_member(info, os.fspath(dest)))
            except ValueError as err:
                reason = f"would be written outside {dest.resolve()} ({err})"
        if reason is not None:
            raise UnsafeArchiveError(
                f"refusing to extract {zip_path}: member {info.filename!r} {reason}; nothing was extracted."
            )
        seen.add(info.filename.rstrip("/"))
        if not info.is_dir():
            written.append(target)
    if dest.is_dir() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty; extract_zip_safely extracts into a new or empty folder.")
    extractall(zip_path, dest, has_base=False)
    return written


def _bundle_top_folder(zip_path: Path) -> str:
    with zipfile.ZipFile(zip_path) as zf:
        names = [n for n in zf.namelist() if n]
    tops = {n.split("/", 1)[0] for n in names}
    if len(tops) != 1 or any("/" not in n for n in names if not n.endswith("/")):
        raise ValueError(
            f"{zip_path} is not a bundle release: expected every entry under one top folder <name>/, "
            f"found {sorted(tops)}."
        )
    top = tops.pop()
    if f"{top}/configs/metadata.json" not in names:
        raise ValueError(f"{zip_path} is not a bundle release: {top}/configs/metadata.json is missing.")
    return top


def _large_files(bundle: Path) -> list[tuple[str, Path, str, str]]:
    """``(url, target, hash, hash type)`` of each weight the bundle's ``large_files.yml`` lists (MONAI reads it with
    PyYAML), all checked before any is downloaded: each has a hash, a hash type of :data:`HASH_TYPES` (MONAI's default
    for a missing one is md5 before 1.6 and sha256 after) and a path inside the bundle."""
    from monai.bundle import ConfigParser
    from monai.utils import OptionalImportError

    listed = bundle / LARGE_FILES
    try:
        entries = ConfigParser.load_config_file(listed).get("large_files") or []
    except OptionalImportError:
        raise ModuleNotFoundError(f"{bundle.name}/{LARGE_FILES} lists the bundle's weights and MONAI reads it with "
                                  "PyYAML, which is not installed: pip install pyyaml") from None  # fmt: skip
    where = f"{bundle.name}/{LARGE_FILES}"
    incomplete = [entry for entry in entries if not entry.get("path") or not entry.get("url")]
    if incomplete:
        raise ValueError(f"{where} lists {incomplete} without a path or a url.")
    unhashed = [entry["path"] for entry in entries if not entry.get("hash_val")]
    if unhashed:
        raise ValueError(f"{where} lists {unhashed} without hash_val; downloads are never used unchecked.")
    untyped = [entry["path"] for entry in entries if str(entry.get("hash_type", "")).lower() not in HASH_TYPES]
    if untyped:
        raise ValueError(f"{where} lists {untyped} without a hash_type of {', '.join(HASH_TYPES)}.")
    root = bundle.resolve()
    targets = [(root / str(entry["path"])).resolve() for entry in entries]
    outside = [entry["path"] for entry, target in zip(entries, targets) if root not in target.parents]
    if outside:
        raise ValueError(f"{where} lists {outside}, which would be written outside {bundle.name}/.")
    return [(str(entry["url"]), target, str(entry["hash_val"]).strip().lower(), str(entry["hash_type"]).lower())
            for entry, target in zip(entries, targets)]  # fmt: skip


def fetch_bundle(
    url: str | os.PathLike, bundle_dir: str | os.PathLike, sha256: str | None = None, overwrite: bool = False
) -> Path:
    """Downloads a bundle zip into ``bundle_dir`` with :func:`fetch` (hash required: ``sha256`` or
    ``<url>.sha256``), checks that it is a bundle release (one top folder ``<name>/`` with
    ``configs/metadata.json``) and extracts it with :func:`extract_zip_safely` to ``bundle_dir/<name>/``, with the
    weights its ``large_files.yml`` lists (a release packaged with a release URL) downloaded and hash-checked into
    it as :func:`fetch` does (:func:`_large_files`; MONAI reads the list with PyYAML); returns that folder.

    This is the hash-checked replacement for ``python -m monai.bundle download``, which passes ``hash_val=None``
    for every bundle source. The zip stays in ``bundle_dir``, so ``monai.bundle download
    --source github --repo owner/repo/tag --version X --bundle_dir <bundle_dir>`` finds it and skips the download,
    and ``monai.bundle.load(name, bundle_dir=<bundle_dir>)`` uses the extracted folder. An existing non-empty
    ``bundle_dir/<name>/`` is replaced only with ``overwrite=True`` (``FileExistsError`` otherwise). Extraction
    goes through a temporary folder, so a refused archive or weight file leaves no partial bundle."""
    bundle_dir = Path(bundle_dir)
    src = os.fspath(url)
    zip_target = bundle_dir / _source_name(src)
    had_zip = zip_target.exists()
    zip_path = fetch(src, zip_target, sha256=sha256)
    try:
        top = _bundle_top_folder(zip_path)
        target = bundle_dir / top
        if target.exists() and any(target.iterdir()) and not overwrite:
            raise FileExistsError(f"{target} exists and is not empty; remove it or pass overwrite=True to replace it.")
        staging = Path(tempfile.mkdtemp(prefix=f".{top}.", dir=bundle_dir))
        try:
            extract_zip_safely(zip_path, staging)
            if (staging / top / LARGE_FILES).is_file():
                for weight_url, weight, digest, hash_type in _large_files(staging / top):
                    _fetch_to(weight_url, weight, digest, hash_type)
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging / top, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except (UnsafeArchiveError, ValueError, zipfile.BadZipFile):
        if not had_zip:  # a verified download that is not a usable bundle release: do not leave it for MONAI
            zip_path.unlink(missing_ok=True)
        raise
    logger.info("fetch_bundle: %s extracted to %s", zip_path, target)
    return target
