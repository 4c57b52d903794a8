"""Where a finetuning epoch's time goes besides its iterations: loader start-up and checkpoint writes.

The BTCV bundle's own ``train#trainer`` (MONAI's SupervisedTrainer with the bundle's handlers and loader) is built
from ``configs/train.json`` on synthetic labeled CT and run for a few short epochs (validation off), in two
configurations:

- ``fresh_workers_epoch_checkpoints``: the loader's workers started anew every epoch and ``checkpoint.pt`` (network,
  optimizer, schedule) written after every epoch: what the bundle did before;
- ``bundle``: the bundle's defaults: persistent workers (``components.PersistentWorkerLoader``) and
  ``checkpoint.pt`` every ``checkpointing#time_interval_s`` seconds.

Per configuration: the median iteration (ITERATION_STARTED -> ITERATION_COMPLETED, the loader's wait excluded),
crops/s, the median epoch wall time (EPOCH_STARTED -> the end of the EPOCH_COMPLETED handlers, so checkpoint writes
are in it) and the per-epoch overhead: epoch time minus the sum of its iterations (loader start-up and waits,
checkpoint writes, handlers). The first epoch (caching done, first worker start) is reported on its own.

    python benchmarks/finetune_step.py                 # CPU: 64x64x32, feature 12; CUDA: 96^3, feature 48, 4 crops
    python benchmarks/finetune_step.py --small         # CI: 64x32x32, feature 12, depths 1, 4 epochs of 2 iterations

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from machine import bundle_parser, bundle_start, machine_info, write_result
from ssl_step import json_stdout

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "bundles" / "swin_unetr_btcv_finetune"

# per size: bundle overrides and the synthetic CT subjects (write_dataset keeps 2 for validation and test); CI's
# network has one Swin block a stage instead of two: its steps only have to run
SIZES = {
    "ci": dict(roi_size=[64, 32, 32], spacing=[3.0, 3.0, 4.0], feature_size=12,
               **{"network_def#window_size": 4, "network_def#depths": [1, 1, 1, 1], "training#num_samples": 1}, volumes=4),
    "cpu": dict(roi_size=[64, 64, 32], spacing=[1.5, 1.5, 2.0], feature_size=12, **{"network_def#window_size": 4, "training#num_samples": 2},
                volumes=6),
    "gpu": dict(roi_size=[96, 96, 96], spacing=[1.5, 1.5, 2.0], feature_size=48, **{"network_def#window_size": 7, "training#num_samples": 4},
                volumes=10),
}  # fmt: skip
CONFIGS = {
    "fresh_workers_epoch_checkpoints": {"loader#persistent_workers": False, "checkpointing#epoch_interval": 1,
                                        "checkpointing#time_interval_s": None},
    "bundle": dict(),
}


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def build_trainer(size: dict, workdir: Path, config: dict, epochs: int, num_workers: int | None):
    """The bundle's train#trainer on synthetic CT for ``size`` and the overrides of ``config`` (no validation)."""
    import components

    data = workdir.parent / "data"
    if not (data / "dataset.json").exists():
        components.write_dataset(data, kind="ct", num=size["volumes"], seed=0)
    overrides = {k: v for k, v in size.items() if k != "volumes"}
    overrides.update({"bundle_root": str(BUNDLE), "dataset_dir": str(data), "output_dir": str(workdir / "eval"),
                      "ckpt_dir": str(workdir / "models"), "max_epochs": epochs, "batch_size": 1,
                      "checkpointing#auto_resume": False, "pretrained_path": None, **config})  # fmt: skip
    parser = bundle_parser(BUNDLE, overrides, num_workers)
    for index, handler in enumerate(parser["train"]["handlers"]):  # no validation, not even the last epoch's
        if handler.get("_target_", "").endswith("FinalValidationHandler"):
            parser[f"train#handlers#{index}#_disabled_"] = True
    bundle_start(parser)
    return parser.get_parsed_content("train#trainer")


