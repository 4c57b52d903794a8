"""Checkpoints: pretrained weights of any published layout, and resumable training state.

Two concerns, in separate modules (the public names are re-exported here, as the configs and ``components`` use
them):

- **Pretrained weights**: :mod:`.layouts` (which layout a state dict is in, how each key maps; the only place that
  knows checkpoint layouts), :mod:`.architecture` (the Swin ViT architecture read from a checkpoint's shapes, the
  one-line mismatch with its overrides, ``pretrained_arch: "auto"``) and :mod:`.pretrained` (:func:`load_pretrained`
  with its :class:`LoadReport`, :func:`convert_state_dict`, the :class:`PretrainedLoader` handler).
- **Resumable training**: :mod:`.training_state` (the file's format, :func:`save_atomic`, :func:`restore_schedule`,
  the events savers fire, :class:`CheckpointEvents`), :mod:`.saver` (:class:`ResumableCheckpointSaver`,
  :class:`BestModelSaver`) and :mod:`.resume` (:class:`ResumeHandler`, :func:`resolve_resume`).

All of them log as ``components.checkpoint``.
"""

from .architecture import (
    OVERRIDE_IDS,
    PRETRAINED_ARCH,
    SwinArchitecture,
    adopt_architecture,
    build_for_weights,
    check_architecture,
    infer_architecture,
)
from .layouts import (
    CHANNEL_POLICIES,
    LAYOUTS,
    PATCH_EMBED_WEIGHT,
    REQUIRED_POLICIES,
    TARGETS,
    CheckpointLoadError,
    LoadReport,
    UnusedKey,
    detect_layout,
    extract_state_dict,
    read_checkpoint,
)
from .pretrained import (
    PretrainedLoader,
    check_pretrained,
    convert_state_dict,
    load_pretrained,
)
from .resume import ResumeHandler, check_resume, resolve_resume
from .saver import BestModelSaver, ResumableCheckpointSaver
from .training_state import RESUME_FORMAT, CheckpointEvents, register_checkpoint_events, restore_schedule, save_atomic

__all__ = [
    "LAYOUTS",
    "TARGETS",
    "CHANNEL_POLICIES",
    "REQUIRED_POLICIES",
    "PATCH_EMBED_WEIGHT",
    "RESUME_FORMAT",
    "CheckpointLoadError",
    "UnusedKey",
    "LoadReport",
    "read_checkpoint",
    "extract_state_dict",
    "detect_layout",
    "SwinArchitecture",
    "OVERRIDE_IDS",
    "PRETRAINED_ARCH",
    "infer_architecture",
    "check_architecture",
    "adopt_architecture",
    "build_for_weights",
    "check_pretrained",
    "convert_state_dict",
    "load_pretrained",
    "save_atomic",
    "ResumableCheckpointSaver",
    "ResumeHandler",
    "BestModelSaver",
    "PretrainedLoader",
    "restore_schedule",
    "check_resume",
    "resolve_resume",
    "CheckpointEvents",
    "register_checkpoint_events",
]
