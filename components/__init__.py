"""Components of the Swin UNETR self-supervised pretraining and finetuning bundles (``import components``).

The public names below are imported on first use (PEP 562 module ``__getattr__``): ``import components`` costs
nothing, ``components.SSLHead`` (as the bundle configs write it) or ``from components import SSLHead`` imports its
submodule then. So ``python -m components --help`` does not pay for torch and MONAI, and a command imports only
what it needs.
"""

from __future__ import annotations

import importlib

from .lazy import lazy_names

__version__ = "0.4.0"

# submodule -> the public names it provides here
_EXPORTS: dict[str, tuple[str, ...]] = {
    "attention": ("FusedWindowAttention", "use_fused_attention"),
    "allocator": ("tune_allocator",),
    "atomic": ("atomic_write",),
    "checkpoint": (
        "BestModelSaver",
        "CheckpointEvents",
        "CheckpointLoadError",
        "LoadReport",
        "PretrainedLoader",
        "ResumableCheckpointSaver",
        "ResumeHandler",
        "SwinArchitecture",
        "adopt_architecture",
        "build_for_weights",
        "check_architecture",
        "convert_state_dict",
        "infer_architecture",
        "load_pretrained",
        "resolve_resume",
        "save_atomic",
    ),
    "compilation": ("CompileMonitor", "compiled_graphs"),
    "config_values": ("as_bool", "optional_path", "require_file"),
    "conversion": ("convert_checkpoint",),
    "data": (  # a package: datalists, partitioning, datasets, the compact cache, the data check, the on-disk store
        "CompactCropForegroundd",
        "DataCheckError",
        "DataIssue",
        "DataItemError",
        "DataReport",
        "EpochShuffleSampler",
        "MissingDatalist",
        "RandCompactSpatialCropSamplesd",
        "ReadStoredd",
        "ResumableSmartCacheHandler",
        "SourceNamingCompose",
        "Store",
        "StoreDataset",
        "StoreError",
        "StoreReadError",
        "StoredArray",
        "batch_filenames",
        "build_dataset",
        "data_pipeline",
        "bundle_transforms",
        "check_before_caching",
        "check_datalist",
        "check_items",
        "check_shard_sizes",
        "compact_nbytes",
        "item_sources",
        "load_datalist",
        "load_split",
        "open_store",
        "partition_for_rank",
        "preprocess",
        "require_datalist",
        "rotate_smart_cache",
        "split_for_rank",
        "transforms_fingerprint",
    ),
    "distributed": (
        "all_gather_with_grad",
        "all_reduce_mean",
        "barrier",
        "cleanup_distributed",
        "device_for_rank",
        "get_rank",
        "get_world_size",
        "init_distributed",
        "wrap_ddp",
    ),
    "encoder_lr": ("FreezeEncoder", "encoder_param_groups"),
    "export": ("ExportedModule", "export_network", "load_exported"),
    "engine": (
        "NonFiniteLossError",
        "PretrainingEvaluator",
        "PretrainingTrainer",
        "Recipe",
        "ReseedEachEpoch",
        "StopOnNonFiniteLoss",
        "log_filter",
    ),
    "loader": ("PersistentWorkerLoader", "default_num_workers"),
    "networks": ("LinearProbe", "check_roi_size", "prepare_network"),
    "origin": ("report_origin",),
    "download": ("HashMismatchError", "UnsafeArchiveError", "extract_zip_safely", "fetch", "fetch_bundle"),
    "package": ("metadata_schema", "package_bundle", "schema_path"),
    "progress": ("StatsWithEta", "VolumeProgress"),
    "quiet": ("install_filters", "log_from_rank_zero"),
    "rankme": ("EmbeddingRankHandler", "effective_rank", "swin_embeddings"),
    "recipes": (
        "InpaintingContrastRecipe",
        "MaskedImageModel",
        "MaskedImageRecipe",
        "MaskedReconstructionLoss",
        "MaskedTokenDistillation",
        "MaskedViewsImageHandler",
        "MultiCrop",
        "SelfDistillationLoss",
        "SelfDistillationNetwork",
        "SelfDistillationRecipe",
        "SSLEvaluator",
        "SSLHead",
        "SSLLoss",
        "SSLTrainer",
        "SSLViewsImageHandler",
        "StopOnCollapse",
        "SwinViTEmbedding",
        "TeacherCollapseError",
        "aug_rand",
        "block_grid",
        "check_koleo_batch",
        "rot_rand",
        "ssl_views",
        "weight_decay_groups",
    ),
    "segmentation": ("PerClassMetrics", "balanced_class_weights", "brats_labels_from_regions", "per_class_means"),
    "settings": ("check_overrides", "check_settings", "rotation_axes"),
    "step_memory": ("checkpointing_decision", "free_memory_bytes", "saved_activation_bytes", "set_checkpointing"),
    "synthetic": ("write_dataset",),
}
__all__, __getattr__, __dir__ = lazy_names(__name__, _EXPORTS, submodules=("demo", "runner"))

# the narrow filters of known-harmless third-party warnings (components.quiet; logging and warnings only)
importlib.import_module(".quiet", __name__).install_filters()
