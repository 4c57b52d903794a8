"""The pretraining bundle's data-path and speed options: compact cache, loader prefetching and pinning, data on the
device, and torch.compile on CPU."""

from __future__ import annotations

import pytest
import torch
from monai.bundle import ConfigParser
from monai.data import DataLoader
from monai.transforms import CropForegroundd, RandSpatialCropSamplesd, ToDeviced
from torch import nn

from components import (CompactCropForegroundd, PersistentWorkerLoader, RandCompactSpatialCropSamplesd, SSLLoss, SSLTrainer,
                        bundle_loader, write_dataset)  # fmt: skip
from components.demo.runner import BUNDLES_DIR
from components.config.running import run_config_files
from tests.test_engine import TinySSLNet  # SSLHead's interface at a size inductor compiles in seconds

pytestmark = pytest.mark.filterwarnings("ignore:monai.transforms.spatial.dictionary Orientationd:FutureWarning")

CONFIGS = BUNDLES_DIR / "swin_unetr_ssl_pretrain" / "configs"


def _parser(**overrides) -> ConfigParser:
    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(CONFIGS.parent, ["train.json"])])
    parser.update({"device": "cpu", **overrides})
    return parser


def _types(pipeline) -> list[type]:
    return [type(t) for t in pipeline.transforms]


def test_compact_cache_is_the_default_and_the_recipes_pipeline_is_one_override_away():
    compact = _types(_parser().get_parsed_content("train#preprocessing"))
    assert CompactCropForegroundd in compact and RandCompactSpatialCropSamplesd in compact
    assert CropForegroundd not in compact and RandSpatialCropSamplesd not in compact
    assert ToDeviced not in compact  # data_on_device is off by default
    plain = _parser(**{"train#transforms": "%train#plain_transforms"})  # as a CLI passes it
    recipe = _types(plain.get_parsed_content("train#preprocessing"))
    assert CropForegroundd in recipe and RandSpatialCropSamplesd in recipe and CompactCropForegroundd not in recipe
    assert _types(plain.get_parsed_content("validate#preprocessing")) == recipe  # validation follows the choice


def test_validation_gets_its_own_pipeline_instance():
    parser = _parser()
    train, val = parser.get_parsed_content("train#preprocessing"), parser.get_parsed_content("validate#preprocessing")
    assert _types(train) == _types(val) and train is not val  # reseeding one never moves the other's random state


@pytest.mark.parametrize(
    "overrides, workers, pin, prefetch",
    [
        ({"loader#num_workers": 4}, 4, torch.cuda.is_available(), 2),
        ({"loader#num_workers": 0}, 0, torch.cuda.is_available(), None),  # torch rejects prefetch_factor without workers
        ({"loader#num_workers": 2, "loader#prefetch_factor": 6, "loader#pin_memory": "true"}, 2, True, 6),
        ({"loader#num_workers": 4, "loader#data_on_device": "true", "loader#pin_memory": True}, 0, False, None),  # device tensors: no
    ],  # worker processes, no pinning
)
def test_loader_options(overrides, workers, pin, prefetch):
    """The loader settings as a command line gives them, read by the loader the bundle builds for training and for
    validation (components.bundle_loader, given the whole loader group)."""
    parser = _parser(**overrides)
    for part in ("train", "validate"):
        assert parser[f"{part}#dataloader#_target_"] == "components.bundle_loader"
        assert parser[f"{part}#dataloader#settings"] == "@loader"
        loader = bundle_loader(list(range(4)), 1, parser.get_parsed_content("loader"), training=part == "train")
        assert (loader.num_workers, loader.pin_memory, loader.prefetch_factor) == (workers, pin, prefetch)
        assert type(loader) is (PersistentWorkerLoader if part == "train" else DataLoader)


def test_data_on_device_caches_after_moving_to_the_device(tmp_path):
    """The CPU path of the fast-training route: ToDeviced sits in the cached part, the loader runs in-process."""
    write_dataset(tmp_path / "ct", kind="ct", num=4, seed=2)
    parser = _parser(
        dataset_dir=str(tmp_path / "ct"), roi_size=[64, 32, 32], batch_size=1,
        **{"loader#data_on_device": True, "training#num_samples": 1},
    )
    assert ToDeviced in _types(parser.get_parsed_content("train#preprocessing"))
    loader = parser.get_parsed_content("train#dataloader")
    assert loader.num_workers == 0 and not loader.pin_memory
    cached = loader.dataset._cache[0]
    assert cached["image"].device == torch.device("cpu") and cached["image"].dtype == torch.int16
    batch = next(iter(loader))
    assert batch["image"].shape == (1, 1, 64, 32, 32) and batch["image"].dtype == torch.float32
    # MONAI's fast-training loader, as the docs suggest it: --train#dataloader#loader_class ThreadDataLoader
    parser["train#dataloader#loader_class"] = "ThreadDataLoader"
    thread_loader = parser.get_parsed_content("train#dataloader", lazy=False)
    assert type(thread_loader).__name__ == "ThreadDataLoader"
    assert next(iter(thread_loader))["image"].shape == (1, 1, 64, 32, 32)


def test_compile_is_an_opt_in_config_id():
    """Off by default; the trainer takes speed#compile as the command line gives it and reads the word itself."""
    assert _parser().get_parsed_content("train#trainer#compile") is False
    assert _parser(**{"speed#compile": "true"}).get_parsed_content("train#trainer#compile") == "true"
    assert _parser().get_parsed_content("train#trainer#compile_kwargs") == {}
    net = TinySSLNet()
    trainer = SSLTrainer(device="cpu", max_epochs=1, train_data_loader=[], network=net, loss_function=SSLLoss(),
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1), compile="false")  # fmt: skip
    assert trainer.compile is False


def _train(compile: bool) -> tuple[SSLTrainer, nn.Module]:
    torch.manual_seed(0)
    net = TinySSLNet()
    g = torch.Generator().manual_seed(0)
    batches = [{"image": torch.rand(2, 1, 20, 20, 20, generator=g)} for _ in range(2)]
    trainer = SSLTrainer(
        device="cpu",
        max_epochs=1,
        train_data_loader=batches,
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_function=SSLLoss(),
        compile=compile,
    )
    trainer.run()
    return trainer, net


def test_compile_runs_the_ssl_iteration_on_cpu():
    """SSLTrainer's own _iteration runs the network MONAI compiled (inductor, C++ on CPU): same training as eager."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compiled, compiled_net = _train(compile=True)
        eager, eager_net = _train(compile=False)
    finally:
        torch.set_num_threads(threads)
    assert type(compiled.network).__name__ == "OptimizedModule" and compiled.network._orig_mod is compiled_net
    out = compiled.state.output[0]
    assert torch.isfinite(out["loss"]) and out["pred"].shape == (4, 1, 20, 20, 20)
    for a, b in zip(compiled_net.parameters(), eager_net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert set(compiled_net.state_dict()) == set(eager_net.state_dict())  # no _orig_mod. in the saved keys
