"""Tests for the `celery-ojs-ml` command line: exit codes, `--json` shapes and messages.

The contract (exit 0 ok, 1 invalid or not eligible, 2 usage error or unreadable
file; `--json` shapes) is what other tools script against, so each case asserts
the exact text users see. Most cases run in-process through click's CliRunner;
one subprocess test per entry point proves the installed scripts are wired up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from celery_ojs_ml.capabilities import probe
from celery_ojs_ml.cli import offline
from celery_ojs_ml.cli.main import cli
from celery_ojs_ml.testing.fake_nvml import FakeNVML
from tests.helpers import EXAMPLES, ROOT

JOBS = EXAMPLES / "jobs"
WORKERS = EXAMPLES / "workers"
BIN = Path(sys.executable).parent


def invoke(*args: str | Path) -> Result:
    """Run the CLI in-process with stdout and stderr captured apart."""
    if tuple(int(x) for x in version("click").split(".")[:2]) < (8, 2):
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    else:
        runner = CliRunner()  # click 8.2+ always keeps result.stderr apart
    return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)


def write(tmp_path: Path, name: str, doc: Any) -> Path:
    """A file in tmp_path: JSON for dicts and lists, verbatim text for strings."""
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    return path


A100_JOB = {"type": "ml.train", "ext_ml_gpu_type": "nvidia-a100"}
GPU_COUNT_0 = {"type": "ml.train", "ext_ml_gpu_count": 0, "ext_ml_gpu_type": "nvidia-a100"}
GPU_COUNT_0_ERROR = (
    "ext_ml_gpu_count is 0 but ext_ml_gpu_type is set (OJS ML §3.2); "
    'set ext_ml_gpu_count >= 1, e.g. "ext_ml_gpu_count": 1, or remove ext_ml_gpu_type'
)


# validate


def test_validate_accepts_every_example_job_with_exit_0() -> None:
    files = sorted(JOBS.glob("*.json")) + sorted(JOBS.glob("*.yaml"))
    result = invoke("validate", *files)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [f"{f}: valid" for f in files]


def test_validate_json_prints_the_flat_canonical_requirements_after_inference() -> None:
    """§3.1/§3.2: a gpu type infers the gpu accelerator and one GPU."""
    result = invoke("validate", "--json", JOBS / "v03-13.5-cpu-only-inference-job.json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {
        "ext_ml_accelerator": "cpu",
        "ext_ml_cpu_cores": 4,
        "ext_ml_memory_gb": 8.0,
        "ext_ml_model_id": "distilbert-base",
        "ext_ml_model_version": "v1.2",
        "ext_ml_model_format": "onnx",
        "ext_ml_max_batch_size": 32,
        "ext_ml_timeout_seconds": 10,
        "ext_ml_runtime": "onnx",
        "ext_ml_priority_class": "on-demand",
        "ext_ml_preemptible": False,
    }


def test_validate_json_fills_the_accelerator_and_gpu_count_a_gpu_type_implies(
    tmp_path: Path,
) -> None:
    """§3.1 inference and the §3.2 default of one GPU."""
    result = invoke("validate", "--json", write(tmp_path, "a100.json", A100_JOB))
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {
        "ext_ml_accelerator": "gpu",
        "ext_ml_gpu_type": "nvidia-a100",
        "ext_ml_gpu_count": 1,
    }


LISTS: dict[str, tuple[Path, int]] = {
    "a workflow prints one object per step": (JOBS / "v03-12.1-training-pipeline-example.json", 4),
    "a flux jobspec prints one object per task": (JOBS / "flux-rfc25-example.yaml", 2),
}


@pytest.mark.parametrize(("path", "length"), list(LISTS.values()), ids=list(LISTS))
def test_validate_json_prints_a_list(path: Path, length: int) -> None:
    result = invoke("validate", "--json", path)
    assert result.exit_code == 0
    out = json.loads(result.stdout)
    assert isinstance(out, list)
    assert len(out) == length
    assert all(isinstance(step, dict) for step in out)
    assert all(key.startswith(("ext_ml_", "ext_mlx_")) for step in out for key in step)


def test_validate_json_of_a_flux_jobspec_gives_each_task_its_slot() -> None:
    result = invoke("validate", "--json", JOBS / "flux-rfc25-example.yaml")
    slot = {
        "ext_ml_accelerator": "gpu",
        "ext_ml_gpu_count": 1,
        "ext_ml_cpu_cores": 2,
        "ext_ml_timeout_seconds": 3600,
    }
    assert json.loads(result.stdout) == [slot, slot]


def test_validate_with_one_invalid_file_exits_1_and_names_attribute_section_and_fix(
    tmp_path: Path,
) -> None:
    good = write(tmp_path, "good.json", A100_JOB)
    bad = write(tmp_path, "bad.json", GPU_COUNT_0)
    result = invoke("validate", good, bad)
    assert result.exit_code == 1
    assert result.stdout == f"{good}: valid\n"
    assert result.stderr == f"{bad}: {GPU_COUNT_0_ERROR}\n"


def test_validate_prints_every_error_of_an_invalid_file(tmp_path: Path) -> None:
    bad = write(
        tmp_path,
        "bad.json",
        {"type": "ml.train", "ext_ml_gpu_memory_gb": -1, "ext_ml_tpu_type": "v9"},
    )
    result = invoke("validate", bad)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"{bad}: ext_ml_gpu_memory_gb is invalid: input should be greater than 0 (OJS ML §3.2); "
        'set ext_ml_gpu_memory_gb to a valid value, e.g. "ext_ml_gpu_memory_gb": 80',
        f"{bad}: ext_ml_tpu_type must be one of 'v4', 'v5e', 'v5p' or 'v6e' (OJS ML §3.3); "
        'set ext_ml_tpu_type to a valid value, e.g. "ext_ml_tpu_type": "v5e"',
    ]


def test_validate_of_a_document_that_is_not_an_object_exits_1(tmp_path: Path) -> None:
    path = write(tmp_path, "list.json", [1, 2])
    result = invoke("validate", path)
    assert result.exit_code == 1
    assert result.stderr == (
        f"{path}: <job> must be a JSON object (OJS core); "
        'write an envelope, e.g. {"type": "ml.train", "args": []}\n'
    )


def test_validate_of_a_missing_file_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    result = invoke("validate", missing)
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: cannot read {missing}: [Errno 2] No such file or directory: '{missing}'\n"
    )


def test_validate_of_a_directory_exits_2(tmp_path: Path) -> None:
    result = invoke("validate", tmp_path)
    assert result.exit_code == 2
    assert (
        result.stderr == f"Error: cannot read {tmp_path}: [Errno 21] Is a directory: '{tmp_path}'\n"
    )


def test_validate_of_a_file_that_is_not_utf8_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"type": "caf\xe9"}')
    result = invoke("validate", path)
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: cannot read {path}: 'utf-8' codec can't decode byte 0xe9 in position 13: "
        "invalid continuation byte\n"
    )


def test_validate_of_a_syntax_error_exits_2_and_says_where(tmp_path: Path) -> None:
    path = write(tmp_path, "broken.json", "{bad")
    result = invoke("validate", path)
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {path} is neither valid JSON nor YAML (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1)) (OJS core); check the file's syntax\n"
    )


def test_a_syntax_error_after_a_valid_file_still_exits_2(tmp_path: Path) -> None:
    good = write(tmp_path, "good.json", A100_JOB)
    result = invoke("validate", good, write(tmp_path, "broken.json", "{bad"))
    assert result.exit_code == 2
    assert result.stdout == f"{good}: valid\n"


SHADOW_JOB = {"type": "ml.train", "ext_mlx_artifact_model_uri": "file:///etc/shadow"}
HTTPS_JOB = {"type": "ml.train", "ext_mlx_artifact_model_uri": "https://models.example/m.onnx"}


def test_validate_refuses_a_file_artifact_uri_with_the_default_settings_extensions_12_1(
    tmp_path: Path,
) -> None:
    """OJS ML Extensions §12.1: backends MUST NOT allow arbitrary file system access."""
    path = write(tmp_path, "shadow.json", SHADOW_JOB)
    result = invoke("validate", path)
    assert result.exit_code == 1
    assert result.stderr == (
        f"{path}: ext_mlx_artifact_model_uri 'file:///etc/shadow' is not under an allowed "
        "prefix (OJS ML Extensions §12.1); use an object-store URI, e.g. "
        '"s3://bucket/models/v1.0/model.safetensors", or allow it with '
        'app.conf.ojs_ml_artifact_prefixes = ["file:///data/artifacts/"] '
        "(every artifact URI must then be under a listed prefix)\n"
    )


def test_validate_with_an_app_uses_its_artifact_settings(tmp_path: Path) -> None:
    path = write(tmp_path, "https.json", HTTPS_JOB)
    assert invoke("validate", path).exit_code == 1
    result = invoke("validate", "-A", "tests.cli.artifactapp:app", path)
    assert (result.exit_code, result.stdout) == (0, f"{path}: valid\n"), result.stderr


def test_validate_under_celery_a_uses_that_apps_settings(tmp_path: Path) -> None:
    from celery.bin.base import CLIContext

    from tests.cli.artifactapp import app

    path = write(tmp_path, "https.json", HTTPS_JOB)
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=False)
    result = CliRunner().invoke(cli, ["validate", str(path)], obj=obj, catch_exceptions=False)
    assert (result.exit_code, result.stdout) == (0, f"{path}: valid\n")


def test_validate_with_an_app_that_cannot_be_loaded_is_a_usage_error(tmp_path: Path) -> None:
    result = invoke("validate", "-A", "celery_ojs_ml.testing:nothing", write(tmp_path, "j", {}))
    assert result.exit_code == 2
    assert "cannot load the app 'celery_ojs_ml.testing:nothing'" in result.stderr


USAGE: dict[str, list[str]] = {
    "validate without a file": ["validate"],
    "validate with an unknown option": ["validate", "--yaml", "job.json"],
    "match without --worker": ["match", "--job", "job.json"],
    "match without --job": ["match", "--worker", "worker.json"],
    "explain without --workers": ["explain", "--job", "job.json"],
    "an unknown command": ["schedule"],
}


@pytest.mark.parametrize("args", list(USAGE.values()), ids=list(USAGE))
def test_a_usage_error_exits_2(args: list[str]) -> None:
    result = invoke(*args)
    assert result.exit_code == 2
    assert "Usage: " in result.stderr


def test_validate_without_a_file_says_which_argument_is_missing() -> None:
    result = invoke("validate")
    assert result.stderr.splitlines()[-1] == "Error: Missing argument 'FILES...'."


# match

MATCH_JSON_KEYS = ["eligible", "reasons", "score"]
REASON_KEYS = ["resource", "requested", "available", "capacity", "verdict", "message"]


def test_match_of_an_eligible_worker_exits_0_and_prints_its_score(tmp_path: Path) -> None:
    result = invoke(
        "match",
        "--job",
        write(tmp_path, "j.json", A100_JOB),
        "--worker",
        WORKERS / "a100x8-nvlink.json",
    )
    assert (result.exit_code, result.stdout) == (0, "eligible (score 100)\n")


def test_match_of_an_ineligible_worker_exits_1_and_lists_every_reason() -> None:
    job = JOBS / "zz-impossible-16x-b200.json"
    result = invoke("match", "--job", job, "--worker", WORKERS / "a100x8-nvlink.json")
    assert result.exit_code == 1
    assert result.stdout == (
        "not eligible: gpu_type nvidia-a100 not in [nvidia-b200]; "
        "compute_capability 8.0 < 8.9; gpu_count 8 < 16\n"
    )


def test_match_json_of_an_eligible_worker_has_no_reasons_and_a_score() -> None:
    result = invoke(
        "match",
        "--job",
        JOBS / "flux-rfc25-example.yaml",
        "--worker",
        WORKERS / "l4x1.json",
        "--json",
    )
    assert result.exit_code == 0
    body = json.loads(result.stdout)
    assert list(body) == MATCH_JSON_KEYS
    assert body == {"eligible": True, "reasons": [], "score": 100.0}


def test_match_json_of_an_ineligible_worker_lists_every_failed_hard_constraint() -> None:
    job = JOBS / "zz-impossible-16x-b200.json"
    result = invoke("match", "--job", job, "--worker", WORKERS / "a100x8-nvlink.json", "--json")
    assert result.exit_code == 1
    body = json.loads(result.stdout)
    assert list(body) == MATCH_JSON_KEYS
    assert body["eligible"] is False
    assert isinstance(body["score"], int | float) and 0 <= body["score"] <= 100
    assert all(list(reason) == REASON_KEYS for reason in body["reasons"])
    assert body["reasons"] == [
        {
            "resource": "gpu_type",
            "requested": "nvidia-b200",
            "available": "nvidia-a100",
            "capacity": "nvidia-a100",
            "verdict": "NEVER",
            "message": "gpu_type nvidia-a100 not in [nvidia-b200]",
        },
        {
            "resource": "compute_capability",
            "requested": "8.9",
            "available": "8.0",
            "capacity": "8.0",
            "verdict": "NEVER",
            "message": "compute_capability 8.0 < 8.9",
        },
        {
            "resource": "gpu_count",
            "requested": 16,
            "available": 8,
            "capacity": 8,
            "verdict": "NEVER",
            "message": "gpu_count 8 < 16",
        },
    ]


def test_match_accepts_bare_ext_ml_keys_and_a_v01_label_worker(tmp_path: Path) -> None:
    job = write(tmp_path, "bare.json", {"ext_ml_gpu_count": 2})
    result = invoke("match", "--job", job, "--worker", WORKERS / "t4x1-labels-v01.json")
    assert (result.exit_code, result.stdout) == (1, "not eligible: gpu_count 1 < 2\n")


def test_match_of_an_invalid_job_exits_1_with_the_teaching_error(tmp_path: Path) -> None:
    job = write(tmp_path, "bad.json", GPU_COUNT_0)
    result = invoke("match", "--job", job, "--worker", WORKERS / "l4x1.json")
    assert result.exit_code == 1
    assert result.stderr == f"{job}: {GPU_COUNT_0_ERROR}\n"


def test_match_of_a_workflow_exits_1_and_asks_for_one_step() -> None:
    job = JOBS / "v03-12.1-training-pipeline-example.json"
    result = invoke("match", "--job", job, "--worker", WORKERS / "l4x1.json")
    assert result.exit_code == 1
    assert result.stderr == (
        f"{job}: workflow_type is a workflow; match takes one job (OJS ML §12); "
        "pass one step of the workflow as its own file\n"
    )


def test_match_with_an_invalid_worker_file_exits_2(tmp_path: Path) -> None:
    worker = write(tmp_path, "w.json", {"cpu_core": 8})
    result = invoke("match", "--job", write(tmp_path, "j.json", A100_JOB), "--worker", worker)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {worker}: capabilities.cpu_core ")


def test_match_with_a_missing_job_file_exits_2(tmp_path: Path) -> None:
    result = invoke("match", "--job", tmp_path / "nope.json", "--worker", WORKERS / "l4x1.json")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: cannot read {tmp_path / 'nope.json'}: ")


# explain

NVLINK_8 = {"type": "ml.train", "ext_ml_gpu_count": 8, "ext_ml_gpu_interconnect": "nvlink"}


def test_explain_ranks_the_workers_that_can_run_the_job(tmp_path: Path) -> None:
    result = invoke("explain", "--job", write(tmp_path, "j.json", NVLINK_8), "--workers", WORKERS)
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [
        "a100x8-nvlink            FITS  score 100",
        "h100x8-train             FITS  score 100",
    ]


def test_explain_puts_the_worker_holding_the_model_first(tmp_path: Path) -> None:
    """§11.3 model locality raises the score of the worker with the model loaded."""
    job = write(
        tmp_path,
        "j.json",
        {"type": "ml.train", "ext_ml_gpu_count": 1, "ext_ml_model_id": "stable-diffusion-xl"},
    )
    result = invoke("explain", "--job", job, "--workers", WORKERS)
    assert result.exit_code == 0
    assert result.stdout.splitlines()[0] == "l4x1                     FITS  score 100"
    assert result.stdout.splitlines()[1].endswith("score 0")


def fleet(tmp_path: Path) -> Path:
    """Three single-GPU workers: two 40 GB A100s and a T4."""
    workers = tmp_path / "workers"
    workers.mkdir()
    for name, gpu in (
        ("a100-a", {"type": "nvidia-a100", "count": 1, "memory_gb": 40}),
        ("a100-b", {"type": "nvidia-a100", "count": 1, "memory_gb": 40}),
        ("t4", {"type": "nvidia-t4", "count": 1}),
    ):
        write(workers, f"{name}.json", {"worker_id": name, "capabilities": {"gpu": gpu}})
    return workers


def test_explain_prints_the_pending_message_and_exits_1_when_no_worker_can(
    tmp_path: Path,
) -> None:
    job = write(
        tmp_path,
        "j.json",
        {"type": "ml.train", "ext_ml_gpu_type": "nvidia-a100", "ext_ml_gpu_memory_gb": 80},
    )
    result = invoke("explain", "--job", job, "--workers", fleet(tmp_path))
    assert result.exit_code == 1
    assert result.stdout == (
        "0/3 workers eligible: 2 gpu_memory_gb 40 < 80, 1 gpu_memory_gb 16 < 80, "
        "1 gpu_type nvidia-t4 not in [nvidia-a100]\n"
    )


def test_explain_reads_a_file_holding_a_list_of_workers(tmp_path: Path) -> None:
    workers = write(
        tmp_path,
        "fleet.json",
        [
            {"worker_id": "big", "capabilities": {"gpu": {"type": "nvidia-h100", "count": 8}}},
            {"worker_id": "small", "capabilities": {"gpu": {"type": "nvidia-l4", "count": 1}}},
        ],
    )
    result = invoke("explain", "--job", write(tmp_path, "j.json", NVLINK_8), "--workers", workers)
    assert (result.exit_code, result.stdout) == (
        1,
        "0/2 workers eligible: 2 gpu_interconnect unknown != nvlink, 1 gpu_count 1 < 8\n",
    )


def test_explain_with_a_missing_workers_path_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    result = invoke("explain", "--job", write(tmp_path, "j.json", A100_JOB), "--workers", missing)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: cannot read {missing}: ")


def test_explain_of_an_invalid_job_exits_1(tmp_path: Path) -> None:
    job = write(tmp_path, "bad.json", GPU_COUNT_0)
    result = invoke("explain", "--job", job, "--workers", WORKERS)
    assert (result.exit_code, result.stderr) == (1, f"{job}: {GPU_COUNT_0_ERROR}\n")


# probe, schema, tour


@pytest.fixture
def no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe as on a machine without the NVIDIA driver, whatever this machine has."""
    monkeypatch.setattr(offline, "probe", lambda: probe(nvml=FakeNVML(driver=False)))


