"""Command line: ``python -m components COMMAND --help`` (python-fire). One thin function per command."""

from __future__ import annotations

from pathlib import Path

import fire

from . import datacheck as _datacheck
from . import demo as _demo
from . import package as _package
from . import synthetic
from .checkpoint import convert_checkpoint as _convert_checkpoint
from .runner import BUNDLES_DIR
from .runtime import as_bool


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


def demo(out: str = "demo_out", seed: int = 0, compare: bool = False, device: str | None = None, budget: str | None = None) -> None:
    """Shows what SSL pretraining is for, each step a real ``monai.bundle run``: synthesises labeled (5 organs)
    and unlabeled CT, pretrains the Swin ViT encoder with the SSL bundle on the unlabeled volumes, finetunes the
    CT bundle from those weights, evaluates it on held-out volumes and segments one. Writes summary.txt,
    summary.json and pictures (segmentations, SSL losses, SSL views, Dice curves) under OUT. SEED changes every
    random draw; --compare adds the from-scratch arm with the same budget (always on with CUDA); --device
    cpu|cuda (default: CUDA where present); --budget cpu|cuda|quick (default: by device; quick learns nothing)."""
    _demo.run_demo(out=out, seed=seed, compare=as_bool(compare, "compare"), device=device, budget=budget)


def check_data(
    datalist: str,
    *more,
    base_dir: str | None = None,
    keys=("image", "label"),
    roi=None,
    deep: bool = False,
    channels: int | None = None,
    num_classes: int | None = None,
    pixdim=None,
    lists=None,
) -> None:
    """Checks DATALIST (Decathlon dataset.json) and every volume it names before hours of caching; prints one
    line per problem ("ERROR <file> [<entry>]: <what>", then warnings) and a summary line. Exits 1 when there
    are errors (warnings alone exit 0), 2 for bad arguments. Reads headers only unless --deep (NaN / Inf,
    constant images, label values, empty labels).

    DATALIST comes first. Several values: --keys image label | --keys image,label | --keys "[image,label]";
    --roi 96 96 96 | --roi 96,96,96 | --roi "[96,96,96]" | --roi 96 (all axes). Spaced values go to the one
    flag they can continue (python-fire hands them over as leftovers); use commas when giving several
    multi-value flags of one kind (--keys and --lists, or --roi and --pixdim). --base-dir DIR (default: the
    datalist's folder), --channels 4 for (H,W,D,4) images (default: from the datalist's modality when it says
    4D, else 1), --num-classes N (default: the datalist's labels), --pixdim 1.5,1.5,2 (resampling before the
    ROI comparison), --lists training,validation (default: training, and validation when the datalist has one)."""
    code = _datacheck.check_data_cli(
        datalist,
        more,
        base_dir=base_dir,
        keys=keys,
        roi=roi,
        deep=deep,
        channels=channels,
        num_classes=num_classes,
        pixdim=pixdim,
        lists=lists,
    )
    if code:
        raise SystemExit(code)


def package(bundle: str, out: str = "dist") -> None:
    """Packs BUNDLE (a bundle folder, or a name under bundles/) into OUT/<name>_v<version>.zip, reproducibly
    (same files, same bytes), with trained models/*.pt when present and without logs, caches, eval/ or data/;
    writes OUT/<name>_v<version>.zip.sha256 ("<sha256>  <file>", as sha256sum) beside it."""
    root = Path(bundle) if Path(bundle).is_dir() else BUNDLES_DIR / bundle
    path = _package.package_bundle(root, out)
    print(f"wrote {path} and {path.name}.sha256 (sha256 {_package.sha256_file(path)})")


def fetch(url: str, dest: str = ".", sha256: str | None = None, extract: bool = True, overwrite: bool = False) -> None:
    """Downloads URL (http(s)://, file:// or a path) into DEST after checking its SHA-256: --sha256 HEX, else
    the URL.sha256 file published beside it (no hash, no download; monai.bundle download checks none). A bundle
    zip is then extracted safely to DEST/<name>/ (--extract false keeps only the zip; --overwrite replaces an
    existing DEST/<name>/). DEST: the folder for a bundle zip (created when missing); with --extract false an
    existing folder or the target file's name."""
    if as_bool(extract, "extract") and str(url).lower().endswith(".zip"):
        folder = _package.fetch_bundle(url, dest, sha256=sha256, overwrite=as_bool(overwrite, "overwrite"))
        print(f"verified and extracted {url} to {folder}")
    else:
        path = _package.fetch(url, dest, sha256=sha256)
        print(f"verified {path}")


COMMANDS = {
    "synth": synth,
    "convert-checkpoint": convert_checkpoint,
    "demo": demo,
    "check-data": check_data,
    "package": package,
    "fetch": fetch,
}


def main() -> None:
    fire.Fire(COMMANDS, name="components")


if __name__ == "__main__":
    main()
