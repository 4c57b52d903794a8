"""Where the time of one SSL pretraining iteration goes, and how close the bundle comes to bare math.

For each size, the pretraining bundle's own ``train#trainer`` is built from ``configs/train.json`` (SSLTrainer with
the handlers the bundle attaches: StatsHandler, TensorBoardStatsHandler, checkpointing, ..., and the data loader
over the cached synthetic CT) and each iteration is split into phases by timing its pieces from outside (nothing in
``components`` is changed):

- ``data``: ignite's GET_BATCH_STARTED -> GET_BATCH_COMPLETED (waiting for the loader: crops, collation);
- ``views``: ``SSLTrainer._views`` (to the device, two rotations and two ``aug_rand`` passes);
- ``forward``, ``loss``, ``backward`` (loss end -> the first GradScaler call), ``optimizer`` (unscale, clipping,
  step), ``gather`` (the all-reduce of the logged losses: at the log iterations only), ``logging`` (optimizer end
  -> the end of the ITERATION_COMPLETED handlers, less the gather: scheduler, outputs, handlers), ``other`` (the
  rest: engine bookkeeping, ITERATION_STARTED handlers).

In the same process, right after every bundle iteration, a bare iteration runs only zero_grad + forward + loss +
backward + optimizer step on already-prepared views with the same network and optimizer; ``overhead_ratio`` = the
median over these pairs of bundle iteration / bare iteration (target <= 1.05). On a shared machine neighbouring
iterations can differ by 1.5x from load alone, so ``overhead_ratio_within`` = the median over bundle iterations of
total / (forward + loss + backward + optimizer phases of that same iteration) is reported too: it compares the
overhead with the math it accompanies, with no second run for the load to change in between.

Throughput and utilisation (every size): ``ms_per_step`` from iterations run after the instrumented ones with no
timer and no twin (one device synchronisation at each end of the span, so on a GPU the host runs ahead as in a
real run), crops/s and volumes/s of this process (per GPU), the FLOPs of one step (forward + backward, counted
with ``torch.utils.flop_counter``), TFLOP/s and, on a GPU whose datasheet bf16 dense peak is known (or
``--peak-tflops``), the share of that peak; peak GPU memory on CUDA.

``--reference-style`` (the default on CUDA) measures, in the same run, each size again as the research code runs
it: MONAI's explicit window attention, the per-sample, per-box views of ``benchmarks/augment.py``, fp16 autocast
with a GradScaler and activation checkpointing on; ``bundle_over_reference`` compares the step times.

The allocator comparison runs the bare loop in two fresh subprocesses, one with ``components.tune_allocator()`` and
one without, alternating, and reports their median iteration times, the ratio tuned / plain (target <= 0.5) and
user / system CPU seconds per iteration (``resource.getrusage``).

    python benchmarks/ssl_step.py                       # CPU: tiny (64^3, feature 12) and paper (96^3, feature 48)
    python benchmarks/ssl_step.py --sizes gpu           # CUDA default: the recipe's 2 volumes x 2 crops at 96^3
    python benchmarks/ssl_step.py --sizes tiny --iters 12
    python benchmarks/ssl_step.py --small               # CI: 64x32x32, 2 iterations, seconds

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from machine import bundle_parser, bundle_start, machine_info, write_result

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "bundles" / "swin_unetr_ssl_pretrain"

# per size: bundle overrides; "volumes" synthetic CT subjects: training gets all but 2 (epochs of 2 / 3 / 2 steps).
# One volume x 2 crops per step as in the published per-GPU setting, 1 x 1 at 96^3: see the memory note below.
SIZES = {
    "ci": dict(roi_size=[64, 32, 32], feature_size=12, batch_size=1, num_samples=1, use_checkpoint=False, volumes=4),
    "tiny": dict(roi_size=[64, 64, 64], feature_size=12, batch_size=1, num_samples=2, use_checkpoint=False, volumes=5),
    # one crop (two views): with tune_allocator a step of 2 crops at 96^3 needs more than the 23 GB of the machine
    # the recorded results come from (peak RSS 2.7x the plain allocator's; see README.md)
    "paper": dict(roi_size=[96, 96, 96], feature_size=48, batch_size=1, num_samples=1, use_checkpoint=True, volumes=4),
    # the recipe per GPU: 2 volumes x 2 crops (8 views) at 96^3, checkpointing as the bundle decides ("auto")
    "gpu": dict(roi_size=[96, 96, 96], feature_size=48, batch_size=2, num_samples=2, use_checkpoint="auto", volumes=6),
}
DEFAULT_ITERS = {"ci": 2, "tiny": 10, "paper": 10, "gpu": 30}
# the bundle's config id of each setting above that lives in one of its groups (``--speed#amp false``)
BUNDLE_IDS = {
    "num_samples": "training#num_samples", "val_interval": "training#val_interval", "amp": "speed#amp",
    "amp_dtype": "speed#amp_dtype", "use_checkpoint": "speed#use_checkpoint", "fused_attention": "speed#fused_attention",
    "compile": "speed#compile", "tune_allocator": "speed#tune_allocator",
}  # fmt: skip
# how each configuration differs from the bundle's defaults; "reference_style" is the research code's way
CONFIGS = {
    "bundle": dict(),
    "reference_style": dict(fused_attention=False, per_box_views=True, amp=True, amp_dtype="float16", use_checkpoint=True,
                            compile=False),
}
# datasheet dense (no sparsity) bf16 tensor-core peaks, TFLOP/s; the first name contained in the device name wins
BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
    ("A10", 125.0),
)
MODES = ("plain", "tuned")
PHASES = ("data", "views", "forward", "loss", "backward", "optimizer", "gather", "logging", "other")


def json_stdout():
    """A file on the original stdout for the JSON result, with file descriptor 1 pointed at stderr from now on, so
    that the log lines of MONAI's handlers (some write to stdout) cannot mix with the JSON."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


