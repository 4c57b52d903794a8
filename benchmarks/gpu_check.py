"""One command for a lent GPU (H100 / H200): the CUDA tests and the bundles' step, inference and loader figures
within a wall-clock budget, written to one JSON named after the device.

Each part runs in its own process (a part that hangs or crashes costs only its share; peak GPU memory is the
part's own), in this order:

- ``ssl_step``: the SSL bundle's own trainer as ``benchmarks/ssl_step.py`` builds and times it (``measure_size``:
  phases, bundle / bare twins, free-running ``ms_per_step``, FLOPs, TFLOP/s, peak memory), with the bundle's
  shipped settings (validation and per-epoch checkpoint saves off, as in every step timing here), then in the same
  process the research code's plain loop on the same crops: SSLHead with MONAI's explicit attention and
  checkpointing, one forward per view, CrossEntropy + MONAI ``ContrastiveLoss`` + L1 under fp16 autocast with a
  GradScaler, clipping, AdamW.
- ``finetune_step``: the BTCV bundle's trainer (``benchmarks/finetune_step.py`` builds it), then the research
  code's loop: MONAI's SwinUNETR with checkpointing, DiceCE, fp16 autocast with a GradScaler, AdamW.
- ``self_distillation_step``: the DINO bundle's trainer alone (the research code has no self-distillation).
- ``sliding_window``: one 512 x 512 x 128 volume through the BTCV inference config's inferer and network.
- ``disk_loader``: crops per second of the SSL bundle's training dataset from an on-disk store written on the fly
  (``components.data.store.preprocess`` of synthetic CT), read by N loader worker processes.
- ``cuda_tests``: pytest on the tests that skip without CUDA (a ``skipif`` whose reason names CUDA, in the test
  files that say "needs CUDA"), with counts and the failures' first lines.

A bundle trainer's step is timed free-running over ``iters`` iterations after ``warmup`` (one device
synchronisation at each end: the loader's wait, the views, the handlers and the epoch ends are in it); a plain
loop's the same way on crops already on the device. FLOPs: ``torch.utils.flop_counter`` over the first (warm-up)
step (a checkpointed forward counts twice; ``ssl_step``'s own count runs after its timed steps). Peak GPU memory:
``max_memory_allocated`` over the timed steps.

Budget: a part's share of the time left is in proportion to :data:`WEIGHTS` (the time one part leaves unused goes
to the later ones); a share under :data:`MIN_S` skips the part with the reason; a part still running at the end of
its share is killed and keeps what it had recorded. The JSON is rewritten after every part, so it exists whatever
happens, and printed on stdout at the end.

    bash benchmarks/gpu_check.sh --commit <sha>        # the device call: install the carried wheels, then this
    python benchmarks/gpu_check.py                     # the recipe's sizes (CUDA), --budget_s 480
    python benchmarks/gpu_check.py --small             # CPU: 64x32x32, feature 12, a step or two per part
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpu_timing import (
    Record, autocast_for, budget_parser, chosen, device_in_use, one_line, peak_gib, ratio, release, reset_peak, run_header,
    run_in_share, significant, synchronizer, time_loop, time_trainer,
)
from machine import device_facts, device_slug

REPO = Path(__file__).resolve().parents[1]
BUNDLES = REPO / "bundles"
sys.path.insert(0, str(REPO))  # this checkout's components, whatever else is installed
PARTS = ("ssl_step", "finetune_step", "self_distillation_step", "sliding_window", "disk_loader", "cuda_tests")
# the seconds each part is expected to take on an H100 at the recipe's sizes: the shares of the budget
WEIGHTS = {"ssl_step": 100, "finetune_step": 70, "self_distillation_step": 70, "sliding_window": 40, "disk_loader": 60,
           "cuda_tests": 120}  # fmt: skip
# a part whose share is shorter than this is skipped: (the recipe's sizes, --small)
MIN_S = {"ssl_step": (45, 10), "finetune_step": (40, 10), "self_distillation_step": (40, 10), "sliding_window": (20, 5),
         "disk_loader": (25, 5), "cuda_tests": (30, 5)}  # fmt: skip
CUDA_REASON = "needs CUDA"  # the skip reason of the tests that need a GPU
BTCV_CLASSES = 14  # the BTCV bundle's 13 organs and background
# per size, per part: what runs (sizes of ssl_step.py / finetune_step.py by name, bundle overrides, iterations)
SETTINGS = {
    "recipe": {
        "ssl_step": dict(size="gpu", warmup=3, iters=20, num_workers=None),
        "finetune_step": dict(size="gpu", warmup=3, iters=20, num_workers=None),
        "self_distillation_step": dict(overrides={}, volumes=8, warmup=3, iters=20, num_workers=None),
        "sliding_window": dict(shape=[512, 512, 128], overrides={}, runs=3),
        "disk_loader": dict(volumes=8, shape=[256, 256, 160], overrides={}, seconds=8.0, workers=None, writers=None),
        "cuda_tests": dict(),
    },
    "small": {
        "ssl_step": dict(size="ci", warmup=0, iters=1, num_workers=0),
        "finetune_step": dict(size="ci", warmup=1, iters=1, num_workers=0),
        "self_distillation_step": dict(
            overrides={"roi_size": [64, 32, 32], "training#context_size": [80, 48, 48],
                       "training#local_size": [32, 32, 32], "training#num_local_crops": 1, "feature_size": 12,
                       "training#prototypes": 32, "training#head_hidden_dim": 24, "training#head_bottleneck_dim": 8},
            volumes=4, warmup=1, iters=1, num_workers=0),
        "sliding_window": dict(shape=[80, 48, 40], overrides={"roi_size": [64, 32, 32], "feature_size": 12,
                                                              "network_def#window_size": 4}, runs=1),
        "disk_loader": dict(volumes=2, shape=[96, 64, 48], overrides={"roi_size": [64, 32, 32]}, seconds=1.0,
                            workers=[1], writers=1),
        "cuda_tests": dict(),
    },
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# the parts (each runs in its own process)
# ---------------------------------------------------------------------------------------------------------------
def reference_ssl_loop(size: dict, device: torch.device, warmup: int, iters: int, deadline: float) -> dict:
    """The research code's SSL step on ``size``'s crops (already on the device; no loader)."""
    import numpy as np
    from augment import reference_ssl_views
    from monai.losses import ContrastiveLoss

    from components import SSLHead

    torch.manual_seed(0)
    network = SSLHead(in_channels=1, feature_size=size["feature_size"], use_checkpoint=True).to(device)
    optimizer = torch.optim.AdamW(network.parameters(), lr=4e-4, weight_decay=0.1)
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")
    crops = torch.rand(size["batch_size"] * size["num_samples"], 1, *size["roi_size"], device=device)
    rotation, reconstruction = torch.nn.CrossEntropyLoss(), torch.nn.L1Loss()
    contrast, rng, autocast = ContrastiveLoss(temperature=0.5), np.random.RandomState(0), autocast_for(device)

    def step() -> None:
        inputs, labels, targets = reference_ssl_views(crops, rng)
        view_1, view_2 = inputs.chunk(2)
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            rot_1, emb_1, rec_1 = network(view_1)
            rot_2, emb_2, rec_2 = network(view_2)
            loss = (rotation(torch.cat([rot_1, rot_2]), labels.to(device)) + contrast(emb_1, emb_2)
                    + reconstruction(torch.cat([rec_1, rec_2]), targets))  # fmt: skip
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()

    return time_loop(step, device, warmup, iters, deadline)


def ssl_step_part(settings: dict, record: Record, deadline: float) -> None:
    """The SSL bundle's step (ssl_step.py's ``measure_size``, shipped settings) and the research code's loop."""
    import ssl_step

    device = device_in_use()
    size = ssl_step.SIZES[settings["size"]]
    crops = size["batch_size"] * size["num_samples"]
    record["step"] = (
        f"{size['batch_size']} volume(s) x {size['num_samples']} crop(s) of {size['roi_size']} = {crops} crops, two "
        f"views each (rot_rand + aug_rand on the device) = {2 * crops} views in one forward of SSLHead (feature "
        f"{size['feature_size']}); SSLLoss (rotation CE + NT-Xent + L1), backward, clipping, AdamW, scheduler; the "
        "bundle's handlers and the loader's wait included"
    )
    record["reference_step"] = (
        f"the same {crops} crops, already on the device: benchmarks/augment.py's per-box views, SSLHead with MONAI's "
        "explicit attention and checkpointing, one forward per view, CrossEntropy + MONAI ContrastiveLoss(temperature "
        "0.5) + L1 under fp16 autocast (none on a CPU), GradScaler, unscale and clipping at 1.0, AdamW"
    )
    bundle = record.measure("bundle", lambda: ssl_step.measure_size(
        settings["size"], size, settings["iters"], settings["warmup"], settings["num_workers"],
        amp=device.type == "cuda", config=ssl_step.CONFIGS["bundle"], tune=False))  # fmt: skip
    release(device)
    reference = record.measure("reference", lambda: reference_ssl_loop(size, device, settings["warmup"],
                                                                       settings["iters"], deadline))  # fmt: skip
    if bundle and reference:
        record["reference_over_bundle"] = ratio(reference, bundle)


