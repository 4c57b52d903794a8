"""RankMe (components.training.rankme): the effective rank of embeddings, and the handler both pretraining bundles attach."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events
from monai.data import Dataset
from monai.transforms import RandSpatialCropSamplesd

import components
from components.training.rankme import EmbeddingRankHandler, effective_rank

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"


def test_constant_embeddings_read_one_and_random_ones_near_the_dimension():
    assert effective_rank(torch.ones(256, 64)) == pytest.approx(1.0, abs=1e-3)
    assert effective_rank(torch.zeros(8, 4)) == 1.0
    assert effective_rank(torch.eye(16)) == pytest.approx(16.0, rel=1e-5)
    gaussian = effective_rank(torch.randn(4096, 64, generator=torch.Generator().manual_seed(0)))
    assert 0.95 * 64 < gaussian <= 64
    rank_two = torch.randn(512, 2, generator=torch.Generator().manual_seed(1)) @ torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    assert 1.0 < effective_rank(rank_two) <= 2.0 + 1e-3


@pytest.mark.parametrize("bad, match", [(torch.ones(1, 8), "N >= 2"), (torch.ones(4), "N >= 2"),
                                        (torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), "not finite")])  # fmt: skip
def test_bad_embeddings_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        effective_rank(bad)


class _Encoder(torch.nn.Module):
    """A stand-in with a ``swinViT`` attribute: the last 'stage' is a linear map of the pooled input (or a constant)."""

    def __init__(self, collapsed: bool = False) -> None:
        super().__init__()
        self.swinViT = _Stages(collapsed)


class _Stages(torch.nn.Module):
    def __init__(self, collapsed: bool) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 32)
        self.collapsed = collapsed

    def forward(self, x: torch.Tensor, normalize: bool = True) -> list[torch.Tensor]:
        features = self.proj(x.flatten(1)[:, :64])
        if self.collapsed:
            features = torch.ones_like(features)
        return [features[:, :, None, None, None]]


def _volumes(count: int, identical: bool = False, marked: bool = False, num_samples: int = 2) -> Dataset:
    """A validation dataset as the bundles build it: volumes of 8^3 voxels, each item ``num_samples`` random 4^3 crops
    (64 values: what the stand-in encoder reads). ``identical``: the same volume ``count`` times; ``marked``: volume
    ``i`` shifted by ``10 * i``, so a crop tells its volume."""

    def volume(i: int) -> torch.Tensor:
        noise = torch.randn(1, 8, 8, 8, generator=torch.Generator().manual_seed(0 if identical else i))
        return noise + 10 * i if marked else noise

    crops = RandSpatialCropSamplesd("image", roi_size=(4, 4, 4), num_samples=num_samples, random_size=False)
    return Dataset([{"image": volume(i)} for i in range(count)], crops)


def _trainer(max_epochs: int) -> Engine:
    engine = Engine(lambda e, b: None)
    engine.state.max_epochs = max_epochs
    return engine


def _recording(images: list[torch.Tensor]):
    """``swin_embeddings`` that also keeps every batch of crops it is given."""

    def embed(network: torch.nn.Module, image: torch.Tensor) -> torch.Tensor:
        images.append(image)
        return components.swin_embeddings(network, image)

    return embed


def test_the_handler_logs_the_rank_at_its_interval_and_the_last_epoch(caplog):
    handler = EmbeddingRankHandler(_Encoder(), _volumes(3), crops=48, interval=2)
    trainer = _trainer(3)
    handler.attach(trainer)
    seen = {}

    @trainer.on(Events.EPOCH_COMPLETED)
    def _record(engine):
        seen[engine.state.epoch] = engine.state.metrics.get("val_rankme")

    with caplog.at_level("INFO", logger="components.training.rankme"):
        trainer.run([0], max_epochs=3)
    assert seen[1] is None and seen[2] is not None and seen[3] == seen[2]  # same crops, same weights: same value
    assert 20 < seen[2] <= 32
    assert "val_rankme" in caplog.text and "(48 crops x 32 dims; at most 32)" in caplog.text


def test_a_collapsed_encoder_reads_near_one_and_the_training_random_stream_is_untouched():
    handler = EmbeddingRankHandler(_Encoder(collapsed=True), _volumes(3), crops=16, interval=1)
    trainer = _trainer(1)
    handler.attach(trainer)
    torch.manual_seed(5)
    trainer.run([0], max_epochs=1)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))  # the handler ran inside a forked random state
    assert trainer.state.metrics["val_rankme"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("crops", [2, 25])
def test_exactly_n_crops_are_embedded_and_the_value_does_not_depend_on_the_list_length(crops):
    """The committed runs embedded 7, 14 or 29 crops: as many as their validation lists gave, so their values did not
    compare. With N fixed, the same volume listed 1, 3 or 7 times gives N crops and the same value."""
    encoder, values, counts = _Encoder(), set(), set()
    for count in (1, 3, 7):
        images: list[torch.Tensor] = []
        handler = EmbeddingRankHandler(encoder, _volumes(count, identical=True), crops=crops, batch_size=4,
                                       embed=_recording(images))  # fmt: skip
        trainer = _trainer(1)
        handler.attach(trainer)
        trainer.run([0], max_epochs=1)
        counts.add(sum(len(batch) for batch in images))
        values.add(trainer.state.metrics["val_rankme"])
        assert max(len(batch) for batch in images) <= 4
    assert counts == {crops} and len(values) == 1


def test_the_crops_cycle_over_the_volumes_and_are_the_same_at_every_evaluation():
    images: list[torch.Tensor] = []
    handler = EmbeddingRankHandler(_Encoder(), _volumes(3, marked=True), crops=14, batch_size=5,
                                   embed=_recording(images))
    first = handler.embeddings(torch.device("cpu"))
    crops = torch.cat(images)
    assert crops.shape == (14, 1, 4, 4, 4)
    # two crops per visit, the volumes in list order and again: 0 0 1 1 2 2 0 0 1 1 2 2 0 0
    assert [round(float(crop.mean()) / 10) for crop in crops] == [(j // 2) % 3 for j in range(14)]
    assert len({crop.sum().item() for crop in crops}) == 14  # each visit draws new random crops
    images.clear()
    assert torch.equal(handler.embeddings(torch.device("cpu")), first) and torch.equal(torch.cat(images), crops)


@pytest.mark.parametrize("bad, match", [({"crops": 1}, r"at least 2 crops \(training#rankme_crops\), got 1"),
                                        ({"batch_size": 0}, "batch size"), ({"interval": 0}, "interval")])  # fmt: skip
def test_bad_settings_fail_in_one_line_when_the_handler_is_built(bad, match):
    with pytest.raises(ValueError, match=match):
        EmbeddingRankHandler(_Encoder(), _volumes(1), **bad)


def test_an_empty_validation_list_is_named():
    handler = EmbeddingRankHandler(_Encoder(), _volumes(0))
    with pytest.raises(ValueError, match="the validation list has no volume"):
        handler.embeddings(torch.device("cpu"))


def test_swin_embeddings_pool_the_last_stage_of_a_real_encoder():
    net = components.SwinViTEmbedding(feature_size=12, window_size=4)
    x = torch.rand(3, 1, 32, 32, 32)
    assert torch.allclose(components.swin_embeddings(net, x), net(x))
    with pytest.raises(AttributeError, match="no swinViT"):
        components.swin_embeddings(torch.nn.Linear(2, 2), x)


@pytest.mark.parametrize("bundle, embedder", [("swin_unetr_ssl_pretrain", "@network_def"), ("swin_unetr_dino_pretrain", "@train#teacher_encoder"),
                                              ("swin_unetr_mim_pretrain", "@network_def")])  # fmt: skip
def test_the_pretraining_bundles_rank_the_released_encoder_on_rankme_crops_before_their_stats_handlers(bundle, embedder):
    """RankMe comes with the health report (components.HealthHandler), before the handlers that log the epoch's
    metrics, on the encoder the bundle releases, with crops bounded by the run's size ("auto")."""
    config = json.loads((BUNDLES / bundle / "configs" / "train.json").read_text())
    handlers = config["train"]["handlers"]
    targets = [h["_target_"] for h in handlers]
    rank = targets.index("components.HealthHandler")
    assert rank < targets.index("components.StatsWithEta") and rank < targets.index("TensorBoardStatsHandler")
    assert handlers[rank].get("embed_network", handlers[rank]["network"]) == embedder
    assert handlers[rank]["dataset"] == "@validate#dataset"
    assert handlers[rank]["crops"] == "@training#rankme_crops" and config["training"]["rankme_crops"] == "auto"