# ---------------------------------------------------------------------------------------------------------------
# the bundle's trainer, instrumented from outside
# ---------------------------------------------------------------------------------------------------------------
class _ScalerProxy:
    """Forwards to the trainer's GradScaler and stamps the first call of an iteration (= the end of backward)."""

    def __init__(self, scaler, timer: "PhaseTimer") -> None:
        self._scaler, self._timer = scaler, timer

    def __getattr__(self, name):
        attr = getattr(self._scaler, name)
        if name in ("unscale_", "step") and callable(attr):

            def stamped(*args, **kwargs):
                self._timer.mark_once("backward_end")
                return attr(*args, **kwargs)

            return stamped
        return attr


class PhaseTimer:
    """Per-iteration timestamps of an SSLTrainer's phases, taken by wrapping its pieces (CPU: synchronous).

    Every mark holds the wall clock (``perf_counter``) and the process CPU time (``process_time``, all threads):
    on a machine shared with other jobs the wall times of neighbouring iterations differ by up to 2x, while the
    CPU time an iteration consumes barely moves, so both are reported."""

    def __init__(self, device: torch.device) -> None:
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.enabled = True
        self.marks: dict[str, tuple[float, float]] = {}
        self.records: list[dict[str, float]] = []
        self.cpu_records: list[dict[str, float]] = []
        self.epoch_first: list[bool] = []

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        self.sync()
        self.marks[name] = (time.perf_counter(), time.process_time())

    def mark_once(self, name: str) -> None:
        if name not in self.marks:
            self.mark(name)

    def timed(self, fn, start: str, end: str):
        def wrapper(*args, **kwargs):
            self.mark(start)
            out = fn(*args, **kwargs)
            self.mark(end)
            return out

        return wrapper

    def _phases(self, clock: int) -> dict[str, float]:
        m = {k: v[clock] for k, v in self.marks.items()}
        phases = {
            "data": m["batch_end"] - m["batch_start"],
            "views": m["views_end"] - m["views_start"],
            "forward": m["forward_end"] - m["forward_start"],
            "loss": m["loss_end"] - m["loss_start"],
            "backward": m["backward_end"] - m["loss_end"],
            "optimizer": m["optimizer_end"] - m["backward_end"],
            # the all-reduce of the logged values runs at the log iterations only
            "gather": m["gather_end"] - m["gather_start"] if "gather_start" in m else 0.0,
        }
        phases["logging"] = m["end"] - m["optimizer_end"] - phases["gather"]
        total = m["end"] - m["batch_start"]
        phases["other"] = total - sum(phases.values())
        phases["total"] = total
        return phases

    def finish(self, engine) -> None:
        """Last ITERATION_COMPLETED handler: turns the marks of this iteration into phase durations."""
        if not self.enabled:
            return
        self.mark("end")
        self.records.append(self._phases(0))
        self.cpu_records.append(self._phases(1))
        length = engine.state.epoch_length
        self.epoch_first.append(length == 1 or engine.state.iteration % length == 1)
        self.marks = {}


