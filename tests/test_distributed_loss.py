"""Real multi-process tests (2 CPU processes, gloo) of components.distributed and the gathered SSLLoss.

Each launch spawns WORLD processes that initialise a gloo process group on 127.0.0.1 (a free port), run one
named scenario and save its result with torch.save; a child that fails writes its traceback to a file, which
the parent shows. The process-group timeout is 60 s and the parent kills the children after LAUNCH_TIMEOUT_S,
so a broken collective fails the test instead of hanging the suite.

The key property (distributed-pitfalls.md f): with an autograd-aware gather, the gradients after DDP averaging
equal the single-process gradients on the concatenated global batch; without gathering they do not.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import ignite.distributed as idist
import pytest
import torch
import torch.nn as nn

from components import distributed as D
from components.recipes.inpainting_contrast.loss import SSLLoss
from tests.ranks import AGENT_STORE_ENV, hosted_store, rank_context, run_ranks

WORLD = 2
GLOBAL_B = 6
FEAT = 8
PG_TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 120
GRAD_RTOL = 1e-5


# --------------------------------------------------------------------------------------------- the tiny model


class TinySSL(nn.Module):
    """Produces all loss inputs from features: rotation logits, both views' embeddings, a reconstruction."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(FEAT, 16)
        self.rotation_head = nn.Linear(16, 4)
        self.contrastive_head = nn.Linear(16, 16)
        self.conv = nn.Linear(16, FEAT)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor):
        h = torch.tanh(self.backbone(torch.cat([x1, x2])))  # one forward of both views: (2b, 16)
        emb = self.contrastive_head(h)
        b = x1.shape[0]
        return self.rotation_head(h), emb[:b], emb[b:], self.conv(h)


def make_model() -> TinySSL:
    torch.manual_seed(0)
    return TinySSL()


