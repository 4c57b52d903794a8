"""Command line: ``python -m components COMMAND --help`` (python-fire). One thin function per command."""

from __future__ import annotations

import fire

from . import demo as _demo
from . import synthetic
from .checkpoint import convert_checkpoint as _convert_checkpoint


def synth(kind: str = "ct", num: int = 6, out: str = "data/ct", seed: int = 0) -> None:
    """Writes NUM synthetic volumes (kind ct: abdominal CT with 13 organ labels; mri: 4-channel brain MRI with
    tumour labels) as .nii.gz under OUT, plus OUT/dataset.json (Decathlon datalist). Deterministic for SEED."""
    path = synthetic.write_dataset(out, kind=kind, num=num, seed=seed)
    print(f"wrote {num} {kind} volumes and {path}")


def convert_checkpoint(
    src: str,
    dst: str,
    target: str = "swinunetr",
    in_channels: int = 1,
    feature_size: int = 48,
    channel_policy: str = "error",
) -> None:
    """Maps a checkpoint in any known layout (published model_swinvit.pt, original SSL code, this collection,
    MONAI ssl_pretrained_weights.pth, full SwinUNETR) onto TARGET (swinunetr | sslhead) and writes a clean
    state dict to DST. Prints the load report; fails when the encoder does not fully load."""
    report = _convert_checkpoint(
        src, dst, target=target, in_channels=in_channels, feature_size=feature_size, channel_policy=channel_policy
    )
    print(report.summary())
    print(f"wrote {dst}")


def demo(out: str = "demo_out", num: int = 8, seed: int = 0, epochs: int = 2, roi: int = 64, feature_size: int = 12) -> None:
    """Runs the whole pipeline on CPU in a few minutes: synthesises a small CT set, then pretrains a tiny SSL
    model with the pretraining bundle (a real ``monai.bundle run``); prints a summary table."""
    _demo.run_demo(out=out, num=num, seed=seed, epochs=epochs, roi=roi, feature_size=feature_size)


COMMANDS = {"synth": synth, "convert-checkpoint": convert_checkpoint, "demo": demo}


def main() -> None:
    fire.Fire(COMMANDS, name="components")


if __name__ == "__main__":
    main()