def instrument(trainer) -> PhaseTimer:
    """Wraps the trainer's pieces with timestamps; returns the timer collecting per-iteration phases."""
    from ignite.engine import Events

    import components.training.non_finite as non_finite_module
    import components.training.trainer as trainer_module

    timer = PhaseTimer(torch.device(trainer.state.device))
    trainer.add_event_handler(Events.GET_BATCH_STARTED, lambda e: timer.mark("batch_start"))
    trainer.add_event_handler(Events.GET_BATCH_COMPLETED, lambda e: timer.mark("batch_end"))
    for event in (Events.GET_BATCH_STARTED, Events.GET_BATCH_COMPLETED):  # first, before the bundle's handlers
        handlers = trainer._event_handlers[event]
        handlers.insert(0, handlers.pop())
    trainer.add_event_handler(Events.ITERATION_COMPLETED, timer.finish)  # last: after the bundle's handlers
    trainer._views = timer.timed(trainer._views, "views_start", "views_end")
    trainer._forward = timer.timed(trainer._forward, "forward_start", "forward_end")
    trainer.loss_function = timer.timed(trainer.loss_function, "loss_start", "loss_end")
    trainer.scaler = _ScalerProxy(trainer.scaler, timer)
    step = trainer._optimizer_step

    def optimizer_step() -> bool:
        stepped = step()
        timer.mark("optimizer_end")
        return stepped

    trainer._optimizer_step = optimizer_step
    for module in (trainer_module, non_finite_module):  # the logged values' all-reduce and the loss check's
        module.all_reduce_mean = timer.timed(module.all_reduce_mean, "gather_start", "gather_end")
    return timer


def build_trainer(size: dict, workdir: Path, num_workers: int | None, amp: bool, tune: bool, config: dict):
    """The bundle's train#trainer on synthetic CT for ``size`` and a configuration of :data:`CONFIGS` (validation
    and checkpoint saves off: they are per epoch, not per step)."""
    import components

    data = workdir / "data"
    if not (data / "dataset.json").exists():
        components.write_dataset(data, kind="ct", num=size["volumes"], seed=0)
    overrides = {k: v for k, v in size.items() if k != "volumes"}
    overrides.update(
        bundle_root=str(BUNDLE),
        dataset_dir=str(data),
        output_dir=str(workdir / "eval"),
        ckpt_dir=str(workdir / "models"),
        amp=amp,
        max_epochs=1000,
        val_interval=10**6,
        tune_allocator=tune,
    )
    overrides.update({k: v for k, v in config.items() if k != "per_box_views"})
    parser = bundle_parser(BUNDLE, {BUNDLE_IDS.get(k, k): v for k, v in overrides.items()}, num_workers)
    # no checkpoint saves: an epoch of these few volumes is a few iterations, a real one thousands per save
    for index, handler in enumerate(parser["train"]["handlers"]):
        if handler.get("_target_", "").endswith("ResumableCheckpointSaver"):
            parser[f"train#handlers#{index}#_disabled_"] = True
    bundle_start(parser)  # the bundle's start-up: tune_allocator, set_determinism
    trainer = parser.get_parsed_content("train#trainer")
    if config.get("per_box_views"):
        use_per_box_views(trainer)
    return trainer, overrides


def use_per_box_views(trainer) -> None:
    """Replaces the recipe's batched views with the per-sample, per-box loop of ``benchmarks/augment.py`` (the
    research code's shape: numpy draws, one slice assignment per box), same semantics."""
    import numpy as np

    from augment import reference_ssl_views

    from components.recipes.inpainting_contrast.recipe import _Views

    rng = np.random.RandomState(0)

    def views(image: torch.Tensor, generator: torch.Generator, host_generator: torch.Generator | None = None) -> _Views:
        inputs, labels, targets = reference_ssl_views(image, rng)
        return _Views(image, inputs, labels.to(image.device), targets)

    trainer.recipe.views = views


