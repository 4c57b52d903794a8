"""Release and reuse of the bundles: deterministic packaging, hash-checked fetching and safe extraction.

Why this module exists next to ``monai.bundle download``: in MONAI 1.6.1 every bundle source of ``download``
(``--url``, ``github``, ``monaihosting``, ``ngc``) calls ``download_url(..., hash_val=None)``, so a bundle zip is
never checked against a hash, and ``monai.bundle.load`` downloads through the same path. A bundle is code (its
configs are evaluated: ``_target_`` and ``$`` expressions) plus weights, so here:

- :func:`package_bundle` writes ``<out>/<name>_v<version>.zip`` byte-for-byte reproducibly (sorted entries, fixed
  timestamps and permissions, no extra attributes) with one top folder ``<name>/``, the layout
  ``monai.bundle download --name <name>`` extracts to ``<bundle_dir>/<name>/``, and ``<zip>.sha256`` in the
  ``sha256sum`` format. Trained weights (``models/*.pt``) are included when present (with a release URL beside the
  zip, listed in ``large_files.yml``); logs, caches, evaluation outputs, data and temporary files are not
  (:func:`bundle_files`).
- :func:`fetch` downloads (``http(s)://``, ``file://`` or a plain path) with MONAI's ``download_url``, which checks
  the SHA-256, into a temporary folder next to the target and only then renames it into place. A hash is required:
  the ``sha256`` argument (from a trusted place, e.g. the release notes) or, when it is not given, the
  ``<url>.sha256`` file published next to the zip. The sidecar only guards against corrupt or truncated downloads
  (whoever can replace the zip can replace the sidecar); pass ``sha256`` to guard against tampering.
- :func:`extract_zip_safely` checks every member with MONAI's ``safe_extract_member`` (absolute names, paths out of
  the target folder) and refuses what MONAI extracts (``..`` anywhere, symbolic links and special files,
  backslashes, drive letters, duplicates) before MONAI's ``extractall`` writes anything.
- :func:`fetch_bundle` = fetch + verify + safe extraction into ``<bundle_dir>/<name>/``, with the weights listed in
  ``large_files.yml`` downloaded by MONAI's ``download_large_files`` once each is checked to have a hash; the zip
  is kept in ``bundle_dir`` so that ``monai.bundle download --source github ... --bundle_dir <bundle_dir>`` and
  ``monai.bundle.load(name, bundle_dir=<bundle_dir>)`` find it afterwards without downloading again.
- :func:`packaged_configs`: ``monai.bundle.load`` builds ``network_def`` from the packaged config and then copies
  the weights with ``copy_model_state``, which skips every tensor whose name or shape does not match and only
  logs "N of M variables" at INFO: a tiny model (``--feature_size 12``) loaded into the config's default
  feature size 48 comes back mostly random. So a package's configs take the network sizes (``feature_size``,
  ``in_channels``, ``window_size``) from its ``models/model.pt``, and packaging fails unless every config's
  ``network_def`` then holds exactly the weights' tensors (a segmentation bundle's outputs are its
  ``label_names``: a count that differs from the weights' fails naming them).
- The code travels in the bundle (as in the Model Zoo): the running package's source goes under ``<name>/components/``
  at packaging time (:func:`components.origin.package_source`), so a downloaded bundle runs from its folder with only
  MONAI and its ``required_packages_version``; with a release URL, ``large_files.yml`` lists the weights' URLs.
- :func:`metadata_schema` is this collection's metadata schema (shipped, offline); :func:`schema_path` finds MONAI's
  published one for ``monai.bundle verify_metadata``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from monai.apps.utils import HashCheckError, download_url, extractall, safe_extract_member

from .atomic import atomic_write
from .origin import PACKAGE_DIR, package_source

__all__ = [
    "SEMVER_RE",
    "HashMismatchError",
    "UnsafeArchiveError",
    "bundle_files",
    "exported_program_metadata",
    "extract_zip_safely",
    "fetch",
    "fetch_bundle",
    "large_files",
    "metadata_schema",
    "package_bundle",
    "packaged_configs",
    "read_metadata",
    "release_asset_name",
    "release_eval_metrics",
    "schema_path",
    "sha256_file",
    "weight_sizes",
]

logger = logging.getLogger(__name__)

# semver.org's reference expression (MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD], no leading zeros)
SEMVER_RE = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip entry can hold
_FILE_MODE = 0o100644  # regular file, rw-r--r--
_DIR_MODE = 0o040755  # directory, rwxr-xr-x
_CHUNK = 1 << 20

# what a bundle folder may contain that is not part of a release
_TOP_LEVEL_OUTPUT_DIRS = {"eval", "data", "dist", "logs", "runs", "mlruns", "lightning_logs", "wandb", "tmp", "temp"}
_CACHE_DIRS = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".cache"}
_EXCLUDED_SUFFIXES = {".pyc", ".pyo", ".log", ".tmp", ".temp", ".part", ".partial", ".swp", ".swo", ".bak", ".orig"}
_WEIGHT_SUFFIXES = {".pt", ".pt2", ".ts"}

# the metadata schema used by the Model Zoo checks (and MONAI's tests)
SCHEMA_NAME = "meta_schema_20240725.json"
SCHEMA_MD5 = "06954cad2cc5d3784e72077ac76f0fc8"
SCHEMA_URL = f"https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/{SCHEMA_NAME}"
OWN_SCHEMA = Path(__file__).resolve().parent / "schema" / "bundle_metadata.schema.json"
LARGE_FILES = "large_files.yml"  # the Model Zoo's list of weights to download by URL (monai.bundle download_large_files)


class HashMismatchError(HashCheckError):
    """A downloaded file's SHA-256 differs from the expected one (the file was removed); MONAI's ``HashCheckError``."""


class UnsafeArchiveError(ValueError):
    """An archive member would be written outside the target folder, or is a link or special file."""


# ------------------------------------------------------------------------------------------------------------
# hashing and metadata


def _file_digest(path: str | os.PathLike, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file, read in chunks."""
    return _file_digest(path, "sha256")


