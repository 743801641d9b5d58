"""Fuzz the publish API: every call publishes exactly what it should, or raises SpecError.

`task.apply_async()` (arbitrary `ml=` options and `ext_ml_*`/`ext_mlx_*`
headers) and `app.ojs_ml.submit()` (envelopes in both forms, workflows, Flux
jobspecs read from YAML, and mutated spec examples) run against a private
Redis broker. The contract checked on every example:

* an accepted call publishes exactly the expected messages (one per job; one
  for a chain, whose later steps travel inside it; one per step of a group or
  batch; `tasks.count` for a Flux jobspec), counted both by Celery's
  `after_task_publish` signal and in the broker's lists;
* a rejected call raises `SpecError` and publishes nothing, and every violation
  names an attribute (`ext_ml_*`, `ext_mlx_*`, `meta`, a core, workflow or Flux
  field) that the message repeats.

`SpecError` is the only error accepted. `ConfigError` is documented for
settings and worker options, `StoreUnavailable` for a Redis outage and
`UnsatisfiableError` for apps with `ojs_ml_deny_unsatisfiable`, none of which
applies here, so any of them escaping would be a bug. Documents are checked
against the offline validator the CLI uses (`parse_document` + `canonical`):
`submit` must accept exactly what `celery-ojs-ml validate` accepts.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import redis
from celery import Celery, signals
from hypothesis import HealthCheck, event, example, given, reject, settings
from hypothesis import strategies as st

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.plugin import OJSML
from celery_ojs_ml.spec.documents import canonical, parse_document
from celery_ojs_ml.spec.flux import FluxJob
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.workflow import Workflow
from celery_ojs_ml.wire.queues import intake_name
from tests.fuzz.strategies import (
    ENVELOPES,
    FLUX_EXAMPLE,
    JSON_EXAMPLES,
    WORKFLOWS,
    attributes,
    envelopes,
    jobspecs,
    mutated,
    named_attribute,
    valid_attributes,
    workflows,
)

pytestmark = pytest.mark.integration

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
GPU_POLICY = {
    "ml_defaults": {"ext_ml_gpu_count": 1},
    "ml_limits": {"max_gpu_count": 4, "allowed_gpu_types": ["nvidia-a100", "nvidia-h100"]},
}
MAX_FLUX_TASKS = 32
"""Jobspecs making more tasks are skipped: nothing bounds `tasks.count`, and a product of
counts in the billions would build that many signatures before the first publish."""


@dataclass
class Broker:
    """The fuzzed app, and what it published, seen two ways."""

    app: Celery
    client: redis.Redis
    published: list[dict[str, Any]] = field(default_factory=list)

    def messages(self) -> int:
        """Messages waiting in the broker: the lengths of every list outside the plugin store."""
        return sum(
            int(self.client.llen(key))
            for key in self.client.scan_iter(_type="list", count=1000)
            if not key.startswith(b"ojs:")
        )

    def outcome(self, call: Callable[[], Any]) -> tuple[SpecError | None, list[dict[str, Any]]]:
        """Run one publish call: the SpecError it raised (or None) and what it published."""
        self.published.clear()
        before = self.messages()
        try:
            call()
            error = None
        except SpecError as exc:
            error = exc
        sent = list(self.published)
        assert self.messages() - before == len(sent), "signal and broker counts disagree"
        return error, sent


@pytest.fixture(scope="module")
def broker(redis_url: str) -> Iterator[Broker]:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    app = Celery("publish-fuzz", broker=redis_url, set_as_current=False)
    app.conf.task_create_missing_queues = True
    app.conf.ojs_ml_queue_policies = {"gpu": GPU_POLICY}
    OJSML(app)

    @app.task(name="ml.train", shared=False)  # type: ignore[untyped-decorator]
    def train(*args: Any, **kwargs: Any) -> None:
        """A registered target for submitted documents (other types go by name)."""

    found = Broker(app, client)

    def record(headers: dict[str, Any] | None = None, routing_key: str = "", **_: Any) -> None:
        found.published.append({"headers": dict(headers or {}), "routing_key": routing_key})

    signals.after_task_publish.connect(record, weak=False)
    yield found
    signals.after_task_publish.disconnect(record)
    app.close()
    client.flushall()
    client.close()


def _assert_teaches(error: SpecError, doc: Any) -> None:
    """Every violation names an attribute of `doc`, and the message repeats each path."""
    assert error.violations, "a SpecError without violations"
    for v in error.violations:
        assert named_attribute(v.path, doc), f"{v.path!r} names no attribute: {error}"
        assert v.path in str(error)
        assert v.section and v.fix, v


def _assert_canonical_on_the_wire(message: dict[str, Any], per_call: Iterable[str] = ()) -> None:
    """The ext_ml_* headers a worker reads are canonical, and the message routes by them.

    `per_call` names the caller's own headers, which may stay on the wire even
    where the canonical form drops them (fixed: see the tests below).
    """
    headers, key = message["headers"], message["routing_key"]
    ml = {k: v for k, v in headers.items() if k.startswith("ext_ml_")}
    canonical_form = normalize(ml).flat()
    assert {k: ml.get(k) for k in canonical_form} == canonical_form
    assert set(ml) - set(canonical_form) == set(), "a dropped attribute went out as given"
    if "ojs_class" in headers:  # an ML job goes to the fleet scheduler's intake
        assert key == intake_name("ojs")
        assert headers["ojs_logical_queue"] and headers["ojs_band"]
    if isinstance(ml.get("ext_ml_timeout_seconds"), int):
        assert list(headers["timelimit"]) == [ml["ext_ml_timeout_seconds"], None]


# -- task.apply_async ----------------------------------------------------------------------


def _noop() -> None:
    """The body of every fuzzed task: only the publish path is under test."""


@FUZZ
@given(
    ml=attributes | valid_attributes,
    headers=attributes | valid_attributes,
    queue=st.sampled_from([None, "gpu", "train"]),
)
@example(  # found in a fresh-clone run: the violation names the project's own key
    ml={}, headers={"ojs_ml_gpu_share": True}, queue=None
)
def test_apply_async_with_any_ml_option_and_headers_publishes_once_or_raises_a_spec_error(
    broker: Broker, ml: dict[str, Any], headers: dict[str, Any], queue: str | None
) -> None:
    app = broker.app
    task = app.task(name=f"fuzz.{uuid.uuid4().hex}", shared=False, ml=ml)(_noop)
    error, sent = broker.outcome(lambda: task.apply_async(headers=dict(headers), queue=queue))
    event("rejected" if error else "published")
    if error is not None:
        assert sent == []
        for v in error.violations:
            # an OJS ML attribute, or the project's own job keys (`ojs_ml_gpu_share`)
            assert v.path.startswith(("ext_ml", "ojs_ml_")), f"{v.path!r}: {error}"
            assert v.path in str(error)
            assert v.section and v.fix, v
        return
    [message] = sent
    _assert_canonical_on_the_wire(message, per_call=headers)


# -- app.ojs_ml.submit ---------------------------------------------------------------------


def _expected_messages(doc: Any, app: Celery) -> int | None:
    """The messages `submit` must publish (None: it must reject the document).

    The oracle is the offline validator the CLI uses (`validate -A app`): it applies a
    Flux jobspec's queue policy too (§10.1/§10.2).
    """
    options = app.ojs_ml.parse_options
    try:
        parsed = parse_document(doc, options)
        canonical(parsed, options)
    except SpecError:
        return None
    if isinstance(parsed, FluxJob):
        if parsed.task_count > MAX_FLUX_TASKS:
            reject()
        return parsed.task_count
    if isinstance(parsed, Workflow):
        sent = parsed.steps[:1] if parsed.workflow_type == "chain" else parsed.steps
        # every step's reservation is verified before anything is published, a later
        # chain step's too (it is published by the first step's worker, too late to refuse)
        return _NO_RESERVATION if _reserved(parsed.steps) else len(sent)
    return _NO_RESERVATION if _reserved([parsed]) else 1


_NO_RESERVATION = -1
"""A published job names a reservation: none exists in the fuzz store (§8.3 MUST verify)."""


def _reserved(jobs: Iterable[Any]) -> bool:
    return any(j.requirements.ext_ml_reservation_id is not None for j in jobs)


def _check_submit(broker: Broker, doc: Any) -> None:
    expected = _expected_messages(doc, broker.app)
    error, sent = broker.outcome(lambda: broker.app.ojs_ml.submit(doc))
    event("rejected" if error else "published")
    if expected is None:
        assert error is not None, "submit published a document the validator rejects"
        assert sent == []
        _assert_teaches(error, doc)
        return
    if expected == _NO_RESERVATION:  # §8.3: verified at publish, nothing goes out
        assert error is not None and "ext_ml_reservation_id" in error.paths, error
        assert sent == []
        return
    assert error is None, f"submit rejected a document the validator accepts: {error}"
    assert len(sent) == expected
    for message in sent:
        _assert_canonical_on_the_wire(message)
        task_id = message["headers"].get("id")
        assert isinstance(task_id, str) and task_id, f"published task id {task_id!r}"


@FUZZ
@given(doc=envelopes)
def test_submit_of_any_envelope_publishes_one_job_or_raises_a_spec_error(
    broker: Broker, doc: dict[str, Any]
) -> None:
    _check_submit(broker, doc)


@FUZZ
@given(doc=workflows)
@example(  # found in a fresh-clone run: the first step went out before the second's check
    doc={
        "workflow_type": "group",
        "jobs": [{"type": "ml.train"}, {"type": "ml.train", "ext_ml_reservation_id": "res-123"}],
    }
)
@example(  # found in a fresh-clone run: the oracle checked only the chain's first step
    doc={
        "workflow_type": "chain",
        "steps": [{"type": "ml.train"}, {"type": "ml.train", "ext_ml_reservation_id": "res-123"}],
    }
)
def test_submit_of_any_workflow_publishes_every_step_or_nothing(
    broker: Broker, doc: dict[str, Any]
) -> None:
    _check_submit(broker, doc)


@FUZZ
@given(doc=jobspecs)
def test_submit_of_any_flux_jobspec_publishes_its_task_count_or_nothing(
    broker: Broker, doc: dict[str, Any]
) -> None:
    _check_submit(broker, doc)


@FUZZ
@given(doc=mutated([*ENVELOPES, *WORKFLOWS, FLUX_EXAMPLE]))
def test_submit_of_a_mutated_spec_example_publishes_it_whole_or_raises_a_spec_error(
    broker: Broker, doc: Any
) -> None:
    _check_submit(broker, doc)


def test_every_unmutated_spec_example_is_published(broker: Broker) -> None:
    """The oracle's baseline: the examples themselves are all accepted and published."""
    for name, doc in [*JSON_EXAMPLES.items(), ("flux", FLUX_EXAMPLE)]:
        error, sent = broker.outcome(partial(broker.app.ojs_ml.submit, doc))
        assert error is None, (name, error)
        assert sent, name