def prepared_views(trainer) -> tuple[torch.Tensor, ...]:
    """One batch of the trainer's own loader turned into network inputs, rotation labels and targets."""
    from components import ssl_views

    batch = next(iter(trainer.data_loader))
    image = batch["image"]
    image = (image.as_tensor() if hasattr(image, "as_tensor") else image).to(trainer.device)
    generator = torch.Generator(device=trainer.device).manual_seed(0)
    return tuple(ssl_views(image, generator=generator))


def bare_step(network, optimizer, loss_function, views, autocast) -> None:
    """zero_grad + forward + loss + backward + optimizer step: the math of an iteration and nothing else."""
    inputs, rot_labels, targets = views
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        rot_logits, embeddings, recon = network(inputs)
    emb_1, emb_2 = embeddings.float().chunk(2)
    total, _ = loss_function(rot_logits.float(), rot_labels, emb_1, emb_2, recon.float(), targets)
    total.backward()
    optimizer.step()


def _checkpointing_applied(network: torch.nn.Module) -> bool:
    """Whether any block of the network runs with activation checkpointing (MONAI's ``use_checkpoint``)."""
    return any(getattr(m, "use_checkpoint", False) for m in network.modules())


def _autocast_factory(trainer):
    if not trainer.use_amp:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=trainer.device.type, dtype=trainer.amp_dtype)


