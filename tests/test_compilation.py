"""torch.compile in the bundles' trainers: the same numbers as eager, no recompiles after the first epoch (validation
and a resume included), DDP, and the monitor that reports the compile cost and late recompiles.

On this CPU the tests compile with ``backend="aot_eager"`` (dynamo's graph capture and AOTAutograd's joint graph,
run by eager kernels; inductor's C++ code generation takes minutes on 2 cores); the inductor kernels are compared
on a GPU in tests/test_cuda.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events
from monai.bundle import ConfigParser
from monai.handlers import ValidationHandler

import components
from components import CompileMonitor, SSLEvaluator, SSLLoss, SSLTrainer, compiled_graphs
from components.checkpoint import ResumableCheckpointSaver, ResumeHandler
from components.config.running import run_config_files
from tests.ranks import run_scenario
from tests.test_engine import TinySSLNet, _batches, _one_thread  # noqa: F401 (autouse fixture)

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"
AOT = {"backend": "aot_eager"}
RTOL = 1e-5  # aot_eager runs the same kernels after AOTAutograd's decompositions: equal to rounding


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _trainer(loader, compile: bool, max_epochs: int = 1, handlers=None, network=None, **kwargs) -> SSLTrainer:
    torch.manual_seed(0)
    network = network or TinySSLNet()
    return SSLTrainer(
        device="cpu", max_epochs=max_epochs, train_data_loader=loader, network=network,
        optimizer=torch.optim.AdamW(network.parameters(), lr=1e-3), loss_function=SSLLoss(), seed=3,
        compile=compile, compile_kwargs=AOT, train_handlers=handlers, **kwargs,
    )  # fmt: skip


def _losses(trainer: SSLTrainer) -> list[torch.Tensor]:
    losses: list[torch.Tensor] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output[0]["loss"]))
    trainer.run()
    return losses


def test_compiled_steps_equal_eager():
    eager, compiled = _trainer(_batches(3), False), _trainer(_batches(3), True)
    assert isinstance(compiled.network, torch._dynamo.eval_frame.OptimizedModule)
    losses_e, losses_c = _losses(eager), _losses(compiled)
    torch.testing.assert_close(torch.stack(losses_c), torch.stack(losses_e), rtol=RTOL, atol=1e-7)
    for (name, p_e), p_c in zip(eager.network.named_parameters(), components.networks.wrappers.unwrap(compiled.network).parameters()):
        torch.testing.assert_close(p_c, p_e, rtol=RTOL, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_no_recompile_after_the_first_epoch_with_validation_and_resume(tmp_path, caplog):
    """3 epochs with a validation after each (the evaluator runs the uncompiled network, as in the bundles), then a
    resumed run in the same process: graphs are compiled in the first epoch only, and the resumed run's own first
    epoch compiles nothing new (the restored weights go into the same parameters)."""
    network = TinySSLNet()
    evaluator = SSLEvaluator(device="cpu", val_data_loader=_batches(1), network=network)
    monitor = CompileMonitor()
    trainer = _trainer(_batches(3), True, max_epochs=3, network=network, handlers=[monitor])
    ValidationHandler(validator=evaluator, interval=1, epoch_level=True).attach(trainer)
    ResumableCheckpointSaver(tmp_path, {"model": network, "optimizer": trainer.optimizer}).attach(trainer)
    per_epoch: list[int] = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: per_epoch.append(compiled_graphs()))
    with caplog.at_level(logging.INFO, logger="components.training.compilation"):
        trainer.run()
    assert per_epoch[0] >= 1 and per_epoch == [per_epoch[0]] * 3, per_epoch
    assert monitor.late_graphs == 0 and len(monitor.iteration_s) == 2
    assert any("compiling about" in r.getMessage() for r in caplog.records)

    resumed = _trainer(_batches(3), True, max_epochs=5, network=network, handlers=[CompileMonitor()])
    ResumeHandler(tmp_path / "checkpoint.pt", {"model": network, "optimizer": resumed.optimizer}).attach(resumed)
    before = compiled_graphs()
    resumed.run()
    assert resumed.state.epoch == 5 and compiled_graphs() == before  # the cached graphs serve the resumed run


def test_monitor_warns_about_a_recompile_after_the_warm_up(caplog):
    """The check above can fail: a batch of another size in epoch 3 compiles a new graph, and the monitor says so."""
    batches = _batches(2)
    monitor = CompileMonitor()
    trainer = _trainer(batches, True, max_epochs=3, handlers=[monitor])
    trainer.add_event_handler(Events.EPOCH_COMPLETED(once=2), lambda e: batches.append(_batches(1, crops=3)[0]))
    with caplog.at_level(logging.WARNING, logger="components.training.compilation"):
        trainer.run()
    assert monitor.late_graphs >= 1
    assert any("epoch 3" in r.getMessage() and "TORCH_LOGS=recompiles" in r.getMessage() for r in caplog.records)


def _ddp_steps(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for compile in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        network = DDP(TinySSLNet())
        trainer = _trainer(_batches(3, seed=rank), compile, network=network)
        out[compile] = {"losses": torch.stack(_losses(trainer)), "params": [p.detach().clone() for p in network.parameters()]}
    return out


def test_compiled_ddp_steps_equal_eager_ddp_steps(tmp_path):
    """compile(DDP(model)), the order the bundles use: 2 gloo ranks, 3 steps, the same losses and weights."""
    for result in run_scenario(_ddp_steps, tmp_path, world=2):
        torch.testing.assert_close(result[True]["losses"], result[False]["losses"], rtol=RTOL, atol=1e-7)
        for p_c, p_e in zip(result[True]["params"], result[False]["params"]):
            torch.testing.assert_close(p_c, p_e, rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("bundle", sorted(p.name for p in BUNDLES.iterdir() if (p / "configs" / "train.json").is_file()))
def test_every_bundle_compiles_its_trainer_on_request(bundle):
    """``--compile true``: the trainer gets compile=True and the bundle's compile_kwargs, and the monitor is
    attached; off by default. The flag reaches both as the command line gives it ("true"), read inside them."""
    train = ConfigParser.load_config_files([str(f) for f in run_config_files(BUNDLES / bundle, ["train.json"])])
    assert train["speed"]["compile"] is False and train["speed"]["compile_kwargs"] == {}
    trainer = train["train"]["trainer"]
    assert trainer["compile"] == "@speed#compile" and trainer["compile_kwargs"] == "@speed#compile_kwargs"
    monitors = [h for h in train["train"]["handlers"] if h["_target_"] == "components.CompileMonitor"]
    assert len(monitors) == 1 and monitors[0]["enabled"] == "@speed#compile"
    parser = ConfigParser(train)
    for compile, enabled in (("true", True), (False, False)):
        parser["speed#compile"] = compile
        monitor = parser.get_parsed_content(f"train#handlers#{train['train']['handlers'].index(monitors[0])}")
        assert monitor.enabled is enabled
        engine = Engine(lambda e, b: None)
        monitor.attach(engine)
        assert engine.has_event_handler(monitor._start, Events.STARTED) is enabled


# -------------------------------------------------------------- the real networks at the tiny size (aot_eager)


def _real_run(kind: str, compile: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Two epochs of two steps of a bundle's real network (feature 12, window 4, fused attention) in its trainer;
    returns the losses, the final weights and the number of compiled graphs after each epoch."""
    from monai.engines import SupervisedTrainer
    from monai.networks.nets import SwinUNETR

    from components import (MultiCrop, PretrainingTrainer, SelfDistillationLoss, SelfDistillationNetwork,
                            SelfDistillationRecipe, SSLHead, use_fused_attention)  # fmt: skip

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "swinunetr":
        network = use_fused_attention(SwinUNETR(in_channels=1, out_channels=3, feature_size=12, window_size=4), True)
        loader = [{"image": torch.rand(1, 1, 64, 32, 32, generator=g), "label": torch.randint(0, 3, (1, 1, 64, 32, 32), generator=g)}
                  for _ in range(2)]  # fmt: skip
        trainer = SupervisedTrainer(device="cpu", max_epochs=2, train_data_loader=loader, network=network,
                                    optimizer=torch.optim.SGD(network.parameters(), lr=1e-2),
                                    loss_function=monai_dice_ce(), compile=compile, compile_kwargs=AOT)  # fmt: skip
    elif kind == "sslhead":
        network = use_fused_attention(SSLHead(in_channels=1, feature_size=12, window_size=4), True)
        loader = [{"image": torch.rand(2, 1, 64, 32, 32, generator=g)} for _ in range(2)]
        trainer = SSLTrainer(device="cpu", max_epochs=2, train_data_loader=loader, network=network, seed=3,
                             optimizer=torch.optim.SGD(network.parameters(), lr=1e-2), loss_function=SSLLoss(),
                             compile=compile, compile_kwargs=AOT)  # fmt: skip
    else:
        network = use_fused_attention(SelfDistillationNetwork(feature_size=12, out_dim=32, hidden_dim=24, bottleneck_dim=8, window_size=4), True)
        recipe = SelfDistillationRecipe(network, SelfDistillationLoss(32, koleo_weight=0.1),
                                        MultiCrop((32, 32, 32), (32, 32, 32), num_local=2), total_iterations=4)  # fmt: skip
        loader = [{"image": torch.rand(2, 1, 40, 40, 40, generator=g)} for _ in range(2)]
        trainer = PretrainingTrainer(device="cpu", max_epochs=2, train_data_loader=loader, network=network, seed=3,
                                     optimizer=torch.optim.SGD(network.parameters(), lr=1e-2), recipe=recipe,
                                     compile=compile, compile_kwargs=AOT)  # fmt: skip
    losses: list[torch.Tensor] = []
    graphs: list[int] = []

    def record(engine) -> None:
        output = engine.state.output
        losses.append(torch.as_tensor((output[0] if isinstance(output, list) else output)["loss"]).detach().clone())

    trainer.add_event_handler(Events.ITERATION_COMPLETED, record)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: graphs.append(compiled_graphs()))
    trainer.run()
    return losses, [p.detach().clone() for p in components.networks.wrappers.unwrap(network).parameters()], graphs


