"""Layer-wise learning-rate decay and the frozen-encoder warm-up of the finetuning bundles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser
from monai.engines import SupervisedTrainer
from monai.engines.utils import IterationEvents
from monai.networks.nets import SwinUNETR
from monai.optimizers import WarmupCosineSchedule

import components
from components.config.running import run_config_files

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"
LR = 1e-3


def _net() -> SwinUNETR:
    torch.manual_seed(0)
    return SwinUNETR(in_channels=1, out_channels=2, feature_size=12, window_size=4)


def _stage(name: str) -> str:
    return name.split(".")[1] if name.startswith("swinViT.") else "decoder"


def test_groups_decay_by_stage_from_the_bottleneck_and_hold_every_parameter_once():
    net = _net()
    groups = components.encoder_param_groups(net, LR, decay=0.5)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in net.parameters())
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    expected = {"decoder": LR, "layers4": LR / 2, "layers3": LR / 4, "layers2": LR / 8, "layers1": LR / 16, "patch_embed": LR / 32}
    for name, param in net.named_parameters():
        assert lr_of[id(param)] == pytest.approx(expected[_stage(name)]), name


def test_ddp_prefix_is_ignored_and_decay_one_is_the_plain_parameter_list():
    class Wrapper(torch.nn.Module):  # names as DistributedDataParallel gives them: module.<name>
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    net = _net()
    plain = {g["lr"]: len(g["params"]) for g in components.encoder_param_groups(net, LR, 0.5)}
    wrapped = {g["lr"]: len(g["params"]) for g in components.encoder_param_groups(Wrapper(net), LR, 0.5)}
    assert wrapped == plain and len(plain) == 6
    single = components.encoder_param_groups(net, LR, 1.0)
    assert [id(p) for p in single] == [id(p) for p in net.parameters()]


@pytest.mark.parametrize("kwargs, match", [({"decay": 0.0}, "encoder_lr_decay"), ({"decay": 1.5}, "encoder_lr_decay"),
                                           ({"decay": 0.5, "prefix": "encoder_x."}, "no parameter")])  # fmt: skip
def test_bad_decay_or_prefix_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        components.encoder_param_groups(_net(), LR, **kwargs)


def test_warmup_cosine_keeps_the_ratios_between_groups():
    net = _net()
    opt = torch.optim.AdamW(components.encoder_param_groups(net, LR, 0.5))
    sched = WarmupCosineSchedule(opt, warmup_steps=3, t_total=10)
    for _ in range(5):
        opt.step()
        sched.step()
        lrs = [g["lr"] for g in opt.param_groups]
        assert lrs[0] > 0 and all(lr / lrs[0] == pytest.approx(0.5**i) for i, lr in enumerate(lrs))


def test_frozen_encoder_does_not_change_until_the_warm_up_ends():
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    torch.manual_seed(1)
    data = [{"image": torch.rand(1, 1, 64, 32, 32), "label": torch.randint(0, 2, (1, 1, 64, 32, 32)).float()} for _ in range(3)]
    trainer = SupervisedTrainer(device="cpu", max_epochs=1, train_data_loader=data, network=net, optimizer=opt,
                                loss_function=lambda pred, label: (pred.softmax(1)[:, 1:] - label).abs().mean(),
                                train_handlers=[components.FreezeEncoder(net, iterations=2)])  # fmt: skip
    encoder = {k: v.clone() for k, v in net.state_dict().items() if k.startswith("swinViT.")}
    decoder = {k: v.clone() for k, v in net.state_dict().items() if k.startswith("decoder1.")}
    seen = []

    @trainer.on(IterationEvents.MODEL_COMPLETED)
    def _snapshot(engine):
        state = net.state_dict()
        seen.append((all(torch.equal(state[k], v) for k, v in encoder.items()),
                     any(not torch.equal(state[k], v) for k, v in decoder.items())))  # fmt: skip

    trainer.run()
    assert seen == [(True, True), (True, True), (False, True)]


def _train_frozen(iterations: int, planned_epochs: int) -> tuple[dict, SwinUNETR]:
    """6 iterations (2 epochs of 3) with the encoder frozen for ``iterations``; the handler attaches while the trainer
    plans ``planned_epochs`` epochs (more than 2: the run looks longer than the freeze, which takes the
    gradient-dropping path)."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    torch.manual_seed(1)
    data = [{"image": torch.rand(1, 1, 64, 32, 32), "label": torch.randint(0, 2, (1, 1, 64, 32, 32)).float()} for _ in range(3)]
    before = {k: v.clone() for k, v in net.state_dict().items()}
    trainer = SupervisedTrainer(device="cpu", max_epochs=planned_epochs, train_data_loader=data, network=net, optimizer=opt,
                                loss_function=lambda pred, label: (pred.softmax(1)[:, 1:] - label).abs().mean(),
                                train_handlers=[components.FreezeEncoder(net, iterations=iterations)])  # fmt: skip
    trainer.state.max_epochs = 2
    trainer.run()
    return before, net


def test_an_encoder_frozen_for_the_whole_run_gets_no_gradients_and_trains_the_rest_identically():
    before, whole = _train_frozen(6, planned_epochs=2)
    assert all(not p.requires_grad for n, p in whole.named_parameters() if n.startswith("swinViT."))
    _, dropping = _train_frozen(6, planned_epochs=3)
    assert all(p.requires_grad for p in dropping.parameters())
    whole_state, dropping_state = whole.state_dict(), dropping.state_dict()
    assert all(torch.equal(whole_state[k], v) for k, v in before.items() if k.startswith("swinViT."))
    assert any(not torch.equal(whole_state[k], v) for k, v in before.items() if k.startswith("decoder1."))
    assert all(torch.equal(whole_state[k], v) for k, v in dropping_state.items()), "the two freezes trained differently"


def test_freeze_encoder_rejects_a_negative_count_or_a_network_without_encoder():
    with pytest.raises(ValueError, match="freeze_encoder_iterations must be >= 0"):
        components.FreezeEncoder(_net(), iterations=-1)
    with pytest.raises(ValueError, match="no parameter"):
        components.FreezeEncoder(torch.nn.Linear(2, 2), iterations=1)


@pytest.mark.parametrize("bundle", ["swin_unetr_btcv_finetune", "swin_unetr_brats_finetune"])
def test_finetuning_bundles_expose_both_levers(bundle, tmp_path):
    for decay, groups in ((1.0, 1), (0.7, 6)):
        parser = ConfigParser()
        parser.read_config([str(f) for f in run_config_files(BUNDLES / bundle, ["train.json"])])
        parser.update({"feature_size": 12, "device": "cpu", "training#encoder_lr_decay": decay, "training#freeze_encoder_iterations": 5,
                       "output_dir": str(tmp_path / "eval"), "ckpt_dir": str(tmp_path / "models")})  # the handlers write there
        parser.parse()
        optimizer = parser.get_parsed_content("train#optimizer")
        assert len(optimizer.param_groups) == groups
        assert optimizer.param_groups[-1]["lr"] == pytest.approx(parser["learning_rate"] * (decay**5 if groups > 1 else 1))
        (freeze,) = [h for h in parser.get_parsed_content("train#handlers") if isinstance(h, components.FreezeEncoder)]
        assert freeze.iterations == 5 and len(freeze.params) > 100