def count_flops(step: Callable[[], object]) -> int:
    """FLOPs of one call of ``step`` by ``torch.utils.flop_counter``: matrix products, convolutions and attention
    kernels as they run (a checkpointed forward counts twice); elementwise work such as the optimizer's is not
    counted."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


def step_flops(trainer, loss_function, views, autocast) -> int:
    """FLOPs of one bare step (forward + backward; see :func:`count_flops`)."""
    return count_flops(lambda: bare_step(trainer.network, trainer.optimizer, loss_function, views, autocast))


def bf16_peak_tflops(device: torch.device) -> tuple[float | None, str | None]:
    """(datasheet dense bf16 peak in TFLOP/s, the device name) of a CUDA device; (None, name) when unknown."""
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key in name), None), name


def measure_size(
    name: str,
    size: dict,
    iters: int,
    warmup: int,
    num_workers: int | None,
    amp: bool,
    config: dict,
    peak_tflops: float | None = None,
    tune: bool = True,
) -> dict:
    """``warmup + iters`` bundle iterations (whole epochs), each with one bare twin run right after it (odd
    iterations: an ITERATION_COMPLETED handler after the timer's) or right before it (even ones: the first
    GET_BATCH_STARTED handler, ahead of the timer's first mark): twins are measured seconds apart, so load changes
    of a shared machine hit both alike, and alternating the order cancels a drift. ``overhead_ratio`` is the median
    of the per-pair ratios. With loader workers the first iteration of each epoch (worker start-up, amortised over
    thousands of iterations in a real epoch) is left out and its data wait reported on its own. Then ``iters``
    more iterations run free (no timer, no twins) for ``ms_per_step`` and the throughput. ``tune``: the bundle's
    ``speed#tune_allocator`` (this script's runs keep it on; the bundle ships it off)."""
    import math

    from ignite.engine import Events

    with tempfile.TemporaryDirectory(prefix=f"ssl_step_{name}_") as tmp:
        workdir = Path(tmp)
        trainer, overrides = build_trainer(size, workdir, num_workers, amp, tune=tune, config=config)
        epoch_length = len(trainer.data_loader)
        workers = trainer.data_loader.num_workers
        loss_function = trainer.recipe.loss_function  # the SSLLoss itself (the engine calls the recipe)
        timer = instrument(trainer)
        views = prepared_views(trainer)
        autocast = _autocast_factory(trainer)
        sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
        bare: list[float] = []
        bare_cpu: list[float] = []

        def bare_twin(engine) -> None:
            if not timer.enabled:
                return
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            bare_step(trainer.network, trainer.optimizer, loss_function, views, autocast)
            sync()
            bare.append(time.perf_counter() - start)
            bare_cpu.append(time.process_time() - start_cpu)

        # the twin runs after odd iterations and before even ones (ahead of the timer's first mark, so never inside
        # the bundle iteration's window): a drift of the machine's load then favours neither side. At
        # GET_BATCH_STARTED, state.iteration is still the previous one: even there means the coming one is odd.
        trainer.add_event_handler(Events.ITERATION_COMPLETED(event_filter=lambda e, i: i % 2 == 1), bare_twin)
        before_even = lambda e: bare_twin(e) if e.state.iteration % 2 == 1 else None  # noqa: E731
        trainer.add_event_handler(Events.GET_BATCH_STARTED, before_even)
        handlers = trainer._event_handlers[Events.GET_BATCH_STARTED]
        handlers.insert(0, handlers.pop())  # before the timer's batch_start mark
        span: dict[str, float] = {}
        instrumented = warmup + iters

        def free_running(engine) -> None:  # after the instrumented iterations: no timer, no twins, one sync per end
            if engine.state.iteration == instrumented:
                timer.enabled = False
                if trainer.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(trainer.device)
                sync()
                span["start"] = time.perf_counter()
            elif engine.state.iteration == instrumented + iters:
                sync()
                span["end"] = time.perf_counter()
                engine.terminate()

        trainer.add_event_handler(Events.ITERATION_COMPLETED, free_running)
        trainer.state.max_epochs = math.ceil((instrumented + iters) / epoch_length) + 1
        trainer.run()
        step_s = (span["end"] - span["start"]) / iters
        flops = step_flops(trainer, loss_function, views, autocast)
        peak, device_name = (peak_tflops, None) if peak_tflops else bf16_peak_tflops(trainer.device)
        tflops_per_s = flops / step_s / 1e12
        keep = [
            i
            for i in range(warmup, len(timer.records))
            if not (timer.epoch_first[i] and workers > 0 and epoch_length > 1)
        ]
        records, twins = [timer.records[i] for i in keep], [bare[i] for i in keep]
        cpu_records, cpu_twins = [timer.cpu_records[i] for i in keep], [bare_cpu[i] for i in keep]
        cpu_phases = {p: _median([r[p] for r in cpu_records]) for p in (*PHASES, "total")}
        cpu_pairs = [r["total"] / b for r, b in zip(cpu_records, cpu_twins)]
        firsts = [timer.records[i]["data"] for i in range(warmup, len(timer.records)) if timer.epoch_first[i]]
        phases = {p: _median([r[p] for r in records]) for p in (*PHASES, "total")}
        full, bare_median = phases["total"], _median(twins)
        fwd_bwd = phases["forward"] + phases["loss"] + phases["backward"]
        pair_ratios = [r["total"] / b for r, b in zip(records, twins)]
        summed = sum(r["total"] for r in records)
        math_phases = ("forward", "loss", "backward", "optimizer")
        within = [r["total"] / sum(r[p] for p in math_phases) for r in records]
        crops = size["batch_size"] * size["num_samples"]
        return {
            "roi_size": size["roi_size"],
            "feature_size": size["feature_size"],
            "crops_per_step": crops,
            "views_per_step": 2 * crops,
            "configuration": {k: overrides.get(k) for k in ("fused_attention", "amp", "amp_dtype", "use_checkpoint", "compile")}
            | {"views": "per_box" if config.get("per_box_views") else "batched"},
            "use_checkpoint_applied": _checkpointing_applied(trainer.network),
            "ms_per_step": round(step_s * 1000, 2),
            "first_iteration_s": round(timer.records[0]["total"], 3),  # with --compile: the compile is in it
            "crops_per_s": round(crops / step_s, 3),
            "volumes_per_s": round(size["batch_size"] / step_s, 3),
            "flops_per_step": flops,
            "tflops_per_s": round(tflops_per_s, 4),
            "device": device_name,
            "bf16_peak_tflops": peak,
            "share_of_bf16_peak": round(tflops_per_s / peak, 5) if peak else None,
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated(trainer.device) / 2**30, 2)
            if trainer.device.type == "cuda"
            else None,
            "amp": amp,
            "num_workers": workers,
            "iterations_measured": len(records),
            "phase_median_s": {k: round(v, 5) for k, v in phases.items()},
            "phase_share_of_iteration": {k: round(sum(r[k] for r in records) / summed, 5) for k in PHASES},
            "epoch_first_data_wait_s": round(_median(firsts), 4),
            "bundle_iteration_median_s": round(full, 5),
            "bare_iteration_median_s": round(bare_median, 5),
            "pair_ratios": [round(r, 4) for r in pair_ratios],
            "overhead_ratio": round(_median(pair_ratios), 4),
            "overhead_ratio_of_medians": round(full / bare_median, 4),
            "overhead_ratio_within": round(_median(within), 4),
            "views_share_of_forward_backward": round(phases["views"] / fwd_bwd, 5),
            "process_max_rss_gb": round(peak_rss_bytes() / 2**30, 2),
            "per_iteration_s": [{k: round(v, 4) for k, v in r.items()} for r in records],
            "cpu_phase_median_s": {k: round(v, 5) for k, v in cpu_phases.items()},
            "cpu_bare_iteration_median_s": round(_median(cpu_twins), 5),
            "cpu_pair_ratios": [round(r, 4) for r in cpu_pairs],
            "overhead_ratio_cpu": round(_median(cpu_pairs), 4),
        }