def read_metadata(bundle_dir: str | os.PathLike) -> dict:
    """``configs/metadata.json`` of a bundle, checked for what a release needs: valid JSON, a semantic
    ``version`` and a ``changelog`` entry for it. Raises ``FileNotFoundError`` / ``ValueError`` saying what is
    wrong and where."""
    meta_file = Path(bundle_dir) / "configs" / "metadata.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} not found: a bundle needs configs/metadata.json with a 'version'.")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_file} is not valid JSON: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_file} must hold a JSON object, got {type(meta).__name__}.")
    version = meta.get("version")
    if not isinstance(version, str) or not version:
        raise ValueError(f"{meta_file} has no 'version' (expected a string such as \"0.1.0\").")
    if not SEMVER_RE.match(version):
        raise ValueError(f"{meta_file}: version {version!r} is not a semantic version (MAJOR.MINOR.PATCH).")
    changelog = meta.get("changelog")
    if not isinstance(changelog, dict) or version not in changelog:
        raise ValueError(f"{meta_file}: version {version!r} has no entry in 'changelog'; describe the release there.")
    return meta


# ------------------------------------------------------------------------------------------------------------
# packaging


def _is_excluded_file(rel: PurePosixPath) -> bool:
    name = rel.name
    return (
        name.startswith(".")
        or name.endswith("~")
        or name.startswith("events.out.tfevents")
        or rel.suffix.lower() in _EXCLUDED_SUFFIXES
    )


def _is_weight_file(rel: PurePosixPath) -> bool:
    """``models/<file>.pt|.pt2|.ts`` (weights, an exported program, TorchScript), except resumable training state (``checkpoint*.pt``: optimizer, scheduler...)."""
    return (
        len(rel.parts) == 2
        and rel.parts[0] == "models"
        and rel.suffix.lower() in _WEIGHT_SUFFIXES
        and not rel.name.startswith("checkpoint")
    )


