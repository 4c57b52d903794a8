"""The on-disk store (components/data/store/): the array format and its checksums, the lazy handle, the values'
round trip, opening and refusing a store, and the SSL recipe's crops from the store equal to the in-memory compact
path and to MONAI's transforms. Writing a store (checks, workers, parts, resuming): tests/test_store_preprocess.py."""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import os
import pickle
import shutil
from copy import deepcopy
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.data import DataLoader, MetaTensor
from monai.transforms import Compose, EnsureTyped

from components import (
    RandCompactSpatialCropSamplesd,
    ReadStoredd,
    StoreDataset,
    StoredArray,
    StoreError,
    StoreReadError,
    bundle_transforms,
    open_store,
    preprocess,
    transforms_fingerprint,
)
from benchmarks.page_cache import drop_page_cache
from components.data.partition import partition_for_rank
from components.data.store.format import FORMAT_VERSION, chunk_numbers, storage_dtype, write_array
from components.data.store.mapped import MappedArray
from components.data.store.packages import package_versions
from components.data.store.transforms import build_transforms
from components.data.store.values import decode_value, encode_value
from components.demo.runner import bundle_dir
from tests.test_transforms import _recipe

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # Orientationd's `labels` default notice

SSL = bundle_dir("swin_unetr_ssl_pretrain")
ROI = [16, 16, 16]
SHAPE = (40, 36, 28)


def write_tiny_ct(root: Path, num: int = 4, seed: int = 0) -> Path:
    """``num`` int16 CT-like volumes of about 40 x 36 x 28 (a noisy soft-tissue ellipsoid in air, storage orders
    RAS and LPS alternating) with uint8 labels, and ``root/dataset.json`` listing them under "training"."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "labels").mkdir(exist_ok=True)
    items = []
    for index in range(num):
        shape = (SHAPE[0] - index, SHAPE[1], SHAPE[2] + index)
        x, y, z = np.meshgrid(*(np.linspace(-1, 1, n) for n in shape), indexing="ij")
        body = (x / 0.8) ** 2 + (y / 0.6) ** 2 + (z / 1.2) ** 2 < 1.0
        image = np.where(body, 40.0, -1000.0) + rng.normal(0, 15, shape)
        label = (body & ((x - 0.2) ** 2 + y**2 < 0.1)).astype(np.uint8) * (1 + index % 2)
        affine = np.diag([0.8, 0.8, 2.5, 1.0]) if index % 2 == 0 else np.diag([-0.8, -0.8, 2.5, 1.0])
        nib.save(nib.Nifti1Image(np.rint(image).astype(np.int16), affine), root / "images" / f"case_{index}.nii.gz")
        nib.save(nib.Nifti1Image(label, affine), root / "labels" / f"case_{index}.nii.gz")
        items.append({"image": f"images/case_{index}.nii.gz", "label": f"labels/case_{index}.nii.gz"})
    path = root / "dataset.json"
    path.write_text(json.dumps({"training": items}))
    return path


@pytest.fixture(scope="module")
def ssl_store(tmp_path_factory):
    """The SSL bundle's compact store (roi 16) of four tiny volumes: (datalist, store folder, transforms)."""
    root = tmp_path_factory.mktemp("ssl_store")
    datalist = write_tiny_ct(root / "data")
    transforms = bundle_transforms(SSL, {"roi_size": ROI})
    preprocess(datalist, root / "store", transforms)
    return datalist, root / "store", transforms


# ------------------------------------------------------------------------------------------------------------
# the array format


def test_integer_valued_floats_are_stored_narrow_and_read_back_in_their_dtype(tmp_path):
    label = np.random.default_rng(0).integers(0, 14, (1, 40, 36, 28)).astype(np.float32)
    image = np.random.default_rng(1).random((1, 40, 36, 28), dtype=np.float32)
    assert storage_dtype(label) == np.uint8 and storage_dtype(image) == np.float32
    assert storage_dtype(label - 7) == np.int8 and storage_dtype(label + 0.5) == np.float32
    for name, array in (("label", label), ("image", image)):
        record = write_array(array, tmp_path / f"{name}.b2nd")
        assert record["nbytes"] == (tmp_path / f"{name}.b2nd").stat().st_size
        assert record["dtype"] == "<f4" and record["shape"] == [1, 40, 36, 28]
        whole = [slice(0, n) for n in array.shape]
        assert len(record["crc32"]) == len(chunk_numbers(array.shape, record["chunks"], whole))
        values = StoredArray(tmp_path / f"{name}.b2nd", record)[...]
        assert values.dtype == np.float32 and np.array_equal(values, array)
    assert write_array(label, tmp_path / "l.b2nd")["stored_dtype"] == "|u1"


def test_chunk_numbers_are_those_a_region_touches():
    shape, chunks = (1, 40, 36, 28), (1, 16, 16, 16)
    grid = np.arange(1 * 3 * 3 * 2).reshape(1, 3, 3, 2)
    region = (slice(0, 1), slice(10, 33), slice(0, 16), slice(15, 17))
    covered = grid[:, 0:3, 0:1, 0:2].ravel().tolist()  # axis 1: chunks 0-2, axis 2: chunk 0, axis 3: chunks 0-1
    assert chunk_numbers(shape, chunks, region) == sorted(covered)
    assert chunk_numbers(shape, chunks, (slice(0, 1), slice(5, 5), slice(0, 1), slice(0, 1))) == []


