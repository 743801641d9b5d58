"""The Python examples import and declare what their docs say (they run against a broker)."""

from __future__ import annotations

import importlib


def test_the_reservation_pipeline_example_declares_an_8_gpu_training_step() -> None:
    mod = importlib.import_module("examples.reservation_pipeline")
    assert mod.train.ml == {"ext_ml_gpu_count": 8}
    assert callable(mod.run_pipeline) and mod.ml.app is mod.app


def test_the_gang_training_example_checkpoints_and_is_a_gang_task() -> None:
    mod = importlib.import_module("examples.gang_training")
    assert mod.train.ml["ext_ml_checkpoint_enabled"] is True
    assert mod.ml.app is mod.app


def test_the_inference_example_caches_its_model_and_deduplicates() -> None:
    mod = importlib.import_module("examples.inference_app")
    assert mod.encode.ml["ext_ml_model_id"] == "tiny-encoder"
    assert mod.encode.ml_dedup == {"window_s": 10}
