"""The worker processes of ``preprocess``: they die with the process that started them, and one that dies (killed by
the kernel's out-of-memory killer, say) fails the task it was running, not the run.

``concurrent.futures.ProcessPoolExecutor`` did neither: a parent killed by SIGTERM or SIGKILL left its workers (and
the fork server and resource tracker they keep alive) writing, then waiting on their task queue for ever, and one
worker's death broke the whole pool, so that no task could be blamed and every pending one failed.

Here each worker has its own pipe to the parent (tasks in, results out), so the parent knows which task each one
runs, and holds the read end of a lifeline pipe whose only write end is the parent's: a thread of the worker waits on
it and ends the worker (``os._exit``) at end-of-file, which the kernel delivers however the parent ended. The parent
waits on the result pipes and on the workers' sentinels together: a worker that ends without a result fails its
task with its exit status, and a new worker takes its place. Workers ignore SIGINT: a Ctrl-C reaches the whole
process group, and the parent, which ends them, decides.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from typing import Any

__all__ = ["death_reason", "run_in_workers"]

_STOP_GRACE_S = 5.0  # a busy worker asked to stop gets this long before SIGKILL
_DIED = object()  # what a worker's pipe gives when the worker ended before its answer was whole


def _exit_with_parent(lifeline: Connection) -> None:
    lifeline.poll(None)  # readable only at end-of-file: the parent is gone
    os._exit(1)


def _worker(tasks: Connection, lifeline: Connection, function: Callable, initializer: Callable, initargs: tuple) -> None:
    """A worker's life: watch the parent, initialise, then answer tasks until told to stop (None or end-of-file)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True).start()
    initializer(*initargs)
    while True:
        try:
            task = tasks.recv()
        except EOFError:
            return
        if task is None:
            return
        tasks.send(function(task))


def death_reason(exitcode: int | None) -> str:
    """Why a worker ended without a result, in words: ``was killed by SIGKILL (...)``, ``exited with status 9``."""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        hint = " (the kernel's out-of-memory killer sends it: fewer --workers leave more memory to each)"
        return f"was killed by {name}" + (hint if -exitcode == signal.SIGKILL else "")
    return f"exited with status {exitcode}"


class _Worker:
    """One worker process, its end of the task pipe and the task it runs (None: idle)."""

    def __init__(self, context: BaseContext, lifeline: Connection, function: Callable, initializer: Callable,
                 initargs: tuple) -> None:  # fmt: skip
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=_worker, args=(theirs, lifeline, function, initializer, initargs),
                                       daemon=True)  # fmt: skip
        self.process.start()
        theirs.close()
        self.task: Any = None

    def give(self, task: Any) -> None:
        """Sends ``task``; an ``OSError`` when the worker has ended since its last answer."""
        self.connection.send(task)
        self.task = task

    def stop(self) -> None:
        """Ends the worker: an idle one is told to (and leaves on its own), a busy one is terminated."""
        if self.task is None:
            try:
                self.connection.send(None)
            except OSError:  # already gone
                pass
        elif self.process.is_alive():
            self.process.terminate()
        self.process.join(_STOP_GRACE_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.connection.close()


def run_in_workers(function: Callable[[Any], Any], tasks: Sequence[Any], workers: int, context: BaseContext,
                   initializer: Callable[..., None], initargs: tuple = ()) -> Iterator[tuple[Any, Any, str | None]]:  # fmt: skip
    """Runs ``function(task)`` for every task in ``workers`` processes of ``context`` (a fork server or spawn:
    a forked worker would hold the lifeline's write end too), each started with ``initializer(*initargs)``.

    Yields ``(task, result, None)`` as each task finishes, or ``(task, None, reason)`` when its worker died
    (:func:`death_reason`); a new worker then takes the dead one's place. Leaving the loop early, or any error,
    ends every worker (see the module docstring); so does the end of this process, however it ends.
    """
    pending = list(tasks)[::-1]
    lifeline, keeper = context.Pipe(duplex=False)  # the workers hold the read end, only this process the write end
    pool: list[_Worker] = []

    def next_task(index: int) -> None:
        """Gives the next task to worker ``index``, or to a new worker in its place if it ended after its answer."""
        pool[index].task = None
        while pending:
            try:
                pool[index].give(pending[-1])
            except OSError:
                pool[index].stop()
                pool[index] = _Worker(context, lifeline, function, initializer, initargs)
                continue
            pending.pop()
            return

    try:
        for index in range(min(int(workers), len(pending))):
            pool.append(_Worker(context, lifeline, function, initializer, initargs))
            next_task(index)
        while any(worker.task is not None for worker in pool):
            busy = [worker for worker in pool if worker.task is not None]
            wait([w.connection for w in busy] + [w.process.sentinel for w in busy])
            for index, worker in enumerate(pool):
                if worker.task is None:
                    continue
                if worker.connection.poll():  # a result is read before the worker's end is looked at
                    try:
                        result = worker.connection.recv()
                    except EOFError:
                        result = _DIED
                    if result is not _DIED:
                        task = worker.task
                        next_task(index)
                        yield task, result, None
                        continue
                if worker.process.is_alive():
                    continue
                task, worker.task = worker.task, None
                worker.stop()
                reason = death_reason(worker.process.exitcode)
                if pending:
                    pool[index] = _Worker(context, lifeline, function, initializer, initargs)
                    next_task(index)
                yield task, None, reason
    finally:
        for worker in pool:
            worker.stop()
        keeper.close()
        lifeline.close()