def _corrupt_chunk(path: Path, number: int) -> None:
    """Flips bytes in the middle of compressed chunk ``number`` of a .b2nd file."""
    import blosc2

    array = blosc2.open(str(path), mode="r")
    chunk = array.schunk.get_chunk(number)
    del array
    data = bytearray(path.read_bytes())
    at = data.find(chunk) + len(chunk) // 2
    assert at > len(chunk) // 2
    data[at : at + 8] = bytes(255 - b for b in data[at : at + 8])
    path.write_bytes(bytes(data))


def test_a_read_checks_and_decompresses_only_the_chunks_it_covers(tmp_path):
    """A corrupt chunk fails exactly the reads that cover it, naming the file and the source; blosc2 alone would
    return wrong values without an error."""
    array = np.random.default_rng(0).integers(-1000, 1000, (1, 130, 70, 40)).astype(np.int16)
    record = write_array(array, tmp_path / "image.b2nd")
    assert record["chunks"] == [1, 64, 64, 40] and len(record["crc32"]) == 3 * 2
    _corrupt_chunk(tmp_path / "image.b2nd", 5)  # chunk (0, 2, 1, 0): voxels 128-130 x 64-70
    handle = StoredArray(tmp_path / "image.b2nd", record, source="/data/case_7.nii.gz")
    assert np.array_equal(handle[:, 0:128, 0:70], array[:, 0:128, 0:70])
    assert np.array_equal(handle[:, 100:130, 0:64, 5:9], array[:, 100:130, 0:64, 5:9])
    with pytest.raises(StoreReadError, match="chunk 5 fails its CRC-32") as caught:
        handle[:, 120:130, 60:70]
    assert caught.value.store_file == str(tmp_path / "image.b2nd") and caught.value.source == "/data/case_7.nii.gz"
    assert "case_7.nii.gz" in str(caught.value) and "image.b2nd" in str(caught.value)