def bundle_files(bundle_dir: str | os.PathLike, include_weights: bool = True) -> list[str]:
    """The files of a bundle folder that belong in a release, as sorted POSIX paths relative to ``bundle_dir``.

    Left out: top-level output folders (``eval/``, ``data/``, ``dist/``, ``logs/``, ``runs/``, ``mlruns/`` ...),
    caches (``__pycache__`` ...), hidden files, ``.pyc``, logs, TensorBoard event files, temporary and editor
    files; under ``models/`` only weights (``models/*.pt``, ``models/*.ts``, not the resumable
    ``checkpoint*.pt``) and only when ``include_weights``. With ``include_weights=False`` this is what the
    repository tracks. Raises ``ValueError`` on a symbolic link (a release holds plain files only)."""
    root = Path(bundle_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no bundle folder at {str(root)!r}.")
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = PurePosixPath(here.relative_to(root).as_posix())
        top = rel_dir == PurePosixPath(".")
        kept = []
        for d in sorted(dirnames):
            path = here / d
            if path.is_symlink():
                raise ValueError(f"{path} is a symbolic link; a bundle release holds plain files only.")
            if d in _CACHE_DIRS or d.startswith(".") or (top and d in _TOP_LEVEL_OUTPUT_DIRS):
                continue
            if rel_dir.parts[:1] == ("models",):  # nothing below models/ is a release file
                continue
            kept.append(d)
        dirnames[:] = kept
        for f in filenames:
            path = here / f
            rel = PurePosixPath(f) if top else rel_dir / f
            if _is_excluded_file(rel):
                continue
            if rel.parts[0] == "models" and not (include_weights and _is_weight_file(rel)):
                continue
            if path.is_symlink():
                raise ValueError(f"{path} is a symbolic link; a bundle release holds plain files only.")
            if not path.is_file():
                continue
            found.append(rel.as_posix())
    return sorted(found)


# SwinUNETR's output block (out_channels, feature_size, 1, 1, 1): the classes a segmentation state was trained with
_SEG_OUT = "out.conv.conv.weight"
_MODEL_FILE = "models/model.pt"
_PROGRAM_FILE = "models/model.pt2"  # components.export's program of _MODEL_FILE
_METADATA_FILE = "configs/metadata.json"
EVALUATION_RECORD = "eval/metrics.json"  # where configs/evaluate.json's PerClassMetrics writes (output_dir)


def weight_sizes(state: Mapping[str, Any]) -> dict[str, int | bool]:
    """The network sizes a Swin UNETR or SSLHead state dict was trained with, read by
    :func:`~components.checkpoint.infer_architecture` (``feature_size``, ``in_channels``, ``window_size``, ``use_v2``),
    and ``out_channels`` from SwinUNETR's output block; empty for other states. Example:
    ``weight_sizes(SSLHead(feature_size=12).state_dict())["use_v2"] is False``."""
    from .checkpoint import CheckpointLoadError, infer_architecture

    try:
        found = infer_architecture(dict(state)).as_dict()
    except CheckpointLoadError:  # not a Swin encoder's state
        found = {}
    sizes = {k: v for k, v in found.items() if k in ("feature_size", "in_channels", "window_size", "use_v2") and v is not None}
    out = state.get(_SEG_OUT)
    if out is not None and out.ndim == 5:
        sizes["out_channels"] = int(out.shape[0])
    return sizes


def _network_state_shapes(config: dict, where: str) -> dict[str, tuple[int, ...]]:
    """Builds ``network_def`` of a bundle config (its ``imports`` evaluated first) and returns its tensors' shapes."""
    from monai.bundle import ConfigParser

    parser = ConfigParser(config)
    if isinstance(config.get("network_def"), dict) and "pretrained_path" in config["network_def"]:
        parser["network_def#pretrained_path"] = None  # the packaged weights decide the network, not pretrained ones
    try:
        if "imports" in config:
            parser.get_parsed_content("imports")
        network = parser.get_parsed_content("network_def", instantiate=True)
    except Exception as err:
        raise ValueError(f"{where}: cannot build network_def to check it against {_MODEL_FILE}: {err}") from err
    return {k: tuple(v.shape) for k, v in network.state_dict().items()}


def packaged_configs(bundle_dir: str | os.PathLike) -> dict[str, bytes]:
    """The configs a package of ``bundle_dir`` holds in place of the bundle's own: those with a ``network_def``
    whose ``feature_size`` / ``in_channels`` / ``window_size`` / ``use_v2`` (top-level ids, or members of
    ``network_def`` such as ``network_def#window_size``) differ from :func:`weight_sizes` of ``models/model.pt``, with
    these ids set to the weights' values (JSON, 4-space indent). Empty without weights.

    Every config with a ``network_def`` is then built and must hold exactly the tensors of ``models/model.pt``
    (same names, same shapes), so that ``monai.bundle.load(..., workflow_type=...)`` returns all the packaged
    weights (a bundle whose trained network differs from its release, e.g. a self-distillation student with heads
    whose release is the teacher's encoder, keeps the trained one under another id). Raises ``ValueError`` naming
    the config and the tensors otherwise (e.g. weights of another decoder than ``upsample`` says: set it in the
    config before packaging)."""
    root = Path(bundle_dir)
    weights = root / _MODEL_FILE
    if not weights.is_file():
        return {}
    import torch

    state = torch.load(weights, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{weights} is not a plain state dict (name -> tensor), which monai.bundle.load expects.")
    sizes = weight_sizes(state)
    expected = {k: tuple(v.shape) for k, v in state.items()}
    replaced: dict[str, bytes] = {}
    for config_file in sorted((root / "configs").glob("*.json")):
        rel = config_file.relative_to(root).as_posix()
        text = config_file.read_text(encoding="utf-8")
        config = json.loads(text)
        if not isinstance(config, dict) or "network_def" not in config:
            continue
        names = config.get("label_names")
        if "out_channels" in sizes and isinstance(names, list) and len(names) != sizes["out_channels"]:
            raise ValueError(
                f"{root.name}/{rel}: label_names has {len(names)} names, {_MODEL_FILE} has {sizes['out_channels']} "
                f"output channels ({_SEG_OUT}); set the {sizes['out_channels']} label_names the weights were trained "
                "with before packaging."
            )
        # a size is a top-level id (feature_size) or a member of network_def (network_def#window_size)
        holder = {k: config if k in config or not isinstance(config["network_def"], dict) else config["network_def"] for k in sizes}
        changed = {k: v for k, v in sizes.items() if isinstance(holder[k].get(k), int) and holder[k][k] != v}
        if changed:
            named = {k: k if holder[k] is config else f"network_def#{k}" for k in changed}
            logger.info("package_bundle: %s takes %s from %s (the config said %s)", rel,
                        {named[k]: v for k, v in changed.items()}, _MODEL_FILE, {named[k]: holder[k][k] for k in changed})  # fmt: skip
            for k, v in changed.items():
                holder[k][k] = v
            replaced[rel] = (json.dumps(config, indent=4, ensure_ascii=False) + ("\n" if text.endswith("\n") else "")).encode()
        built = _network_state_shapes(config, f"{root.name}/{rel}")
        missing = sorted(set(built) - set(expected))
        unused = sorted(set(expected) - set(built))
        shapes = [f"{k}: weights {list(expected[k])}, network {list(built[k])}" for k in built if k in expected and built[k] != expected[k]]
        if missing or unused or shapes:
            raise ValueError(
                f"{root.name}/{rel}: network_def does not hold exactly the tensors of {_MODEL_FILE} "
                f"(sizes from the weights: {sizes}): {len(missing)} not in the weights {missing[:3]}, {len(unused)} "
                f"not in the network {unused[:3]}, {len(shapes)} of another shape {shapes[:3]}; monai.bundle.load "
                "would return a partly random network. Make the config match the weights before packaging."
            )
    return replaced


def exported_program_metadata(bundle_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``exported_program`` of a release's metadata: what ``models/model.pt2`` takes and which weights it computes
    with, read from the program (:func:`components.export.exported_program_record`), as ``file``, ``input_shape``
    (``"dynamic"`` for the batch), ``dtype``, ``exported_from`` and ``exported_from_sha256``; ``None`` without a
    ``.pt2``. Raises ``ValueError`` (one line naming the file and the export command) when the program was not
    exported from ``models/model.pt``: it would compute with other weights than the release's."""
    root = Path(bundle_dir)
    program = root / _PROGRAM_FILE
    if not program.is_file():
        return None
    from .export import exported_program_record

    record = exported_program_record(program)
    source = record["exported_from_sha256"]
    weights = root / _MODEL_FILE
    packaged = sha256_file(weights) if weights.is_file() else None
    if source is None or source != packaged:
        why = "records no weights it was exported from" if source is None else (
            f"was exported from weights of sha256 {source}, not from {_MODEL_FILE} "
            f"({f'sha256 {packaged}' if packaged else 'missing'})")  # fmt: skip
        raise ValueError(f"{program}: {why}; export it again before packaging (python -m components export {root}, "
                         "with the --overrides the model was trained with) or remove it.")  # fmt: skip
    return {"file": _PROGRAM_FILE, "input_shape": record["input_shape"], "dtype": record["dtype"],
            "exported_from": _MODEL_FILE, "exported_from_sha256": source}  # fmt: skip


def _read_evaluation_record(record: Path) -> dict[str, Any]:
    """An evaluation summary of :class:`components.PerClassMetrics`, checked for what ``eval_metrics`` takes."""
    try:
        summary = json.loads(record.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{record} is not valid JSON: {e}") from e
    missing = [k for k in ("metric", "mean", "per_class", "weights") if not isinstance(summary, dict) or k not in summary]
    if missing:
        raise ValueError(f"{record} is not an evaluation record of PerClassMetrics: it has no {missing}.")
    return summary


def release_eval_metrics(bundle_dir: str | os.PathLike, record: str | os.PathLike | None = None) -> dict[str, Any]:
    """``eval_metrics`` of a release: the mean and per-class values of the evaluation ``record`` (default
    ``<bundle>/eval/metrics.json``, written by ``configs/evaluate.json``) when it measured the packaged
    ``models/model.pt`` (the SHA-256 the record names, see :class:`components.PerClassMetrics`), e.g.
    ``{"val_mean_dice": 0.81, "spleen": 0.93, ...}``; otherwise ``{}``, with a WARNING saying why when weights are
    packaged. The bundle's own metadata ``eval_metrics`` are never copied: they describe no particular weights."""
    root = Path(bundle_dir)
    record = Path(record) if record is not None else root / EVALUATION_RECORD
    weights = root / _MODEL_FILE
    if not weights.is_file():
        logger.info("package_bundle: no %s, so the release's eval_metrics are empty", _MODEL_FILE)
        return {}
    packaged = sha256_file(weights)
    summary = _read_evaluation_record(record) if record.is_file() else None
    measured = (summary["weights"] or {}).get("sha256") if summary is not None else None
    if measured == packaged:
        return {summary["metric"]: summary["mean"], **summary["per_class"]}
    why = (f"no evaluation record at {record}" if summary is None
           else f"{record} names no weights it measured" if measured is None
           else f"{record} measured weights of sha256 {measured}, not {_MODEL_FILE} (sha256 {packaged})")  # fmt: skip
    logger.warning("package_bundle: the release's eval_metrics are empty: %s; they hold only numbers measured on the "
                   "packaged weights (evaluate them with configs/evaluate.json before packaging).", why)  # fmt: skip
    return {}


def _packaged_metadata(
    bundle_dir: Path, meta: dict[str, Any], eval_metrics: dict[str, Any], exported: dict[str, Any] | None
) -> bytes:
    """The release's ``configs/metadata.json``: the bundle's, with the release's ``eval_metrics`` and, when it
    carries a program, ``exported_program``."""
    packaged = {k: v for k, v in meta.items() if k != "exported_program"}
    packaged["eval_metrics"] = eval_metrics
    if exported is not None:
        packaged["exported_program"] = exported
    text = (bundle_dir / _METADATA_FILE).read_text(encoding="utf-8")
    return (json.dumps(packaged, indent=4, ensure_ascii=False) + ("\n" if text.endswith("\n") else "")).encode()


def _zip_info(arcname: str, mode: int, compress_type: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(arcname, date_time=ZIP_DATE_TIME)
    info.create_system = 3  # unix, so that external_attr holds the mode
    info.external_attr = mode << 16
    if stat.S_ISDIR(mode):
        info.external_attr |= 0x10  # MS-DOS directory flag
    info.compress_type = compress_type
    return info


def _release_base(release_url: str) -> str:
    """``release_url`` without a trailing ``/``, checked: an absolute ``http(s)://`` or ``file://`` URL."""
    parts = urllib.parse.urlparse(str(release_url))
    if parts.scheme not in ("http", "https", "file") or not (parts.netloc or parts.path.strip("/")):
        raise ValueError(f"release_url {release_url!r} is not an http(s):// or file:// URL of the release's files.")
    return str(release_url).rstrip("/")


def release_asset_name(name: str, version: str, weight: str) -> str:
    """The release file of weight ``models/<file>``, beside the zip: ``swin_unetr_btcv_finetune_v0.3.0_model.pt``."""
    return f"{name}_v{version}_{PurePosixPath(weight).name}"


def large_files(weights: Mapping[str, str], release_url: str, name: str, version: str) -> str:
    """``large_files.yml`` in the Model Zoo's format for ``weights`` (bundle-relative path -> SHA-256): per weight
    ``path``, ``url`` (``<release_url>/`` :func:`release_asset_name`), ``hash_val`` and ``hash_type: "sha256"``, as
    ``python -m monai.bundle download_large_files`` reads it (JSON strings are valid YAML double-quoted scalars)."""
    base = _release_base(release_url)
    lines = ["large_files:"]
    for path, digest in sorted(weights.items()):
        url = f"{base}/{release_asset_name(name, version, path)}"
        lines += [f"  - path: {json.dumps(path)}", f"    url: {json.dumps(url)}",
                  f"    hash_val: {json.dumps(_normalize_sha256(digest, path))}", '    hash_type: "sha256"']  # fmt: skip
    return "\n".join(lines) + "\n"


def package_bundle(
    bundle_dir: str | os.PathLike,
    out_dir: str | os.PathLike = "dist",
    release_url: str | None = None,
    evaluation_record: str | os.PathLike | None = None,
) -> Path:
    """Writes ``<out_dir>/<name>_v<version>.zip`` and ``<out_dir>/<name>_v<version>.zip.sha256`` for a bundle.

    ``name`` is the bundle folder's name, ``version`` the one in ``configs/metadata.json`` (checked first by
    :func:`read_metadata`; ``LICENSE`` must exist too). Every entry sits under the top folder ``<name>/``,
    which is what ``python -m monai.bundle download --name <name> --url <zip url> --bundle_dir D`` (and the
    ``github`` source) extract to ``D/<name>/``. The same files give the same bytes: entries sorted, every
    timestamp 1980-01-01 00:00, permissions 0644 (files) / 0755 (folders), no extra fields or comment, deflate.
    The files are :func:`bundle_files` (``models/*.pt`` when present), the configs as :func:`packaged_configs` makes
    them fit ``models/model.pt`` (it raises when they cannot), the metadata with :func:`release_eval_metrics` (from
    ``evaluation_record``, default ``<bundle>/eval/metrics.json``, when it measured ``models/model.pt``; else empty)
    and :func:`exported_program_metadata` of a ``models/model.pt2`` (it raises when the program is not
    ``model.pt``'s), and the running package's source under ``<name>/components/``
    (:func:`components.origin.package_source`; a bundle folder's own ``components/`` is refused). With
    ``release_url`` (the release's files: ``https://github.com/<owner>/<repo>/releases/download/<tag>``) the weights
    stay out of the zip, as in the Model Zoo: the zip holds :func:`large_files` of them instead and each is written
    beside the zip as :func:`release_asset_name`, to attach to the release (``monai.bundle download_large_files``
    and :func:`fetch_bundle` download them); without it the weights are in the zip (offline ``file://`` use). The
    zip is written to a temporary name and moved into place. Returns the zip's path."""
    root = Path(bundle_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no bundle folder at {str(root)!r}.")
    name = root.resolve().name
    if not _NAME_RE.match(name):
        raise ValueError(f"bundle folder name {name!r} is not a usable bundle name (letters, digits, '_', '.', '-').")
    if (root / "components").exists():
        raise ValueError(f"{root / 'components'} exists: a package carries the components package copied from "
                         f"{PACKAGE_DIR} at packaging time, never a copy kept in the bundle folder; remove it.")  # fmt: skip
    base = _release_base(release_url) if release_url is not None else None
    meta = read_metadata(root)
    if not (root / "LICENSE").is_file():
        raise FileNotFoundError(f"{root / 'LICENSE'} not found: a bundle release needs a LICENSE file.")
    version = meta["version"]
    files = bundle_files(root)
    weights = [f for f in files if f.startswith("models/")]
    digests = {w: sha256_file(root / w) for w in weights} if base is not None else {}
    contents: dict[str, Path | bytes] = {rel: root / rel for rel in files if rel not in digests}
    contents.update(packaged_configs(root))
    contents[_METADATA_FILE] = _packaged_metadata(root, meta, release_eval_metrics(root, evaluation_record),
                                                  exported_program_metadata(root))  # fmt: skip
    contents.update({f"components/{rel}": PACKAGE_DIR / rel for rel in package_source(PACKAGE_DIR)})
    if digests:
        contents[LARGE_FILES] = large_files(digests, base, name, version).encode()

    folders = {parent for rel in contents for parent in PurePosixPath(name, rel).parents if parent != PurePosixPath(".")}
    entries = sorted([(f"{d.as_posix()}/", None) for d in folders] + [(f"{name}/{rel}", rel) for rel in contents])
    out = Path(out_dir)  # created by atomic_write
    zip_path = out / f"{name}_v{version}.zip"
    with atomic_write(zip_path) as archive:
        with zipfile.ZipFile(archive, "w") as zf:
            for arcname, rel in entries:
                if rel is None:
                    zf.writestr(_zip_info(arcname, _DIR_MODE, zipfile.ZIP_STORED), b"")
                    continue
                info, src = _zip_info(arcname, _FILE_MODE, zipfile.ZIP_DEFLATED), contents[rel]
                if isinstance(src, bytes):
                    zf.writestr(info, src)
                    continue
                large = src.stat().st_size >= zipfile.ZIP64_LIMIT
                with open(src, "rb") as fin, zf.open(info, "w", force_zip64=large) as fout:
                    shutil.copyfileobj(fin, fout, _CHUNK)

    digest = sha256_file(zip_path)
    sidecar = zip_path.with_name(zip_path.name + ".sha256")
    with atomic_write(sidecar, "w", encoding="ascii") as f:
        f.write(f"{digest}  {zip_path.name}\n")
    for weight in digests:  # the files large_files.yml points at
        with open(root / weight, "rb") as fin, atomic_write(out / release_asset_name(name, version, weight)) as fout:
            shutil.copyfileobj(fin, fout, _CHUNK)
    logger.info("package_bundle: wrote %s (weights %s: %s; components from %s), sha256 %s", zip_path,
                "beside the zip" if digests else "in the zip", ", ".join(weights) or "none", PACKAGE_DIR, digest)  # fmt: skip
    return zip_path


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


def _normalize_sha256(value: object, where: str) -> str:
    text = str(value).strip().lower()
    if not _SHA256_RE.match(text):
        raise ValueError(f"{where}: {value!r} is not a SHA-256 (64 hexadecimal characters).")
    return text


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


def _as_url(src: str) -> str:
    """``src`` as a URL for MONAI's ``download_url`` (a plain path becomes ``file://``)."""
    return src if _is_url(src) else Path(src).resolve().as_uri()


def _download_checked(src: str, path: Path, expected: str) -> None:
    """MONAI's ``download_url`` of ``src`` to ``path`` with the expected SHA-256; a mismatch raises
    :class:`HashMismatchError` naming the source (MONAI's message names only its temporary file)."""
    try:
        download_url(_as_url(src), path, hash_val=expected, hash_type="sha256", progress=False)
    except HashCheckError as err:
        raise HashMismatchError(
            f"sha256 of {src} differs from the expected {expected}; the download was discarded (corrupt, truncated "
            "or not the published file)."
        ) from err
    if not path.is_file():  # download_url returns without a file after a PermissionError or NotADirectoryError
        raise OSError(f"could not download {src} to {path}.")


def fetch(url_or_path: str | os.PathLike, dest: str | os.PathLike, sha256: str | None = None) -> Path:
    """Downloads ``url_or_path`` (``http(s)://``, ``file://`` or a local path) to ``dest`` with MONAI's
    ``download_url``, which checks its SHA-256; returns the file's path.

    ``dest`` is the target file, or a folder (existing, or written with a trailing ``/``) to put the file in
    under its own name. What this adds to ``download_url``, which downloads unchecked (a warning) without a hash:

    - a hash is required: ``sha256`` or, when that is ``None``, the one in ``<url_or_path>.sha256``
      (``sha256sum`` format, as :func:`package_bundle` writes it); without either the download is refused
      (``ValueError``), as MONAI's own bundle download passes no hash at all (``hash_val=None``);
    - the file is downloaded into a temporary folder beside the target and renamed into place, so the target is
      never a partial file (``download_url`` moves it from the system's temporary folder, a copy across file
      systems); a target with another hash is replaced (``download_url`` refuses it), one with the expected hash
      is kept as it is (no download);
    - on a mismatch (:class:`HashMismatchError`, a ``HashCheckError``) or any other failure nothing is left: no
      temporary file, no folder this call created."""
    src = os.fspath(url_or_path)
    name = _source_name(src)
    expected = _normalize_sha256(sha256, "sha256") if sha256 is not None else _read_sidecar(src, name)
    as_folder = os.fspath(dest).endswith(("/", os.sep)) or Path(dest).is_dir()
    target = Path(dest) / name if as_folder else Path(dest)
    if target.is_file() and sha256_file(target) == expected:
        logger.info("fetch: %s already present with sha256 %s; not downloading", target, expected)
        return target

    created = _make_dirs(target.parent)
    try:
        with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=target.parent) as staging:
            _download_checked(src, Path(staging) / name, expected)
            os.replace(Path(staging) / name, target)
    except BaseException:
        _remove_empty(created)
        raise
    logger.info("fetch: %s -> %s (sha256 %s verified)", src, target, expected)
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


def _download_large_files(bundle: Path) -> None:
    """The files a bundle's ``large_files.yml`` lists, downloaded by MONAI's ``download_large_files`` (its
    ``download_url`` checks each listed hash), once every entry is checked to have a hash: MONAI downloads an entry
    without one unchecked."""
    from monai.bundle import ConfigParser, download_large_files
    from monai.utils import OptionalImportError

    listed = bundle / LARGE_FILES
    try:
        entries = ConfigParser.load_config_file(listed).get("large_files") or []
    except OptionalImportError:
        raise ModuleNotFoundError(f"{bundle.name}/{LARGE_FILES} lists the bundle's weights and MONAI reads it with "
                                  "PyYAML, which is not installed: pip install pyyaml") from None  # fmt: skip
    unhashed = [entry.get("path") for entry in entries if not entry.get("hash_val")]
    if unhashed:
        raise ValueError(f"{bundle.name}/{LARGE_FILES} lists {unhashed} without hash_val; downloads are never used "
                         "unchecked.")  # fmt: skip
    download_large_files(bundle_path=str(bundle))


def fetch_bundle(
    url: str | os.PathLike, bundle_dir: str | os.PathLike, sha256: str | None = None, overwrite: bool = False
) -> Path:
    """Downloads a bundle zip into ``bundle_dir`` with :func:`fetch` (hash required: ``sha256`` or
    ``<url>.sha256``), checks that it is a bundle release (one top folder ``<name>/`` with
    ``configs/metadata.json``) and extracts it with :func:`extract_zip_safely` to ``bundle_dir/<name>/``, with the
    weights its ``large_files.yml`` lists (a release packaged with a release URL) downloaded and hash-checked into
    it (:func:`_download_large_files`; MONAI reads the list with PyYAML); returns that folder.

    This is the hash-checked replacement for ``python -m monai.bundle download``, which in MONAI 1.6.1 passes
    ``hash_val=None`` for every bundle source. The zip stays in ``bundle_dir``, so ``monai.bundle download
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
                _download_large_files(staging / top)
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


# ------------------------------------------------------------------------------------------------------------
# metadata schema


def metadata_schema() -> Path:
    """This collection's JSON schema of ``configs/metadata.json``, shipped with the package (no download): the keys
    and formats the Model Zoo requires, stricter where the collection relies on a value (semantic versions, a
    changelog). For ``python -m monai.bundle verify_metadata --filepath``; :func:`schema_path` is MONAI's own."""
    return OWN_SCHEMA


def schema_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """MONAI's published bundle metadata schema (``meta_schema_20240725.json``) for ``python -m monai.bundle
    verify_metadata --filepath``.

    Looked up in this order: the file named by the environment variable ``BUNDLE_SCHEMA_PATH`` (taken as given:
    an explicit choice, e.g. a newer schema or a local copy); a cached download under ``cache_dir`` (default
    ``$XDG_CACHE_HOME`` or ``~/.cache``, ``swin-ssl-bundles/``); else a download from the public URL MONAI's tests
    use, checked against md5 ``06954cad2cc5d3784e72077ac76f0fc8`` (so offline it raises: use
    :func:`metadata_schema`, which needs no network). ``verify_metadata`` itself only downloads when the file is
    missing, so pointing it at this path keeps it offline."""
    env = os.environ.get("BUNDLE_SCHEMA_PATH")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"BUNDLE_SCHEMA_PATH={env!r} is not a file.")
        return Path(env)
    default_base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swin-ssl-bundles"
    base = Path(cache_dir) if cache_dir else default_base
    cached = base / SCHEMA_NAME
    if cached.is_file() and _file_digest(cached, "md5") == SCHEMA_MD5:
        return cached
    from monai.apps.utils import download_url  # checks the hash of the download and removes a mismatch

    cached.unlink(missing_ok=True)
    download_url(url=SCHEMA_URL, filepath=cached, hash_val=SCHEMA_MD5, hash_type="md5", progress=False)
    return cached
