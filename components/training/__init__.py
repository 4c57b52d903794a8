"""Training: the recipe-agnostic trainer and evaluator and what every training run shares.

- ``trainer``, ``evaluator``: ``PretrainingTrainer`` / ``PretrainingEvaluator`` (one MONAI engine each for every
  recipe); ``recipe``: the ``Recipe`` protocol they run and the steps they share.
- ``non_finite``: ``StopOnNonFiniteLoss`` (any trainer); ``seeding``: ``ReseedEachEpoch`` (any trainer), ``epoch_seed``;
  ``log_interval``: ``log_filter``; ``wrappers``: ``unwrap`` (the network under DDP and compile).
- ``loader``: ``PersistentWorkerLoader`` (workers kept for the run, reseeded per epoch), ``bundle_loader`` (a
  bundle's loader from its ``loader`` settings), ``default_num_workers``.
- ``encoder_lr``: ``encoder_param_groups`` (layer-wise rates of the encoder), ``FreezeEncoder``,
  ``lr_for_world_size``.
- ``compilation``: ``CompileMonitor``; ``allocator``: ``tune_allocator``.
- ``settings``: ``check_settings`` (a run's settings before any data is read), ``rotation_axes``;
  ``setting_types``: ``check_setting_types`` (every setting's type and range, ``BUNDLE_SETTINGS``).
- ``progress``: ``StatsWithEta``, ``VolumeProgress``, ``RankLossStats``, ``loss_and_lr``; ``quiet``: the log filters
  every process installs.
- ``rankme``: ``EmbeddingRankHandler`` (RankMe of the encoder on fixed crops).
- ``read_errors``: ``SkippedReads`` (the stored volumes a run skipped, per epoch and in total; the cap).
- ``health``: pretext and collapse signals beside their trivial answers, read together (``HealthReport``);
  ``health_handler``: ``HealthHandler`` (a run's health at every validation), ``recipe_health``.
- ``segmentation``: the finetuning bundles' ``PerClassMetrics``, class weights and BraTS labels; ``supervised``:
  ``BundleTrainer`` / ``BundleEvaluator`` (MONAI's supervised engines, the settings as a command line gives them).
- ``validation``: ``FinalValidationHandler`` (validation every ``val_interval`` epochs and at the last one).

The names are re-exported here and in ``components``, imported on first use.
"""

from __future__ import annotations

from ..lazy import lazy_names

# module -> the public names it provides here
_EXPORTS: dict[str, tuple[str, ...]] = {
    "allocator": ("tune_allocator",),
    "compilation": ("CompileMonitor", "compiled_graphs"),
    "encoder_lr": ("FreezeEncoder", "encoder_param_groups", "lr_for_world_size"),
    "evaluator": ("PretrainingEvaluator",),
    "health": ("HealthReport", "Signal", "embedding_signals"),
    "health_handler": ("HealthHandler", "health_crops", "recipe_health"),
    "loader": ("PersistentWorkerLoader", "bundle_loader", "default_num_workers"),
    "log_interval": ("log_filter",),
    "non_finite": ("NonFiniteLossError", "StopOnNonFiniteLoss"),
    "progress": ("RankLossStats", "StatsWithEta", "VolumeProgress", "loss_and_lr"),
    "quiet": ("install_filters", "log_from_rank_zero"),
    "rankme": ("EmbeddingRankHandler", "effective_rank", "swin_embeddings"),
    "read_errors": ("SkippedReads",),
    "recipe": ("Recipe",),
    "seeding": ("ReseedEachEpoch",),
    "segmentation": (
        "PerClassMetrics",
        "balanced_class_weights",
        "brats_labels_from_regions",
        "loss_class_weights",
        "per_class_means",
    ),
    "settings": ("check_accumulation_steps", "check_settings", "rotation_axes"),
    "supervised": ("BundleEvaluator", "BundleTrainer", "cuda_amp"),
    "setting_types": ("BUNDLE_SETTINGS", "Device", "check_setting_types"),
    "trainer": ("PretrainingTrainer",),
    "validation": ("FinalValidationHandler",),
}
__all__, __getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