# -- what the fuzzing found, fixed (regressions) ------------------------------------------------


@pytest.mark.parametrize("bad_id", [5, True, {"a": 1}, [1], ""])
def test_submit_refuses_an_envelope_whose_id_is_not_a_non_empty_string(
    broker: Broker, bad_id: Any
) -> None:
    """Was published with that value as the Celery task id (OJS core ids are strings)."""
    error, sent = broker.outcome(lambda: broker.app.ojs_ml.submit({"type": "t", "id": bad_id}))
    assert sent == []
    assert error is not None
    assert str(error) == (
        "id must be a non-empty string (OJS core); "
        'e.g. "id": "019502a4-0001-7abc-8000-000000000001"'
    )


@pytest.mark.parametrize("kind", [[], {}, ["chain"]])
def test_submit_refuses_a_workflow_type_that_is_not_a_string(broker: Broker, kind: Any) -> None:
    """Was a TypeError (unhashable type) from the workflow parser."""
    doc = {"workflow_type": kind, "jobs": [{"type": "ml.train"}]}
    error, sent = broker.outcome(lambda: broker.app.ojs_ml.submit(doc))
    assert sent == []
    assert error is not None
    assert error.paths == ["workflow_type"]


def test_submit_of_an_envelope_with_a_non_string_key_publishes_it(broker: Broker) -> None:
    """YAML allows int keys; they are core keys, not attributes (was an AttributeError)."""
    doc = {"type": "ml.train", 1: 2, "ext_ml_gpu_count": 1}
    error, sent = broker.outcome(lambda: broker.app.ojs_ml.submit(doc))
    assert error is None
    [message] = sent
    assert message["headers"]["ext_ml_gpu_count"] == 1


