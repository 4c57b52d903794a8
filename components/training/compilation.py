"""What ``torch.compile`` costs and whether it keeps paying: a trainer handler for the bundles' ``compile`` id.

The bundles compile their training network through MONAI's ``SupervisedTrainer(compile=True, compile_kwargs=...)``,
which wraps the network it is given: under ``multi_gpu_train.json`` that is the DDP module, the order PyTorch
recommends (``torch.compile(DDP(model))``: dynamo's DDP optimizer splits the graph at the gradient buckets, so the
all-reduces still overlap the backward). Validation runs the uncompiled network (the evaluator's ``network``), so it
neither waits for a compile nor adds graphs.

Compiling is paid once per graph: at the first training iteration, and again for each new input shape (a last,
smaller batch) or mode. A graph compiled later, every epoch or after a validation, means a guard keeps failing and
the run pays the compile again and again; :class:`CompileMonitor` logs the first iterations' times (the compile
cost) and warns when graphs are still being compiled after the warm-up epochs.
"""

from __future__ import annotations

import logging
import time

import torch
from ignite.engine import Engine, Events

from ..config.values import as_bool

__all__ = ["CompileMonitor", "compiled_graphs"]

logger = logging.getLogger(__name__)


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process so far (its ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters  # torch offers no public count of compiled graphs

    return int(counters["stats"]["unique_graphs"])


class CompileMonitor:
    """Logs what compiling cost and warns at each epoch that compiled new graphs after ``warmup_epochs``.

    At INFO: the first iteration's time against the second's (their difference is about the compile time) and, at
    the end of the run, the graphs compiled. At WARNING: an epoch after the warm-up that compiled graphs, with their
    number and how to see why (``TORCH_LOGS=recompiles``). Epochs count from the start of this run, so a resumed run
    has its own warm-up.

    Args:
        warmup_epochs: epochs of this run in which compiling is expected (the first; a last, smaller batch of an
            epoch compiles one more graph there too).
        enabled: whether the run compiles (the bundles pass ``speed#compile``, command-line words accepted); when
            not, :meth:`attach` attaches nothing.

    Example::

        trainer = SupervisedTrainer(..., compile=True)
        CompileMonitor().attach(trainer)
    """

    def __init__(self, warmup_epochs: int = 1, enabled: bool | str = True) -> None:
        self.enabled = as_bool(enabled, "compile")
        if int(warmup_epochs) < 1:
            raise ValueError(f"warmup_epochs must be >= 1, got {warmup_epochs}.")
        self.warmup_epochs = int(warmup_epochs)
        self.iteration_s: list[float] = []
        self.late_graphs = 0
        self._graphs_at_start = self._graphs_seen = 0
        self._epochs = 0
        self._started = 0.0
        self._sync = lambda: None

    def attach(self, engine: Engine) -> None:
        if not self.enabled:
            return
        engine.add_event_handler(Events.STARTED, self._start)
        engine.add_event_handler(Events.ITERATION_STARTED(event_filter=self._timed), self._iteration_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED(event_filter=self._timed), self._iteration_completed)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)
        engine.add_event_handler(Events.COMPLETED, self._completed)

    def _timed(self, engine: Engine, event: int) -> bool:
        return len(self.iteration_s) < 2

    def _start(self, engine: Engine) -> None:
        device = getattr(engine.state, "device", None)  # MONAI's engines keep it there
        on_cuda = device is not None and torch.device(device).type == "cuda"
        self._sync = torch.cuda.synchronize if on_cuda else (lambda: None)
        self._graphs_at_start = self._graphs_seen = compiled_graphs()

    def _iteration_started(self, engine: Engine) -> None:
        self._sync()
        self._started = time.perf_counter()

    def _iteration_completed(self, engine: Engine) -> None:
        self._sync()  # two synchronisations in a run: the compile cost needs the device's time
        self.iteration_s.append(time.perf_counter() - self._started)
        if len(self.iteration_s) == 2:
            first, second = self.iteration_s
            logger.info("torch.compile: the first iteration took %.1f s, the second %.3f s (compiling about %.1f s)",
                        first, second, max(first - second, 0.0))  # fmt: skip

    def _epoch_completed(self, engine: Engine) -> None:
        self._epochs += 1
        graphs = compiled_graphs()
        new, self._graphs_seen = graphs - self._graphs_seen, graphs
        if self._epochs > self.warmup_epochs and new > 0:
            self.late_graphs += new
            logger.warning(
                "torch.compile: epoch %d (iteration %d) compiled %d new graph(s) after the warm-up: a guard keeps "
                "failing and each recompile costs about the first iteration's time; run with TORCH_LOGS=recompiles "
                "to see which.", engine.state.epoch, engine.state.iteration, new,
            )  # fmt: skip

    def _completed(self, engine: Engine) -> None:
        logger.info("torch.compile: %d graph(s) compiled in this run, %d after the warm-up",
                    compiled_graphs() - self._graphs_at_start, self.late_graphs)  # fmt: skip
