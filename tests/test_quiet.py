"""Quiet runs (components.training.quiet): the known-harmless third-party messages are filtered narrowly, engine progress
comes from rank 0 unless log_per_rank, and other warnings still show."""

from __future__ import annotations

import logging
import warnings

import pytest
from ignite.engine import Engine
from monai.transforms import Orientationd

import components
from components.training import quiet


@pytest.fixture
def root_handler():
    """A handler on the root logger, as the bundles' logging.conf installs, recording what it would print."""
    records: list[logging.LogRecord] = []

    class Recorder(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Recorder(level=logging.INFO)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield handler, records
    root.removeHandler(handler)
    root.setLevel(level)


def test_orientation_future_warning_is_filtered_but_others_show():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet._INSTALLED.clear()
        components.install_filters()
        Orientationd(keys=["image"], axcodes="RAS")
        warnings.warn("monai.transforms.spatial.dictionary Something else: Current default value", FutureWarning)
    messages = [str(w.message) for w in caught if w.category is FutureWarning]
    assert not any("Orientationd.__init__:labels" in m for m in messages), messages
    assert any("Something else" in m for m in messages)  # narrow: not every MONAI FutureWarning


def test_fresh_run_line_is_a_start_line_and_a_real_resume_keeps_its_words(root_handler):
    handler, records = root_handler
    quiet._add_to_handlers(quiet._FreshRunLine())
    engine = Engine(lambda e, b: None)
    engine.logger.propagate = True
    engine.logger.setLevel(logging.INFO)
    engine.state.max_epochs = 2  # as MONAI's workflows set it at construction: ignite then says "resuming"
    engine.state.epoch_length = 1
    engine.run([0], max_epochs=2)
    lines = [r.getMessage() for r in records if r.name.startswith("ignite.engine.engine")]
    assert "Engine run starting, until 2 epochs" in lines, lines
    assert not any("resuming from iteration 0" in line for line in lines)
    engine.state.iteration, engine.state.epoch = 0, 1  # MONAI's evaluator at the second validation
    engine.run([0], max_epochs=2)
    assert not any("resuming from iteration 0" in r.getMessage() for r in records)
    engine.state.iteration, engine.state.epoch = 2, 2
    engine.run([0], max_epochs=3)  # a real resume: iteration 2
    assert any(r.getMessage().startswith("Engine run resuming from iteration 2, epoch 2") for r in records)


@pytest.mark.parametrize("rank, log_per_rank, shown", [(0, False, True), (1, False, False), (1, True, True)])
def test_engine_progress_from_rank_zero_unless_log_per_rank(root_handler, monkeypatch, rank, log_per_rank, shown):
    handler, records = root_handler
    monkeypatch.setattr(quiet, "get_rank", lambda: rank)
    components.log_from_rank_zero(log_per_rank)
    logging.getLogger("ignite.engine.engine.SSLTrainer").info("Epoch[1] Complete")
    logging.getLogger("ignite.engine.engine.SSLTrainer").warning("a warning from any rank")
    logging.getLogger("ssl_train.rank1").info("rank1_loss: 1.0")  # the per-rank handler of log_per_rank
    messages = [r.getMessage() for r in records]
    assert ("Epoch[1] Complete" in messages) is shown
    assert "a warning from any rank" in messages and "rank1_loss: 1.0" in messages
    handler.filters.clear()


def test_runner_filters_monais_eval_notice_for_its_own_runs(monkeypatch, tmp_path):
    """The runner (demo, benchmarks) runs this collection's own bundles: MONAI's "parsing config_file ... eval()"
    notice, printed before any bundle code loads, is filtered in its subprocesses; other warnings still show."""
    import sys

    from components.demo import runner

    script = ("import warnings; warnings.warn('parsing config_file c.json: any value is passed to eval()', UserWarning); "
              "warnings.warn('another notice', UserWarning)")  # fmt: skip
    monkeypatch.setattr(runner, "bundle_command", lambda *args, **kwargs: [sys.executable, "-c", script])
    log = tmp_path / "run.log"
    runner.run_bundle("any", log=log, echo=False)
    text = log.read_text()
    assert "parsing config_file" not in text and "another notice" in text
