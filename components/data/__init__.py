"""Data: datalists and rank partitioning, dataset construction, the compact cache transforms and the data check.

Under DDP every rank must cache only its own shard (a cache of the whole list on
every rank multiplies the memory by the world size): the datalist is
partitioned with a fixed seed into equal shards before any caching, each rank builds one dataset of its
shard, and sizes are validated before the (possibly hour-long) caching starts.

Every bundle pipeline runs as a :class:`SourceNamingCompose`, so a volume that breaks a transform at item 700 of
caching, or in a loader worker mid-training, is named in the error (:class:`DataItemError`).

Modules, each one concern:

- ``datalists``: ``load_datalist``, ``load_split`` (checkable without data, a fixed validation split when the
  datalist has none), ``MissingDatalist``, ``require_datalist``.
- ``partition``: ``partition_for_rank``, ``split_for_rank``, ``check_shard_sizes`` (sizes fail before caching).
- ``datasets``: ``build_dataset`` (the one place that builds training datasets), ``EpochShuffleSampler``,
  ``ResumableSmartCacheDataset`` and ``ResumableSmartCacheHandler``.
- ``sources``: ``batch_filenames``, ``item_sources``, ``SourceNamingCompose`` / ``DataItemError``.
- ``compact_cache``: ``CompactCropForegroundd``, ``RandCompactSpatialCropSamplesd``, ``IntensityScaler``,
  ``compact_nbytes``: the recipe's crops from a compact cache.
- the data check: ``check`` (``check_datalist``, ``check_items``, ``check_before_caching``), built on
  ``check_entries`` (one datalist entry) and ``check_files`` (one file's header and voxels); ``check_report``
  (``DataReport``, ``DataIssue``, ``DataCheckError``); ``check_command`` (``python -m components check-data``);
  ``check_voxels``: ``CheckVoxelsd``, the deep check's voxel tests as a transform, where caching first reads a volume.
- ``store`` (a package): the on-disk store of preprocessed volumes for corpora that do not fit in memory:
  ``preprocess`` (``python -m components preprocess``), ``open_store`` / ``Store``, ``StoreDataset`` with lazy
  ``StoredArray`` handles, ``ReadStoredd``, ``bundle_transforms`` / ``transforms_fingerprint``, ``StoreError`` / ``StoreReadError``.
- ``synthetic``: ``write_dataset``: the synthetic CT and MRI volumes, labels and datalists that the demo, the tests and
  the benchmarks train on (``python -m components synth``).

The public names are re-exported here (``from components.data import build_dataset``) and imported on first use
(PEP 562, as in ``components``): ``check-data`` imports the check without MONAI's datasets and ignite.
"""

from __future__ import annotations

from ..lazy import lazy_names

# the modules and the sub-package whose public names (each module's __all__) are offered here
__getattr__, __dir__ = lazy_names(
    __name__,
    modules=(
        "check", "check_report", "check_voxels", "compact_cache", "datalists", "datasets", "partition", "sources",
        "synthetic",
    ),
    packages=("store",),
)  # fmt: skip
