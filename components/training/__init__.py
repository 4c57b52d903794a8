"""Training: the recipe-agnostic trainer and evaluator and what every training run shares.

- ``trainer``, ``evaluator``: ``PretrainingTrainer`` / ``PretrainingEvaluator`` (one MONAI engine each for every
  recipe); ``recipe``: the ``Recipe`` protocol they run and the steps they share.
- ``non_finite``: ``StopOnNonFiniteLoss`` (any trainer); ``seeding``: ``ReseedEachEpoch`` (any trainer), ``epoch_seed``;
  ``log_interval``: ``log_filter``.
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

# the modules whose public names (each one's __all__) are offered here
__getattr__, __dir__ = lazy_names(
    __name__,
    modules=(
        "allocator", "compilation", "encoder_lr", "evaluator", "health", "health_handler", "loader", "log_interval",
        "non_finite", "progress", "quiet", "rankme", "read_errors", "recipe", "seeding", "segmentation", "settings",
        "setting_types", "supervised", "trainer", "validation",
    ),
)  # fmt: skip
