"""Fuzz the offline CLI verbs: any file gives exit 0, 1 or 2 with a message, never a traceback.

`validate`, `match` and `explain --job --workers` run in-process through
click's CliRunner on files that are random bytes, random JSON, random YAML
(aliases, tags, dates and non-string keys included), truncated spec examples
and corrupted documents. Each run must end with exit code 0, 1 or 2 (io.py:
2 for an unreadable file, 1 for a document that breaks the spec or a worker
that cannot run the job) and say why on the stream the contract names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_ojs_ml.cli.main import cli
from tests.fuzz.strategies import (
    FLUX_EXAMPLE,
    corrupted,
    envelopes,
    example_paths,
    jobspecs,
    junk,
    mutated,
    workflows,
)
from tests.helpers import EXAMPLES

FUZZ = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
WORKER_PATHS = sorted((EXAMPLES / "workers").glob("*.json"))
WORKER_DOCS = [json.loads(p.read_text(encoding="utf-8")) for p in WORKER_PATHS]
JOB_TEXTS = [p.read_text(encoding="utf-8") for p in example_paths()]
WORKER_TEXTS = [p.read_text(encoding="utf-8") for p in WORKER_PATHS]

YAML_TRAPS = [
    "type: ml.train\next_mlx_training_hyperparameters: &h {a: *h}\n",
    "type: ml.train\next_ml_affinity: &a {required: [{key: a, operator: In, values: *a}]}\n",
    "workflow_type: chain\nsteps: &s [{type: ml.x, args: *s}]\n",
    "version: 1\nresources: &r [{type: slot, count: 1, label: default, with: *r}]\n",
    "type: ml.train\next_mlx_training_hyperparameters: {started: 2024-01-01}\n",
    "type: ml.train\next_mlx_model_name: 2024-01-01\n",
    "type: ml.train\n1: 2\n",
    "type: ml.train\n? [1, 2]\n: x\n",
    "type: ml.train\nmeta: {resources: {gpu: {1: 2}}}\n",
    "type: !!python/object:os.system ls\n",
    "type: ml.train\next_ml_gpu_count: !!binary aGVsbG8=\n",
    "type: ml.train\next_mlx_training_hyperparameters: !!set {a, b}\n",
    "---\ntype: ml.train\n---\ntype: ml.other\n",
    "type: ml.train\next_ml_gpu_count: .nan\next_ml_memory_gb: .inf\n",
    "type: ml.train\next_ml_timeout_seconds: 1e999\n",
    "worker_id: w\ncapabilities: &c {gpu: *c}\n",
    "worker_id: w\nlabels: [gpu_count:1, gpu_count:x, '::', ~]\n",
    "worker_id: w\ncapabilities: {gpu: {type: nvidia-l4, count: 1, seen: 2024-01-01}}\n",
    "[]\n",
    "~\n",
    "\ufeff{}",
    '{"type": "ml.train", "ext_ml_gpu_count": NaN}',
    '{"type": "ml.train", "ext_ml_gpu_count": 1e400}',
]
"""Hand-picked YAML and JSON edge cases random text rarely hits."""


def _truncated(texts: list[str]) -> st.SearchStrategy[str]:
    return st.sampled_from(texts).flatmap(lambda t: st.integers(0, len(t)).map(lambda n: t[:n]))


def _yaml(doc: Any) -> str:
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


def _json(doc: Any) -> str:
    return json.dumps(doc, ensure_ascii=False)


def _texts(docs: st.SearchStrategy[Any]) -> st.SearchStrategy[str]:
    return docs.map(_json) | docs.map(_yaml)


any_text = (
    st.text(max_size=200)
    | junk.map(_json)
    | junk.map(_yaml)
    | st.sampled_from(YAML_TRAPS)
    | st.text(alphabet="{}[]:,-&*!?'\"#| \n\tab01", max_size=60)
)
job_texts = (
    _texts(envelopes | workflows)
    | jobspecs.map(_yaml)
    | _truncated(JOB_TEXTS)
    | _texts(mutated([FLUX_EXAMPLE]))
    | any_text
)
worker_texts = _texts(corrupted(st.sampled_from(WORKER_DOCS))) | _truncated(WORKER_TEXTS) | any_text
contents = st.one_of(job_texts.map(str.encode), st.binary(max_size=200))
worker_contents = st.one_of(worker_texts.map(str.encode), st.binary(max_size=120))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("cli-fuzz")


def _write(path: Path, content: bytes) -> str:
    path.write_bytes(content)
    return str(path)


def _run(*args: str) -> Result:
    """Run the CLI in-process; exceptions are caught so the test can look at them."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=True)


