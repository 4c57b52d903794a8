"""What this package needs of ``torch.distributed`` beyond ``ignite.distributed``: the one module that calls it.

Rank, world size, broadcast and the all-reduce of plain values come from ``ignite.distributed`` (``idist``) at the
call sites; ``get_rank`` and ``get_world_size`` are ignite's, re-exported because the bundle configs call
``components.get_rank()``. What is here, each function says why: the process group's start from torchrun's environment
(with a per-attempt store after a restart) and its end, a barrier that names the GPU, the device of a rank before any
group exists, the autograd-aware gather of the pretraining losses, and the mean of per-rank values for the logs.

Every function degrades to single-process behaviour when no process group is initialised (gathers and reductions
return their input, barriers return at once), so the same code path runs under ``python -m ...`` and ``torchrun``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.distributed import get_rank, get_world_size

__all__ = [
    "all_gather_with_grad",
    "all_reduce_mean",
    "barrier",
    "cleanup_distributed",
    "device_for_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "wrap_ddp",
]

#: The environment variables that ``init_method="env://"`` needs; torchrun sets all of them (plus LOCAL_RANK).
TORCHRUN_ENV_VARS: tuple[str, ...] = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Fixed length of the metadata record exchanged by all_gather_with_grad: [ndim, dtype code, size_0, ..., size_k].
_MAX_GATHER_DIMS = 16


def _initialised() -> bool:
    """Whether a default process group exists (a group of one process too, unlike ``idist.get_world_size() > 1``)."""
    return dist.is_available() and dist.is_initialized()


def get_local_rank() -> int:
    """Rank of this process on its node, read from the ``LOCAL_RANK`` variable that torchrun sets (default 0): it
    picks a rank's GPU before any process group exists, when ``idist.get_local_rank()`` still says 0.

    Raises:
        ValueError: when ``LOCAL_RANK`` is set but is not a non-negative integer.
    """
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        local_rank = int(value)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be a non-negative integer, got {value!r}.") from None
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK must be a non-negative integer, got {value!r}.")
    return local_rank


def get_local_world_size() -> int:
    """Ranks on this node, read from the ``LOCAL_WORLD_SIZE`` variable that torchrun sets (default 1): they share the
    node's CPUs (data-loader workers) and, on a CPU, its memory. Read before any process group exists, when
    ``idist.get_nproc_per_node()`` still says 1.

    Raises:
        ValueError: when ``LOCAL_WORLD_SIZE`` is set but is not a positive integer.
    """
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        ranks = int(value)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be a positive integer, got {value!r}.")
    return ranks


def default_backend() -> str:
    """``"nccl"`` when CUDA and NCCL are available, otherwise ``"gloo"`` (CPU; works everywhere): the choice the
    configs' ``dist_backend`` and :func:`init_distributed` make, which ignite leaves to the caller."""
    if torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def device_for_rank(device: str | torch.device | None = None) -> torch.device:
    """The device this process should compute on, known before the process group exists (the configs' ``device``
    builds the network first), unlike ``idist.device()``.

    Args:
        device: ``None`` or ``"cuda"`` (no index) mean "this rank's GPU", i.e. ``cuda:{LOCAL_RANK}``, when CUDA is
            available; ``None`` falls back to the CPU without CUDA. Anything explicit, e.g. ``"cpu"`` from
            ``--device cpu`` or ``"cuda:1"``, is respected as given.

    Raises:
        RuntimeError: when ``"cuda"`` is asked for explicitly but CUDA is not available.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", get_local_rank())
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {str(device)!r} was requested but CUDA is not available; use 'cpu'.")
        if dev.index is None:
            return torch.device("cuda", get_local_rank())
    return dev


def wrap_ddp(module: torch.nn.Module, device: str | torch.device, **kwargs) -> torch.nn.Module:
    """``module`` moved to ``device`` and wrapped in DistributedDataParallel (``device_ids`` only on CUDA, as
    DDP requires); returned unwrapped on one process, so one config serves both cases. ``idist.auto_model`` would
    pick the device itself and wrap one process with several GPUs in ``DataParallel``."""
    device = torch.device(device)
    module = module.to(device)
    if not _initialised():
        return module
    device_ids = [device] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids, **kwargs)


def init_distributed(backend: str | None = None, timeout_s: float = 4 * 3600) -> None:
    """Initialise the default process group from the torchrun environment (``env://``), as ``idist.initialize`` does
    not: torchrun's variables checked first, a timeout long enough for caching, and a store of its own for a restarted
    attempt (:func:`_restart_attempt_store`).

    Idempotent: does nothing when a process group is already initialised. For NCCL the CUDA device of this
    process is set to ``cuda:{LOCAL_RANK}`` first, so that collectives and ``barrier`` use the right GPU.
    Then every rank syncs ignite's distributed model: its first rank query runs a collective, and handlers that
    exist on rank 0 only (MONAI's ``CheckpointSaver`` asks in its constructor) would otherwise leave rank 0 in that
    collective while the other ranks wait in DDP's first forward, until the timeout.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ...; ``None`` picks :func:`default_backend`.
        timeout_s: process-group timeout in seconds. The default (4 h) is long on purpose: ranks may reach the
            first collective far apart in time, e.g. after filling a per-rank dataset cache, and PyTorch's
            default timeout would kill (or hang) the run there.

    Raises:
        RuntimeError: when ``torch.distributed`` is unavailable or torchrun's variables are missing.
        ValueError: when ``timeout_s`` is not positive.
    """
    if _initialised():
        return
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build.")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}.")
    missing = [name for name in TORCHRUN_ENV_VARS if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            f"Cannot initialise distributed training: environment variable(s) {', '.join(missing)} not set "
            f"(needed: {', '.join(TORCHRUN_ENV_VARS)}). Launch with torchrun, e.g. "
            "`torchrun --nproc_per_node=2 ...`, or set them yourself."
        )
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(get_local_rank())
    timeout = timedelta(seconds=timeout_s)
    store = _restart_attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    else:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    idist.sync()


def _restart_attempt_store(timeout: timedelta) -> dist.Store | None:
    """torchrun's shared store under a prefix of this restart attempt, when the workers use the agent's store.

    With ``--max-restarts``, torchrun hands the restarted workers the same TCPStore as the attempt before
    (``TORCHELASTIC_USE_AGENT_STORE``), and ``env://`` uses it without a per-attempt prefix (pytorch/pytorch#135712):
    the restarted ranks then read the previous attempt's keys (e.g. the gloo / NCCL addresses of dead processes)
    and fail to connect. Prefixing with ``TORCHELASTIC_RESTART_COUNT`` gives every attempt its own keys.
    None for a first attempt, and when the workers do not use the agent's store (``env://`` then makes a fresh
    store per attempt).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or attempt == "0":
        return None  # a first attempt shares no keys with an earlier one: torch's own env:// path
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    client = dist.TCPStore(host, port, int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/components/attempt_{attempt}", client)


def agent_store(name: str, timeout_s: float = 10.0) -> dist.Store | None:
    """torchrun's agent store, under ``/components/<name>/attempt_<restart count>``: keys the ranks of this attempt
    share without a process group (one may not exist yet, or may be broken by a rank that exited), e.g. the errors
    :mod:`components.errors` has printed. Its operations wait at most ``timeout_s``.

    None outside torchrun, when the workers do not use the agent's store (``TORCHELASTIC_USE_AGENT_STORE``), or when
    the store does not answer.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timedelta(seconds=timeout_s), wait_for_workers=False)  # fmt: skip
    except (KeyError, ValueError, RuntimeError):  # no address, or no answer (DistStoreError is a RuntimeError)
        return None
    return dist.PrefixStore(f"/components/{name}/attempt_{attempt}", client)


def cleanup_distributed() -> None:
    """Destroy the default process group if one is initialised (no-op otherwise), after a barrier, and return ignite's
    model to one process (``idist.finalize``) so that a later group is seen. The barrier: a rank that tears down its
    connections while another still finishes (e.g. rank 0 writing the last checkpoint) was once seen to abort at exit
    ("terminate called without an active exception") in a restarted torchrun run."""
    if not _initialised():
        return
    barrier()
    if idist.model_name() == "serial":  # a group ignite was never told of: destroyed here, ignite's model is right
        dist.destroy_process_group()
    else:
        idist.finalize()


def barrier() -> None:
    """Wait until every rank gets here; returns at once when not distributed. Under NCCL the GPU is named, which
    ``idist.barrier()`` does not: NCCL otherwise guesses it (and warns) when no collective has run yet."""
    if not _initialised():
        return
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


_DTYPE_CODES = {
    dt: i
    for i, dt in enumerate(
        (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.complex128,
        )
    )
}


def _gather_shapes(x: torch.Tensor, world_size: int) -> list[tuple[int, ...]]:
    """All ranks' shapes of ``x``, checked: same ndim, dtype and trailing dims everywhere.

    Every rank receives the same records and so raises the same error, instead of one rank failing and the
    others hanging in the data all-gather.
    """
    if x.dim() == 0:
        raise ValueError("all_gather_with_grad needs a tensor with at least one dimension, got a scalar.")
    if x.dim() > _MAX_GATHER_DIMS - 2:
        raise ValueError(f"all_gather_with_grad supports at most {_MAX_GATHER_DIMS - 2} dims, got {x.dim()}.")
    record = torch.full((_MAX_GATHER_DIMS,), -1, dtype=torch.int64, device=x.device)
    record[0] = x.dim()
    record[1] = _DTYPE_CODES.get(x.dtype, -2)
    record[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    records = [torch.empty_like(record) for _ in range(world_size)]
    dist.all_gather(records, record)
    rows = [r.tolist() for r in records]
    ref = rows[dist.get_rank()]
    for rank, row in enumerate(rows):
        if row[0] != ref[0] or row[1] != ref[1] or row[3 : 2 + row[0]] != ref[3 : 2 + ref[0]]:
            raise ValueError(
                "all_gather_with_grad: tensors must have the same dtype and the same sizes except dim 0 on all "
                f"ranks; rank {dist.get_rank()} has shape {tuple(x.shape)} ({x.dtype}), rank {rank} has shape "
                f"{tuple(row[2:2 + row[0]])} (dtype code {row[1]})."
            )
    return [tuple(row[2 : 2 + row[0]]) for row in rows]


class _AllGatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0 with a gradient; sizes along dim 0 may differ across ranks.

    forward: gather every rank's dim-0 size, pad the local tensor to the largest size, ``all_gather``, cut the
    padding off and concatenate in rank order.
    backward: the gathered output is used by the loss of *every* rank, so the gradient of the sum of the ranks'
    losses w.r.t. this rank's input is the sum over ranks of their incoming gradients restricted to this rank's
    rows: ``all_reduce(SUM)`` of the incoming gradient, then this rank's slice. DDP then divides the parameter
    gradients by W, which makes the result the gradient of the *mean* of the ranks' losses.

    ``torch.distributed.nn.functional.all_gather`` is not used because it needs equal sizes on all ranks (it
    allocates ``empty_like`` buffers), returns a tuple rather than the concatenation, and its non-NCCL backward
    goes through all-to-all; all_reduce is supported by every backend and the gathered tensors here are small.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, equal_sizes: bool) -> torch.Tensor:  # type: ignore[override]
        world_size = dist.get_world_size()
        rank = dist.get_rank()
        x = x.contiguous()
        if equal_sizes:  # every rank has x.shape: one collective, nothing read back to the host
            out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))
            dist.all_gather_into_tensor(out, x)
            ctx.start, ctx.size = rank * x.shape[0], x.shape[0]
            return out
        sizes = [s[0] for s in _gather_shapes(x, world_size)]
        max_size = max(sizes)
        if x.shape[0] < max_size:
            pad = x.new_zeros((max_size - x.shape[0], *x.shape[1:]))
            padded = torch.cat([x, pad], dim=0)
        else:
            padded = x
        buffers = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(buffers, padded)
        ctx.start = sum(sizes[:rank])
        ctx.size = sizes[rank]
        return torch.cat([b[:n] for b, n in zip(buffers, sizes)], dim=0)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad_output.contiguous().clone()  # all_reduce works in place; never modify autograd's buffer
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.start : ctx.start + ctx.size], None


def all_gather_with_grad(x: torch.Tensor, equal_sizes: bool = False) -> torch.Tensor:
    """Concatenate ``x`` of all ranks along dim 0, in rank order, keeping the autograd graph: ``idist.all_gather``
    (like ``torch.distributed.all_gather``) returns copies without history, so a loss over the gathered embeddings
    would send no gradient back to the other ranks' rows (the contrastive gradient 1/W too small after DDP).

    Sizes along dim 0 may differ across ranks (the other dims and the dtype must agree; a clear ``ValueError``
    is raised on every rank otherwise): the shapes are exchanged first, which reads them back to the host (on
    CUDA a host sync). With ``equal_sizes=True`` the caller guarantees that every rank passes the same shape
    (e.g. equal training shards and a fixed batch): one ``all_gather_into_tensor`` then does the whole forward,
    with no shape exchange and no host sync; :func:`check_equal_shapes` verifies the guarantee once. The backward
    all-reduces (sums) the incoming gradient and returns this rank's rows, so that after DDP's gradient averaging the parameter gradients equal those of one process
    computing the mean of the ranks' losses on the concatenated batch. Every rank must call this (and run
    backward through it) the same number of times, like any collective.

    Returns ``x`` itself when no process group is initialised (or the world has one process).

    Args:
        x: tensor of shape (N_rank, ...).
        equal_sizes: every rank's ``x`` has the same shape (skip the shape exchange).

    Returns:
        tensor of shape (sum of N_rank over ranks, ...).
    """
    if get_world_size() == 1:
        return x
    return _AllGatherWithGrad.apply(x, bool(equal_sizes))


def check_equal_shapes(x: torch.Tensor, what: str) -> None:
    """Raises ``ValueError`` on every rank when the ranks' ``x`` differ in shape or dtype: the one-time check of a
    caller that then gathers with ``equal_sizes=True`` (every rank raises, where one rank's check would leave the
    others waiting in the gather). ``what`` names the setting that promised equal shapes.
    A no-op on one process."""
    if get_world_size() == 1:
        return
    shapes = _gather_shapes(x, get_world_size())
    if len(set(shapes)) > 1:
        raise ValueError(
            f"{what} promises the same batch on every rank, but the ranks' shapes are {shapes} (rank order): "
            "turn it off where shards or batches differ in size."
        )


class RankBatches:
    """How a loss gathers its anchors across ranks: whether it gathers at all, the one-time check of the promise
    that every rank's batch has the same size, and the gather itself with this rank's first row.

    Both pretraining losses hold one, so the decision, the check and the gather are written once.

    Args:
        gather: gather across ranks; ``None``: when a process group is initialised at call time. ``True`` without
            a process group (or with one process) is the same as ``False``.
        equal_sizes: every rank's batch has the same size at every step (equal training shards, a fixed batch):
            gathers then need no shape exchange and read nothing back to the host. Checked once, at the first
            distributed use (a ``ValueError`` on every rank if broken).
        owner: the setting that makes the promise, named in that error (e.g. ``"SSLLoss(equal_rank_batches=True)"``).

    Example::

        ranks = RankBatches(gather=None, equal_sizes=True, owner="MyLoss(equal_rank_batches=True)")
        if ranks.active:
            candidates, offset = ranks.gather(z)  # (sum of B_rank, D), this rank's rows start at offset
    """

    def __init__(self, gather: bool | None, equal_sizes: bool, owner: str) -> None:
        if gather not in (None, True, False):
            raise ValueError(f"gather_distributed must be None, True or False, got {gather!r}.")
        self.wanted = gather
        self.equal_sizes = bool(equal_sizes)
        self.owner = owner
        self._checked = False

    @property
    def active(self) -> bool:
        """Whether this call gathers: wanted (or, by default, a process group exists) and more than one rank."""
        return self.wanted is not False and get_world_size() > 1

    def check_once(self, *tensors: torch.Tensor) -> None:
        """With ``equal_sizes``, verify once (one shape exchange per tensor) that every rank holds the same shapes."""
        if self.equal_sizes and not self._checked and get_world_size() > 1:
            for tensor in tensors:
                check_equal_shapes(tensor, self.owner)
            self._checked = True

    def gather(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every rank's ``x`` (B_rank, ...) concatenated in rank order with gradients, and the row where this rank's
        own rows start; ``(x, 0)`` on one process."""
        if get_world_size() == 1:
            return x, 0
        if self.equal_sizes:
            self.check_once(x)
            return all_gather_with_grad(x, equal_sizes=True), get_rank() * x.shape[0]
        counts = all_gather_with_grad(torch.tensor([x.shape[0]], device=x.device)).tolist()
        return all_gather_with_grad(x), sum(counts[: get_rank()])


def all_reduce_mean(x: torch.Tensor | float, weight: torch.Tensor | float | None = None) -> torch.Tensor:
    """Global mean of per-rank values, detached: for logging a loss or metric that each rank computed locally
    (``idist.all_reduce`` sums in place, keeps the graph and takes no weights).

    Args:
        x: this rank's value (a scalar or a tensor of the same shape on every rank).
        weight: optional weight of this rank's value, e.g. its number of samples when ranks hold unequal
            counts; the result is then ``sum_r(w_r * x_r) / sum_r(w_r)`` instead of the plain mean over ranks.

    Returns:
        a new detached floating-point tensor with the shape of ``x``; a detached copy of ``x`` on one process.
    """
    x = torch.as_tensor(x).detach()
    if not x.is_floating_point():
        x = x.to(torch.get_default_dtype())
    if get_world_size() == 1:
        return x.clone()
    if weight is None:
        total = x.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / get_world_size()
    if isinstance(weight, torch.Tensor):
        w = weight.detach().to(dtype=x.dtype, device=x.device)
    else:  # a fill kernel on the device: a Python number copied to the device would block the host every call
        w = torch.full((), float(weight), dtype=x.dtype, device=x.device)
    if w.numel() != 1:
        raise ValueError(f"weight must be a single number per rank, got shape {tuple(w.shape)}.")
    packed = torch.cat([(x * w).reshape(-1), w.reshape(1)])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return (packed[:-1] / packed[-1]).reshape(x.shape)
