"""The SSL training iteration: AMP, clipping after unscaling, scheduler stepping, seeding, overfitting."""

from __future__ import annotations

import math

import warnings

import pytest
import torch
from ignite.engine import Events
from torch import nn

from components import SSLEvaluator, SSLHead, SSLLoss, SSLTrainer
from components.training.recipe import resolve_amp_dtype
from components.training.seeding import epoch_seed


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TinySSLNet(nn.Module):
    """A stand-in with SSLHead's interface: (rotation logits, embedding, reconstruction)."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Conv3d(1, 4, 3, padding=1)
        self.rotation_head = nn.Linear(4, 4)
        self.contrastive_head = nn.Linear(4, 8)
        self.conv = nn.Conv3d(4, 1, 1)

    def forward(self, x):
        features = torch.relu(self.encode(x))
        pooled = features.mean(dim=(2, 3, 4))
        return self.rotation_head(pooled), self.contrastive_head(pooled), self.conv(features)


def _batches(n: int, crops: int = 2, size: int = 20, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"image": torch.rand(crops, 1, size, size, size, generator=g)} for _ in range(n)]


def _trainer(network, optimizer, loader, **kwargs) -> SSLTrainer:
    return SSLTrainer(
        device="cpu",
        max_epochs=kwargs.pop("max_epochs", 1),
        train_data_loader=loader,
        network=network,
        optimizer=optimizer,
        loss_function=SSLLoss(),
        **kwargs,
    )


def test_output_holds_finite_loss_parts_and_learning_rate():
    torch.manual_seed(0)
    net = TinySSLNet()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    trainer = _trainer(net, optimizer, _batches(2))
    trainer.run()
    out = trainer.state.output[0]
    trivial = {f"loss_{part}_trivial" for part in ("rot", "contrast", "recon")}  # the recipe's monitor, beside each part
    assert set(out["log"]) == {"loss", "loss_rot", "loss_contrast", "loss_recon", "lr", *trivial}
    assert out["log"]["loss_rot_trivial"] == pytest.approx(math.log(4)) and out["log"]["loss_contrast_trivial"] == pytest.approx(math.log(3))
    parts = [float(out["log"][k]) for k in ("loss_rot", "loss_contrast", "loss_recon")]
    assert all(torch.isfinite(torch.tensor(parts)))
    assert float(out["log"]["loss"]) == pytest.approx(sum(parts), rel=1e-5)
    assert out["pred"].shape == out["label"].shape == (4, 1, 20, 20, 20)  # both views of 2 crops


def test_scheduler_steps_only_when_the_optimizer_stepped():
    """Pitfall e: under fp16 AMP an overflow skips optimizer.step(); the scheduler must not step either."""
    torch.manual_seed(0)
    net = TinySSLNet()
    before = [p.detach().clone() for p in net.parameters()]
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 + step)
    trainer = _trainer(net, optimizer, _batches(3), lr_scheduler=scheduler, amp=True, amp_dtype="float16")
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # every step overflows (scale halves per step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "lr_scheduler.step() before optimizer.step()" would raise
        trainer.run()
    assert scheduler.last_epoch == 0
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert trainer.scaler.get_scale() == 2.0**124  # three skipped steps

    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer.state.max_epochs = 2
    trainer.run()
    assert scheduler.last_epoch == 3  # a step per iteration once the optimizer steps
    assert not all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_gradients_are_clipped_after_unscaling():
    """Pitfall e: clipping scaled gradients would make the update 1/scale too small."""
    torch.manual_seed(0)
    net = TinySSLNet()
    before = torch.cat([p.detach().flatten().clone() for p in net.parameters()])
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    trainer = _trainer(net, optimizer, _batches(1), clip_grad_norm=1e-3, amp=True, amp_dtype="float16")
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer.run()
    after = torch.cat([p.detach().flatten() for p in net.parameters()])
    assert torch.linalg.vector_norm(after - before).item() == pytest.approx(1e-3, rel=1e-3)


def test_bf16_autocast_on_cpu_runs_without_a_scaler():
    torch.manual_seed(0)
    net = TinySSLNet()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    trainer = _trainer(net, optimizer, _batches(2), amp=True)
    assert trainer.amp_dtype == torch.bfloat16 and not trainer.scaler.is_enabled()
    trainer.run()
    assert torch.isfinite(trainer.state.output[0]["loss"])


def test_amp_dtype_resolution():
    assert resolve_amp_dtype(torch.device("cpu"), None) == torch.bfloat16
    assert resolve_amp_dtype(torch.device("cpu"), "float16") == torch.float16
    with pytest.raises(ValueError, match="amp_dtype must be one of"):
        resolve_amp_dtype(torch.device("cpu"), "int8")


def test_views_are_seeded_per_epoch():
    """Epoch e of two runs with the same seed sees the same views; different epochs see different ones."""
    views = {}

    def record(engine):
        views.setdefault(id(engine), []).append(engine.state.output[0]["label"].clone())

    for _ in range(2):
        torch.manual_seed(0)
        net = TinySSLNet()
        trainer = _trainer(net, torch.optim.SGD(net.parameters(), lr=0.0), _batches(1), max_epochs=2, seed=7)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, record)
        trainer.run()
    first, second = views.values()
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[0], first[1])
    assert epoch_seed(7, 1, 0) != epoch_seed(7, 1, 1)  # ranks draw different views


def test_evaluator_scores_the_same_views_every_time():
    torch.manual_seed(0)
    net = TinySSLNet()
    evaluator = SSLEvaluator(device="cpu", val_data_loader=_batches(1), network=net)
    evaluator.run()
    first = evaluator.state.output["views"].clone()
    evaluator.run()
    assert torch.equal(first, evaluator.state.output["views"])


def test_few_iterations_on_a_fixed_batch_lower_the_loss():
    """Overfitting one fixed batch (the same crops and, reseeded before every step, the same views). Window 4 tiles
    the 64x32x32 crop's tokens without padding (the default 7 pads them) and one Swin block per stage keeps the steps
    cheap."""
    torch.manual_seed(0)
    net = SSLHead(feature_size=12, window_size=4, depths=(1, 1, 1, 1))
    crops = torch.rand(2, 1, 64, 32, 32, generator=torch.Generator().manual_seed(1))
    trainer = _trainer(net, torch.optim.AdamW(net.parameters(), lr=1e-3), [{"image": crops}] * 8)
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda engine: engine.view_generator.manual_seed(0))
    losses = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: losses.append(float(engine.state.output[0]["loss"])))
    trainer.run()
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses


def test_iteration_events_see_this_iterations_output():
    """FORWARD_COMPLETED sees this iteration's outputs, LOSS_COMPLETED and BACKWARD_COMPLETED its loss and parts,
    MODEL_COMPLETED its log, as MONAI's SupervisedTrainer fills ``state.output`` before firing them."""
    from monai.engines.utils import IterationEvents

    torch.manual_seed(0)
    net = TinySSLNet()
    trainer = _trainer(net, torch.optim.AdamW(net.parameters(), lr=1e-3), _batches(3), log_interval=1)
    seen: dict = {}

    def record(event):
        def handler(engine):
            output = engine.state.output[0]
            seen.setdefault(engine.state.iteration, {})[event] = (output.get("pred"), output.get("loss"), output.get("log"))

        return handler

    for event in (IterationEvents.FORWARD_COMPLETED, IterationEvents.LOSS_COMPLETED, IterationEvents.BACKWARD_COMPLETED,
                  IterationEvents.MODEL_COMPLETED, Events.ITERATION_COMPLETED):  # fmt: skip
        trainer.add_event_handler(event, record(event))
    trainer.run()
    for iteration, events in seen.items():
        pred, loss, log = events[Events.ITERATION_COMPLETED]
        assert loss is not None and log is not None
        assert events[IterationEvents.FORWARD_COMPLETED][0] is pred and events[IterationEvents.FORWARD_COMPLETED][1] is None
        for event in (IterationEvents.LOSS_COMPLETED, IterationEvents.BACKWARD_COMPLETED, IterationEvents.MODEL_COMPLETED):
            assert events[event][0] is pred and events[event][1] is loss, f"iteration {iteration}: {event} saw another output"
        assert events[IterationEvents.MODEL_COMPLETED][2] is log and events[IterationEvents.BACKWARD_COMPLETED][2] is None


@pytest.mark.parametrize("steps", [2, 4, 1.5, True, "1", 1.0, None])
def test_gradient_accumulation_is_refused_at_construction_naming_the_value(steps):
    """Only the integer 1: a float, a bool or a string that int() would turn into 1 is refused as well."""
    net = TinySSLNet()
    with pytest.raises(ValueError) as err:
        _trainer(net, torch.optim.AdamW(net.parameters(), lr=1e-3), _batches(1), accumulation_steps=steps)
    message = str(err.value)
    assert message.startswith("accumulation_steps must be the integer 1") and message.endswith(f"got {steps!r}.")
    assert "\n" not in message


def test_one_accumulation_step_is_accepted():
    net = TinySSLNet()
    trainer = _trainer(net, torch.optim.AdamW(net.parameters(), lr=1e-3), _batches(1), accumulation_steps=1)
    assert trainer.optimizer is not None
