"""A deployable model of a finetuning bundle: its trained ``network`` as a ``torch.export`` program (``.pt2``).

:func:`export_network` builds the network as the bundle's ``configs/inference.json`` does, loads the trained
weights strictly, exports it in eval mode and float32 with ``torch.export`` and writes ``models/model.pt2``;
:func:`load_exported` gives it back as a module that MONAI's evaluators can run. A plain PyTorch script needs
neither this package nor MONAI's network code nor the bundle configs: ``torch.export.load(path).module()`` is the
network, ready for ``monai.inferers.sliding_window_inference``.

Why ``torch.export`` and not TorchScript: TorchScript is in maintenance in the supported PyTorch versions and
``torch.export`` is the route PyTorch recommends; MONAI's ``SwinUNETR`` does not script (it only traces) and a
trace records no input specification, whereas an exported program checks every input against its shape
specification and fails with a message instead of computing on a shape it was not made for.

What the program accepts: ``(batch, in_channels, *roi_size)`` float32, with a dynamic batch dimension and the
ROI fixed. Sliding-window inference calls the network on patches of exactly ``roi_size`` (``sw_batch_size`` of
them, the last batch possibly smaller), so a dynamic batch is what it needs. The spatial size cannot be dynamic
with MONAI's ``SwinUNETR`` (1.6): each stage picks its attention window and shift in Python by comparing its size
with the window (``get_window_size``: a stage no larger than the window attends over all of it, unshifted), and
rounds the padded size up through ``int(np.ceil(...))``, so ``torch.export`` specialises every spatial dimension
to the example's size (it reports "marked as dynamic but your code specialized it to be a constant").

The ``.pt2`` records the SHA-256 of the checkpoint it was exported from (:func:`exported_program_record` reads it
back with the input shape): ``python -m components package`` writes both into the release's metadata
(``exported_program``) and refuses a program that was not exported from the packaged ``model.pt``.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from monai.bundle import ConfigParser
from torch import nn

from ..files import atomic_write
from ..checkpoint import CheckpointLoadError, extract_state_dict, read_checkpoint
from ..networks.swin import SPATIAL_REDUCTION

__all__ = ["ExportedModule", "export_network", "load_exported"]

logger = logging.getLogger(__name__)

#: the exported program's file name, beside the bundle's ``model.pt``.
EXPORTED_FILENAME = "model.pt2"

# the example batch: torch.export specialises a dimension whose example size is 0 or 1
_EXAMPLE_BATCH = 2
# the extra file of the .pt2 that holds the SHA-256 of the checkpoint the program was exported from
_SOURCE_SHA256 = "exported_from_sha256"


class ExportedModule(nn.Module):
    """The module of an exported program, usable wherever a network is: ``eval()`` and ``train()`` only set the flag.

    ``torch.export``'s own module refuses both (``NotImplementedError``), but MONAI's evaluators switch their network
    to eval mode on every iteration. The graph was exported in eval mode and computes that whatever the flag says.
    """

    def __init__(self, program: torch.export.ExportedProgram) -> None:
        super().__init__()
        self.program = program.module()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.program(x)

    def train(self, mode: bool = True) -> ExportedModule:
        self.training = mode
        return self


def load_exported(path: str | os.PathLike) -> ExportedModule:
    """The network of an exported program written by :func:`export_network`.

    Args:
        path: a ``.pt2`` file from ``torch.export.save``.

    Returns:
        a module taking ``(batch, in_channels, *roi_size)`` float32 on the device it was exported on and returning
        the logits ``(batch, out_channels, *roi_size)``; an input of another spatial size raises.

    Raises:
        FileNotFoundError: ``path`` does not exist.

    Example::

        >>> net = load_exported("bundles/swin_unetr_btcv_finetune/models/model.pt2")
        >>> sliding_window_inference(image, (96, 96, 96), 4, net, overlap=0.5)
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"exported model '{path}' does not exist (write it with `python -m components export`).")
    return ExportedModule(torch.export.load(path))