def global_batch():
    """A fixed global batch: clean features, two noisy views, rotation labels of both views."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(GLOBAL_B, FEAT, generator=g)
    x1 = x + 0.3 * torch.randn(GLOBAL_B, FEAT, generator=g)
    x2 = x + 0.3 * torch.randn(GLOBAL_B, FEAT, generator=g)
    labels = torch.randint(0, 4, (2, GLOBAL_B), generator=g)
    return x, x1, x2, labels


def loss_inputs(model: nn.Module, rows: slice):
    """The 6 loss inputs of the samples ``rows`` of the global batch (local layout: [view 1; view 2])."""
    x, x1, x2, labels = global_batch()
    rot_logits, emb_1, emb_2, recon = model(x1[rows], x2[rows])
    rot_labels = torch.cat([labels[0][rows], labels[1][rows]])
    target = torch.cat([x[rows], x[rows]])
    return rot_logits, rot_labels, emb_1, emb_2, recon, target


def train_step(model: nn.Module, params_of: nn.Module, loss_fn: SSLLoss, rows: slice) -> dict:
    total, parts = loss_fn(*loss_inputs(model, rows))
    total.backward()
    return {
        "total": total.detach(),
        "parts": {k: v.detach() for k, v in parts.items()},
        "grads": {n: p.grad.detach().clone() for n, p in params_of.named_parameters()},
    }


def shard(rank: int, sizes: tuple[int, ...]) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_grad_rel_err(grads: dict, ref: dict) -> float:
    assert grads.keys() == ref.keys()
    return max(rel_err(grads[k], ref[k]) for k in ref)


# ----------------------------------------------------------------------------------- scenarios (child side)


def scenario_training(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    runs = {
        "equal_gather": ((3, 3), dict(gather_distributed=True)),
        "equal_auto": ((3, 3), {}),  # None: gathers because a process group is initialised
        "equal_no_gather": ((3, 3), dict(gather_distributed=False)),
        "unequal_gather": ((4, 2), dict(gather_distributed=True)),
        "equal_promised": ((3, 3), dict(equal_rank_batches=True)),
    }
    for name, (sizes, kwargs) in runs.items():
        model = DDP(make_model())
        loss_fn = SSLLoss(**kwargs)
        with CollectiveCounter() as first:
            out[name] = train_step(model, model.module, loss_fn, shard(rank, sizes))
        with CollectiveCounter() as second:  # a second step of the same loss: the one-time check is done
            train_step(model, model.module, loss_fn, shard(rank, sizes))
        out[name]["collectives"] = (first.calls, second.calls)
        out[name]["logged_total"] = D.all_reduce_mean(out[name]["total"])
    try:
        SSLLoss(equal_rank_batches=True)(*loss_inputs(make_model(), shard(rank, (4, 2))))
        out["broken_promise"] = None
    except ValueError as err:
        out["broken_promise"] = str(err)
    return out


class CollectiveCounter:
    """Counts the Python-level torch.distributed collectives called inside the block, by name (DDP's own
    gradient all-reduce runs in C++ and is not counted)."""

    NAMES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast")

    def __enter__(self) -> "CollectiveCounter":
        import torch.distributed as dist

        self.calls: dict[str, int] = {}
        self._saved = {name: getattr(dist, name) for name in self.NAMES}

        def counting(name, fn):
            def wrapper(*args, **kwargs):
                self.calls[name] = self.calls.get(name, 0) + 1
                return fn(*args, **kwargs)

            return wrapper

        for name, fn in self._saved.items():
            setattr(dist, name, counting(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def scenario_gather(rank: int, world: int) -> dict:
    out = {"is_distributed": torch.distributed.is_initialized(), "rank": D.get_rank(), "world": D.get_world_size()}
    out["local_rank"] = D.get_local_rank()
    # unequal first dims: rank r sends r + 2 rows
    x = (torch.arange((rank + 2) * 3, dtype=torch.float32).reshape(rank + 2, 3) + 100 * rank).requires_grad_(True)
    y = D.all_gather_with_grad(x)
    weights = (rank + 1) * torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape)
    (y * weights).sum().backward()
    out["gathered"] = y.detach()
    out["grad"] = x.grad.clone()
    out["gathered_int"] = D.all_gather_with_grad(torch.full((rank + 1,), rank, dtype=torch.int64))
    # trailing dims differ: every rank must raise the same clear error (and nobody hangs)
    try:
        D.all_gather_with_grad(torch.zeros(2, 3 + rank))
        out["mismatch_error"] = None
    except ValueError as err:
        out["mismatch_error"] = str(err)
    # all_reduce_mean: plain and weighted
    out["mean"] = D.all_reduce_mean(torch.tensor([rank + 1.0, 10.0 * (rank + 1)], requires_grad=True))
    out["weighted_mean"] = D.all_reduce_mean(torch.tensor(float(rank + 1)), weight=[4, 2][rank])
    out["int_mean"] = D.all_reduce_mean(torch.tensor(rank + 1))
    D.barrier()
    return out


SCENARIOS = {"training": scenario_training, "gather": scenario_gather}


def _child(rank: int, world: int, port: int, out_dir: str, scenario: str) -> None:
    out = Path(out_dir)
    try:
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        torch.set_num_threads(1)
        D.init_distributed(backend="gloo", timeout_s=PG_TIMEOUT_S)
        D.init_distributed(backend="gloo", timeout_s=PG_TIMEOUT_S)  # idempotent
        result = SCENARIOS[scenario](rank, world)
        D.barrier()
        D.cleanup_distributed()
        result["after_cleanup"] = (torch.distributed.is_initialized(), D.get_rank(), D.get_world_size())
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)  # do not wait for the other rank's collectives


def launch(scenario: str, out_dir: Path, world: int = WORLD) -> list[dict]:
    """Run ``scenario`` on ``world`` processes of ``rank_context``; return each rank's result, or fail with the
    traceback."""
    args = lambda rank, port: (rank, world, port, str(out_dir), scenario)  # noqa: E731
    codes = run_ranks(rank_context(), _child, args, world, LAUNCH_TIMEOUT_S)
    errors = "\n".join(f"--- rank {r} ---\n{f.read_text()}" for r, f in enumerate(sorted(out_dir.glob("*.err"))))
    assert codes == [0] * world, f"scenario {scenario!r}: exit codes {codes} (timeout {LAUNCH_TIMEOUT_S} s)\n{errors}"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


# ----------------------------------------------------------------------------------------- tests (parent side)


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    return launch("training", tmp_path_factory.mktemp("training"))


@pytest.fixture(scope="module")
def gather(tmp_path_factory):
    return launch("gather", tmp_path_factory.mktemp("gather"))


@pytest.fixture(scope="module")
def reference():
    """Single process, global batch of GLOBAL_B, no gathering (no process group here anyway)."""
    model = make_model()
    return train_step(model, model, SSLLoss(gather_distributed=False), slice(None))


@pytest.mark.parametrize("run", ["equal_gather", "equal_auto", "unequal_gather", "equal_promised"])
def test_gathered_ddp_gradients_equal_single_process(training, reference, run):
    for rank, result in enumerate(training):
        err = max_grad_rel_err(result[run]["grads"], reference["grads"])
        assert err < GRAD_RTOL, f"{run}, rank {rank}: max relative gradient error {err:.3g}"
        for name, ref in reference["grads"].items():
            atol = GRAD_RTOL * ref.abs().max()
            torch.testing.assert_close(result[run]["grads"][name], ref, rtol=GRAD_RTOL, atol=atol)


def test_without_gather_ddp_gradients_differ(training, reference):
    """The check above can fail: the local-only contrastive term gives a clearly different gradient."""
    err = max_grad_rel_err(training[0]["equal_no_gather"]["grads"], reference["grads"])
    assert err > 100 * GRAD_RTOL, f"no-gather gradient unexpectedly equal to the global one (rel err {err:.3g})"
    # only the contrastive path differs: the rotation head's gradient is the same either way
    grads = training[0]["equal_no_gather"]["grads"]
    assert rel_err(grads["rotation_head.weight"], reference["grads"]["rotation_head.weight"]) < GRAD_RTOL
    assert rel_err(grads["contrastive_head.weight"], reference["grads"]["contrastive_head.weight"]) > 100 * GRAD_RTOL


@pytest.mark.parametrize("run", ["equal_gather", "equal_auto", "unequal_gather", "equal_promised"])
def test_rank_mean_of_loss_equals_single_process_loss(training, reference, run):
    mean_total = torch.stack([r[run]["total"] for r in training]).mean()
    torch.testing.assert_close(mean_total, reference["total"], rtol=1e-6, atol=1e-6)
    for key in ("rot", "contrast", "recon"):
        mean_part = torch.stack([r[run]["parts"][key] for r in training]).mean()
        torch.testing.assert_close(mean_part, reference["parts"][key], rtol=1e-6, atol=1e-6)
    for r in training:  # what rank 0 would log
        torch.testing.assert_close(r[run]["logged_total"], reference["total"], rtol=1e-6, atol=1e-6)


def test_equal_rank_batches_gathers_without_exchanging_shapes(training):
    """With equal_rank_batches a step is one all_gather_into_tensor (forward) and one all_reduce (its backward):
    no count or shape exchange, whose results the host would have to read. Its first step checks the promise
    once (one shape exchange per checked tensor); the general path exchanges shapes and counts at every step."""
    for result in training:
        first, second = result["equal_promised"]["collectives"]
        assert second == {"all_gather_into_tensor": 1, "all_reduce": 1}
        assert first == {"all_gather": 3, "all_gather_into_tensor": 1, "all_reduce": 1}
        assert result["equal_gather"]["collectives"][1] == {"all_gather": 4, "all_reduce": 1}


def test_broken_equal_batch_promise_raises_on_every_rank(training):
    for result in training:
        assert "SSLLoss(equal_rank_batches=True) promises the same batch on every rank" in result["broken_promise"]


def test_ranks_disagree_on_local_loss_without_gather(training, reference):
    mean_contrast = torch.stack([r["equal_no_gather"]["parts"]["contrast"] for r in training]).mean()
    assert abs(mean_contrast.item() - reference["parts"]["contrast"].item()) > 1e-3


def test_unequal_batches_follow_the_documented_scaling(training):
    """Each part is W * n_local / n_global times the mean over the rank's own anchors / rows / elements."""
    sizes = (4, 2)
    for rank, result in enumerate(training):
        rows = shard(rank, sizes)
        scale = WORLD * sizes[rank] / GLOBAL_B
        model = make_model()
        rot_logits, rot_labels, emb_1, emb_2, recon, target = loss_inputs(model, rows)
        # rank-local means computed directly: rot over own rows, recon over own elements
        rot_local = nn.functional.cross_entropy(rot_logits, rot_labels)
        recon_local = nn.functional.l1_loss(recon, target)
        torch.testing.assert_close(result["unequal_gather"]["parts"]["rot"], scale * rot_local.detach())
        torch.testing.assert_close(result["unequal_gather"]["parts"]["recon"], scale * recon_local.detach())
        # contrast: own anchors only, against the candidates of the whole global batch
        _, _, all_1, all_2, _, _ = loss_inputs(model, slice(None))
        z = nn.functional.normalize(torch.cat([all_1, all_2]).detach(), dim=1)
        sim = z @ z.T / 0.5
        sim.fill_diagonal_(float("-inf"))
        anchors = list(range(rows.start, rows.stop)) + [GLOBAL_B + i for i in range(rows.start, rows.stop)]
        per_anchor = [torch.logsumexp(sim[a], 0) - sim[a, (a + GLOBAL_B) % (2 * GLOBAL_B)] for a in anchors]
        torch.testing.assert_close(
            result["unequal_gather"]["parts"]["contrast"], scale * torch.stack(per_anchor).mean(), rtol=1e-5, atol=1e-6
        )