@pytest.mark.usefixtures("no_gpus")
def test_probe_json_on_a_machine_without_gpus_advertises_a_cpu_worker() -> None:
    result = invoke("probe", "--json")
    assert result.exit_code == 0
    body = json.loads(result.stdout)
    assert list(body) == ["capabilities"]
    caps = body["capabilities"]
    assert caps["accelerator"] == "cpu"
    assert "gpu" not in caps
    assert isinstance(caps["cpu_cores"], int) and caps["cpu_cores"] >= 1


@pytest.mark.usefixtures("no_gpus")
def test_probe_prints_the_derived_labels_one_a_line() -> None:
    result = invoke("probe")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert "accelerator          cpu" in lines
    assert "gpu_count            0" in lines
    assert lines == sorted(lines)


def test_schema_prints_the_json_schema_of_the_canonical_model() -> None:
    result = invoke("schema")
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert schema["type"] == "object"
    assert schema["title"] == "MLRequirements"
    assert "ext_ml_gpu_count" in schema["properties"]
    assert {"minimum": 0, "type": "integer"} in schema["properties"]["ext_ml_gpu_count"]["anyOf"]


def test_tour_exits_0_and_explains_why_nothing_runs_the_impossible_job() -> None:
    result = invoke("tour")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("zz-impossible-16x-b200 "))
    assert lines[row + 1].startswith("    why not: 0/6 workers eligible: ")
    assert lines[-1] == (
        "0 invalid example(s); workers: a100x8-nvlink, cpu-fetch-v01, h100x8-train, "
        "l4x1, t4x1, tpu-v5e-4x4"
    )


def test_help_lists_every_command() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    commands = result.stdout.split("Commands:")[1].split()
    for name in ("demo", "explain", "match", "probe", "schema", "tour", "validate"):
        assert name in commands


# entry points

VALID_JOB = JOBS / "v03-13.1-llm-inference-job.json"

ENTRY_POINTS: dict[str, list[str]] = {
    "the celery-ojs-ml console script validates a job": [str(BIN / "celery-ojs-ml")],
    "python -m celery_ojs_ml validates a job": [sys.executable, "-m", "celery_ojs_ml"],
    "celery ojs-ml validates a job through the celery.commands entry point": [
        str(BIN / "celery"),
        "ojs-ml",
    ],
}


@pytest.mark.parametrize("command", list(ENTRY_POINTS.values()), ids=list(ENTRY_POINTS))
def test_entry_point(command: list[str]) -> None:
    done = subprocess.run(
        [*command, "validate", str(VALID_JOB)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, f"{VALID_JOB}: valid\n"), done.stderr


def test_the_console_script_exits_2_on_a_usage_error() -> None:
    done = subprocess.run(
        [str(BIN / "celery-ojs-ml"), "match"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "Error: Missing option '--job'." in done.stderr
