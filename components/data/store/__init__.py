"""An on-disk store of preprocessed volumes, for corpora that do not fit in memory.

``python -m components preprocess`` reads every volume of a datalist once, runs a bundle's deterministic
transforms (for the SSL bundle: down to the compact int16 array of ``CompactCropForegroundd``) and writes each
volume's arrays as compressed, chunked blosc2 files with an index; training then reads only the crops it cuts.

Modules, each one concern:

- ``format``: one array on disk (blosc2, LZ4HC, chunks and blocks from the crop size, a CRC-32 per chunk,
  quantized floats) and why that format;
- ``values``: the small values and metadata of an item as JSON that reads back as the same types;
- ``index``: the store's layout, the transforms' fingerprint, where its sources are (a root and paths under it),
  index shards and their merge into memory-mapped columns (``StoreError``);
- ``packages``: the package versions a store's values depend on (part of the fingerprint);
- ``transforms``: a bundle's ``train#transforms#deterministic`` as plain configs (``bundle_transforms``);
- ``volume``: one volume's folder, written whole or not at all, and read back with lazy handles;
- ``foreground``: a label map's sampled foreground locations per class (``ClassLocations``);
- ``preprocessing``: ``preprocess``, the run over a datalist (check, workers, parts, resume, errors);
- ``workers``: the worker processes of ``preprocess``, which die with it and fail only the volume of one that dies;
- ``mapped``: a stored file memory-mapped for random reads (a read moves from disk the chunks it covers), its
  header and tail checked, each chunk's bytes found for its CRC-32;
- ``handle``: ``StoredArray``, the lazy handle, and ``StoreReadError``;
- ``dataset``: ``open_store``, ``Store``, ``StoreDataset``, ``training_store`` (the datalist's volumes, a rank's
  shard, their sources checked) and ``ReadStoredd`` (whole arrays as MetaTensors);
- ``crops``: the finetuning bundles' crops cut from the store (``StoreRandCropByPosNegLabeld``,
  ``StoreRandSpatialCropSamplesd``), reading only the chunks each covers.
- ``read_errors``: ``ReadErrors``, the skipped reads counted in memory shared with the loader's workers.

Public names are imported on first use (PEP 562), so ``import components.data.store`` loads neither blosc2 nor
MONAI.
"""

from __future__ import annotations

from ...lazy import lazy_names

# the modules whose public names (each one's __all__) are offered here; the others are the store's machinery
__getattr__, __dir__ = lazy_names(__name__, modules=("crops", "dataset", "handle", "index", "preprocessing", "transforms"))