def _assert_clean_exit(result: Result) -> None:
    """Exit 0, 1 or 2 by sys.exit or a click error: never an exception, never a traceback."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"the CLI raised {result.exception!r}:\n{result.output}") from (
            result.exception
        )
    assert result.exit_code in (0, 1, 2), result.output
    assert "Traceback" not in result.output


def _assert_unreadable(result: Result, path: str) -> None:
    """Exit 2: one click error naming the file (io.py's `Unreadable`)."""
    assert result.stderr.startswith("Error: "), result.output
    assert path in result.stderr


@FUZZ
@given(content=contents, as_json=st.booleans())
def test_validate_of_any_file_exits_0_1_or_2_and_names_the_file(
    workdir: Path, content: bytes, as_json: bool
) -> None:
    path = _write(workdir / "job.yaml", content)
    result = _run("validate", *(["--json"] if as_json else []), path)
    _assert_clean_exit(result)
    if result.exit_code == 0:
        out = result.stdout
        assert json.loads(out) is not None if as_json else out == f"{path}: valid\n"
    elif result.exit_code == 1:  # one line per violation, each naming the file
        lines = result.stderr.splitlines()
        assert lines and all(line.startswith(f"{path}: ") for line in lines), result.stderr
        assert result.stdout == ""
    else:
        _assert_unreadable(result, path)


@FUZZ
@given(job=contents, worker=worker_contents, as_json=st.booleans())
def test_match_of_any_job_and_worker_files_exits_0_1_or_2_with_a_reason(
    workdir: Path, job: bytes, worker: bytes, as_json: bool
) -> None:
    job_path = _write(workdir / "job.json", job)
    worker_path = _write(workdir / "worker.json", worker)
    args = ["match", "--job", job_path, "--worker", worker_path, *(["--json"] if as_json else [])]
    result = _run(*args)
    _assert_clean_exit(result)
    if result.exit_code == 2:
        _assert_unreadable(result, job_path if job_path in result.stderr else worker_path)
    elif result.stdout and as_json:
        body = json.loads(result.stdout)
        assert body["eligible"] is (result.exit_code == 0)
    elif result.stdout:
        expected = "eligible (score " if result.exit_code == 0 else "not eligible: "
        assert result.stdout.startswith(expected), result.stdout
    else:  # the job breaks the spec: its violations, naming the job file
        assert result.exit_code == 1
        assert result.stderr.startswith(f"{job_path}: "), result.stderr


@FUZZ
@given(
    job=contents,
    workers=st.lists(worker_contents, min_size=1, max_size=3),
    as_dir=st.booleans(),
)
def test_explain_of_any_job_and_fleet_exits_0_1_or_2_with_a_reason(
    workdir: Path, job: bytes, workers: list[bytes], as_dir: bool
) -> None:
    job_path = _write(workdir / "explain-job.yaml", job)
    fleet = workdir / "fleet"
    fleet.mkdir(exist_ok=True)
    for old in fleet.iterdir():
        os.unlink(old)
    for i, content in enumerate(workers):
        _write(fleet / f"w{i}.json", content)
    target = str(fleet) if as_dir else str(fleet / "w0.json")
    result = _run("explain", "--job", job_path, "--workers", target)
    _assert_clean_exit(result)
    if result.exit_code == 2:
        assert result.stderr.startswith("Error: "), result.output
    elif result.exit_code == 0:
        assert " score " in result.stdout
    else:
        assert result.stdout or result.stderr.startswith(f"{job_path}: "), result.output


def test_every_spec_example_validates_so_the_corpus_starts_from_valid_documents() -> None:
    paths = [str(p) for p in example_paths()]
    result = _run("validate", *paths)
    assert (result.exit_code, result.stderr) == (0, "")


@pytest.mark.parametrize("text", YAML_TRAPS, ids=[f"trap{i}" for i in range(len(YAML_TRAPS))])
@pytest.mark.parametrize("verb", ["validate", "validate --json", "match", "explain"])
def test_a_yaml_or_json_edge_case_exits_0_1_or_2_in_every_verb(
    workdir: Path, verb: str, text: str
) -> None:
    path = _write(workdir / "trap.yaml", text.encode())
    if verb.startswith("validate"):
        args = [*verb.split(), path]
    else:
        worker = str(WORKER_PATHS[0])
        args = [verb, "--job", path, "--worker" if verb == "match" else "--workers", worker]
    _assert_clean_exit(_run(*args))
    worker_args = ["match", "--job", str(EXAMPLES / "jobs" / "mlx-5.2-inference-job.json")]
    _assert_clean_exit(_run(*worker_args, "--worker", path))


def test_validate_prints_one_line_per_violation_when_a_key_holds_a_line_break(
    workdir: Path,
) -> None:
    """A key holding a line break or an escape sequence is printed escaped: one violation,
    one line, and no raw control bytes reach the terminal."""
    doc = {"type": "ml.train", "ext_ml_node_selector": {"a\nb\x1b[31m": "x"}}
    path = _write(workdir / "newline-key.json", json.dumps(doc).encode())
    result = _run("validate", path)
    assert result.exit_code == 1
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "\x1b" not in result.stderr
    assert "a\\nb\\x1b[31m" in result.stderr, result.stderr
