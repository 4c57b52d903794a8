"""What the finetuning bundles' crops cost from the on-disk store against their in-memory cache, and what the store
keeps for them: chunk shapes, quantized float images.

Three parts, each on synthetic data written into ``--work``:

1. ``layout``: the BTCV bundle's deterministic transforms on ``--volumes`` labeled CT volumes of ``--shape``
   (``data_scale.labeled_ct``: int16 HU, spine / vessel / liver labels), their float image (quantized) and uint8
   label written with the 64^3 chunks / 32^3 blocks of store format 1 and with the chunks and blocks
   ``format.layout`` derives from the crop size, for 96^3 (BTCV) and 128^3 (BraTS) crops: bytes, the voxels of the
   chunks a random crop covers per voxel of the crop and their compressed bytes (what a cold read moves; no
   timing, the same on any machine), and the milliseconds of a crop of image and label through a fresh handle with
   the process's cache of opened arrays cleared (10th percentile and median).
2. ``floats``: the project's synthetic BraTS-like MRI (``components.data.synthetic.write_dataset(kind="mri")``,
   int16 .nii.gz) and the CT of part 1 through the BraTS and BTCV bundles' deterministic transforms, stored with
   ``floats="exact"`` (float32) and ``"quantized"`` (int16 and a scale per channel): bytes against the
   .nii.gz files, and the quantization's largest and mean absolute error over all voxels, as the store records it.
3. ``crops``: crops per second of one process (one torch thread, as a loader worker) through each bundle's
   training dataset: ``loader#cache`` full (in memory), disk (the store crops: chunks of the crop only) and disk as
   store format 1 read it (``ReadStoredd``: whole volumes, then the bundle's own random transforms), alternating
   rounds from the same random states after a first pass (files in the page cache, arrays opened). BTCV on the CT of
   part 1 (96^3 crops, 4 per volume); BraTS on the synthetic MRI resampled to ``--brats_shape`` (BraTS's 240 x 240
   x 155, spacing kept; the phantoms are smaller than the 128^3 crop), ``--volumes`` of them.

    nice python benchmarks/finetune_crops.py --work /tmp/finetune_crops          # ~3 min on 2 busy cores
    python benchmarks/finetune_crops.py --small --work /tmp/finetune_crops_small  # CI

Prints one JSON object (the machine, the load before each timed step) and writes it to ``--out`` (default
``benchmarks/results/finetune_crops.json``; with ``--small`` only when given). ``--note`` is recorded with it
(e.g. how loaded the machine was).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from data_scale import _load, _timed_pass, _write_json, labeled_ct
from machine import bundle_parser, git_commit, machine_info, write_result
from store_format import _nii_gz_bytes

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULT = REPO / "benchmarks" / "results" / "finetune_crops.json"
BTCV, BRATS = "swin_unetr_btcv_finetune", "swin_unetr_brats_finetune"


@dataclass(frozen=True)
class Settings:
    shape: tuple[int, int, int] = (256, 256, 160)
    volumes: int = 4
    mri_volumes: int = 6
    brats_shape: tuple[int, int, int] = (240, 240, 155)
    layout_crops: int = 60
    crop_rounds: int = 4
    overrides: tuple = ()  # (bundle, {id: value}) pairs for both bundles' parsers


SMALL = Settings(shape=(96, 96, 64), volumes=2, mri_volumes=3, brats_shape=(96, 96, 64), layout_crops=6,
                 crop_rounds=1, overrides=((BTCV, {"roi_size": [48, 48, 32]}), (BRATS, {"roi_size": [48, 48, 32]})))


def _overrides(settings: Settings, bundle: str) -> dict:
    return dict(dict(settings.overrides).get(bundle, {}))


def _parser(settings: Settings, bundle: str, datalist: Path, cache: str, store: Path):
    from components.demo.runner import bundle_dir

    overrides = {"datalist": str(datalist), "device": "cpu", "loader#cache": cache, "loader#store": str(store),
                 "loader#check_data": False, **_overrides(settings, bundle)}  # fmt: skip
    return bundle_parser(bundle_dir(bundle), overrides, num_workers=0)


# ------------------------------------------------------------------------------------------------------- the data


def write_ct(settings: Settings, root: Path) -> Path:
    """Labeled CT volumes (``labeled_ct``) and their datalist."""
    (root / "ct").mkdir(parents=True, exist_ok=True)
    items = []
    for index in range(settings.volumes):
        image, label = root / "ct" / f"image_{index}.nii.gz", root / "ct" / f"label_{index}.nii.gz"
        if not label.is_file():
            for array, path in zip(labeled_ct(tuple(settings.shape), 2 * 10**6 + index), (image, label)):
                _nii_gz_bytes(array, path)
        items.append({"image": str(image), "label": str(label)})
    path = root / "ct.json"
    _write_json(path, {"training": items, "validation": []})
    return path


def write_mri(settings: Settings, root: Path) -> tuple[Path, Path]:
    """The project's synthetic MRI (all cases listed for training) and the same resampled to ``brats_shape``."""
    import nibabel as nib
    from scipy.ndimage import zoom

    from components.data.synthetic import write_dataset

    datalist = write_dataset(root / "mri", kind="mri", num=settings.mri_volumes, seed=0)
    data = json.loads(datalist.read_text())
    cases = [{k: str(datalist.parent / v) for k, v in e.items()} for part in ("training", "validation", "test")
             for e in data[part]]  # fmt: skip
    (root / "brats").mkdir(exist_ok=True)
    large = []
    for index, case in enumerate(cases):
        out = {k: root / "brats" / f"{k}_{index}.nii.gz" for k in ("image", "label")}
        if not out["label"].is_file():
            image, label = nib.load(case["image"]), nib.load(case["label"])
            factors = [b / n for b, n in zip(settings.brats_shape, label.shape)]
            values = np.stack([zoom(np.asarray(image.dataobj)[..., c].astype(np.float32), factors, order=1)
                               for c in range(image.shape[-1])], axis=-1)  # fmt: skip
            # the phantom's spacing kept: a head of BraTS's size in voxels and millimetres
            nib.save(nib.Nifti1Image(np.rint(values).astype(np.int16), image.affine), out["image"])
            nib.save(nib.Nifti1Image(zoom(np.asarray(label.dataobj), factors, order=0), label.affine), out["label"])
        large.append({k: str(v) for k, v in out.items()})
        if len(large) == settings.volumes:
            break
    _write_json(root / "mri.json", {"training": cases, "validation": []})
    _write_json(root / "brats.json", {"training": large, "validation": []})
    return root / "mri.json", root / "brats.json"


