"""The recipes' TensorBoard pictures of the first validation batch (components.recipes.pictures)."""

from __future__ import annotations

import torch
from ignite.engine import Engine
from monai.utils import CommonKeys as Keys

from components.recipes import MaskedViewsImageHandler, SSLViewsImageHandler


def _evaluate(handler, outputs: list[dict], tmp_path) -> list:
    """Runs an engine of ``outputs`` (one per iteration) with ``handler`` attached; returns TensorBoard's images."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine = Engine(lambda engine, batch: batch)
    handler.attach(engine)
    engine.run(outputs, max_epochs=1)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    return [events.Images(tag) for tag in events.Tags()["images"]]


def test_the_ssl_picture_is_the_first_batchs_crops_views_and_reconstructions(tmp_path):
    crop = torch.rand(3, 1, 8, 6, 4)
    output = {Keys.IMAGE: crop, "views": torch.rand(6, 1, 8, 6, 4), Keys.PRED: torch.rand(6, 1, 8, 6, 4)}
    handler = SSLViewsImageHandler(str(tmp_path), max_crops=2)
    picture = handler.picture(output)
    assert picture.shape == (1, 2 * 8, 5 * 6)  # 2 crops: clean, two views, two reconstructions
    assert torch.equal(picture[0, :8, :6], crop[0, 0, :, :, 2])
    (images,) = _evaluate(handler, [output, {**output, Keys.IMAGE: crop * 0}], tmp_path)
    assert len(images) == 1 and images[0].step == 1  # one picture per evaluation, of its first batch


def test_the_masked_picture_shows_crop_mask_reconstruction_and_target_scaled_together(tmp_path):
    image = torch.rand(2, 1, 8, 6, 4)
    output = {Keys.IMAGE: image, "masked": image * 0, "reconstruction": image * 2, "target": image - 3}
    picture = MaskedViewsImageHandler(str(tmp_path), max_crops=1).picture(output)
    assert picture.shape == (1, 8, 4 * 6) and float(picture.min()) == 0.0 and float(picture.max()) == 1.0
    (images,) = _evaluate(MaskedViewsImageHandler(str(tmp_path)), [output], tmp_path)
    assert len(images) == 1
