"""Checkpoints: pretrained weights of any published layout, and resumable training state.

Two concerns, in separate modules (the public names are re-exported here, as the configs and ``components`` use
them, and imported on first use):

- **Pretrained weights**: :mod:`.layouts` (which layout a state dict is in, how each key maps; the only place that
  knows checkpoint layouts), :mod:`.architecture` (the Swin ViT architecture read from a checkpoint's shapes, the
  one-line mismatch with its overrides, ``pretrained_arch: "auto"``) and :mod:`.pretrained` (:func:`load_pretrained`
  with its :class:`LoadReport`, :func:`convert_state_dict`, the :class:`PretrainedLoader` handler).
- **Resumable training**: :mod:`.training_state` (the file's format, :func:`save_atomic`, :func:`restore_schedule`,
  the events savers fire, :class:`CheckpointEvents`), :mod:`.saver` (:class:`ResumableCheckpointSaver`,
  :class:`BestModelSaver`) and :mod:`.resume` (:class:`ResumeHandler`, :func:`resolve_resume`).

All of them log as ``components.checkpoint``.
"""

from __future__ import annotations

from ..lazy import lazy_names

# the modules whose public names (each one's __all__) are offered here
__getattr__, __dir__ = lazy_names(
    __name__, modules=("architecture", "layouts", "pretrained", "resume", "saver", "training_state")
)