def _store(settings: Settings, bundle: str, datalist: Path, folder: Path, floats: str = "quantized") -> Path:
    from components.data.store import bundle_crop_size, bundle_transforms, preprocess

    if not (folder / "index.json").is_file():
        parser = _parser(settings, bundle, datalist, "disk", folder)
        preprocess(datalist, folder, bundle_transforms(parser), channels=parser["in_channels"], workers=1,
                   patch_size=bundle_crop_size(parser), floats=floats, stream=open(os.devnull, "w"))  # fmt: skip
    return folder


# ---------------------------------------------------------------------------------------------------- 1. layout


def _crop_time(path: Path, record: dict, region: tuple) -> float:
    from components.data.store import handle

    handle._OPENED.clear()  # as a crop of a volume not read before: open, check its chunks' CRCs, decompress
    start = time.perf_counter()
    handle.StoredArray(path, record)[region]
    return time.perf_counter() - start


def layout_part(settings: Settings, work: Path, ct: Path) -> dict:
    """Part 1: 64^3 / 32^3 against the crop-size layout, for 96^3 and 128^3 crops."""
    from components.data.store.format import chunk_numbers, layout, write_array
    from components.data.store.transforms import build_transforms
    from components.data.store import bundle_transforms

    parser = _parser(settings, BTCV, ct, "full", work)
    transforms = build_transforms(bundle_transforms(parser))
    items = [transforms(dict(e)) for e in json.loads(ct.read_text())["training"]]
    arrays = [{k: np.asarray(item[k].as_tensor()) for k in ("image", "label")} for item in items]
    crops = {"btcv_96": _overrides(settings, BTCV).get("roi_size", [96] * 3),
             "brats_128": _overrides(settings, BRATS).get("roi_size", [128] * 3)}
    rng = np.random.default_rng(0)
    out = {}
    folder = work / "layout"
    folder.mkdir(exist_ok=True)
    for name, crop in crops.items():
        candidates = {"64^3 chunks, 32^3 blocks (format 1)": None, "from the crop size": crop}
        result = {}
        for label, patch in candidates.items():
            stats = {"bytes": 0, "cover": [], "cold_bytes": [], "ms": []}
            for index, volume in enumerate(arrays):
                records = {k: write_array(a, folder / f"{k}_{index}.b2nd", patch, "quantized" if k == "image" else "exact")
                           for k, a in volume.items()}  # fmt: skip
                stats["bytes"] += sum(r["nbytes"] for r in records.values())
                sizes = {k: _chunk_sizes(folder / f"{k}_{index}.b2nd") for k in volume}
                shape = volume["image"].shape
                for _ in range(settings.layout_crops):
                    size = [min(c, n) for c, n in zip(crop, shape[1:])]
                    start = [int(rng.integers(0, n - s + 1)) for n, s in zip(shape[1:], size)]
                    region = (slice(0, shape[0]), *(slice(a, a + s) for a, s in zip(start, size)))
                    chunks = records["image"]["chunks"]
                    numbers = chunk_numbers(shape, chunks, region)
                    stats["cover"].append(len(numbers) * float(np.prod(chunks[1:])) / float(np.prod(size)))
                    stats["cold_bytes"].append(sum(sum(sizes[k][n] for n in numbers) for k in volume))
                    stats["ms"].append(1000 * sum(_crop_time(folder / f"{k}_{index}.b2nd", records[k], region)
                                                  for k in volume))  # fmt: skip
            ms = sorted(stats["ms"])
            result[label] = {"chunks": records["image"]["chunks"], "blocks": list(layout(shape, patch)[1]),
                             "bytes_per_volume": round(stats["bytes"] / len(arrays)),
                             "chunk_voxels_per_crop_voxel": round(statistics.mean(stats["cover"]), 2),
                             "compressed_bytes_read_per_crop": round(statistics.mean(stats["cold_bytes"])),
                             "crop_ms_p10": round(ms[len(ms) // 10], 2), "crop_ms_median": round(statistics.median(ms), 2),
                             "crops": len(ms), "load_avg_before": _load()}  # fmt: skip
        out[name] = {"crop": list(crop), "volume_shape": [list(a["image"].shape) for a in arrays][:1], **result}
    return out


def _chunk_sizes(path: Path) -> list[int]:
    import blosc2

    array = blosc2.open(str(path), mode="r")
    return [len(array.schunk.get_chunk(n)) for n in range(array.schunk.nchunks)]


# ---------------------------------------------------------------------------------------------------- 2. floats


def _store_figures(store: Path, datalist: Path) -> dict:
    items = [json.loads(p.read_text()) for p in sorted((store / "volumes").glob("*/item.json"))]
    sources = json.loads(datalist.read_text())["training"]
    nii = sum(os.path.getsize(e[k]) for e in sources for k in ("image", "label"))
    image = sum(item["arrays"]["image"]["nbytes"] for item in items)
    arrays = sum(record["nbytes"] for item in items for record in item["arrays"].values())
    errors = [item["arrays"]["image"] for item in items if "max_abs_error" in item["arrays"]["image"]]
    voxels = [float(np.prod(item["arrays"]["image"]["shape"])) for item in items if "max_abs_error" in item["arrays"]["image"]]
    figures = {"volumes": len(items), "nii_gz_bytes_per_volume": round(nii / len(items)),
               "image_bytes_per_volume": round(image / len(items)),
               "arrays_bytes_per_volume": round(arrays / len(items)),
               "arrays_over_nii_gz": round(arrays / nii, 3)}  # fmt: skip
    if errors:
        figures["max_abs_error"] = max(e["max_abs_error"] for e in errors)
        figures["mean_abs_error"] = sum(e["mean_abs_error"] * v for e, v in zip(errors, voxels)) / sum(voxels)
        figures["largest_magnitude"] = round(max(max(e["scales"]) for e in errors) * 32767, 4)  # one code: 1/32767 of it
    return figures


def floats_part(settings: Settings, work: Path, ct: Path, mri: Path) -> dict:
    """Part 2: exact against quantized float images, against the .nii.gz files."""
    out = {}
    for name, bundle, datalist in (("brats_synthetic_mri", BRATS, mri), ("btcv_ct", BTCV, ct)):
        out[name] = {floats: _store_figures(_store(settings, bundle, datalist, work / "stores" / f"{name}_{floats}",
                                                   floats), datalist)
                     for floats in ("exact", "quantized")}  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------- 3. crops


def crops_part(settings: Settings, work: Path, ct: Path, brats: Path) -> dict:
    """Part 3: crops per second, memory against disk (store crops) against disk read whole (format 1's path)."""
    import torch
    from monai.transforms import Compose

    from components.data.store import ReadStoredd

    out = {}
    for name, bundle, datalist in (("btcv", BTCV, ct), ("brats", BRATS, brats)):
        store = _store(settings, bundle, datalist, work / "stores" / f"{name}_crops")
        memory = _parser(settings, bundle, datalist, "full", store).get_parsed_content("train#dataset")
        disk = _parser(settings, bundle, datalist, "disk", store).get_parsed_content("train#dataset")
        whole = _parser(settings, bundle, datalist, "disk", store).get_parsed_content("train#dataset")
        random = _parser(settings, bundle, datalist, "disk", store).get_parsed_content("train#transforms#random")
        whole.transform = Compose([ReadStoredd(["image", "label"]), *random])
        sources = {"memory": memory, "disk": disk, "disk_whole_volumes": whole}
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for dataset in sources.values():
                _timed_pass(dataset, seed=0)
            totals, loads = {k: [0, 0.0] for k in sources}, []
            for round_ in range(settings.crop_rounds):
                loads.append(_load())
                for key, dataset in sources.items():
                    crops, seconds, _ = _timed_pass(dataset, seed=1 + round_)
                    totals[key][0] += crops
                    totals[key][1] += seconds
        finally:
            torch.set_num_threads(threads)
        rates = {k: round(c / s, 2) for k, (c, s) in totals.items()}
        out[name] = {"bundle": bundle, "volumes": len(disk), "crops": totals["disk"][0],
                     "crop_reader": type(disk.transform.transforms[0]).__name__,
                     **{f"crops_per_s_{k}": v for k, v in rates.items()},
                     "disk_over_memory": round(rates["disk"] / rates["memory"], 3),
                     "disk_whole_over_memory": round(rates["disk_whole_volumes"] / rates["memory"], 3),
                     "overrides": _overrides(settings, bundle), "load_avg_before_rounds": loads}  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the synthetic data and stores (~2 GB at full size)")
    parser.add_argument("--small", action="store_true", help="CI: small volumes and crops, seconds")
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: benchmarks/results/finetune_crops.json)")
    parser.add_argument("--note", default="", help="recorded with the figures, e.g. how loaded the machine was")
    parser.add_argument("--parts", nargs="+", default=["layout", "floats", "crops"], choices=["layout", "floats", "crops"])
    args = parser.parse_args(argv)
    settings = SMALL if args.small else Settings()
    started = time.perf_counter()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"benchmark": "finetune_crops", "commit": git_commit(), "machine": machine_info(),
                    "note": args.note, "settings": asdict(settings)}  # fmt: skip
    ct = write_ct(settings, work)
    mri, brats = write_mri(settings, work)
    if "layout" in args.parts:
        result["layout"] = layout_part(settings, work, ct)
    if "floats" in args.parts:
        result["floats"] = floats_part(settings, work, ct, mri)
    if "crops" in args.parts:
        result["crops"] = crops_part(settings, work, ct, brats)
    write_result(result, sys.stdout, started)
    out = args.out or (None if args.small else RESULT)
    if out:
        _write_json(out, result)
    return result


if __name__ == "__main__":
    main()
