"""A training step reads nothing back to the host between log intervals (issue 15 item 4).

On CUDA every read of a device value (``.item()``, ``.tolist()``, ``float(t)``, ``if t:``) waits for the GPU, so a
per-step read stalls the pipeline. Here (CPU) the Python-level reads are recorded by patching ``torch.Tensor``, with
the function that made them, and the collectives by patching ``torch.distributed``, per iteration: both must happen
only at the log / check iterations (1, 1 + n, ...), at epoch ends and before checkpoint saves, but for the collectives
a step itself needs (named per recipe below). Some readers are allowed at every iteration because they read no
device value on CUDA: the optimizer's step count (a CPU tensor unless ``capturable``), the cutout boxes and paste
partners of ``aug_rand`` (checked while drawing on CPU, read to be applied) and the multi-crop boxes of
self-distillation, both drawn by the trainer's CPU host generator on accelerators. Reads inside C++ kernels
(``nonzero``, boolean indexing) are not visible here; the CUDA test at the end, with
``torch.cuda.set_sync_debug_mode("error")``, sees them.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from ignite.engine import Events

from components import NonFiniteLossError, ResumableCheckpointSaver, SSLLoss, SSLTrainer, StopOnNonFiniteLoss
from tests.ranks import run_scenario
from tests.test_engine import TinySSLNet, _batches, _one_thread  # noqa: F401 (autouse fixture)

HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast")
WORLD = 2


#: (file, function) of the readers that read CPU tensors only on CUDA (see above)
CPU_ONLY_READERS = {
    ("torch/optim/optimizer.py", "_get_value"),
    ("inpainting_contrast/views.py", "_draw_boxes"),
    ("inpainting_contrast/views.py", "_regions"),
    ("inpainting_contrast/views.py", "_paste"),
    ("self_distillation/views.py", "_crops"),
}


class PerIteration:
    """Counts calls of the named attributes of ``owner`` while installed, keyed by the trainer's iteration; for
    each call also the (file, function) that made it, in ``sites[iteration]`` (a set) and ``per_site[iteration]``
    (a Counter). The caller is the frame ``depth`` above the wrapper, then further up past the frames whose file
    path contains one of ``skip`` (e.g. the collective helpers, to name the code that needs the collective)."""

    def __init__(self, owner, names: tuple[str, ...], trainer, depth: int = 1, skip: tuple[str, ...] = ()) -> None:
        self.owner, self.names, self.trainer, self.depth, self.skip = owner, names, trainer, depth, skip
        self.calls: Counter = Counter()
        self.sites: dict[int, set[tuple[str, str]]] = {}
        self.per_site: dict[int, Counter] = {}

    def __enter__(self) -> "PerIteration":
        self.saved = {name: getattr(self.owner, name) for name in self.names}
        for name, fn in self.saved.items():
            setattr(self.owner, name, self._counting(fn))
        return self

    def _counting(self, fn):
        def wrapper(*args, **kwargs):
            iteration = self.trainer.state.iteration
            frame = sys._getframe(self.depth)
            while frame.f_back is not None and any(part in frame.f_code.co_filename for part in self.skip):
                frame = frame.f_back
            caller = frame.f_code
            path = Path(caller.co_filename).as_posix()
            site = ("/".join(path.split("/")[-3:]) if "/torch/" in path else "/".join(path.split("/")[-2:]), caller.co_name)
            self.calls[iteration] += 1
            self.sites.setdefault(iteration, set()).add(site)
            self.per_site.setdefault(iteration, Counter())[site] += 1
            return fn(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(self.owner, name, fn)


def _trainer(loader, log_interval: int, handlers: list, network=None, **loss_kwargs) -> SSLTrainer:
    torch.manual_seed(0)
    network = network or TinySSLNet()
    return SSLTrainer(
        device="cpu", max_epochs=1, train_data_loader=loader, network=network,
        optimizer=torch.optim.AdamW(network.parameters(), lr=1e-3), loss_function=SSLLoss(**loss_kwargs),
        log_interval=log_interval, train_handlers=handlers,
    )  # fmt: skip


def test_host_reads_only_at_log_iterations_epoch_ends_and_saves(tmp_path):
    handlers = [StopOnNonFiniteLoss(check_interval=4), ResumableCheckpointSaver(tmp_path, {"model": TinySSLNet()}, iteration_interval=6)]
    trainer = _trainer(_batches(8), log_interval=4, handlers=handlers)
    logged = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: logged.append(e.state.output[0]["log"] is not None))
    with PerIteration(torch.Tensor, HOST_READS, trainer) as reads:
        trainer.run()
    assert logged == [True, False, False, False, True, False, False, False]
    # 1 and 5: the log and the non-finite check; 6: the check before the save (the save itself copies to the
    # host anyway); 8: the check at the epoch end
    device_reads = {i for i, sites in reads.sites.items() if sites - CPU_ONLY_READERS}
    assert device_reads == {1, 5, 6, 8}, reads.sites
    assert reads.sites[2] == CPU_ONLY_READERS - {("self_distillation/views.py", "_crops")}
    assert ("training/trainer.py", "_log") in reads.sites[1] and ("training/non_finite.py", "check") in reads.sites[5]


def test_per_iteration_check_reads_every_iteration():
    """The record above can fail: checking at every iteration (check_interval 1) reads at every iteration."""
    trainer = _trainer(_batches(3), log_interval=10, handlers=[StopOnNonFiniteLoss(check_interval=1)])
    with PerIteration(torch.Tensor, HOST_READS, trainer) as reads:
        trainer.run()
    assert {i for i, sites in reads.sites.items() if ("training/non_finite.py", "check") in sites} == {1, 2, 3}


def test_deferred_check_names_the_first_bad_iteration_and_saves_nothing_after_it(tmp_path):
    batches = _batches(6)
    batches[1]["image"][0, 0, 2, 2, 2] = float("nan")  # iteration 2 turns the weights NaN: every later loss too
    trainer = _trainer(batches, log_interval=4, handlers=[StopOnNonFiniteLoss(check_interval=4)])
    saver = ResumableCheckpointSaver(tmp_path, {"model": trainer.network}, iteration_interval=1)
    saver.attach(trainer)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.run()
    message = str(err.value)
    assert "at epoch 1, iteration 2 (iteration 2/6 of the epoch)" in message
    # the saver's check before its save at iteration 2 found it: no later iteration ran
    assert trainer.state.iteration == 2
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["trainer"]["iteration"] == 1


def test_deferred_check_without_saves_stops_at_the_next_check():
    batches = _batches(6)
    batches[1]["image"][0, 0, 2, 2, 2] = float("nan")
    trainer = _trainer(batches, log_interval=4, handlers=[StopOnNonFiniteLoss(check_interval=4)])
    with pytest.raises(NonFiniteLossError) as err:
        trainer.run()
    message = str(err.value)
    assert "at epoch 1, iteration 2 (iteration 2/6 of the epoch)" in message
    assert "found at iteration 5 (checked every 4 iterations" in message
    assert "loss_rot=" in message and "loss_contrast=" in message
    assert trainer.state.iteration == 5


# ------------------------------------------------------------------------------------------ two ranks (gloo)


def _scenario(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict = {}
    torch.manual_seed(0)
    network = DDP(TinySSLNet())
    trainer = _trainer(_batches(6, seed=rank), 3, [StopOnNonFiniteLoss(check_interval=3)], network, equal_rank_batches=True)
    with PerIteration(torch.distributed, COLLECTIVES, trainer) as collectives:
        trainer.run()
    out["collectives"] = dict(collectives.calls)
    batches = _batches(6, seed=rank)
    if rank == 1:
        batches[3]["image"][0, 0, 1, 1, 1] = float("nan")  # rank 1, iteration 4
    # not gathered, so that rank 0's loss of iteration 4 stays finite (rank 1's NaN embeddings stay on rank 1)
    trainer = _trainer(batches, 3, [StopOnNonFiniteLoss(check_interval=3)], DDP(TinySSLNet()), gather_distributed=False)
    try:
        trainer.run()
        out["error"] = None
    except NonFiniteLossError as err:
        out["error"] = str(err)
    out["stopped_at"] = trainer.state.iteration
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_scenario(_scenario, tmp_path_factory.mktemp("host_sync_ranks"), WORLD)


def test_collectives_per_iteration_under_ddp(ranks):
    """Every iteration: the contrastive gather (forward) and its gradient's all-reduce (backward); iterations 1 and
    4 (log interval 3) add the logged values' all-reduce and the check's; 6 (the epoch end) the check's. The first
    gathered step also checks once that the ranks' batches have equal shapes (3 shape gathers). DDP's own gradient
    all-reduce runs in C++ and is not counted."""
    for result in ranks:
        calls = result["collectives"]
        assert calls[1] == 2 + 2 + 3 and calls[4] == 2 + 2 and calls[6] == 2 + 1, calls
        assert all(calls[i] == 2 for i in (2, 3, 5)), calls


def test_every_rank_stops_at_the_same_check_naming_the_bad_rank(ranks):
    for rank, result in enumerate(ranks):
        assert result["stopped_at"] == 4
        assert "iteration 4 (iteration 4/6 of the epoch)" in result["error"]
        assert "of the epoch) on ranks [1] of 2." in result["error"].splitlines()[0]
    assert "non-finite training loss on another rank" in ranks[0]["error"]
    assert "non-finite training loss nan" in ranks[1]["error"]


# ------------------------------------------- tensors made from Python numbers (host-to-device copies on CUDA)


class FreshTensors(PerIteration):
    """Counts, per trainer iteration, the tensors built from Python data (``torch.tensor(3.0, device=d)``,
    ``torch.as_tensor(n, device=d)``, ``x.new_tensor(...)``): on CUDA each is a blocking host-to-device copy.
    ``torch.full`` and Python numbers in arithmetic or indexed assignment are kernel arguments, not copies."""

    def __init__(self, trainer) -> None:
        super().__init__(torch, ("tensor", "as_tensor", "asarray"), trainer, depth=2)
        self.methods = PerIteration(torch.Tensor, ("new_tensor",), trainer)
        self.methods.calls, self.methods.sites, self.methods.per_site = self.calls, self.sites, self.per_site  # one record

    def _counting(self, fn):
        counted = super()._counting(fn)

        def wrapper(*args, **kwargs):  # a tensor passed to as_tensor is no copy from the host
            data = args[0] if args else kwargs.get("data")
            return fn(*args, **kwargs) if isinstance(data, torch.Tensor) else counted(*args, **kwargs)

        return wrapper

    def __enter__(self) -> "FreshTensors":
        self.methods.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.methods.__exit__(*exc)


#: the recipes of the DDP record below: the SSL recipe with equal batches promised, self-distillation with and
#: without the promise (the bundle promises it; the loss's default does not)
DDP_RECIPES = ("ssl", "self_distillation_equal", "self_distillation")
STEADY = (2, 3, 5)  # log interval 3 over 6 iterations: 1 and 4 log and check, 6 ends the epoch

#: the collectives one steady self-distillation step needs, by the code that needs them: the centre's all-reduce of
#: the teacher's row sums and row count (the row count also gives an unequal batch its share of the DINO term); the
#: teacher's EMA, KoLeo (per rank) and the views need none, and DDP's gradient all-reduce runs in C++
SELF_DISTILLATION_STEP_COLLECTIVES = {("self_distillation/loss.py", "_global_teacher_mean"): 1}


def _self_distillation_trainer(rank: int, equal_rank_batches: bool):
    """A tiny DDP self-distillation run of 6 iterations, 2 volumes per rank (KoLeo runs on each rank's own batch)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from components import PretrainingTrainer, weight_decay_groups
    from tests.test_self_distillation import _batches as _volumes, _recipe, _student

    student = _student()
    recipe = _recipe(student, total_iterations=6, koleo=0.1, equal_rank_batches=equal_rank_batches)
    return PretrainingTrainer(device="cpu", max_epochs=1, train_data_loader=_volumes(6, volumes=2, seed=rank),
                              network=DDP(student), optimizer=torch.optim.AdamW(weight_decay_groups(student, 0.04), lr=1e-3),
                              recipe=recipe, log_interval=3, train_handlers=[StopOnNonFiniteLoss(check_interval=3)])  # fmt: skip


def _ddp_scenario(rank: int) -> dict:
    """Every recipe under DDP on 2 gloo ranks: per iteration, where tensors are made from Python numbers, where
    values are read back to the host and which code runs collectives."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    trainers = {
        "ssl": _trainer(_batches(6, seed=rank), 3, [StopOnNonFiniteLoss(check_interval=3)], DDP(TinySSLNet()),
                        equal_rank_batches=True),  # fmt: skip
        "self_distillation_equal": _self_distillation_trainer(rank, equal_rank_batches=True),
        "self_distillation": _self_distillation_trainer(rank, equal_rank_batches=False),
    }
    out = {}
    for name, trainer in trainers.items():
        with contextlib.ExitStack() as stack:
            fresh = stack.enter_context(FreshTensors(trainer))
            reads = stack.enter_context(PerIteration(torch.Tensor, HOST_READS, trainer))
            collectives = stack.enter_context(PerIteration(torch.distributed, COLLECTIVES, trainer, skip=("components/distributed.py",)))
            trainer.run()
        out[name] = {key: {i: dict(c) for i, c in record.per_site.items()}
                     for key, record in (("fresh", fresh), ("reads", reads), ("collectives", collectives))}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory) -> list[dict]:
    return run_scenario(_ddp_scenario, tmp_path_factory.mktemp("ddp_record_ranks"), WORLD)


@pytest.mark.parametrize("recipe", DDP_RECIPES)
def test_no_tensor_is_made_from_python_numbers_between_log_iterations_under_ddp(ddp_ranks, recipe):
    """Iterations 2, 3 and 5 build no tensor from Python data on any rank: on CUDA each would be a blocking
    host-to-device copy every step (the self-distillation centre's rank weight was one)."""
    for result in ddp_ranks:
        steady = {i: result[recipe]["fresh"][i] for i in STEADY if result[recipe]["fresh"].get(i)}
        assert steady == {}, steady


@pytest.mark.parametrize("recipe", DDP_RECIPES)
def test_no_value_is_read_back_to_the_host_between_log_iterations_under_ddp(ddp_ranks, recipe):
    """Iterations 2, 3 and 5 read nothing back to the host on any rank but what is a CPU tensor on CUDA too: the
    optimizer's step count, the boxes of both recipes' views (drawn by the trainer's CPU host generator there).
    A per-step read (the self-distillation loss read the mean batch size with ``float()`` at every step without
    equal batches) fails it; the log iterations read."""
    for result in ddp_ranks:
        reads = result[recipe]["reads"]
        steady = {i: set(reads.get(i, {})) - CPU_ONLY_READERS for i in STEADY}
        assert steady == {i: set() for i in STEADY}, steady
        assert ("training/trainer.py", "_log") in reads[1] and ("training/non_finite.py", "check") in reads[4]


@pytest.mark.parametrize("recipe", ["self_distillation_equal", "self_distillation"])
def test_a_self_distillation_step_runs_only_the_centres_collective_under_ddp(ddp_ranks, recipe):
    """A steady step runs exactly SELF_DISTILLATION_STEP_COLLECTIVES, with or without the promise of equal batches
    (an all-reduce of the batch sizes for the DINO term's share at every step was one more); iteration 1 adds the
    logged values' all-reduce, the check's and, with the promise, its one-time shape check; 4 the log's and the
    check's, 6 (the epoch end) the check's."""
    logged = {("training/trainer.py", "_log"): 1, ("training/non_finite.py", "check"): 1}
    for result in ddp_ranks:
        calls = result[recipe]["collectives"]
        assert {i: calls[i] for i in STEADY} == {i: SELF_DISTILLATION_STEP_COLLECTIVES for i in STEADY}, calls
        assert calls[4] == {**SELF_DISTILLATION_STEP_COLLECTIVES, **logged}, calls[4]
        assert calls[6] == {**SELF_DISTILLATION_STEP_COLLECTIVES, ("training/non_finite.py", "check"): 1}, calls[6]
        first = Counter(calls[1])
        first.subtract({**SELF_DISTILLATION_STEP_COLLECTIVES, **logged})
        shape_check = {site: n for site, n in first.items() if n}
        assert shape_check == ({("self_distillation/loss.py", "_global_teacher_mean"): 1} if recipe.endswith("equal") else {}), calls[1]


# ------------------------------------------------------------------------------------------------- CUDA


def _run_without_syncs_between_logs(trainer) -> None:
    """Runs 6 iterations with log interval 5: iterations 2-5 must not synchronise; 1 and 6 (log, epoch end) may."""

    def set_mode(engine) -> None:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if engine.state.iteration in (1, 2, 3, 4) else "default")

    trainer.add_event_handler(Events.ITERATION_COMPLETED, set_mode)
    try:
        trainer.run()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_between_log_iterations_never_synchronise():
    from components import SSLHead

    torch.manual_seed(0)
    network = SSLHead(in_channels=1, feature_size=12, window_size=4).cuda()
    loader = [{"image": torch.rand(2, 1, 64, 64, 64).pin_memory()} for _ in range(6)]  # pinned: async copies
    trainer = SSLTrainer(device="cuda", max_epochs=1, train_data_loader=loader, network=network,
                         optimizer=torch.optim.AdamW(network.parameters(), lr=1e-4), loss_function=SSLLoss(),
                         amp=True, amp_dtype="bfloat16", log_interval=5,
                         train_handlers=[StopOnNonFiniteLoss(check_interval=5)])  # fmt: skip
    _run_without_syncs_between_logs(trainer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_self_distillation_steps_between_log_iterations_never_synchronise():
    from components import MultiCrop, PretrainingTrainer, SelfDistillationLoss, SelfDistillationNetwork, SelfDistillationRecipe, weight_decay_groups

    torch.manual_seed(0)
    student = SelfDistillationNetwork(feature_size=12, out_dim=32, hidden_dim=24, bottleneck_dim=8).cuda()
    recipe = SelfDistillationRecipe(student, SelfDistillationLoss(32, koleo_weight=0.1, equal_rank_batches=True),
                                    MultiCrop((32, 32, 32), (32, 32, 32), num_local=2), total_iterations=6)  # fmt: skip
    loader = [{"image": torch.rand(2, 1, 48, 48, 48).pin_memory()} for _ in range(6)]
    trainer = PretrainingTrainer(device="cuda", max_epochs=1, train_data_loader=loader, network=student,
                                 optimizer=torch.optim.AdamW(weight_decay_groups(student, 0.04), lr=1e-4), recipe=recipe,
                                 amp=True, amp_dtype="bfloat16", log_interval=5,
                                 train_handlers=[StopOnNonFiniteLoss(check_interval=5)])  # fmt: skip
    _run_without_syncs_between_logs(trainer)

