"""Test-only probes a layered bundle config attaches to a trainer (``$import tests.probes as probes``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ignite.engine import Engine, Events


def _crop_digest(batch) -> str:
    """A digest of the values of a batch's ``image`` (a MONAI trainer's decollated list of samples, or one dict):
    equal digests, bitwise equal crops."""
    import torch

    digest = hashlib.sha256()
    for sample in batch if isinstance(batch, (list, tuple)) else [batch]:
        digest.update(torch.as_tensor(sample["image"]).detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def record_lr(trainer: Engine, path: str) -> None:
    """Appends ``{"iteration": i, "lr": lr, "volumes": [...], "crop": digest}`` for every iteration: the exact LR
    (no log rounding), the files of the batch and a digest of its ``image`` (the random crops the loader drew)."""
    from components import batch_filenames

    def write(engine: Engine) -> None:
        record = {"iteration": engine.state.iteration, "lr": engine.optimizer.param_groups[0]["lr"],
                  "volumes": batch_filenames(engine.state.batch), "crop": _crop_digest(engine.state.batch)}  # fmt: skip
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    trainer.add_event_handler(Events.ITERATION_COMPLETED, write)


def scramble_random_state(loader, seed: int = 987_654) -> None:
    """Reseeds the loader's random transforms and torch's generators with an unrelated ``seed`` after the bundle
    built them, as another build would leave them: crops that depend on the run's seed alone do not change."""
    import torch
    from monai.data.utils import set_rnd

    set_rnd(loader.dataset.transform, seed)
    torch.manual_seed(seed)
    if loader.generator is not None:
        loader.generator.manual_seed(seed)


def stop_after_iteration(trainer: Engine, iteration: int) -> None:
    """Ends the run after ``iteration`` (mid-epoch), like a killed job, once that iteration's handlers have run."""
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=iteration), lambda engine: engine.terminate())


def stop_after_epoch(trainer: Engine, epoch: int) -> None:
    """Ends the run after ``epoch`` and its validation and checkpoint, like a job stopped between epochs."""
    trainer.add_event_handler(Events.EPOCH_COMPLETED(once=epoch), lambda engine: engine.terminate())


def read_lr(path: str | Path) -> dict[int, float]:
    return {r["iteration"]: r["lr"] for r in map(json.loads, Path(path).read_text().splitlines())}


def read_volumes(path: str | Path) -> list[tuple[int, list[str]]]:
    """(iteration, files of the batch) of every iteration recorded by :func:`record_lr`, in the order run."""
    return [(r["iteration"], r["volumes"]) for r in map(json.loads, Path(path).read_text().splitlines())]


def read_crops(path: str | Path) -> dict[int, str]:
    """iteration -> digest of the batch's image, as recorded by :func:`record_lr`."""
    return {r["iteration"]: r["crop"] for r in map(json.loads, Path(path).read_text().splitlines())}


# ------------------------------------------------------------------ fault injection (tests/test_faults.py)


class _NaNFrom:
    def __init__(self, loss_function, call: int) -> None:
        self.loss_function, self.call, self.calls = loss_function, int(call), 0

    def __call__(self, *args, **kwargs):
        total, parts = self.loss_function(*args, **kwargs)
        self.calls += 1
        if self.calls >= self.call:  # keeps the graph: backward runs, with NaN gradients
            parts = {**parts, "recon": parts["recon"] * float("nan")}
            total = total * float("nan")
        return total, parts


def nan_loss_from(loss_function, call: int) -> _NaNFrom:
    """Wraps an SSL loss ``(total, parts)``: from its ``call``-th call on, the total and the recon part are NaN."""
    return _NaNFrom(loss_function, call)


def _mark_time(marker: str | None) -> None:
    """Writes the wall-clock time of a failure, so a test can measure how long the other ranks outlive it."""
    if marker:
        import time

        Path(marker).write_text(repr(time.time()))


def raise_on_rank(rank: int, message: str, marker: str | None = None):
    """A deterministic (cached) transform that passes data through, except on ``rank``, where it raises."""
    from monai.transforms import Transform

    import components

    class RaiseOnRank(Transform):
        def __call__(self, data):
            if components.get_rank() == int(rank):
                _mark_time(marker)
                raise RuntimeError(f"{message} (rank {components.get_rank()})")
            return data

    return RaiseOnRank()


def raise_at_iteration(trainer: Engine, iteration: int, rank: int, message: str, marker: str | None = None) -> None:
    """Raises ``RuntimeError(message)`` on ``rank`` only, after ``iteration``."""
    import components

    def fail(engine: Engine) -> None:
        if components.get_rank() == int(rank):
            _mark_time(marker)
            raise RuntimeError(f"{message} (rank {components.get_rank()}, iteration {engine.state.iteration})")

    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=iteration), fail)


def _wait_for_checkpoint(path: str, iteration: int, timeout_s: float = 60.0) -> None:
    """Until the resumable checkpoint at ``path`` (written by rank 0, atomically) holds ``iteration``."""
    import time

    import torch

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path) and torch.load(path, weights_only=True)["trainer"]["iteration"] >= iteration:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not reach iteration {iteration} within {timeout_s} s")


def kill_once_at_iteration(
    trainer: Engine, iteration: int, rank: int, marker: str, checkpoint: str | None = None
) -> None:
    """SIGKILLs this process on ``rank`` after ``iteration``, once: only while ``marker`` does not exist yet. With
    ``checkpoint``, only once rank 0 has saved that iteration there (so the restart is mid-epoch for sure)."""
    import signal

    import components

    def kill(engine: Engine) -> None:
        if components.get_rank() == int(rank) and not os.path.exists(marker):
            if checkpoint:
                _wait_for_checkpoint(checkpoint, engine.state.iteration)
            Path(marker).write_text(str(engine.state.iteration))
            print(f"probe: SIGKILL rank {components.get_rank()} at iteration {engine.state.iteration}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=iteration), kill)