def test_all_gather_with_grad_unequal_sizes(gather):
    expected = torch.cat(
        [torch.arange((r + 2) * 3, dtype=torch.float32).reshape(r + 2, 3) + 100 * r for r in range(WORLD)]
    )
    weight_sum = sum(r + 1 for r in range(WORLD)) * torch.arange(expected.numel(), dtype=torch.float32).reshape(
        expected.shape
    )
    start = 0
    for rank, result in enumerate(gather):
        identity = (result["is_distributed"], result["rank"], result["world"], result["local_rank"])
        assert identity == (True, rank, WORLD, rank)
        torch.testing.assert_close(result["gathered"], expected, rtol=0, atol=0)
        # backward: the sum over ranks of their upstream gradients, sliced to this rank's rows
        torch.testing.assert_close(result["grad"], weight_sum[start : start + rank + 2], rtol=0, atol=0)
        start += rank + 2
        assert result["gathered_int"].tolist() == [0, 1, 1]
        assert result["after_cleanup"] == (False, 0, 1)


def test_all_gather_with_grad_shape_mismatch_raises_on_every_rank(gather):
    for result in gather:
        assert result["mismatch_error"] is not None
        assert "same dtype and the same sizes except dim 0" in result["mismatch_error"]


def test_all_reduce_mean(gather):
    for result in gather:
        torch.testing.assert_close(result["mean"], torch.tensor([1.5, 15.0]))
        assert not result["mean"].requires_grad
        torch.testing.assert_close(result["weighted_mean"], torch.tensor((4 * 1.0 + 2 * 2.0) / 6))
        torch.testing.assert_close(result["int_mean"], torch.tensor(1.5))