def exported_program_record(path: str | os.PathLike) -> dict[str, Any]:
    """What a program written by :func:`export_network` says about itself, read from the program (for a release's
    metadata: a bundle's ``network_data_format`` says ``64*n``, the program takes one ROI).

    Returns:
        ``input_shape``: the shape of its one input, ``"dynamic"`` for a dimension of any size (the batch);
        ``dtype``: the input's, e.g. ``"float32"``; ``exported_from_sha256``: the SHA-256 of the checkpoint file it
        was exported from, ``None`` when the program records none (exported by other code).

    Raises:
        ValueError: the program takes other than one input.
    """
    extra = {_SOURCE_SHA256: ""}
    program = torch.export.load(path, extra_files=extra)
    user_inputs = set(program.graph_signature.user_inputs)
    inputs = [node.meta["val"] for node in program.graph.nodes if node.op == "placeholder" and node.name in user_inputs]
    if len(inputs) != 1:
        raise ValueError(f"{path}: expected a program of one input (the image), it takes {len(inputs)}.")
    return {
        "input_shape": [int(d) if isinstance(d, int) else "dynamic" for d in inputs[0].shape],
        "dtype": str(inputs[0].dtype).removeprefix("torch."),
        "exported_from_sha256": extra[_SOURCE_SHA256] or None,
    }


