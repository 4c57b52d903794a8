"""Components of the Swin UNETR self-supervised pretraining and finetuning bundles (``import components``).

The public names below are imported on first use (PEP 562 module ``__getattr__``): ``import components`` costs
nothing, ``components.SSLHead`` (as the bundle configs write it) or ``from components import SSLHead`` imports its
submodule then. So ``python -m components --help`` does not pay for torch and MONAI, and a command imports only
what it needs.

The packages, each one concern; imports point down this list, never up:

- ``release``: packaging, download, export, checkpoint conversion, the code-origin check, a bundle run's start;
- ``demo``: the demo, its pictures and the bundle runner;
- ``recipes``: one package per pretraining recipe (views, forward, loss, head) and the recipes' pictures;
- ``training``: the recipe-agnostic trainer and evaluator and what every run shares (loader, settings, progress,
  RankMe, the finetuning metrics);
- ``checkpoint``: published layouts, the architecture of a file, pretrained loading, resume, saving;
- ``data``: datalists, rank partitioning, datasets and caches, the data check, the on-disk store, synthetic data;
- ``networks``: the Swin ViT encoder, ``prepare_network``, fused attention, activation checkpointing, the probe;
- ``config``: config values, the running bundle's files and overrides, the override check;
- ``errors`` (the refusals told in one line, once across the ranks), ``distributed`` (the one module that calls
  ``torch.distributed``), ``files`` (atomic writes, digests) and ``lazy`` (these lazy names).
"""

from __future__ import annotations

import importlib

from .lazy import lazy_names

__version__ = "0.4.0"

# sub-package or module -> the public names it provides here (each sub-package re-exports them from its modules)
_EXPORTS: dict[str, tuple[str, ...]] = {
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
        "check_pretrained",
        "check_resume",
        "convert_state_dict",
        "infer_architecture",
        "load_pretrained",
        "resolve_resume",
        "save_atomic",
    ),
    "config": ("as_bool", "check_overrides", "check_types", "defined_overrides", "is_null", "optional_path",
               "require_file", "run_config_files"),
    "data": (  # datalists, partitioning, datasets, the compact cache, the data check, the on-disk store, synthetic data
        "CheckVoxelsd",
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
        "write_dataset",
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
    "errors": ("ConfigError", "MissingFileError", "UserError", "report_errors"),
    "files": ("atomic_write", "sha256_file"),
    "networks": (
        "FusedWindowAttention",
        "LinearProbe",
        "check_roi_size",
        "checkpointing_decision",
        "free_memory_bytes",
        "prepare_network",
        "saved_activation_bytes",
        "set_checkpointing",
        "use_fused_attention",
    ),
    "recipes": (
        "MASKED_IMAGE_SETTINGS",
        "SELF_DISTILLATION_SETTINGS",
        "SSL_SETTINGS",
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
        "input_corruption",
        "rot_rand",
        "ssl_views",
        "weight_decay_groups",
    ),
    "release": (
        "ExportedModule",
        "HashMismatchError",
        "UnsafeArchiveError",
        "convert_checkpoint",
        "export_network",
        "extract_zip_safely",
        "fetch",
        "fetch_bundle",
        "load_exported",
        "metadata_schema",
        "package_bundle",
        "report_origin",
        "schema_path",
        "start",
    ),
    "training": (
        "BUNDLE_SETTINGS",
        "BundleEvaluator",
        "BundleTrainer",
        "CompileMonitor",
        "EmbeddingRankHandler",
        "FinalValidationHandler",
        "FreezeEncoder",
        "HealthHandler",
        "HealthReport",
        "NonFiniteLossError",
        "PerClassMetrics",
        "PersistentWorkerLoader",
        "PretrainingEvaluator",
        "PretrainingTrainer",
        "Recipe",
        "RankLossStats",
        "ReseedEachEpoch",
        "SkippedReads",
        "StatsWithEta",
        "StopOnNonFiniteLoss",
        "VolumeProgress",
        "balanced_class_weights",
        "brats_labels_from_regions",
        "bundle_loader",
        "check_accumulation_steps",
        "check_setting_types",
        "check_settings",
        "compiled_graphs",
        "cuda_amp",
        "default_num_workers",
        "effective_rank",
        "embedding_signals",
        "encoder_param_groups",
        "health_crops",
        "install_filters",
        "log_filter",
        "log_from_rank_zero",
        "loss_and_lr",
        "loss_class_weights",
        "lr_for_world_size",
        "per_class_means",
        "recipe_health",
        "rotation_axes",
        "swin_embeddings",
        "tune_allocator",
    ),
}
__all__, __getattr__, __dir__ = lazy_names(__name__, _EXPORTS, submodules=("demo",))

# the narrow filters of known-harmless third-party warnings (components.training.quiet; logging and warnings only)
importlib.import_module(".training.quiet", __name__).install_filters()