# ---------------------------------------------------------------------------------------------------------------
# allocator: the bare loop in a plain process vs one with tune_allocator
# ---------------------------------------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """Peak resident memory of this process image: ``VmHWM`` (Linux), which starts afresh at exec; ``ru_maxrss``
    would also count the parent's peak, which a child inherits across fork + exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def allocator_child(size: dict, iters: int, tune: bool) -> dict:
    """Runs in a fresh subprocess: the bare loop on random crops; median time, user and system CPU per iteration."""
    import components
    from components import SSLHead, SSLLoss, ssl_views

    applied = components.tune_allocator(tune) if tune else False
    torch.manual_seed(0)
    network = SSLHead(in_channels=1, feature_size=size["feature_size"], use_checkpoint=size["use_checkpoint"])
    optimizer = torch.optim.AdamW(network.parameters(), lr=4e-4, weight_decay=0.1)
    crops = torch.rand(size["batch_size"] * size["num_samples"], 1, *size["roi_size"])
    views = tuple(ssl_views(crops, generator=torch.Generator().manual_seed(0)))
    loss = SSLLoss()
    bare_step(network, optimizer, loss, views, contextlib.nullcontext)  # warm-up
    times, users, systems = [], [], []
    for _ in range(iters):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        bare_step(network, optimizer, loss, views, contextlib.nullcontext)
        after = resource.getrusage(resource.RUSAGE_SELF)
        times.append(time.perf_counter() - start)
        users.append(after.ru_utime - before.ru_utime)
        systems.append(after.ru_stime - before.ru_stime)
    return {
        "tuned": applied,
        "times_s": [round(t, 4) for t in times],
        "user_s": [round(t, 4) for t in users],
        "system_s": [round(t, 4) for t in systems],
        "minor_page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
        "max_rss_bytes": peak_rss_bytes(),
    }


