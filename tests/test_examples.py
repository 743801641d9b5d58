"""The Python examples import, document how to run them, and declare what their docs say.

They run end to end against real workers in tests/integration/test_examples_run.py.
"""

from __future__ import annotations

import importlib
import re

import pytest

from tests.helpers import EXAMPLES

NAMES = sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_"))


def test_every_example_is_covered_here() -> None:
    assert NAMES == [
        "gang_training",
        "inference_app",
        "reservation_pipeline",
        "spot_sweep",
        "spot_training",
        "train_evaluate_deploy",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_every_example_documents_its_worker_and_run_commands_and_has_a_main(name: str) -> None:
    mod = importlib.import_module(f"examples.{name}")
    doc = mod.__doc__ or ""
    assert re.search(
        rf"^ +(\S+=\S+ )*celery -A examples\.{name} worker .*--ojs-ml-capabilities=", doc, re.M
    )
    assert re.search(rf"^ +python -m examples\.{name}\b", doc, re.M)
    assert "OJS_EXAMPLE_BROKER" in doc
    assert callable(mod.main)


@pytest.mark.parametrize("name", NAMES)
def test_every_example_task_has_the_same_name_under_python_m_as_in_the_worker(name: str) -> None:
    """Celery names a task of `__main__` after `app.main`: it must be the module's name."""
    mod = importlib.import_module(f"examples.{name}")
    assert mod.app.main == f"examples.{name}"
    ours = [t.name for t in mod.app.tasks.values() if t.__module__ == mod.__name__]
    assert ours and all(t.startswith(f"examples.{name}.") for t in ours), ours


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


def test_the_spot_training_example_is_a_checkpointing_spot_job() -> None:
    mod = importlib.import_module("examples.spot_training")
    assert mod.train.ml["ext_ml_priority_class"] == "spot"
    assert mod.train.ml["ext_ml_checkpoint_enabled"] is True
    assert mod.urgent.ml["ext_ml_priority_class"] == "reserved"


def test_the_sweep_example_trials_escalate_from_spot() -> None:
    mod = importlib.import_module("examples.spot_sweep")
    assert mod.trial.ml["ext_ml_priority_class"] == "spot"
    assert mod.trial.ml["ext_ml_priority_escalation"] is True


def test_the_pipeline_example_gates_deployment_on_evaluation_thresholds() -> None:
    mod = importlib.import_module("examples.train_evaluate_deploy")
    assert mod.evaluate_model.ml["ext_mlx_eval_thresholds"]["accuracy"] == {"min": 0.9}
