"""What the masked image bundle's own settings accept (:func:`components.check_setting_types`)."""

from __future__ import annotations

from ...config.kinds import Flag, Integer, Kind, ListOf, Number, OneOf
from .loss import LOSSES
from .network import DECODERS

__all__ = ["MASKED_IMAGE_SETTINGS"]

_COUNT = Integer(1)
_TEMPERATURE = Number(above=0)

#: the kinds of the masked image bundle's settings beyond the shared ones, by id (these win)
MASKED_IMAGE_SETTINGS: dict[str, Kind] = {
    "masking#ratio": Number(above=0, below=1).because("the share of blocks masked"),
    "masking#block_size": Integer(2, multiple_of=2).because("voxels per axis, a whole number of patches"),
    "masking#loss": OneOf(LOSSES),
    "masking#norm_target": Flag(),
    "masking#decoder": OneOf(DECODERS),
    "masking#distill_weight": Number(0).because("0: no masked-token distillation"),
    "masking#distill_prototypes": _COUNT,
    "masking#head_hidden_dim": _COUNT,
    "masking#head_bottleneck_dim": _COUNT,
    "masking#student_temperature": _TEMPERATURE,
    "masking#teacher_temperature": _TEMPERATURE,
    "masking#warmup_teacher_temperature": _TEMPERATURE,
    "masking#teacher_temperature_warmup_epochs": Integer(0),
    "masking#momentum": ListOf(Number(0, 1), 2).because("start and end of the teacher's EMA schedule"),
    "masking#center_momentum": Number(0, 1),
}