def measure_allocator(size_name: str, iters: int, rounds: int) -> dict:
    """Alternates plain / tuned subprocesses ``rounds`` times; medians over all their iterations."""
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--_allocator-child", mode, "--sizes", size_name]
            cmd += ["--allocator-iters", str(iters), "--threads", str(torch.get_num_threads())]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
            runs[mode].append(json.loads(out.stdout))
    result: dict = {"size": size_name, "iterations_per_process": iters, "processes_per_mode": rounds}
    for mode, items in runs.items():
        times = [t for r in items for t in r["times_s"]]
        result[mode] = {
            "iteration_median_s": round(_median(times), 4),
            "user_s_per_iteration": round(_median([t for r in items for t in r["user_s"]]), 4),
            "system_s_per_iteration": round(_median([t for r in items for t in r["system_s"]]), 4),
            "minor_page_faults_per_process": int(_median([r["minor_page_faults"] for r in items])),
            "max_rss_gb": round(max(r["max_rss_bytes"] for r in items) / 2**30, 2),
            "times_s_per_process": [r["times_s"] for r in items],
            "applied": items[0]["tuned"],
        }
    result["tuned_over_plain"] = round(result["tuned"]["iteration_median_s"] / result["plain"]["iteration_median_s"], 4)
    result["tuned_over_plain_max_rss"] = round(result["tuned"]["max_rss_gb"] / result["plain"]["max_rss_gb"], 3)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=None, help=f"comma-separated, of {sorted(SIZES)} (default: 'gpu' on CUDA, "
                        "'tiny,paper' on CPU)")
    parser.add_argument("--iters", type=int, default=None, help=f"measured iterations (default {DEFAULT_ITERS})")
    parser.add_argument(
        "--warmup", type=int, default=3, help="iterations left out first (the tuned heap grows in the first ones)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--num-workers", type=int, default=None, help="loader workers (default: the bundle's)")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                        help="autocast as the bundle's default (bf16 where supported; default: on CUDA only)")
    parser.add_argument("--explicit-attention", action="store_true", help="MONAI's explicit window attention "
                        "(the bundle's fused_attention false) instead of scaled_dot_product_attention")
    parser.add_argument("--compile", action="store_true", help="the bundle's compile true (torch.compile, inductor)")
    parser.add_argument("--reference-style", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure the research code's configuration (default: on CUDA only)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's bf16 dense peak, TFLOP/s (default: from the datasheet table by device name)")
    parser.add_argument("--allocator-size", default=None, help="size of the allocator comparison ('none' skips it)")
    parser.add_argument("--allocator-iters", type=int, default=5, help="iterations per allocator process")
    parser.add_argument("--allocator-rounds", type=int, default=2, help="processes per mode, alternating")
    parser.add_argument("--small", action="store_true", help="CI: the 'ci' size, 2 iterations, no loader workers")
    parser.add_argument("--_allocator-child", dest="allocator_child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.allocator_child:
        result = allocator_child(SIZES[args.sizes], args.allocator_iters, args.allocator_child == "tuned")
        print(json.dumps(result))
        return result
    cuda = torch.cuda.is_available()
    if args.small:
        args.sizes, args.iters, args.warmup, args.allocator_size = "ci", 2, 1, "ci"
        args.allocator_iters, args.allocator_rounds = 1, 1
        args.num_workers = 0 if args.num_workers is None else args.num_workers
        args.reference_style = True if args.reference_style is None else args.reference_style
    args.sizes = args.sizes or ("gpu" if cuda else "tiny,paper")
    args.amp = cuda if args.amp is None else args.amp
    args.reference_style = cuda if args.reference_style is None else args.reference_style
    args.allocator_size = args.allocator_size or ("none" if cuda else "tiny")
    names = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; choose from {sorted(SIZES)}")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)  # StatsHandler really formats and writes its lines
    out = json_stdout()

    result: dict = {"benchmark": "ssl_step", "machine": machine_info(), "sizes": {}}
    result["fused_attention"] = not args.explicit_attention
    bundle_config = {**CONFIGS["bundle"], "fused_attention": not args.explicit_attention, "compile": args.compile}
    start = time.perf_counter()
    for name in names:
        size, iters = SIZES[name], args.iters or DEFAULT_ITERS[name]
        common = dict(num_workers=args.num_workers, peak_tflops=args.peak_tflops)
        measured = measure_size(name, size, iters, args.warmup, amp=args.amp, config=bundle_config, **common)
        result["sizes"][name] = measured
        if args.reference_style:
            reference = measure_size(name, size, iters, args.warmup, amp=True, config=CONFIGS["reference_style"], **common)
            result.setdefault("reference_style", {})[name] = reference
            measured["reference_over_bundle"] = round(reference["ms_per_step"] / measured["ms_per_step"], 3)
    if args.allocator_size != "none":
        result["allocator"] = measure_allocator(args.allocator_size, args.allocator_iters, args.allocator_rounds)
    result["targets"] = {
        "overhead_ratio_max": 1.05,
        "overhead_ratio_met": {n: r["overhead_ratio"] <= 1.05 for n, r in result["sizes"].items()},
        "overhead_ratio_cpu_met": {n: r["overhead_ratio_cpu"] <= 1.05 for n, r in result["sizes"].items()},
        "overhead_ratio_within_met": {n: r["overhead_ratio_within"] <= 1.05 for n, r in result["sizes"].items()},
        "allocator_ratio_max": 0.5,
        "allocator_ratio_met": result["allocator"]["tuned_over_plain"] <= 0.5 if "allocator" in result else None,
    }
    if "gpu" in result["sizes"] and cuda:  # the H100 targets at the recipe's size
        gpu = result["sizes"]["gpu"]
        shares = gpu["phase_share_of_iteration"]
        result["targets"]["gpu"] = {
            "device": gpu["device"],
            "ms_per_step_max_100_met": gpu["ms_per_step"] <= 100,
            "peak_gpu_memory_max_12_gib_met": gpu["peak_gpu_memory_gib"] <= 12,
            "data_share_max_0.01_met": shares["data"] <= 0.01,
            "views_share_max_0.02_met": shares["views"] <= 0.02,
            "bundle_over_bare_max_1.05_met": gpu["overhead_ratio"] <= 1.05,
        }
    return write_result(result, out, start)


if __name__ == "__main__":
    main()
