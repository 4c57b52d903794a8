"""RankMe (components.rankme): the effective rank of embeddings, and the handler both pretraining bundles attach."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events

import components
from components.rankme import EmbeddingRankHandler, effective_rank

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


def _loader(n: int = 48):
    torch.manual_seed(0)
    return [{"image": torch.randn(4, 1, 4, 4, 4)} for _ in range(n // 4)]


def _trainer(max_epochs: int) -> Engine:
    engine = Engine(lambda e, b: None)
    engine.state.max_epochs = max_epochs
    return engine


def test_the_handler_logs_the_rank_at_its_interval_and_the_last_epoch(caplog):
    handler = EmbeddingRankHandler(_Encoder(), _loader(), interval=2)
    trainer = _trainer(3)
    handler.attach(trainer)
    seen = {}

    @trainer.on(Events.EPOCH_COMPLETED)
    def _record(engine):
        seen[engine.state.epoch] = engine.state.metrics.get("val_rankme")

    with caplog.at_level("INFO", logger="components.rankme"):
        trainer.run([0], max_epochs=3)
    assert seen[1] is None and seen[2] is not None and seen[3] == seen[2]  # same crops, same weights: same value
    assert 20 < seen[2] <= 32
    assert "val_rankme" in caplog.text and "(12 crops x 32 dims" not in caplog.text and "48 crops x 32 dims" in caplog.text


def test_a_collapsed_encoder_reads_near_one_and_the_training_random_stream_is_untouched():
    handler = EmbeddingRankHandler(_Encoder(collapsed=True), _loader(), interval=1)
    trainer = _trainer(1)
    handler.attach(trainer)
    torch.manual_seed(5)
    trainer.run([0], max_epochs=1)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))  # the handler ran inside a forked random state
    assert trainer.state.metrics["val_rankme"] == pytest.approx(1.0, abs=1e-3)


def test_one_crop_is_skipped_with_a_warning(caplog):
    handler = EmbeddingRankHandler(_Encoder(), [{"image": torch.randn(1, 1, 4, 4, 4)}])
    trainer = _trainer(1)
    handler.attach(trainer)
    with caplog.at_level("WARNING", logger="components.rankme"):
        trainer.run([0], max_epochs=1)
    assert "val_rankme" not in trainer.state.metrics and "at least 2" in caplog.text


def test_swin_embeddings_pool_the_last_stage_of_a_real_encoder():
    net = components.SwinViTEmbedding(feature_size=12, window_size=4)
    x = torch.rand(3, 1, 32, 32, 32)
    assert torch.allclose(components.swin_embeddings(net, x), net(x))
    with pytest.raises(AttributeError, match="no swinViT"):
        components.swin_embeddings(torch.nn.Linear(2, 2), x)


@pytest.mark.parametrize("bundle, network", [("swin_unetr_ssl_pretrain", "@network_def"), ("swin_unetr_dino_pretrain", "@train#teacher_encoder")])
def test_both_pretraining_bundles_rank_the_released_encoder_before_their_stats_handlers(bundle, network):
    handlers = json.loads((BUNDLES / bundle / "configs" / "train.json").read_text())["train"]["handlers"]
    targets = [h["_target_"] for h in handlers]
    rank = targets.index("components.EmbeddingRankHandler")
    assert rank < targets.index("components.StatsWithEta") and rank < targets.index("TensorBoardStatsHandler")
    assert handlers[rank]["network"] == network and handlers[rank]["data_loader"] == "@validate#dataloader"
