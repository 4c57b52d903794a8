"""Command line: ``python -m components COMMAND --help`` (python-fire). One thin function per command.

Each command imports what it needs when it runs, so ``--help`` answers without loading torch or MONAI. Help is
written here from the signatures and docstrings, because python-fire's shows ``Optional['str | None']`` for
every flag with a None default. A failing command prints one line, ``components COMMAND: error: ...``, and exits
with status 2; ``--debug`` (anywhere on the line) shows the traceback instead.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections.abc import Callable, Sequence

from .errors import error_lines


def synth(kind: str = "ct", num: int = 6, out: str = "data/ct", seed: int = 0) -> None:
    """Writes NUM synthetic volumes (kind ct: abdominal CT with 13 organ labels; mri: 4-channel brain MRI with
    tumour labels) as .nii.gz under OUT, plus OUT/dataset.json (Decathlon datalist). Deterministic for SEED."""
    from .data.synthetic import write_dataset

    path = write_dataset(out, kind=kind, num=num, seed=seed)
    print(f"wrote {num} {kind} volumes and {path}")


def convert_checkpoint(
    src: str,
    dst: str,
    target: str = "swinunetr",
    in_channels: int | None = None,
    feature_size: int | None = None,
    channel_policy: str = "error",
    use_v2: bool | None = None,
    window_size: int | None = None,
    depths: list | None = None,
    num_heads: list | None = None,
    required: str = "encoder",
) -> None:
    """Maps a checkpoint in any known layout (published model_swinvit.pt, original SSL code, VoCo, SuPreM,
    BrainSegFounder, this collection, MONAI ssl_pretrained_weights.pth, full SwinUNETR) onto TARGET (swinunetr |
    sslhead) and writes a clean state dict to DST. IN_CHANNELS, FEATURE_SIZE, USE_V2, WINDOW_SIZE, DEPTHS and
    NUM_HEADS default to the checkpoint's (read from its tensors); a flag given overrides it (--depths 2,2,6,2
    --num_heads 4,8,16,32). CHANNEL_POLICY (error | repeat | skip) adapts the patch embedding to other IN_CHANNELS;
    REQUIRED none accepts a partial encoder. Prints the load report; fails when the encoder does not fully load."""
    from .release.conversion import convert_checkpoint as convert

    report = convert(
        src,
        dst,
        target=target,
        in_channels=in_channels,
        feature_size=feature_size,
        channel_policy=channel_policy,
        use_v2=use_v2,
        window_size=window_size,
        depths=depths,
        num_heads=num_heads,
        required=required,
    )
    print(report.summary())
    print(f"wrote {dst}")


def demo(
    out: str = "demo_out", seed: int = 0, compare: bool = False, device: str | None = None, budget: str | None = None,
    recipe: str = "ssl",
) -> None:
    """Shows what pretraining is for, each step a real ``monai.bundle run``: synthesises labeled (5 organs) and
    unlabeled CT, pretrains the Swin ViT encoder on the unlabeled volumes, finetunes the CT bundle from those
    weights, evaluates it on held-out volumes and segments one. Writes summary.txt, summary.json and pictures
    (segmentations, pretraining losses, the recipe's views, Dice curves) under OUT. SEED changes every random
    draw; --compare adds the from-scratch arm with the same budget (always on with CUDA); --device cpu|cuda
    (default: CUDA where present); --budget cpu|cuda|quick (default: by device; quick learns nothing); --recipe
    ssl|dino|mim (the SSL, self-distillation or masked image bundle; default ssl)."""
    from .config.values import as_bool
    from .demo.run import run_demo

    run_demo(out=out, seed=seed, compare=as_bool(compare, "compare"), device=device, budget=budget, recipe=recipe)


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
    from .data.check_command import check_data_cli

    code = check_data_cli(
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


def package(bundle: str, out: str = "dist", release_url: str | None = None, evaluation_record: str | None = None) -> None:
    """Packs BUNDLE (a bundle folder, or the name of a bundle this package carries) into OUT/<name>_v<version>.zip, reproducibly
    (same files, same bytes), with trained models/*.pt when present and without logs, caches, eval/ or data/, and
    with this package's source under <name>/components/ (the code its configs import, run from the bundle folder);
    writes OUT/<name>_v<version>.zip.sha256 ("<sha256>  <file>", as sha256sum) beside it. --release_url URL (where
    the release's files will be, e.g. https://github.com/OWNER/REPO/releases/download/TAG) keeps the weights out of
    the zip, as the Model Zoo does: the zip lists them in large_files.yml (URLs and SHA-256) and each is written as
    OUT/<name>_v<version>_<file> beside it, to attach to the release with it; without it they are in the zip. A
    models/model.pt2 (written by `python -m components export` before packaging) goes into the metadata's
    exported_program (its input shape, read from it) and is refused unless exported from the packaged models/model.pt.
    The metadata's eval_metrics are those of --evaluation_record (default BUNDLE/eval/metrics.json, written by
    configs/evaluate.json) when it measured the packaged models/model.pt, else empty (a warning says why)."""
    from .files import sha256_file
    from .release.package import package_bundle
    from .demo.runner import bundle_dir

    path = package_bundle(bundle_dir(bundle), out, release_url=release_url, evaluation_record=evaluation_record)
    print(f"wrote {path} and {path.name}.sha256 (sha256 {sha256_file(path)})")


def fetch(url: str, dest: str = ".", sha256: str | None = None, extract: bool = True, overwrite: bool = False) -> None:
    """Downloads URL (http(s)://, file:// or a path) into DEST after checking its SHA-256: --sha256 HEX, else
    the URL.sha256 file published beside it (no hash, no download; monai.bundle download checks none). A bundle
    zip is then extracted safely to DEST/<name>/ with the weights its large_files.yml lists, downloaded and
    hash-checked (MONAI reads the list with PyYAML) (--extract false keeps only the zip; --overwrite replaces an
    existing DEST/<name>/). DEST: the folder for a bundle zip (created when missing); with --extract false an
    existing folder or the target file's name."""
    from .release.download import fetch as fetch_file
    from .release.download import fetch_bundle
    from .config.values import as_bool

    if as_bool(extract, "extract") and str(url).lower().endswith(".zip"):
        folder = fetch_bundle(url, dest, sha256=sha256, overwrite=as_bool(overwrite, "overwrite"))
        print(f"verified and extracted {url} to {folder}")
    else:
        path = fetch_file(url, dest, sha256=sha256)
        print(f"verified {path}")


def export(
    bundle: str,
    checkpoint: str | None = None,
    out: str | None = None,
    roi_size=None,
    device: str = "cpu",
    overrides=None,
) -> None:
    """Writes BUNDLE's trained network as a deployable torch.export program to OUT (default: the bundle's
    models/model.pt2), checked to compute what the network computes. BUNDLE: a finetuning bundle folder, or the name
    of one this package carries. The network is built as configs/inference.json builds it, with --checkpoint (default:
    models/model.pt) loaded strictly. The program takes (batch, channels, *ROI_SIZE) float32 with any batch size:
    --roi_size 96,96,96 (default: the config's; multiples of 32). --device cpu|cuda: where it is exported and will
    run. --overrides: the config values the model was trained with, e.g. --overrides '{"feature_size": 24}'. Load
    it with torch.export.load(OUT).module()."""
    import json

    from .release.export import export_network
    from .demo.runner import bundle_dir

    root = bundle_dir(bundle)
    if isinstance(overrides, str):
        overrides = json.loads(overrides)
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"--overrides must be a dict of config ids to values, got {overrides!r}.")
    path = export_network(root, out_path=out, checkpoint=checkpoint, roi_size=roi_size, device=device, overrides=overrides)
    print(f"wrote {path}; load it with torch.export.load({str(path)!r}).module()")


def preprocess(
    datalist: str,
    out: str,
    bundle: str = "swin_unetr_ssl_pretrain",
    list_key: str = "training",
    workers: int = 1,
    part: int = 0,
    parts: int = 1,
    on_error: str = "stop",
    overrides=None,
    overwrite: bool = False,
    floats: str = "quantized",
    source_root: str | None = None,
) -> None:
    """Writes the on-disk store OUT of the volumes of DATALIST (Decathlon dataset.json, its LIST_KEY list): each
    volume decoded once through BUNDLE's deterministic transforms (train#transforms#deterministic; a bundle folder or
    the name of one this package carries; --overrides '{"roi_size": [64, 64, 64]}' changes its ids), stored as
    compressed chunked arrays and indexed, so training reads only the crops it cuts. The data check runs first: a
    broken file stops the run before any work (--on_error stop) or is skipped and listed (skip). --workers N
    processes, which end with this command; a worker that dies (out of memory) fails its volume as an error would.
    --part i --parts n (i from 0) writes every n-th volume from the i-th: n machines onto one shared OUT
    make the same store as one run. A rerun resumes after the volumes already written; --overwrite true replaces a
    store of other transforms. Chunks follow the size of BUNDLE's training crops; float images (a normalised MRI)
    are stored quantized to 16 bits per channel (the error recorded per array), or as they are with --floats
    exact. The sources are recorded under --source_root (default: the datalist's folder when it
    holds them all), so a training run reads the store wherever they are (loader#source_root); a rerun after they
    moved rewrites the index only, and writes anew the volumes whose source changed."""
    import json
    import shlex

    from .config.values import as_bool
    from .data.store import bundle_crop_size, bundle_transforms
    from .data.store import preprocess as run_preprocess
    from .demo.runner import bundle_dir

    if isinstance(overrides, str):
        overrides = json.loads(overrides)
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"--overrides must be a dict of config ids to values, got {overrides!r}.")
    folder = bundle_dir(bundle)
    transforms = bundle_transforms(folder, overrides)
    words = ["python -m components preprocess", "--datalist", datalist, "--out", out, "--bundle", bundle]
    words += ["--list_key", list_key] if list_key != "training" else []
    words += ["--overrides", json.dumps(overrides, sort_keys=True)] if overrides else []
    words += ["--floats", floats] if floats != "quantized" else []
    words += ["--source_root", source_root] if source_root else []
    command = " ".join(words[:1] + [shlex.quote(str(w)) for w in words[1:]])
    channels = _bundle_channels(folder, overrides)
    summary = run_preprocess(datalist, out, transforms, list_key=list_key, workers=workers, part=part, parts=parts,
                             on_error=on_error, overwrite=as_bool(overwrite, "overwrite"), channels=channels,
                             command=command, patch_size=bundle_crop_size(folder, overrides), floats=floats,
                             source_root=source_root)  # fmt: skip
    print(summary.line())


def health(
    checkpoint: str, datalist: str, list_name: str = "validation", roi_size: list | None = None,
    intensity_range: list | None = None, crops: int = 64, batch_size: int = 4, seed: int = 0, device: str = "cpu",
    out: str | None = None,
) -> None:
    """Prints the health report of a saved encoder on crops of DATALIST's LIST_NAME list: each pretext signal beside
    its trivial answer (checkpoints with the recipe's heads: the SSL and masked image bundles' model.pt) and the
    embedding collapse signals (any encoder layout the loaders read), with a verdict: learning, at baseline,
    collapsed. ROI_SIZE (default 96,96,96) and INTENSITY_RANGE (default -1000,1000 HU) as the pretraining bundle's;
    CROPS crops drawn with SEED; OUT writes the report as JSON. Exits with status 1 when the verdict is collapsed."""
    import json

    from .release.health import checkpoint_health

    kind, report = checkpoint_health(
        checkpoint, datalist, list_name, roi_size or (96, 96, 96), intensity_range or (-1000.0, 1000.0), crops,
        batch_size, seed, device,
    )  # fmt: skip
    heads = {"mim": "masked image heads", "ssl": "SSL heads", "encoder": "an encoder without pretext heads"}[kind]
    print(f"{checkpoint}: {heads}; {report.embedded} crops of {datalist} ({list_name})")
    print(report.line())
    if report.warning():
        print(report.warning())
    if out:
        with open(out, "w") as file:
            json.dump({"checkpoint": checkpoint, "heads": kind, **report.as_dict()}, file, indent=1)
    if report.verdict == "collapsed":
        raise SystemExit(1)


def _bundle_channels(bundle, overrides: dict | None) -> int | None:
    """The bundle's ``in_channels`` (what the data check expects of each image), None where it has none."""
    import json

    config = json.loads((bundle / "configs" / "train.json").read_text())
    value = (overrides or {}).get("in_channels", config.get("in_channels"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


COMMANDS: dict[str, Callable[..., None]] = {
    "synth": synth,
    "convert-checkpoint": convert_checkpoint,
    "demo": demo,
    "check-data": check_data,
    "package": package,
    "fetch": fetch,
    "export": export,
    "preprocess": preprocess,
    "health": health,
}

_HELP_FLAGS = ("-h", "--help")
_WIDTH = 100


def _first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    end = flat.find(". ")
    return flat if end < 0 else flat[: end + 1]


def _type_name(parameter: inspect.Parameter) -> str:
    """The annotation as a user reads it: ``str | None`` -> ``str`` (the default says none), tuples -> list."""
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        default = parameter.default
        return "list" if isinstance(default, (tuple, list)) else ""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return " | ".join(part for part in (p.strip() for p in text.split("|")) if part != "None")


def _default_text(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


def command_help(name: str) -> str:
    """``components NAME --help``: usage, the docstring, then one line per argument with its type and default."""
    function = COMMANDS[name]
    parameters = list(inspect.signature(function).parameters.values())
    positional = [p for p in parameters if p.default is inspect.Parameter.empty and p.kind != p.VAR_POSITIONAL]
    flags = [p for p in parameters if p.default is not inspect.Parameter.empty]
    usage = " ".join([f"components {name}", *(p.name.upper() for p in positional), "[FLAGS]" if flags else ""])
    lines = [f"usage: {usage.strip()}", ""]
    for paragraph in inspect.getdoc(function).split("\n\n"):
        lines += textwrap.wrap(" ".join(paragraph.split()), _WIDTH) + [""]
    rows = [(p.name.upper(), _type_name(p), "required") for p in positional]
    rows += [(f"--{p.name} {p.name.upper()}", _type_name(p), f"default: {_default_text(p.default)}") for p in flags]
    rows.append(("--debug", "", "show the traceback of an error"))
    width = max(len(r[0]) for r in rows)
    type_width = max(len(r[1]) for r in rows)
    lines.append("arguments:")
    lines += [f"  {flag:<{width}}  {kind:<{type_width}}  {default}".rstrip() for flag, kind, default in rows]
    return "\n".join(lines)


def main_help() -> str:
    """``components --help``: every command with the first sentence of its docstring."""
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m components COMMAND [ARGS] [--debug]", "", "commands:"]
    for name, function in COMMANDS.items():
        wrapped = textwrap.wrap(_first_sentence(inspect.getdoc(function)), _WIDTH - width - 4)
        lines.append(f"  {name:<{width}}  {wrapped[0]}")
        lines += [f"  {'':<{width}}  {more}" for more in wrapped[1:]]
    lines += ["", "`python -m components COMMAND --help` describes a command's arguments."]
    return "\n".join(lines)


def _unknown_flags(function: Callable[..., None], args: Sequence[str]) -> str | None:
    """The first ``--flag`` in ``args`` that ``function`` does not take. python-fire runs the command first and
    complains about a leftover flag afterwards, so a mistyped flag would run the command with its default."""
    names = set(inspect.signature(function).parameters)
    for arg in args:
        if arg == "--":
            break
        if arg.startswith("--") and len(arg) > 2:
            flag = arg[2:].split("=", 1)[0].replace("-", "_")
            if flag not in names and not (flag.startswith("no") and flag[2:] in names):
                return arg.split("=", 1)[0]
    return None


def _error(prefix: str, message: str) -> int:
    print(f"{prefix}: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns the exit status (0 on success, 2 on an error, a command's own status)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    if not args or args[0] in _HELP_FLAGS or args[0] == "help":
        print(main_help())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        return _error("components", f"unknown command {name!r}; one of {', '.join(COMMANDS)} (see --help)")
    if any(a in _HELP_FLAGS for a in rest):
        print(command_help(name))
        return 0
    unknown = _unknown_flags(COMMANDS[name], rest)
    if unknown:
        return _error(f"components {name}", f"unknown flag {unknown}; see `python -m components {name} --help`")
    import fire

    try:
        fire.Fire(COMMANDS, command=[name, *rest], name="components")
    except fire.core.FireExit as exit_:  # fire's own argument errors: it printed them (status 2)
        return int(exit_.code or 0)
    except SystemExit as exit_:  # a command's status (check-data: 1 when the data has errors)
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else _error(f"components {name}", exit_.code)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 -- a command's failure, reported as one line
        if debug:
            raise
        print("\n".join(error_lines(f"components {name}", err, "--debug shows the traceback")), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
