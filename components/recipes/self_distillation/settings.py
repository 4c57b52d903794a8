"""What the self-distillation bundle's own settings accept (:func:`components.check_setting_types`)."""

from __future__ import annotations

from ...config.kinds import Integer, Kind, ListOf, Number

__all__ = ["SELF_DISTILLATION_SETTINGS"]

_COUNT = Integer(1)
_PROBABILITY = Number(0, 1)
_TEMPERATURE = Number(above=0)
_START_END = "start and end of the cosine schedule"

#: the kinds of the self-distillation bundle's settings beyond the shared ones, by id (these win)
SELF_DISTILLATION_SETTINGS: dict[str, Kind] = {
    "training#weight_decay": ListOf(Number(0), 2).because(_START_END),
    "training#context_size": ListOf(_COUNT, 3).because("voxels along each axis"),
    "training#local_size": ListOf(_COUNT, 3).because("voxels along each axis"),
    "training#num_local_crops": Integer(0),
    "training#prototypes": _COUNT,
    "training#head_hidden_dim": _COUNT,
    "training#head_bottleneck_dim": _COUNT,
    "training#student_drop_path_rate": Number(0, below=1),
    "training#patch_embed_lr_mult": Number(0),
    "training#momentum": ListOf(_PROBABILITY, 2).because(_START_END + " of the teacher's EMA"),
    "training#student_temperature": _TEMPERATURE,
    "training#teacher_temperature": _TEMPERATURE,
    "training#warmup_teacher_temperature": _TEMPERATURE,
    "training#teacher_temperature_warmup_epochs": Integer(0),
    "training#center_momentum": _PROBABILITY,
    "training#koleo_weight": Number(0).because("0: no KoLeo term"),
    "training#freeze_last_layer_epochs": Integer(0),
    "training#collapse_patience": _COUNT,
    "augmentation#global_crop_1#blur_prob": _PROBABILITY,
    "augmentation#global_crop_1#solarize_prob": _PROBABILITY,
    "augmentation#global_crop_2#blur_prob": _PROBABILITY,
    "augmentation#global_crop_2#solarize_prob": _PROBABILITY,
    "augmentation#local_crops#blur_prob": _PROBABILITY,
    "augmentation#local_crops#solarize_prob": _PROBABILITY,
    "augmentation#blur_sigma": ListOf(Number(above=0), 2).because("the smallest and largest sigma, in voxels"),
    "augmentation#solarize_threshold": _PROBABILITY,
}