def monai_dice_ce():
    from monai.losses import DiceCELoss

    return DiceCELoss(to_onehot_y=True, softmax=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["swinunetr", "sslhead", "self_distillation"])
def test_real_networks_compile_to_the_eager_numbers_without_recompiling(kind):
    """The networks the bundles train (SwinUNETR and SSLHead with fused window attention, the self-distillation
    student with its global and local crops): compiled steps equal eager ones, and the second epoch compiles nothing."""
    losses_e, params_e, _ = _real_run(kind, compile=False)
    torch._dynamo.reset()
    losses_c, params_c, graphs = _real_run(kind, compile=True)
    torch.testing.assert_close(torch.stack(losses_c), torch.stack(losses_e), rtol=1e-4, atol=1e-6)
    # SGD: the weights move by lr x gradient, so they differ by the gradients' rounding only (Adam would turn a
    # near-zero gradient's rounding into a step of lr). At this size SSLHead's decoder normalises maps of 2 voxels
    # (64x32x32 / 32), which amplifies rounding: its weights differ by up to ~7e-6 after 4 steps; a wrong gradient
    # differs by the size of the steps (~1e-3)
    for p_c, p_e in zip(params_c, params_e):
        torch.testing.assert_close(p_c, p_e, rtol=1e-4, atol=2e-5)
    assert graphs[0] >= 1 and graphs[1] == graphs[0], graphs