def measure(name: str, size: dict, workdir: Path, config: dict, epochs: int, num_workers: int | None) -> dict:
    """Runs ``epochs`` epochs and splits each into its iterations and the rest."""
    from ignite.engine import Events

    import components.checkpoint.saver as checkpoint_module  # the saver's own reference to save_atomic

    save_atomic = checkpoint_module.save_atomic

    trainer = build_trainer(size, workdir / name, config, epochs, num_workers)
    device = torch.device(trainer.state.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    marks: dict[str, float] = {}
    iterations: list[list[float]] = []
    epoch_times: list[float] = []
    saves: list[int] = []

    def stamp(key: str):
        def handler(engine) -> None:
            sync()
            marks[key] = time.perf_counter()

        return handler

    def iteration_done(engine) -> None:
        sync()
        iterations[-1].append(time.perf_counter() - marks["iteration"])

    def epoch_done(engine) -> None:
        sync()
        epoch_times.append(time.perf_counter() - marks["epoch"])

    def counted_save(obj, path):  # every write of checkpoint.pt goes through save_atomic
        saves.append(trainer.state.iteration)
        return save_atomic(obj, path)

    checkpoint_module.save_atomic = counted_save
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: (iterations.append([]), stamp("epoch")(e)))
    trainer.add_event_handler(Events.ITERATION_STARTED, stamp("iteration"))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, iteration_done)  # after the bundle's handlers
    trainer.add_event_handler(Events.EPOCH_COMPLETED, epoch_done)  # last: after the checkpoint saver
    for event in (Events.EPOCH_STARTED, Events.ITERATION_STARTED):  # first, before the bundle's handlers
        handlers = trainer._event_handlers[event]
        handlers.insert(0, handlers.pop())
    try:
        trainer.run()
    finally:
        checkpoint_module.save_atomic = save_atomic
    overheads = [epoch - sum(its) for epoch, its in zip(epoch_times, iterations)]
    later = slice(1, None)
    per_iteration = _median([t for its in iterations[later] for t in its])
    crops = size["training#num_samples"]
    return {
        "persistent_workers": trainer.data_loader.persistent_workers,
        "num_workers": trainer.data_loader.num_workers,
        "iterations_per_epoch": len(iterations[0]),
        "epochs": len(epoch_times),
        "ms_per_iteration": round(per_iteration * 1000, 2),
        "crops_per_s": round(crops / per_iteration, 3),
        "epoch_s_median": round(_median(epoch_times[later]), 4),
        "epoch_overhead_s_median": round(_median(overheads[later]), 4),
        "epoch_overhead_share": round(_median(overheads[later]) / _median(epoch_times[later]), 4),
        "first_epoch_overhead_s": round(overheads[0], 4),
        "checkpoint_saves_at_iterations": saves,
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default=None, help=f"one of {sorted(SIZES)} (default: 'gpu' on CUDA, 'cpu' on CPU)")
    parser.add_argument("--epochs", type=int, default=6, help="epochs per configuration (the first is reported apart)")
    parser.add_argument("--num-workers", type=int, default=None, help="loader workers (default: the bundle's)")
    parser.add_argument("--small", action="store_true", help="CI: the 'ci' size, 4 epochs, 1 loader worker")
    args = parser.parse_args(argv)
    if args.small:
        args.size, args.epochs = "ci", 4
        args.num_workers = 1 if args.num_workers is None else args.num_workers
    args.size = args.size or ("gpu" if torch.cuda.is_available() else "cpu")
    if args.size not in SIZES:
        parser.error(f"unknown size {args.size!r}; choose from {sorted(SIZES)}")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    out = json_stdout()
    size = SIZES[args.size]
    result: dict = {"benchmark": "finetune_step", "machine": machine_info(), "size": args.size,
                    "roi_size": size["roi_size"], "feature_size": size["feature_size"], "crops_per_step": size["training#num_samples"],
                    "configurations": {}}  # fmt: skip
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="finetune_step_") as tmp:
        for name, config in CONFIGS.items():
            result["configurations"][name] = measure(name, size, Path(tmp) / "runs", config, args.epochs, args.num_workers)
    before, now = (result["configurations"][k]["epoch_overhead_s_median"] for k in CONFIGS)
    result["epoch_overhead_bundle_over_before"] = round(now / before, 4) if before > 0 else None
    return write_result(result, out, start)


if __name__ == "__main__":
    main()
