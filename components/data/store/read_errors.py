"""The reads of stored volumes that a :class:`~components.data.store.StoreDataset` skipped
(``loader#on_read_error`` "skip"), counted in shared memory: the loader's worker processes read and skip, the
training process reads the counts.

A worker process holds a copy of the dataset (forked, or pickled when it is spawned); a count kept in the dataset's
own attributes would be that worker's alone, and lost with it when the loader starts new workers at the next epoch.
These counts live in memory shared with every worker, so the training process sees every skip of its loader, over
the whole run.
"""

from __future__ import annotations

import multiprocessing

import numpy as np

__all__ = ["ReadErrors"]


class ReadErrors:
    """The skipped reads of a dataset of ``volumes`` volumes, and which of its volumes failed, in shared memory.

    Picklable while a worker process is started, whatever its start method (``multiprocessing`` hands the shared
    memory over), and shared with forked workers as they are.

    Example:
        >>> errors = ReadErrors(4)
        >>> errors.record(2), errors.record(2), errors.reads, errors.volumes()
        (True, False, 2, [2])
    """

    def __init__(self, volumes: int) -> None:
        # with a lock (workers count at once) of a spawn context: such a lock travels to spawned and fork-server
        # workers as well as it is shared by forked ones; a fork context's lock refuses to go to a spawned worker
        self._reads = multiprocessing.get_context("spawn").Value("q", 0)
        self._failed = multiprocessing.Array("b", max(int(volumes), 1), lock=False)

    def record(self, volume: int) -> bool:
        """Counts one skipped read of volume ``volume``; True when it is the first of that volume."""
        with self._reads.get_lock():
            self._reads.value += 1
            first = not self._failed[volume]
            self._failed[volume] = 1
        return first

    @property
    def reads(self) -> int:
        """The reads skipped so far, by this process and its workers."""
        return int(self._reads.value)

    def volumes(self) -> list[int]:
        """The volumes (their positions in the dataset) that failed to read at least once, in order."""
        return np.flatnonzero(np.frombuffer(self._failed, dtype=np.int8)).tolist()