def reference_finetune_loop(size: dict, device: torch.device, warmup: int, iters: int, deadline: float) -> dict:
    """The research code's BTCV step on ``size``'s crops (random image and labels on the device; no loader)."""
    from monai.losses import DiceCELoss
    from monai.networks.nets import SwinUNETR

    torch.manual_seed(0)
    network = SwinUNETR(in_channels=1, out_channels=BTCV_CLASSES, feature_size=size["feature_size"],
                        window_size=size["network_def#window_size"], use_checkpoint=True).to(device)  # fmt: skip
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4, weight_decay=1e-5)
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")
    loss_function, autocast = DiceCELoss(to_onehot_y=True, softmax=True), autocast_for(device)
    shape = (size["training#num_samples"], 1, *size["roi_size"])
    image, label = torch.rand(shape, device=device), torch.randint(0, BTCV_CLASSES, shape, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_function(network(image), label)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return time_loop(step, device, warmup, iters, deadline)


def finetune_step_part(settings: dict, record: Record, deadline: float) -> None:
    """The BTCV bundle's step (finetune_step.py's trainer, shipped settings) and the research code's loop."""
    import finetune_step

    device = device_in_use()
    size = finetune_step.SIZES[settings["size"]]
    crops = size["training#num_samples"]
    record["step"] = (
        f"1 volume -> {crops} crops of {size['roi_size']} (RandCropByPosNegLabeld and the bundle's augmentations, in "
        f"the loader); SwinUNETR (feature {size['feature_size']}, {BTCV_CLASSES} classes), DiceCE, backward, AdamW as "
        "the bundle's SupervisedTrainer runs them (on CUDA: fp16 autocast and a GradScaler, fused attention, "
        "use_checkpoint auto); handlers and the loader's wait included"
    )
    record["reference_step"] = (
        f"the same {crops} crops, random image and labels on the device: MONAI's SwinUNETR with its explicit "
        "attention and checkpointing, DiceCELoss, fp16 autocast (none on a CPU) and a GradScaler, AdamW"
    )

    def bundle_step() -> dict:
        with tempfile.TemporaryDirectory(prefix="gpu_check_finetune_") as tmp:
            trainer = finetune_step.build_trainer(size, Path(tmp) / "run", {}, 1000, settings["num_workers"])
            return {**time_trainer(trainer, settings["warmup"], settings["iters"]), "crops_per_step": crops}

    bundle = record.measure("bundle", bundle_step)
    release(device)
    reference = record.measure("reference", lambda: reference_finetune_loop(size, device, settings["warmup"],
                                                                            settings["iters"], deadline))  # fmt: skip
    if bundle and reference:
        record["reference_over_bundle"] = ratio(reference, bundle)


def self_distillation_step_part(settings: dict, record: Record, deadline: float) -> None:
    """The DINO bundle's step with its shipped settings (validation off, checkpoints only at the end)."""
    import components
    from machine import bundle_parser, bundle_start

    device, bundle = device_in_use(), BUNDLES / "swin_unetr_dino_pretrain"
    with tempfile.TemporaryDirectory(prefix="gpu_check_dino_") as tmp:
        data = components.write_dataset(Path(tmp) / "data", kind="ct", num=settings["volumes"], seed=0).parent
        overrides = {"bundle_root": str(bundle), "dataset_dir": str(data), "output_dir": str(Path(tmp) / "eval"),
                     "ckpt_dir": str(Path(tmp) / "models"), "max_epochs": 1000, "training#val_interval": 10**6,
                     "checkpointing#epoch_interval": None, "checkpointing#auto_resume": False,
                     "speed#amp": device.type == "cuda", **settings["overrides"]}  # fmt: skip
        parser = bundle_parser(bundle, overrides, settings["num_workers"])
        bundle_start(parser)
        views = parser.get_parsed_content("train#views")
        crops = parser.get_parsed_content("batch_size") * parser.get_parsed_content("training#num_samples")
        record["step"] = (
            f"{crops} context crop(s) of {parser.get_parsed_content('training#context_size')} (one per volume), each "
            f"giving {views.num_global} global views of {list(views.global_size)} and {views.num_local} local views "
            f"of {list(views.local_size)} (MultiCrop, on the device); the student on all "
            f"{crops * (views.num_global + views.num_local)} views, the EMA teacher on the {crops * views.num_global} "
            "global ones; DINO loss with KoLeo, backward, clipping, AdamW, teacher update; the bundle's handlers and "
            "the loader's wait included"
        )
        trainer = parser.get_parsed_content("train#trainer")
        record["bundle"] = time_trainer(trainer, settings["warmup"], settings["iters"])
        del trainer
    release(device)


def sliding_window_part(settings: dict, record: Record, deadline: float) -> None:
    """One volume through the BTCV inference config's sliding-window inferer and network (no weights: random)."""
    from machine import bundle_parser

    device, bundle = device_in_use(), BUNDLES / "swin_unetr_btcv_finetune"
    parser = bundle_parser(bundle, {"bundle_root": str(bundle), "network_def#pretrained_path": None,
                                    **settings["overrides"]}, config="inference.json")  # fmt: skip
    parser.get_parsed_content("initialize")
    network, inferer = parser.get_parsed_content("network").eval(), parser.get_parsed_content("inferer")
    amp = bool(parser.get_parsed_content("speed#amp")) and device.type == "cuda"  # the evaluator's rule
    volume = torch.rand(1, parser.get_parsed_content("in_channels"), *settings["shape"], device=device)
    windows = [0]
    network.register_forward_pre_hook(lambda module, args: windows.__setitem__(0, windows[0] + args[0].shape[0]))
    sync = synchronizer(device)

    def infer() -> torch.Tensor:
        with torch.no_grad(), torch.autocast(device.type, enabled=amp):  # MONAI's evaluator: float16 on CUDA
            return inferer(volume, network)

    out = infer()  # the first pass: kernels and their choices
    record["setup"] = {"volume": settings["shape"], "roi_size": list(inferer.roi_size), "overlap": inferer.overlap,
                       "sw_batch_size": inferer.sw_batch_size, "windows": windows[0], "amp": amp,
                       "output": list(out.shape)}  # fmt: skip
    del out
    sync()
    reset_peak(device)
    times: list[float] = []
    while len(times) < settings["runs"] and (not times or time.time() + times[-1] < deadline):
        start = time.perf_counter()
        infer()
        sync()
        times.append(time.perf_counter() - start)
    record["inference"] = {"ms_per_volume": round(sorted(times)[len(times) // 2] * 1000, 1), "runs": len(times),
                           "ms_per_run": [round(t * 1000, 1) for t in times],
                           "peak_gpu_memory_gib": peak_gib(device)}  # fmt: skip


def _write_volumes(folder: Path, count: int, shape: list[int]) -> Path:
    """``count`` CT-like int16 volumes (store_format.py's) as .nii.gz and a datalist of them all for training."""
    import nibabel as nib
    import numpy as np
    from store_format import ct_volume

    images = folder / "imagesTr"
    images.mkdir(parents=True)
    for index in range(count):
        volume = ct_volume(tuple(shape), seed=index)
        nib.save(nib.Nifti1Image(volume, np.diag([0.8, 0.8, 2.0, 1.0])), str(images / f"volume_{index:03d}.nii.gz"))
    datalist = folder / "dataset.json"
    training = [{"image": f"imagesTr/volume_{i:03d}.nii.gz"} for i in range(count)]
    datalist.write_text(json.dumps({"training": training, "validation": []}))  # all for training, none held out
    return datalist


def _crops_per_s(dataset, workers: int, batch_size: int, seconds: float) -> dict:
    """Batches drawn at random (with replacement) from ``dataset`` by ``workers`` processes for ``seconds`` after the
    first batch (the workers' start-up, reported apart)."""
    from monai.data import DataLoader
    from torch.utils.data import RandomSampler

    sampler = RandomSampler(dataset, replacement=True, num_samples=10**6, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    batches = iter(DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers))
    next(batches)
    first = time.perf_counter() - start
    crops, count, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        crops += next(batches)["image"].shape[0]
        count += 1
    elapsed = time.perf_counter() - start
    del batches  # ends the workers
    return {"crops_per_s": significant(crops / elapsed), "crops": crops, "batches": count,
            "seconds": round(elapsed, 2), "first_batch_s": round(first, 3)}  # fmt: skip


def disk_loader_part(settings: dict, record: Record, deadline: float) -> None:
    """Crops per second of the SSL bundle's training dataset read from a store (loader#cache disk) by N workers."""
    import components
    from components.data.store import bundle_crop_size, bundle_transforms, preprocess
    from machine import bundle_parser

    bundle = BUNDLES / "swin_unetr_ssl_pretrain"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    counts = settings["workers"] or sorted({1, components.default_num_workers(), cpus})
    with tempfile.TemporaryDirectory(prefix="gpu_check_store_") as tmp:
        datalist = _write_volumes(Path(tmp) / "data", settings["volumes"], settings["shape"])
        overrides = {"bundle_root": str(bundle), "datalist": str(datalist), **settings["overrides"]}
        parser = bundle_parser(bundle, overrides)
        store, writers = Path(tmp) / "store", settings["writers"] or min(settings["volumes"], cpus)
        start = time.perf_counter()
        preprocess(datalist, store, bundle_transforms(parser), workers=writers, channels=parser["in_channels"],
                   patch_size=bundle_crop_size(parser))
        preprocess_s, batch_size = time.perf_counter() - start, parser.get_parsed_content("batch_size")
        record["setup"] = {
            "volumes": settings["volumes"], "volume_shape": settings["shape"], "cpus": cpus,
            "roi_size": parser.get_parsed_content("roi_size"),
            "crops_per_batch": batch_size * parser.get_parsed_content("training#num_samples"),
            "preprocess_s": round(preprocess_s, 2), "preprocess_workers": writers,
            "store_bytes": sum(p.stat().st_size for p in store.rglob("*") if p.is_file()),
            "reads": "page cache warm (the store was just written): decompression, CRC checks and cropping",
        }  # fmt: skip
        disk, by_workers = {"loader#cache": "disk", "loader#store": str(store)}, {}
        for index, workers in enumerate(counts):
            seconds = min(settings["seconds"], (deadline - time.time()) / (len(counts) - index) - 5)  # 5: start-up
            dataset = bundle_parser(bundle, {**overrides, **disk}, workers).get_parsed_content("train#dataset")
            by_workers[str(workers)] = _crops_per_s(dataset, workers, batch_size, max(0.5, seconds))
            record["by_workers"] = by_workers


class _CudaTests:
    """pytest plugin: keeps the tests that skip without CUDA and records every outcome as it comes."""

    def __init__(self, record: Record) -> None:
        self.record, self.tests, self.deselected = record, {}, 0

    @staticmethod
    def _needs_cuda(item) -> bool:
        return any(CUDA_REASON in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif"))

    def pytest_collection_modifyitems(self, config, items) -> None:
        dropped = [item for item in items if not self._needs_cuda(item)]
        items[:] = [item for item in items if self._needs_cuda(item)]
        self.deselected = len(dropped)
        config.hook.pytest_deselected(items=dropped)
        self._write()

    def pytest_runtest_logreport(self, report) -> None:
        test = self.tests.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
        test["seconds"] = round(test["seconds"] + report.duration, 3)
        if report.skipped:
            reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else ""
            test["outcome"], test["message"] = "skipped", str(reason)
        elif report.failed:
            test["outcome"] = "failed" if report.when == "call" else "error"
            crash = getattr(report.longrepr, "reprcrash", None)
            test["message"] = (crash.message if crash else str(report.longrepr)).strip().splitlines()[0]
        if report.when == "teardown":
            self._write()

    def _write(self) -> None:
        outcomes = [t["outcome"] for t in self.tests.values()]
        counts = {k: outcomes.count(k) for k in ("passed", "failed", "error", "skipped")}
        self.record["counts"] = {**counts, "deselected": self.deselected}
        failed = [(n, t) for n, t in self.tests.items() if t["outcome"] in ("failed", "error")]
        self.record["failures"] = [f"{n}: {t['message']}" for n, t in failed]
        self.record["tests"] = self.tests


def cuda_tests_part(settings: dict, record: Record, deadline: float) -> None:
    """pytest on the tests that need CUDA, in the test files that name the reason (others are not even imported:
    their dependencies need not be installed), without the machine's own pytest plugins (none is needed, and one
    written for another pytest than the carried one could stop the collection)."""
    import pytest

    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    files = [str(p.relative_to(REPO)) for p in sorted((REPO / "tests").glob("test_*.py"))
             if CUDA_REASON in p.read_text()]  # fmt: skip
    record["files"] = files
    record["exit_code"] = int(pytest.main([*files, "-q", "-p", "no:cacheprovider"], plugins=[_CudaTests(record)]))


PART_FUNCTIONS = {"ssl_step": ssl_step_part, "finetune_step": finetune_step_part,
                  "self_distillation_step": self_distillation_step_part, "sliding_window": sliding_window_part,
                  "disk_loader": disk_loader_part, "cuda_tests": cuda_tests_part}  # fmt: skip


def run_child(name: str, small: bool, partial: Path, deadline: float) -> None:
    """The part ``name`` in this process; what fails is recorded in one line (the traceback goes to the log) and
    the exit code says so."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    record = Record(partial)
    try:
        PART_FUNCTIONS[name](SETTINGS["small" if small else "recipe"][name], record, deadline)
    except Exception as err:
        record.fail(one_line(err))
        raise
    if record.errors:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------------------------
# the budget, the device and the JSON
# ---------------------------------------------------------------------------------------------------------------
def _share(name: str, todo: list[str], left: float) -> float:
    """``name``'s share of the ``left`` seconds, by its weight among the parts still to run."""
    return left * WEIGHTS[name] / sum(WEIGHTS[n] for n in todo)


def run_part(name: str, share: float, small: bool, log: Path, workdir: Path) -> dict:
    """Runs part ``name`` in a child process for at most ``share`` seconds; its status, figures and wall time."""
    partial = workdir / f"{name}.json"
    tail = min(15.0, 0.15 * share)  # for the last FLOP count and the clean-up after a part's adaptive loops
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_part", name, "--_partial", str(partial),
           "--_deadline", str(time.time() + share - tail), *(["--small"] if small else [])]  # fmt: skip
    return run_in_share(cmd, partial, share, log, name, workdir)


def result_path(out_dir: Path, device: str, small: bool) -> Path:
    """``gpu_check_<device slug>[_small].json``: "nvidia-h100-80gb-hbm3", "cpu"."""
    return out_dir / f"gpu_check_{device_slug(device)}{'_small' if small else ''}.json"


def _write(result: dict, path: Path) -> None:
    from components import atomic_write

    with atomic_write(path, "w") as f:
        f.write(json.dumps(result, indent=2) + "\n")


def _skip_reason(name: str, share: float, left: float, small: bool) -> str | None:
    """Why part ``name`` does not start with ``share`` of the ``left`` seconds, or None when it does."""
    least = MIN_S[name][small]
    if share >= least:
        return None
    return f"needs at least {least} s; its share of the {max(left, 0):.0f} s left is {max(share, 0):.0f} s"


def run_all(parts: list[str], started: float, small: bool, path: Path, log: Path, header: dict) -> dict:
    """Runs ``parts`` in order within ``header["budget_s"]`` seconds from ``started`` (``time.perf_counter``),
    rewriting the JSON at ``path`` after each (and once before the first: a run killed from outside still leaves
    its header)."""
    result = {**header, "log": str(log), "parts": {}}
    _write(result, path)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for index, name in enumerate(parts):
            left = header["budget_s"] - (time.perf_counter() - started) - 2.0  # 2 s to write the JSON at the end
            share = _share(name, parts[index:], left)
            reason = _skip_reason(name, share, left, small)
            entry = {"status": "skipped", "reason": reason} if reason else run_part(name, share, small, log, Path(tmp))
            result["parts"][name] = entry
            result["wall_s"] = round(time.perf_counter() - started, 1)
            print(f"gpu_check: {name} {entry['status']} ({entry.get('wall_s', 0)} s) {entry.get('reason', '')}",
                  file=sys.stderr, flush=True)  # fmt: skip
            _write(result, path)
    result["machine"]["load_avg_1_5_15_at_end"] = [round(v, 2) for v in os.getloadavg()]
    result["wall_s"] = round(time.perf_counter() - started, 1)
    _write(result, path)
    return result


def _temporary_log() -> Path:
    handle, name = tempfile.mkstemp(prefix="gpu_check_", suffix=".log")
    os.close(handle)
    return Path(name)


def main(argv: list[str] | None = None) -> dict | None:
    parser = budget_parser(__doc__.split("\n\n")[0], "part", PARTS, "tiny shapes (64x32x32, feature 12), a step or two",
                           "the parts' output (default: a temporary file)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.part:
        run_child(args.part, args.small, args.partial, args.deadline)
        return None
    started = time.perf_counter()
    parts = chosen(parser, "part", args.parts, PARTS)
    log = args.log or _temporary_log()
    log.parent.mkdir(parents=True, exist_ok=True)
    device = device_facts()
    header = run_header("gpu_check", device, args.small, args.budget_s, args.commit)
    result = run_all(parts, started, args.small, result_path(args.out_dir, device["name"], args.small), log, header)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