# --------------------------------------------------------------------------------- without a process group


def test_helpers_are_noops_without_process_group(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not torch.distributed.is_initialized()
    assert (D.get_rank(), D.get_world_size(), D.get_local_rank()) == (0, 1, 0)
    x = torch.randn(3, 4, requires_grad=True)
    assert D.all_gather_with_grad(x) is x
    mean = D.all_reduce_mean(x)
    torch.testing.assert_close(mean, x.detach())
    assert not mean.requires_grad
    torch.testing.assert_close(D.all_reduce_mean(2.5, weight=3), torch.tensor(2.5))
    D.barrier()
    D.cleanup_distributed()
    cuda = torch.cuda.is_available() and torch.distributed.is_nccl_available()
    assert D.default_backend() == ("nccl" if cuda else "gloo")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert D.get_local_rank() == 3
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        D.get_local_rank()


def test_rank_and_world_size_are_ignites_and_cleanup_returns_it_to_one_process(monkeypatch):
    """The configs' components.get_rank is ignite's own; after cleanup_distributed ignite answers for one process and
    sees the next process group (a group of one here, twice in this process), as a second run in one process needs."""
    assert D.get_rank is idist.get_rank and D.get_world_size is idist.get_world_size
    with hosted_store(60) as port:
        monkeypatch.setenv(AGENT_STORE_ENV, str(True))
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)}.items():  # fmt: skip
            monkeypatch.setenv(name, value)
        for _ in range(2):
            D.init_distributed(backend="gloo", timeout_s=60)
            assert (idist.model_name(), idist.backend(), idist.get_world_size()) == ("native-dist", "gloo", 1)
            D.cleanup_distributed()
            assert not torch.distributed.is_initialized()
            assert (idist.model_name(), idist.get_rank(), idist.get_world_size()) == ("serial", 0, 1)


def test_device_for_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert D.device_for_rank("cpu") == torch.device("cpu")
    assert D.device_for_rank(torch.device("cpu")) == torch.device("cpu")
    if torch.cuda.is_available():
        assert D.device_for_rank() == torch.device("cuda", 1)
        assert D.device_for_rank("cuda") == torch.device("cuda", 1)
        assert D.device_for_rank("cuda:0") == torch.device("cuda", 0)
    else:
        assert D.device_for_rank() == torch.device("cpu")
        assert D.device_for_rank(None) == torch.device("cpu")
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            D.device_for_rank("cuda")


def test_init_distributed_names_missing_torchrun_variables(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT") as info:
        D.init_distributed(backend="gloo", timeout_s=5)
    assert "torchrun" in str(info.value) and "RANK" in str(info.value)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="timeout_s"):
        D.init_distributed(timeout_s=0)