def test_a_truncated_file_is_refused_when_opened(tmp_path):
    array = np.random.default_rng(0).integers(-1000, 1000, (1, 40, 36, 28)).astype(np.int16)
    record = write_array(array, tmp_path / "image.b2nd")
    data = (tmp_path / "image.b2nd").read_bytes()
    (tmp_path / "image.b2nd").write_bytes(data[: len(data) // 2])
    half = len(data) // 2
    with pytest.raises(StoreReadError, match=rf"image.b2nd \(from case_0.nii.gz\): the file has {half} bytes"):
        StoredArray(tmp_path / "image.b2nd", record, source="case_0.nii.gz")[:, 0:4]
    (tmp_path / "image.b2nd").unlink()
    with pytest.raises(StoreReadError, match="FileNotFoundError"):
        StoredArray(tmp_path / "image.b2nd", record, source="case_0.nii.gz")[:, 0:4]


def test_a_record_without_the_frames_checksums_is_refused_naming_the_file(tmp_path):
    """A volume written before the frame's header and tail were recorded (an earlier store under the same format
    number) raises StoreReadError naming the file and the missing field, not a KeyError."""
    array = np.random.default_rng(0).integers(-1000, 1000, (1, 40, 36, 28)).astype(np.int16)
    record = write_array(array, tmp_path / "image.b2nd")
    old = {k: v for k, v in record.items() if k not in ("head_bytes", "head_crc32", "tail_bytes", "tail_crc32")}
    with pytest.raises(StoreReadError, match=r"image.b2nd \(from case_0.nii.gz\): its record .* has no 'head_bytes'"):
        StoredArray(tmp_path / "image.b2nd", old, source="case_0.nii.gz")[:, 0:4]


def _frame_regions(record: dict) -> dict[str, range]:
    """The byte positions of a stored file's header, compressed chunks and tail (offsets and trailer)."""
    size, head, tail = record["nbytes"], record["head_bytes"], record["tail_bytes"]
    return {"header": range(0, head), "chunks": range(head, size - tail), "tail": range(size - tail, size)}


def test_every_corrupt_byte_of_a_stored_volume_raises_a_read_error_naming_it(ssl_store, tmp_path):
    """Seeded fuzz over one stored volume's image file: every byte of its header and tail, and 64 bytes of its
    compressed chunks, each replaced by another value (a random non-zero XOR): reading the volume raises
    StoreReadError naming the file and the source, never another error and never other values. (Without the header's
    CRC, header bytes 95-98 of this file made blosc2 return an SChunk, so the read raised AttributeError, and
    bytes 178, 192 and 193 changed the block shape: other values, no error.)"""
    _, root, _ = ssl_store
    store = open_store(root)
    stored = store.item(0)["image"]
    original, clean = stored.path.read_bytes(), stored[...]
    regions = _frame_regions(stored.record)
    assert sum(map(len, regions.values())) == len(original) and min(map(len, regions.values())) > 0
    rng = np.random.default_rng(45)
    chunk_bytes = sorted(rng.choice(np.asarray(regions["chunks"]), 64, replace=False).tolist())
    positions = [*regions["header"], *chunk_bytes, *regions["tail"]]
    assert 98 in positions and len(positions) > 300
    for position in positions:
        data = bytearray(original)
        data[position] ^= int(rng.integers(1, 256))
        path = tmp_path / f"byte_{position}.b2nd"  # a fresh path: no opened array of another case is reused
        path.write_bytes(bytes(data))
        handle = StoredArray(path, stored.record, source=stored.source)
        with pytest.raises(StoreReadError) as caught:
            handle.read()
        assert caught.value.store_file == str(path) and caught.value.source == stored.source, (position, caught.value)
        path.unlink()
    assert np.array_equal(StoredArray(stored.path, stored.record, stored.source)[...], clean)


def test_verify_names_a_corrupt_header(ssl_store, tmp_path):
    _, root, _ = ssl_store
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    store = open_store(copy)
    path = copy / "volumes" / store.entries[1]["id"] / "image.b2nd"
    data = bytearray(path.read_bytes())
    data[98] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"1 corrupt file.*image.b2nd \(from .*case_1.nii.gz\): its header .* CRC-32"):
        store.verify()


def test_a_handle_reads_numpy_and_torch_and_pickles_without_its_open_file(tmp_path):
    array = np.random.default_rng(0).integers(-1000, 1000, (1, 40, 36, 28)).astype(np.int16)
    handle = StoredArray(tmp_path / "a.b2nd", write_array(array, tmp_path / "a.b2nd"))
    assert handle.shape == (1, 40, 36, 28) and handle.dtype == np.int16 and handle.ndim == 4
    assert np.array_equal(handle[0:1, 3:9, ..., 2:30], array[0:1, 3:9, :, 2:28])
    assert torch.equal(handle.read((slice(None), slice(1, 5))), torch.from_numpy(array[:, 1:5]))
    assert handle[:, 5:5].shape == (1, 0, 36, 28)
    with pytest.raises(IndexError, match="step 1"):
        handle[:, ::2]
    with pytest.raises(IndexError, match="at most 4 slices"):
        handle[0]
    state = pickle.dumps(handle)
    assert len(state) < 2000  # the record and the path, no open file
    copy = pickle.loads(state)
    assert copy._mapped is None and np.array_equal(np.asarray(copy), array)


def _read_from_storage() -> int | None:
    """This process's bytes read from storage so far (``/proc/self/io``), None where they are not counted."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split(":")[1]) for line in lines if line.startswith("read_bytes:")), None)


def _evict(path: Path) -> None:
    """Writes back and drops ``path``'s pages from the page cache (no root needed)."""
    drop_page_cache([path])


def _cold_reads_counted(folder: Path) -> str | None:
    """Why a cold read cannot be counted in ``folder`` (no posix_fadvise or /proc/self/io, or a filesystem whose
    reads never reach storage, such as tmpfs), or None: a 1 MiB file evicted and read back must count its bytes."""
    if not hasattr(os, "posix_fadvise") or _read_from_storage() is None:
        return "no posix_fadvise or /proc/self/io read_bytes on this platform"
    probe = folder / "probe.bin"
    probe.write_bytes(np.random.default_rng(0).integers(0, 255, 2**20, dtype=np.uint8).tobytes())
    _evict(probe)
    before = _read_from_storage()
    probe.read_bytes()
    counted = _read_from_storage() - before
    probe.unlink()
    return None if counted >= 2**20 else f"reads are not counted from {folder} ({counted} bytes for 1 MiB: tmpfs?)"


def test_a_crop_from_a_cold_file_reads_the_chunks_it_covers_not_the_file(tmp_path):
    """From a file not in the page cache, a crop reads from storage the compressed chunks it covers and a few pages
    (header, tail, page rounding), in a few large reads: not the whole file, which one page fault's read-ahead
    around it fetched where the device's read-ahead is larger than the file (8 MiB here)."""
    import resource

    reason = _cold_reads_counted(tmp_path)
    if reason:
        pytest.skip(reason)
    rng = np.random.default_rng(5)
    array = rng.integers(-1000, 1000, (1, 160, 160, 96)).astype(np.int16)  # noise: chunks of ~50 kB
    path = tmp_path / "image.b2nd"
    record = write_array(array, path, patch_size=(64, 64, 64))
    assert record["chunks"] == [1, 32, 32, 32] and len(record["crc32"]) == 5 * 5 * 3
    region = (slice(0, 1), slice(40, 104), slice(40, 104), slice(20, 84))
    covered = chunk_numbers(array.shape, record["chunks"], region)
    assert len(covered) == 27
    import blosc2

    written = blosc2.open(str(path), mode="r")
    covered_bytes = sum(len(written.schunk.get_chunk(n)) for n in covered)
    del written
    _evict(path)
    handle = StoredArray(path, record, source="case.nii.gz")
    before, faults = _read_from_storage(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    assert np.array_equal(handle[region], array[region])
    read = _read_from_storage() - before
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults
    size = path.stat().st_size
    assert covered_bytes <= read <= covered_bytes + 64 * 1024, (read, covered_bytes, size)
    assert read < 0.45 * size
    assert faults <= 16  # the chunks asked for at once (MADV_WILLNEED), not page by page (about 330 pages)


def test_a_mapped_file_finds_every_chunks_bytes_and_the_chunks_not_stored(tmp_path):
    """The chunk offsets in the frame's tail give each stored chunk's bytes (their CRC-32 is the recorded one); a
    chunk of zeros is described by the offsets and not stored, and is checked as blosc2 describes it; offsets of
    another number of chunks are refused."""
    from components.data.store.mapped import FrameError, chunk_spans

    label = np.zeros((1, 96, 64, 64), np.uint8)
    label[0, 10:40, 5:30, 5:60] = np.random.default_rng(0).integers(1, 4, (30, 25, 55))
    record = write_array(label, tmp_path / "label.b2nd", patch_size=(64, 64, 64))
    mapped = MappedArray(tmp_path / "label.b2nd", record)
    stored = [n for n in range(len(record["crc32"])) if mapped._spans[n, 0] >= 0]
    assert 0 < len(stored) < len(record["crc32"])  # some chunks all zeros
    assert [mapped.checksum(n) for n in range(len(record["crc32"]))] == record["crc32"]
    assert mapped._spans[stored[0], 0] == record["head_bytes"]
    assert mapped._spans[stored[-1], 1] == record["nbytes"] - record["tail_bytes"]
    assert np.array_equal(StoredArray(tmp_path / "label.b2nd", record)[...], label)
    tail = (tmp_path / "label.b2nd").read_bytes()[-record["tail_bytes"] :]
    assert len(record["crc32"]) == 3 * 2 * 2
    with pytest.raises(FrameError, match="name 12 chunks, the index 25"):
        chunk_spans(tail, record["head_bytes"], record["nbytes"] - record["tail_bytes"], 25)


def test_opening_a_stored_file_decompresses_in_this_thread(tmp_path, monkeypatch):
    """Every blosc2 decompression an open makes (the chunk offsets) runs in one thread: blosc2's default context
    starts its threads on every call, which made opening a file the largest cost of a crop whose array is not kept
    (as at 100,000 volumes). Reads decompress in one thread too (the array's own parameters)."""
    import blosc2

    calls: list[dict] = []
    original = blosc2.decompress2

    def counting(src, dst=None, **kwargs):
        calls.append(kwargs)
        return original(src, dst, **kwargs)

    monkeypatch.setattr(blosc2, "decompress2", counting)
    array = np.random.default_rng(8).integers(-1000, 1000, (1, 60, 50, 40)).astype(np.int16)
    record = write_array(array, tmp_path / "image.b2nd", patch_size=(32, 32, 32))
    mapped = MappedArray(tmp_path / "image.b2nd", record)
    assert calls and all(call.get("nthreads") == 1 for call in calls), calls
    assert mapped.array.schunk.dparams.nthreads == 1


def test_a_process_reuses_an_opened_array_until_its_file_is_rewritten(tmp_path):
    """New handles of one file share the opened array and its verified chunks (a dataset makes a handle per item);
    a file rewritten at the same path (preprocess --overwrite) is opened anew, never served from the old one."""
    path = tmp_path / "a.b2nd"
    first = np.arange(40 * 36 * 28, dtype=np.int16).reshape(1, 40, 36, 28)
    record = write_array(first, path)
    one, two = StoredArray(path, record), StoredArray(path, record)
    assert np.array_equal(one[:, :4], first[:, :4])
    assert two._open() is one._mapped and two._verified is one._verified and len(one._verified) > 0
    second = first[:, ::-1].copy()  # the same size and record shape
    record = write_array(second, path)
    assert np.array_equal(StoredArray(path, record)[:, :4], second[:, :4])


# ------------------------------------------------------------------------------------------------------------
# values and metadata


class _Space(str, enum.Enum):
    RAS = "RAS"


def test_values_read_back_as_the_same_types():
    value = {
        "offset": (3, 0, -2),
        "coords": np.array([1, 2, 3], np.int64),
        "scalar": np.array(7.5, np.float32),  # nibabel's header values: 0-d arrays
        "numpy_scalar": np.float64(0.25),
        "affine": torch.eye(4, dtype=torch.float64) * 0.8,
        "nested": [None, True, 1.5, "a", {"b": (1.0,)}],
        "space": _Space.RAS,
    }
    back = decode_value(json.loads(json.dumps(encode_value(value))))
    assert back.keys() == value.keys() and back["space"] == "RAS" and type(back["space"]) is str
    for key in ("coords", "scalar"):
        assert type(back[key]) is np.ndarray and back[key].dtype == value[key].dtype
        assert back[key].shape == value[key].shape and np.array_equal(back[key], value[key])
    assert type(back["numpy_scalar"]) is np.float64 and back["numpy_scalar"] == 0.25
    assert back["affine"].dtype == torch.float64 and torch.equal(back["affine"], value["affine"])
    assert back["offset"] == (3, 0, -2) and back["nested"] == [None, True, 1.5, "a", {"b": (1.0,)}]
    with pytest.raises(TypeError, match=r"meta\['obj'\]: a object cannot be stored"):
        encode_value({"obj": object()}, "meta")
    with pytest.raises(TypeError, match="key 3 is not a string"):
        encode_value({3: 1}, "meta")


# ------------------------------------------------------------------------------------------------------------
# opening a store


def test_the_index_records_what_the_issue_asks_for(ssl_store):
    datalist, root, transforms = ssl_store
    store = open_store(root, fingerprint=transforms_fingerprint(transforms))
    assert len(store) == 4 and store.skipped == [] and store.failed == []
    entry = store.entries[1]
    assert entry["position"] == 1 and entry["id"].startswith("case_1-")
    assert store.source_root == str(datalist.parent) and entry["key"] == "images/case_1.nii.gz"  # relative: movable
    image = datalist.parent / "images" / "case_1.nii.gz"
    assert entry["files"] == [{"path": "images/case_1.nii.gz", "size": image.stat().st_size,
                               "mtime_ns": image.stat().st_mtime_ns,
                               "sha256": hashlib.sha256(image.read_bytes()).hexdigest()}]  # fmt: skip
    assert store.source(entry) == str(image)
    record = entry["arrays"]["image"]
    assert record["dtype"] == record["stored_dtype"] == "<i2"
    assert record["nbytes"] == (root / "volumes" / entry["id"] / "image.b2nd").stat().st_size > 0
    assert entry["spacing"] == pytest.approx([0.8, 0.8, 2.5])
    geometry = decode_value(entry["values"]["image_compact"])
    assert geometry["scale"] == (-1000.0, 1000.0, 0.0, 1.0, True) and len(geometry["padded_shape"]) == 3
    assert store.fingerprint == transforms_fingerprint(transforms) and store.index["format_version"] == FORMAT_VERSION
    assert store.index["index_layout"] == 2 and "entries" not in store.index  # the header only: entries stay on disk


def test_the_versions_of_the_packages_that_compute_the_values_are_part_of_the_fingerprint(ssl_store, tmp_path,
                                                                                           monkeypatch):
    """MONAI, nibabel, numpy and torch compute what a store holds: a store written under another version of any of
    them is refused, naming the package and both versions, and preprocessing does not add to it unless asked;
    blosc2 (lossless, every byte checked at read) and a build's local label (+cpu) are not part of it."""
    datalist, root, transforms = ssl_store
    installed = package_versions()
    assert set(installed) == {"monai", "nibabel", "numpy", "torch"} and "+" not in installed["torch"]
    assert open_store(root).index["packages"] == installed
    for package in installed:
        other = {**installed, package: "0.0.1"}
        assert transforms_fingerprint(transforms, other) != transforms_fingerprint(transforms), package
    older = {**installed, "monai": "1.3.0"}
    monkeypatch.setattr("components.data.store.preprocessing.package_versions", lambda: older)
    preprocess(datalist, tmp_path / "older", transforms)
    monkeypatch.undo()
    with pytest.raises(StoreError, match=rf"was written with other package versions \(monai 1.3.0, now "
                       rf"{installed['monai']}\) \(fingerprint .*\): rebuild it with"):  # fmt: skip
        open_store(tmp_path / "older", fingerprint=transforms_fingerprint(transforms))
    with pytest.raises(StoreError, match=r"holds a store written with other package versions \(monai 1.3.0, now .*"
                       r"--overwrite true"):  # fmt: skip
        preprocess(datalist, tmp_path / "older", transforms)
    assert preprocess(datalist, tmp_path / "older", transforms, overwrite=True).written == 4


def test_a_store_of_other_transforms_is_refused_with_the_command_that_rebuilds_it(ssl_store, tmp_path):
    _, root, _ = ssl_store
    other = transforms_fingerprint(bundle_transforms(SSL, {"roi_size": [32, 32, 32]}))
    with pytest.raises(StoreError, match="other deterministic transforms") as caught:
        open_store(root, fingerprint=other, rebuild="python -m components preprocess --datalist d.json --out s")
    assert str(caught.value).endswith("rebuild it with `python -m components preprocess --datalist d.json --out s`")
    assert "\n" not in str(caught.value)
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    index = json.loads((copy / "index.json").read_text())
    (copy / "index.json").write_text(json.dumps({**index, "command": "python -m components preprocess --out s"}))
    with pytest.raises(StoreError, match=r"fingerprint .*: rebuild it with `python -m components preprocess --out s "
                       r"--overwrite true`$"):  # fmt: skip
        open_store(copy, fingerprint=other)
    (copy / "index.json").write_text(json.dumps({**index, "format_version": 0}))
    with pytest.raises(StoreError, match=f"has store format 0, this version reads {FORMAT_VERSION}: rebuild it with"):
        open_store(copy)
    with pytest.raises(StoreError, match="no index.json: not a store"):
        open_store(tmp_path)


def test_verify_names_a_corrupt_file_and_its_source(ssl_store, tmp_path):
    _, root, _ = ssl_store
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    store = open_store(copy)
    store.verify()
    entry = store.entries[2]
    _corrupt_chunk(copy / "volumes" / entry["id"] / "image.b2nd", 0)
    with pytest.raises(StoreError, match=rf"1 corrupt file.*{entry['id']}/image.b2nd \(from .*case_2.nii.gz\): chunk"):
        store.verify()


# ------------------------------------------------------------------------------------------------------------
# the SSL recipe's crops from the store


def _random_part(num_samples: int) -> Compose:
    return Compose([RandCompactSpatialCropSamplesd("image", roi_size=ROI, num_samples=num_samples),
                    EnsureTyped("image", track_meta=False)])  # fmt: skip


def _same_values(got, want, where) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _same_values(got[key], want[key], (*where, key))
    elif isinstance(want, (torch.Tensor, np.ndarray)):
        assert type(got) is type(want) and got.dtype == want.dtype, where
        got, want = np.asarray(got), np.asarray(want)
        assert np.array_equal(got, want, equal_nan=want.dtype.kind == "f"), where  # a header's NaN slope
    elif isinstance(want, enum.Enum):  # MONAI's SpaceKeys: documented to come back as the equal str
        assert type(got) is str and got == want, where
    else:
        assert type(got) is type(want) and (got == want or got != got and want != want), where  # NaN == NaN


def test_crops_from_the_store_equal_the_in_memory_compact_path_and_monais_transforms(ssl_store):
    """Same random state: the store's items through the bundle's random transforms give torch.equal crops and the
    same other keys as the bundle's deterministic transforms in memory, and the crops of MONAI's original recipe
    (ScaleIntensityRanged, SpatialPadd, CropForegroundd, RandSpatialCropSamplesd) from the same files."""
    datalist, root, transforms = ssl_store
    dataset = StoreDataset(open_store(root, fingerprint=transforms_fingerprint(transforms)))
    deterministic = build_transforms(transforms)
    items = json.loads(datalist.read_text())["training"]
    padded_crops = 0
    for index, item in enumerate(items):
        files = {k: str(datalist.parent / v) for k, v in item.items()}
        stored, in_memory = dataset[index], deterministic(dict(files))
        assert isinstance(stored["image"], StoredArray)
        assert torch.equal(stored["image"].read(), in_memory["image"])
        from_store, from_memory, recipe = _random_part(3), _random_part(3), _recipe(ROI, 3)
        recipe_cached = Compose(recipe.transforms[:6])({"image": files["image"]})
        recipe_random = Compose(recipe.transforms[6:])
        for part in (from_store, from_memory, recipe_random):
            part.set_random_state(20 + index)
        for draw in range(3):
            got = from_store(deepcopy(stored))
            want = from_memory(deepcopy(in_memory))
            original = recipe_random(deepcopy(recipe_cached))
            for sample_got, sample_want, sample_original in zip(got, want, original):
                assert sample_got.keys() == sample_want.keys()
                assert torch.equal(sample_got["image"], sample_want["image"]), (index, draw)
                assert torch.equal(sample_got["image"], sample_original["image"]), (index, draw)
                padded_crops += int((sample_got["image"] == 0).any())
                for key in sample_want.keys() - {"image"}:
                    _same_values(sample_got[key], sample_want[key], (index, draw, key))
                for key in ("foreground_start_coord", "foreground_end_coord"):
                    assert np.array_equal(sample_got[key], sample_original[key]), (index, key)
    assert padded_crops  # some crops reached outside the stored region


class _CountingSlices:
    """An opened blosc2 array that records, per slice read, the chunks the slice covers (those decompressed)."""

    def __init__(self, array, decompressed: list[list[int]]) -> None:
        self._array, self._decompressed = array, decompressed

    def __getattr__(self, name):
        return getattr(self._array, name)

    def __getitem__(self, region):
        self._decompressed.append(chunk_numbers(self._array.shape, self._array.chunks, region))
        return self._array[region]


class _CountingMapped(MappedArray):
    """A mapped stored file that records the chunks each slice decompresses and, per compressed chunk checked (its
    CRC-32 computed), its number: what a crop costs, counted where blosc2 and the bytes are read."""

    decompressed: list[list[int]] = []
    fetched: list[int] = []

    def __init__(self, path, record) -> None:
        super().__init__(path, record)
        self.array = _CountingSlices(self.array, self.decompressed)

    def checksum(self, number: int) -> int:
        self.fetched.append(number)
        return super().checksum(number)


def test_a_pretraining_crop_reads_only_the_chunks_it_covers(tmp_path, monkeypatch):
    """The SSL recipe's crops from a stored volume of 18 chunks (3 x 3 x 2 of 64^3): every read a 32^3 crop makes
    covers at most 2 x 2 x 2 chunks, and only the chunks read are fetched and checked. A crop that read the whole
    volume and sliced it (``array.read()[region]``) would decompress all 18 for every crop."""
    rng = np.random.default_rng(3)
    shape = (150, 140, 80)
    x, y, z = np.meshgrid(*(np.linspace(-1, 1, n) for n in shape), indexing="ij")
    body = (x / 0.95) ** 2 + (y / 0.95) ** 2 + (z / 1.3) ** 2 < 1.0
    image = np.where(body, 40.0, -1000.0) + rng.normal(0, 15, shape)
    (tmp_path / "data").mkdir()
    nib.save(nib.Nifti1Image(np.rint(image).astype(np.int16), np.eye(4)), tmp_path / "data" / "big.nii.gz")
    roi = [32, 32, 32]
    preprocess([{"image": str(tmp_path / "data" / "big.nii.gz")}], tmp_path / "store", bundle_transforms(SSL, {"roi_size": roi}))
    decompressed: list[list[int]] = []
    fetched: list[int] = []
    from components.data.store import handle as handle_module

    monkeypatch.setattr(_CountingMapped, "decompressed", decompressed)
    monkeypatch.setattr(_CountingMapped, "fetched", fetched)
    monkeypatch.setattr(handle_module, "MappedArray", _CountingMapped)
    dataset = StoreDataset(tmp_path / "store", transform=Compose([
        RandCompactSpatialCropSamplesd("image", roi_size=roi, num_samples=2), EnsureTyped("image", track_meta=False)]))
    stored = dataset[0]  # the crops of one item
    assert len(stored) == 2
    whole = open_store(tmp_path / "store").item(0)["image"]
    record = whole.record
    total = len(chunk_numbers(record["shape"], record["chunks"], [slice(0, n) for n in record["shape"]]))
    assert total == 18, record
    crops = 0
    for seed in range(8):
        dataset.transform.set_random_state(seed)
        before = len(decompressed)
        for crop in dataset[0]:
            assert crop["image"].shape == (1, *roi)
        reads = decompressed[before:]
        assert 1 <= len(reads) <= 2  # one read per crop (none for a crop wholly in the padding)
        assert all(1 <= len(chunks) <= 8 for chunks in reads), reads
        crops += len(reads)
    assert crops >= 12 and max(len(chunks) for chunks in decompressed) < total
    assert set(fetched) == {n for chunks in decompressed for n in chunks}  # checked: the chunks read, each once
    assert len(fetched) == len(set(fetched))
    decompressed.clear()
    whole.read()
    assert decompressed == [list(range(total))]  # the counting sees a whole read


class _BlockCountingMapped(MappedArray):
    """A mapped stored file whose blosc2 array records, per block it decompresses, the block's first item in the
    array's chunked order (a blosc2 postfilter runs once per decompressed block)."""

    decompressed: list[int] = []

    def __init__(self, path, record) -> None:
        super().__init__(path, record)
        dtype = np.dtype(record["stored_dtype"])

        @self.array.schunk.postfilter(dtype)
        def count(values, out, offset):
            self.decompressed.append(int(offset))
            out[:] = values


def _blocks_covered(shape, chunks, blocks, region) -> list[int]:
    """The first item (chunk x items per chunk + block in the chunk x items per block) of every block that
    ``region`` covers, the blocks of each chunk in C order."""
    chunk_items, block_items = int(np.prod(chunks)), int(np.prod(blocks))
    chunk_grid = [-(-n // c) for n, c in zip(shape, chunks)]
    block_grid = [-(-c // b) for c, b in zip(chunks, blocks)]
    covered = []
    for number in chunk_numbers(shape, chunks, region):
        origin = [i * c for i, c in zip(np.unravel_index(number, chunk_grid), chunks)]
        for index in itertools.product(*(range(g) for g in block_grid)):
            starts = [o + i * b for o, i, b in zip(origin, index, blocks)]
            if all(s < r.stop and r.start < s + b for s, b, r in zip(starts, blocks, region)):
                covered.append(number * chunk_items + int(np.ravel_multi_index(index, block_grid)) * block_items)
    return covered


def test_a_crop_decompresses_only_the_blocks_it_covers(tmp_path, monkeypatch):
    """Of the chunks a read covers, blosc2 decompresses only the blocks it covers, each once, counted per block: a
    96^3 crop in chunks of 48^3 with blocks of 16^3 (the layout for 96^3 crops) decompresses at most 8^3 blocks of
    16^3, where reading its chunks whole would decompress up to 3^3 chunks of 27 blocks each."""
    from components.data.store import handle as handle_module

    array = np.random.default_rng(6).integers(-1000, 1000, (1, 150, 130, 110)).astype(np.int16)
    record = write_array(array, tmp_path / "image.b2nd", patch_size=(96, 96, 96))
    assert (record["chunks"], record["blocks"]) == ([1, 48, 48, 48], [1, 16, 16, 16])
    decompressed: list[int] = []
    monkeypatch.setattr(_BlockCountingMapped, "decompressed", decompressed)
    monkeypatch.setattr(handle_module, "MappedArray", _BlockCountingMapped)
    handle = StoredArray(tmp_path / "image.b2nd", record)
    rng = np.random.default_rng(7)
    corners = [(0, 0, 0), (54, 34, 14), (40, 40, 10)] + [tuple(int(rng.integers(0, n - 95)) for n in (150, 130, 110))
                                                         for _ in range(5)]  # fmt: skip
    blocks, in_chunks = 0, 0
    for corner in [*corners, (100, 120, 100)]:
        size = 96 if corner != (100, 120, 100) else 5  # the last: a few voxels in one block
        region = (slice(0, 1), *(slice(c, c + size) for c in corner))
        decompressed.clear()
        assert np.array_equal(handle[region], array[region])
        expected = _blocks_covered(array.shape, record["chunks"], record["blocks"], region)
        assert sorted(decompressed) == sorted(expected) and len(set(decompressed)) == len(decompressed), corner
        assert len(decompressed) <= 8**3 if size == 96 else len(decompressed) == 1
        blocks += len(decompressed)
        in_chunks += 27 * len(chunk_numbers(array.shape, record["chunks"], region))
    assert blocks < 0.7 * in_chunks  # (0, 0, 0) lies on chunk borders: 8 whole chunks; the others do not


@pytest.mark.parametrize("floats", ["quantized", "exact"])
def test_a_finetuning_store_keeps_float_images_compact_labels_narrow_and_metatensor_metadata(tmp_path, floats):
    """The BTCV bundle's deterministic transforms (Spacingd, ScaleIntensityRanged, CropForegroundd): the float32
    label is stored as uint8 and read back as float32 exactly; the float32 image is stored as int16 codes within
    half a code step of its values (quantized, the default) or as float32 (exact); ReadStoredd gives the in-memory
    MetaTensors back."""
    datalist = write_tiny_ct(tmp_path / "data", num=2)
    transforms = bundle_transforms(bundle_dir("swin_unetr_btcv_finetune"))
    preprocess(datalist, tmp_path / "store", transforms, floats=floats)
    store = open_store(tmp_path / "store")
    assert store.entries[1]["arrays"]["label"]["stored_dtype"] == "|u1"
    assert store.entries[1]["arrays"]["image"]["stored_dtype"] == ("<i2" if floats == "quantized" else "<f4")
    item = json.loads(datalist.read_text())["training"][1]
    in_memory = build_transforms(transforms)({k: str(datalist.parent / v) for k, v in item.items()})
    stored = StoreDataset(store)[1]
    read = ReadStoredd(["image", "label"])(stored)
    for key in ("image", "label"):
        assert isinstance(read[key], MetaTensor) and read[key].dtype == in_memory[key].dtype == torch.float32
        assert torch.equal(read[key].affine, in_memory[key].affine)
    assert torch.equal(read["label"].as_tensor(), in_memory["label"].as_tensor())
    error = (read["image"].as_tensor() - in_memory["image"].as_tensor()).abs()
    if floats == "exact":
        assert not error.any() and "scales" not in stored["image"].record
    else:
        record = stored["image"].record
        largest = float(in_memory["image"].abs().max())
        step = largest / 32767
        assert record["scales"] == [pytest.approx(step)]
        assert float(error.max()) == pytest.approx(record["max_abs_error"])
        assert 0 < record["max_abs_error"] <= step / 2 + largest * 2**-23  # half a step, and float32's rounding
        assert not read["image"][in_memory["image"] == 0].any()  # zeros stay zeros
    assert read["image_meta_dict"]["filename_or_obj"] == str(datalist.parent / item["image"])


def test_a_volume_without_foreground_is_stored_empty_and_cropped_as_zeros(tmp_path):
    """All air: the compact array has no voxel, the store holds a 0-voxel array, and the crops are the recipe's
    zeros."""
    (tmp_path / "images").mkdir()
    path = tmp_path / "images" / "air.nii.gz"
    nib.save(nib.Nifti1Image(np.full(SHAPE, -1024, np.int16), np.eye(4)), path)
    transforms = bundle_transforms(SSL, {"roi_size": ROI})
    preprocess([{"image": str(path)}], tmp_path / "store", transforms)
    stored = StoreDataset(open_store(tmp_path / "store"))[0]
    assert stored["image"].shape == (1, 0, 0, 0)
    in_memory = build_transforms(transforms)({"image": str(path)})
    from_store, from_memory = _random_part(2), _random_part(2)
    from_store.set_random_state(1), from_memory.set_random_state(1)
    for got, want in zip(from_store(stored), from_memory(in_memory)):
        assert torch.equal(got["image"], want["image"]) and not got["image"].any()


def _whole_image(item: dict) -> torch.Tensor:
    return item["image"].read()


def test_a_dataloader_reads_the_store_in_worker_processes(ssl_store):
    """Items travel to two workers as handles (no open file) and are read there; a shard is this rank's part."""
    _, root, _ = ssl_store
    store = open_store(root)
    expected = [store.item(i)["image"].read() for i in range(len(store))]
    loader = DataLoader(StoreDataset(store, transform=_whole_image), batch_size=1, num_workers=2)
    batches = list(loader)
    assert len(batches) == 4 and all(torch.equal(got[0], want) for got, want in zip(batches, expected))
    volumes = [(e["id"], store.source(e)) for e in store.entries]
    for rank in range(2):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("ignite.distributed.get_rank", lambda: rank)
            patch.setattr("ignite.distributed.get_world_size", lambda: 2)
            shard = StoreDataset(store, shard=True, seed=3)
        assert list(shard.data) == partition_for_rank(volumes, seed=3, rank=rank, world_size=2) and len(shard) == 2


def test_a_volume_that_fails_to_read_names_the_store_file_and_the_source(ssl_store, tmp_path):
    _, root, _ = ssl_store
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    store = open_store(copy)
    entry = store.entries[0]
    os.truncate(copy / "volumes" / entry["id"] / "image.b2nd", 100)
    crop = _random_part(1)
    with pytest.raises(Exception) as caught:
        crop(StoreDataset(store)[0])
    error = caught.value if isinstance(caught.value, StoreReadError) else caught.value.__cause__
    assert isinstance(error, StoreReadError), repr(caught.value)
    assert error.source == store.source(entry) and error.store_file.endswith(f"{entry['id']}/image.b2nd")
    shutil.rmtree(copy / "volumes" / entry["id"])
    with pytest.raises(StoreReadError, match=rf"{entry['id']}/item.json \(from .*case_0.nii.gz\): no volume entry"):
        StoreDataset(store)[0]
