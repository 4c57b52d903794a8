"""Which array format the on-disk store uses: blosc2, zarr and a raw ``.npy`` memmap on CT-like int16 volumes.

Each volume is a synthetic abdomen-sized CT (int16 Hounsfield units, ``--shape``, default 256 x 256 x 160): a
reconstruction circle of -1024 outside it, air of -1000 with noise inside it, a body-shaped elliptic cylinder of
soft tissue (+40 HU) with a fat rim, two lungs, a spine and a few organs, all with scanner-like noise (sigma 12 HU).
Every format writes every volume once, then reads ``--crops`` random 96^3 crops from it (the SSL recipe's crop),
each from a freshly opened file, reading only that region. The formats take turns on each volume, so a change of
the machine's load (a shared VM) falls on all of them alike. Reported per format:

- ``bytes_per_volume`` and ``ratio_to_nii_gz`` (the volume's file written by nibabel, gzip level 6 as nibabel's
  default), ``write_s_per_volume_median``;
- ``crop_read_ms``: 10th percentile, median and 90th percentile over all crops (page cache warm: the files were
  just written, so this is decompression and indexing, not the disk; a cold read moves ``bytes_per_volume`` times
  the share of the volume the crop's chunks cover). On a VM shared with other work the median and above include
  the reads that lost the CPU to another process; the 10th percentile is the format's own cost.

Compression runs on one thread (``nthreads=1``, zarr's blosc without threads), as in a DataLoader worker.
``store_as_shipped`` is the store's own writer and lazy handle (``components.data.store``): the chosen blosc2
settings at the chunks and blocks of 96^3 crops, plus a CRC-32 check of the chunks each crop covers.

    nice python benchmarks/store_format.py [--caveat TEXT]     # 32 volumes, 256 x 256 x 160, 50 crops each
    python benchmarks/store_format.py --small                 # CI: 2 volumes of 128 x 128 x 96

Prints one JSON object and writes it to ``benchmarks/results/store_format.json`` (not with ``--small``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from machine import machine_info, write_result

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from components import atomic_write  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "store_format.json"
CROP = 96


def ct_volume(shape: tuple[int, int, int], seed: int) -> np.ndarray:
    """An int16 CT-like volume of ``shape`` (x, y, z): see the module docstring."""
    rng = np.random.default_rng(seed)
    x, y, z = np.meshgrid(*(np.linspace(-1, 1, n, dtype=np.float32) for n in shape), indexing="ij")
    volume = np.full(shape, -1000.0, np.float32)
    body_r = (x / rng.uniform(0.8, 0.9)) ** 2 + (y / rng.uniform(0.55, 0.65)) ** 2
    volume[body_r < 1.0] = -100.0  # fat rim
    volume[body_r < 0.8] = 40.0  # soft tissue
    for side in (-1, 1):  # lungs in the upper part of the slab
        lung = ((x - side * 0.35) / 0.25) ** 2 + (y / 0.35) ** 2 + ((z - 0.6) / 0.5) ** 2
        volume[lung < 1.0] = -850.0
    organs = (((-0.3, 0.1, -0.2), 0.3, 60.0), ((0.35, 0.05, -0.3), 0.2, 30.0), ((0.0, -0.2, 0.0), 0.15, 150.0))
    for centre, radius, value in organs:  # liver, spleen, a contrast-filled vessel
        organ = sum(((c - m) / radius) ** 2 for c, m in zip((x, y, z), centre))
        volume[organ < 1.0] = value
    volume[(x / 0.08) ** 2 + ((y - 0.45) / 0.08) ** 2 < 1.0] = 700.0  # spine
    volume += rng.normal(0.0, 12.0, shape).astype(np.float32)
    volume[x**2 + y**2 > 1.0] = -1024.0  # outside the reconstruction circle
    return np.rint(volume).astype(np.int16)


def _blosc2(codec: str, clevel: int, shuffle: str, chunks: int, blocks: int) -> dict:
    import blosc2

    def write(array: np.ndarray, path: Path) -> list[Path]:
        cparams = blosc2.CParams(
            codec=getattr(blosc2.Codec, codec.upper()),
            clevel=clevel,
            filters=[getattr(blosc2.Filter, shuffle.upper())],
            nthreads=1,
        )
        blosc2.asarray(array, urlpath=str(path) + ".b2nd", mode="w", chunks=(chunks,) * 3, blocks=(blocks,) * 3,
                       cparams=cparams, dparams=blosc2.DParams(nthreads=1))  # fmt: skip
        return [Path(str(path) + ".b2nd")]

    def read(path: Path, region: tuple[slice, ...]) -> np.ndarray:
        return blosc2.open(str(path) + ".b2nd", mode="r", mmap_mode="r", dparams=blosc2.DParams(nthreads=1))[region]

    return {"write": write, "read": read, "settings": {"library": f"blosc2 {blosc2.__version__}", "codec": codec,
            "clevel": clevel, "filter": shuffle, "chunks": [chunks] * 3, "blocks": [blocks] * 3}}  # fmt: skip


def _zarr(clevel: int, chunks: int) -> dict:
    import zarr
    from zarr.codecs import BloscCodec

    def write(array: np.ndarray, path: Path) -> list[Path]:
        target = zarr.create_array(
            store=str(path) + ".zarr", shape=array.shape, dtype=array.dtype, chunks=(chunks,) * 3,
            compressors=BloscCodec(cname="zstd", clevel=clevel, shuffle="shuffle"), overwrite=True,
        )  # fmt: skip
        target[...] = array
        return [p for p in Path(str(path) + ".zarr").rglob("*") if p.is_file()]

    def read(path: Path, region: tuple[slice, ...]) -> np.ndarray:
        return zarr.open_array(str(path) + ".zarr", mode="r")[region]

    return {"write": write, "read": read, "settings": {"library": f"zarr {zarr.__version__} (v3, blosc codec)",
            "codec": "zstd", "clevel": clevel, "filter": "shuffle", "chunks": [chunks] * 3}}  # fmt: skip


def _npy() -> dict:
    def write(array: np.ndarray, path: Path) -> list[Path]:
        np.save(str(path) + ".npy", array)
        return [Path(str(path) + ".npy")]

    def read(path: Path, region: tuple[slice, ...]) -> np.ndarray:
        return np.array(np.load(str(path) + ".npy", mmap_mode="r")[region])

    return {"write": write, "read": read, "settings": {"library": f"numpy {np.__version__}", "codec": "none"}}


def _store() -> dict:
    """The store's own format as it ships for 96^3 crops: ``write_array`` (chunks and blocks from the crop size, a
    CRC-32 per chunk) and a fresh ``StoredArray`` per crop (opened, the covered chunks' CRCs checked, decompressed),
    as a training item reads."""
    from components.data.store import StoredArray
    from components.data.store.format import CLEVEL, CODEC, FILTER, layout, write_array

    records = {}
    chunks, blocks = layout((1, CROP, CROP, CROP), (CROP,) * 3)

    def write(array: np.ndarray, path: Path) -> list[Path]:  # channel-first, as the store keeps it
        records[path] = write_array(array[None], str(path) + ".b2nd", patch_size=(CROP,) * 3)
        return [Path(str(path) + ".b2nd")]

    def read(path: Path, region: tuple[slice, ...]) -> np.ndarray:
        return StoredArray(str(path) + ".b2nd", records[path])[(slice(None), *region)][0]

    return {"write": write, "read": read, "settings": {"library": "components.data.store.format", "codec":
            CODEC.lower(), "clevel": CLEVEL, "filter": FILTER.lower(), "chunks": list(chunks[1:]),
            "blocks": list(blocks[1:])}}  # fmt: skip


def formats() -> dict[str, dict]:
    """The candidates, by name."""
    return {
        "blosc2_zstd1_shuffle_c64_b32": _blosc2("zstd", 1, "shuffle", 64, 32),
        "blosc2_zstd3_shuffle_c64_b32": _blosc2("zstd", 3, "shuffle", 64, 32),
        "blosc2_zstd3_bitshuffle_c64_b32": _blosc2("zstd", 3, "bitshuffle", 64, 32),
        "blosc2_zstd3_shuffle_c96_b32": _blosc2("zstd", 3, "shuffle", 96, 32),
        "blosc2_zstd3_shuffle_c128_b32": _blosc2("zstd", 3, "shuffle", 128, 32),
        "blosc2_zstd3_shuffle_c64_b16": _blosc2("zstd", 3, "shuffle", 64, 16),
        "blosc2_lz4_shuffle_c64_b32": _blosc2("lz4", 5, "shuffle", 64, 32),
        "blosc2_lz4_bitshuffle_c64_b32": _blosc2("lz4", 5, "bitshuffle", 64, 32),
        "blosc2_zstd3_bitshuffle_c48_b24": _blosc2("zstd", 3, "bitshuffle", 48, 24),  # store format 2, 96^3 crops
        "blosc2_zstd3_bitshuffle_c48_b16": _blosc2("zstd", 3, "bitshuffle", 48, 16),
        "blosc2_lz4_bitshuffle_c48_b16": _blosc2("lz4", 5, "bitshuffle", 48, 16),
        "blosc2_lz4hc6_bitshuffle_c48_b24": _blosc2("lz4hc", 6, "bitshuffle", 48, 24),
        "blosc2_lz4hc6_bitshuffle_c48_b16": _blosc2("lz4hc", 6, "bitshuffle", 48, 16),  # store format 3, 96^3 crops
        "blosc2_lz4hc6_bitshuffle_c48_b12": _blosc2("lz4hc", 6, "bitshuffle", 48, 12),
        "blosc2_lz4hc9_bitshuffle_c48_b16": _blosc2("lz4hc", 9, "bitshuffle", 48, 16),
        "zarr3_blosc_zstd3_shuffle_c64": _zarr(3, 64),
        "zarr3_blosc_zstd3_shuffle_c96": _zarr(3, 96),
        "npy_memmap": _npy(),
        "store_as_shipped": _store(),
    }


def _timed(function: Callable, *args) -> tuple[float, object]:
    start = time.perf_counter()
    out = function(*args)
    return time.perf_counter() - start, out


def _nii_gz_bytes(volume: np.ndarray, path: Path) -> int:
    import nibabel as nib

    nib.save(nib.Nifti1Image(volume, np.diag([0.8, 0.8, 2.0, 1.0])), str(path))
    return path.stat().st_size


def _crop_regions(shape: tuple[int, ...], count: int, seed: int) -> list[tuple[slice, ...]]:
    rng = np.random.default_rng(seed)
    corners = [[int(rng.integers(0, n - CROP + 1)) for n in shape] for _ in range(count)]
    return [tuple(slice(c, c + CROP) for c in corner) for corner in corners]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--volumes", type=int, default=32, help="synthetic CT volumes")
    parser.add_argument("--shape", type=int, nargs=3, default=[256, 256, 160], help="voxels per volume")
    parser.add_argument("--crops", type=int, default=50, help="random 96^3 crops read per volume and format")
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temporary folder)")
    parser.add_argument("--small", action="store_true", help="CI: 2 volumes of 128 x 128 x 96, 4 crops; no file")
    parser.add_argument("--caveat", help='recorded with the result, e.g. "loaded 2-core VM, not a clean measurement"')
    args = parser.parse_args(argv)
    if args.small:
        args.volumes, args.shape, args.crops = 2, [128, 128, 96], 4
    if min(args.shape) < CROP:
        parser.error(f"--shape must be at least {CROP} on every axis, got {args.shape}")
    started = time.perf_counter()
    machine = machine_info()  # the load before the runs; write_result adds the load after them
    candidates = formats()
    root = Path(tempfile.mkdtemp(prefix="store_format_", dir=args.dir))
    sizes, writes, reads = ({name: [] for name in candidates} for _ in range(3))
    nii_bytes = []
    try:
        for index in range(args.volumes):  # formats interleaved per volume: a change of load hits them all alike
            volume = ct_volume(tuple(args.shape), index)
            nii_bytes.append(_nii_gz_bytes(volume, root / "volume.nii.gz"))
            regions = _crop_regions(volume.shape, args.crops, seed=index)
            for name, fmt in candidates.items():
                path = root / name
                seconds, files = _timed(fmt["write"], volume, path)
                writes[name].append(seconds)
                sizes[name].append(sum(f.stat().st_size for f in files))
                for region in regions:
                    seconds, crop = _timed(fmt["read"], path, region)
                    if not np.array_equal(crop, volume[region]):
                        raise AssertionError(f"{name}: a crop of volume {index} differs from the volume's")
                    reads[name].append(seconds * 1000)
            print(f"volume {index + 1}/{args.volumes} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {}
    for name, fmt in candidates.items():
        ordered = sorted(reads[name])
        results[name] = {
            **fmt["settings"],
            "bytes_per_volume": round(statistics.mean(sizes[name])),
            "ratio_to_nii_gz": round(sum(sizes[name]) / sum(nii_bytes), 3),
            "write_s_per_volume_median": round(statistics.median(writes[name]), 3),
            "crop_read_ms_p10": round(ordered[int(0.1 * (len(ordered) - 1))], 2),
            "crop_read_ms_median": round(statistics.median(ordered), 2),
            "crop_read_ms_p90": round(ordered[int(0.9 * (len(ordered) - 1))], 2),
        }
    result = {
        "benchmark": "store_format",
        **({"caveat": args.caveat} if args.caveat else {}),
        "volumes": args.volumes,
        "shape": args.shape,
        "dtype": "int16",
        "crop": [CROP] * 3,
        "crops_per_volume": args.crops,
        "nii_gz_bytes_per_volume": round(statistics.mean(nii_bytes)),
        "raw_bytes_per_volume": int(np.prod(args.shape)) * 2,
        "formats": results,
        "machine": machine,
    }
    write_result(result, sys.stdout, started)
    if not args.small:
        with atomic_write(RESULT, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