def _roi_size(value: Any, spatial_dims: int) -> tuple[int, ...]:
    """The ROI as ints: a sequence, one number for every axis, or a string such as ``64,64,32`` (command line)."""
    if isinstance(value, str):
        value = value.strip().strip("[]()").replace(",", " ").split()
    parts = [value] * spatial_dims if isinstance(value, (int, float)) else list(value)
    try:
        roi = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"roi_size must be {spatial_dims} integers, got {value!r}.") from None
    if len(roi) != spatial_dims or any(s <= 0 or s % SPATIAL_REDUCTION for s in roi):
        raise ValueError(
            f"roi_size must be {spatial_dims} positive multiples of {SPATIAL_REDUCTION} (SwinUNETR reduces each "
            f"axis by {SPATIAL_REDUCTION}), got {value!r}."
        )
    if math.prod(s // SPATIAL_REDUCTION for s in roi) < 2:
        raise ValueError(
            f"roi_size {roi} leaves one voxel at SwinUNETR's bottleneck, whose InstanceNorm needs more than one; "
            f"use e.g. {(2 * SPATIAL_REDUCTION,) + roi[1:]}."
        )
    return roi


def _load_weights(network: nn.Module, checkpoint: Path) -> None:
    """Loads ``checkpoint`` (a state dict, bare or under ``model`` / ``state_dict`` ...) into ``network``, every key.

    Raises:
        CheckpointLoadError: keys missing from the file or not in the network, or a tensor of another shape; the
            message names the file and the keys.
    """
    state, _ = extract_state_dict(read_checkpoint(checkpoint), where=f"'{checkpoint}'")
    expected = network.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointLoadError(
            f"checkpoint '{checkpoint}' does not fit the bundle's network: {len(missing)} missing keys {missing[:10]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:10]} (was it trained with other feature_size, "
            "channels or window_size? pass the same overrides)."
        )
    mismatched = [f"{k}: {tuple(state[k].shape)} in the file, {tuple(v.shape)} in the network"
                  for k, v in expected.items() if state[k].shape != v.shape]  # fmt: skip
    if mismatched:
        raise CheckpointLoadError(f"checkpoint '{checkpoint}' has tensors of other shapes: {mismatched[:10]}.")
    network.load_state_dict(state, strict=True)


def export_network(
    bundle_dir: str | os.PathLike,
    out_path: str | os.PathLike | None = None,
    checkpoint: str | os.PathLike | None = None,
    roi_size: Sequence[int] | int | str | None = None,
    device: str | torch.device = "cpu",
    overrides: Mapping[str, Any] | None = None,
    atol: float = 1e-5,
) -> Path:
    """Exports the trained network of a finetuning bundle to a ``torch.export`` program and writes it atomically.

    The network is ``network`` of ``<bundle_dir>/configs/inference.json`` (``prepare_network`` with the config's
    fused attention), built on ``device`` with ``overrides`` applied, with the weights of ``checkpoint`` loaded
    strictly, in eval mode and float32. The program takes ``(batch, in_channels, *roi_size)`` with a dynamic batch
    (see the module docstring for why the ROI is fixed) and records the SHA-256 of ``checkpoint`` (read back by
    :func:`exported_program_record`: packaging refuses a program of other weights than the packaged ``model.pt``).
    Before the file is written, the saved bytes are loaded back and their output on a random ROI batch compared
    with the network's: a file that would compute anything else is never written.

    Args:
        bundle_dir: the bundle folder (holding ``configs/inference.json``).
        out_path: the ``.pt2`` file; default ``<ckpt_dir>/model.pt2`` (``models/`` in the bundle).
        checkpoint: the trained weights; default the config's ``checkpoint`` (``models/model.pt``).
        roi_size: the spatial size of the program's input (multiples of 32); default the config's ``roi_size``.
        device: where the network is exported and the program runs (its constants, e.g. the shifted-window
            masks, live there): ``"cpu"`` or a CUDA device.
        overrides: config values the model was trained with, as ``monai.bundle run`` takes them, e.g.
            ``{"feature_size": 24, "network_def#window_size": 4}``.
        atol: the largest absolute difference allowed between program and network (``rtol`` is the same).

    Returns:
        the path written.

    Raises:
        FileNotFoundError: the bundle has no ``configs/inference.json``, or the checkpoint does not exist.
        ValueError: ``roi_size`` is not positive multiples of 32, or leaves one voxel at the bottleneck.
        CheckpointLoadError: the checkpoint is unreadable or does not fit the network (names the file and keys).
        RuntimeError: the saved program's output differs from the network's.

    Example::

        >>> export_network("bundles/swin_unetr_btcv_finetune")
        PosixPath('bundles/swin_unetr_btcv_finetune/models/model.pt2')
    """
    bundle_dir = Path(bundle_dir)
    config_file = bundle_dir / "configs" / "inference.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"bundle '{bundle_dir}' has no configs/inference.json ('{config_file}').")
    parser = ConfigParser()
    parser.read_config(config_file)
    parser.update({"bundle_root": str(bundle_dir), **dict(overrides or {}), "device": str(torch.device(device))})
    spatial_dims = int(parser.get_parsed_content("network_def#spatial_dims", default=3))
    roi = _roi_size(parser.get_parsed_content("roi_size") if roi_size is None else roi_size, spatial_dims)
    in_channels = int(parser.get_parsed_content("network_def#in_channels"))
    checkpoint = Path(checkpoint if checkpoint is not None else parser.get_parsed_content("checkpoint"))
    out = Path(out_path) if out_path is not None else Path(parser.get_parsed_content("ckpt_dir")) / EXPORTED_FILENAME
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint '{checkpoint}' does not exist (train the bundle or pass --checkpoint).")

    network = parser.get_parsed_content("network")
    with open(checkpoint, "rb") as f:
        source_sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    _load_weights(network, checkpoint)
    network = network.float().eval()
    example = torch.randn(_EXAMPLE_BATCH, in_channels, *roi, device=device)
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        program = torch.export.export(network, (example,), dynamic_shapes=({0: batch},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={_SOURCE_SHA256: source_sha256})

    buffer.seek(0)
    reloaded = torch.export.load(buffer).module()
    check = torch.randn(1, in_channels, *roi, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        expected, actual = network(check), reloaded(check)
    difference = (actual - expected).abs().max().item()
    if not torch.allclose(actual, expected, atol=atol, rtol=atol):
        raise RuntimeError(
            f"the exported program of '{checkpoint}' differs from the network by up to {difference:.3g} "
            f"(allowed {atol:g}) on a random {tuple(check.shape)} input; '{out}' was not written."
        )
    with atomic_write(out, "wb") as f:
        f.write(buffer.getvalue())
    logger.info(
        "export: wrote %s (%.1f MB) from %s (sha256 %s): input (batch, %d, %s) float32 on %s, dynamic dims: batch "
        "(dim 0) from 1, spatial size fixed; max |difference| to the network %.3g",
        out, len(buffer.getvalue()) / 2**20, checkpoint, source_sha256, in_channels, "x".join(map(str, roi)), device,
        difference,
    )  # fmt: skip
    return out
