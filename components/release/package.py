"""Releases of the bundles: deterministic packaging, the configs and metadata a release holds, and the metadata
schema. Downloading a release with a hash check and extracting it safely is :mod:`components.fetch`'s.

- :func:`package_bundle` writes ``<out>/<name>_v<version>.zip`` byte-for-byte reproducibly (sorted entries, fixed
  timestamps and permissions, no extra attributes) with one top folder ``<name>/``, the layout
  ``monai.bundle download --name <name>`` extracts to ``<bundle_dir>/<name>/``, and ``<zip>.sha256`` in the
  ``sha256sum`` format. Trained weights (``models/*.pt``) are included when present (with a release URL beside the
  zip, listed in ``large_files.yml``); logs, caches, evaluation outputs, data and temporary files are not
  (:func:`bundle_files`).
- :func:`packaged_configs`: ``monai.bundle.load`` builds ``network_def`` from the packaged config and then copies
  the weights with ``copy_model_state``, which skips every tensor whose name or shape does not match and only
  logs "N of M variables" at INFO: a tiny model (``--feature_size 12``) loaded into the config's default
  feature size 48 comes back mostly random. So a package's configs take the network sizes (``feature_size``,
  ``in_channels``, ``window_size``) from its ``models/model.pt``, and packaging fails unless every config's
  ``network_def`` then holds exactly the weights' tensors (a segmentation bundle's outputs are its
  ``label_names``: a count that differs from the weights' fails naming them).
- The code travels in the bundle (as in the Model Zoo): the running package's source goes under ``<name>/components/``
  at packaging time (:func:`components.release.origin.package_source`), so a downloaded bundle runs from its folder with only
  MONAI and its ``required_packages_version``; with a release URL, ``large_files.yml`` lists the weights' URLs.
- :func:`metadata_schema` is this collection's metadata schema (shipped, offline); :func:`schema_path` finds MONAI's
  published one for ``monai.bundle verify_metadata``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from ..files import atomic_write, sha256_file
from .origin import PACKAGE_DIR, package_source

__all__ = ["metadata_schema", "package_bundle", "schema_path"]

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


# ------------------------------------------------------------------------------------------------------------
# hashing and metadata


def _normalize_sha256(value: object, where: str) -> str:
    text = str(value).strip().lower()
    if not _SHA256_RE.match(text):
        raise ValueError(f"{where}: {value!r} is not a SHA-256 (64 hexadecimal characters).")
    return text


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
_PROGRAM_FILE = "models/model.pt2"  # components.release.export's program of _MODEL_FILE
_METADATA_FILE = "configs/metadata.json"
EVALUATION_RECORD = "eval/metrics.json"  # where configs/evaluate.json's PerClassMetrics writes (output_dir)


def weight_sizes(state: Mapping[str, Any]) -> dict[str, int | bool]:
    """The network sizes a Swin UNETR or SSLHead state dict was trained with, read by
    :func:`~components.checkpoint.infer_architecture` (``feature_size``, ``in_channels``, ``window_size``, ``use_v2``),
    and ``out_channels`` from SwinUNETR's output block; empty for other states. Example:
    ``weight_sizes(SSLHead(feature_size=12).state_dict())["use_v2"] is False``."""
    from ..checkpoint import CheckpointLoadError, infer_architecture

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
    with, read from the program (:func:`components.release.export.exported_program_record`), as ``file``, ``input_shape``
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
    (:func:`components.release.origin.package_source`; a bundle folder's own ``components/`` is refused). With
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
    from monai.apps.utils import check_hash, download_url  # download_url checks the hash and removes a mismatch

    if cached.is_file() and check_hash(cached, SCHEMA_MD5, "md5"):
        return cached
    cached.unlink(missing_ok=True)
    download_url(url=SCHEMA_URL, filepath=cached, hash_val=SCHEMA_MD5, hash_type="md5", progress=False)
    return cached