@pytest.mark.parametrize("ml", ["gpu", 5, ["ext_ml_gpu_count"]], ids=["str", "int", "list"])
def test_a_task_whose_ml_option_is_not_a_mapping_is_refused_with_a_spec_error_naming_ml(
    broker: Broker, ml: Any
) -> None:
    task = broker.app.task(name=f"fuzz.{uuid.uuid4().hex}", shared=False, ml=ml)(_noop)
    with pytest.raises(SpecError, match=r"\bml\b"):
        task.apply_async()


def test_a_header_with_a_non_string_key_is_published_like_any_non_ml_header(
    broker: Broker,
) -> None:
    task = broker.app.task(name=f"fuzz.{uuid.uuid4().hex}", shared=False)(_noop)
    error, sent = broker.outcome(lambda: task.apply_async(headers={1: "x"}))
    assert (error, len(sent)) == (None, 1)


@pytest.mark.parametrize(
    "headers",
    [{"ext_ml_accelerator": None}, {"ext_ml_gpu_count": 1, "ext_ml_gpu_interconnect": "nvlink"}],
    ids=["none-value", "interconnect-for-one-gpu"],
)
def test_per_call_headers_that_the_canonical_form_drops_are_not_published(
    broker: Broker, headers: dict[str, Any]
) -> None:
    task = broker.app.task(name=f"fuzz.{uuid.uuid4().hex}", shared=False)(_noop)
    error, [message] = broker.outcome(lambda: task.apply_async(headers=dict(headers)))
    assert error is None
    wire = {k: v for k, v in message["headers"].items() if k.startswith("ext_ml_")}
    assert wire == normalize(headers).flat()


CPU_JOBSPEC_ON_GPU_QUEUE = {
    "version": 1,
    "resources": [
        {"type": "slot", "count": 1, "label": "default", "with": [{"type": "core", "count": 1}]}
    ],
    "tasks": [{"command": ["app"], "slot": "default", "count": {"per_slot": 1}}],
    "attributes": {"system": {"duration": 0, "queue": "gpu"}},
}


def test_the_offline_validator_and_submit_agree_on_a_flux_jobspec_for_a_policy_queue(
    broker: Broker,
) -> None:
    """Both apply the queue's policy (§10.1/§10.2) to the slot: its default
    ext_ml_gpu_count 1 against the slot's ext_ml_accelerator cpu is refused by both."""
    options = broker.app.ojs_ml.parse_options
    try:
        canonical(parse_document(CPU_JOBSPEC_ON_GPU_QUEUE, options), options)
        validator_accepts = True
    except SpecError:
        validator_accepts = False
    error, _ = broker.outcome(lambda: broker.app.ojs_ml.submit(CPU_JOBSPEC_ON_GPU_QUEUE))
    assert validator_accepts == (error is None), error
    assert not validator_accepts
