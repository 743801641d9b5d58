"""The project's error tree: shallow, each error with a one-line docstring.

Every validation problem is a `Violation` that names the attribute path, the
rule broken (with its spec section) and a fix that shows a correct example, so
the CLI, the publish path and the worker all print the same teaching message.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: where, what, which spec section, and how to fix it."""

    path: str
    problem: str
    section: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path} {self.problem} ({self.section}); {self.fix}"


class OJSMLError(Exception):
    """Base class of every error raised by celery_ojs_ml."""


class SpecError(OJSMLError, ValueError):
    """A job, workflow, jobspec or capability document breaks the spec."""

    def __init__(self, violations: list[Violation] | Violation | str) -> None:
        if isinstance(violations, str):  # rebuilt from its message (a result backend)
            self.violations: list[Violation] = []
            super().__init__(violations)
            return
        if isinstance(violations, Violation):
            violations = [violations]
        self.violations = list(violations)
        super().__init__("; ".join(str(v) for v in self.violations) or "invalid document")

    @property
    def paths(self) -> list[str]:
        """The attribute paths of all violations, in order."""
        return [v.path for v in self.violations]

    def prefixed(self, prefix: str) -> SpecError:
        """The same violations with their paths nested under `prefix`."""
        return SpecError(
            [Violation(f"{prefix}.{v.path}", v.problem, v.section, v.fix) for v in self.violations]
        )


class ConfigError(OJSMLError, ValueError):
    """An `ojs_ml_*` setting or a worker option has an invalid value."""


class StoreUnavailable(OJSMLError):
    """The plugin's Redis store did not answer; nothing was published."""


class UnsatisfiableError(OJSMLError):
    """No live worker could ever run the job and the app denies such jobs (RFC 27 DENY)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True, slots=True)
class ThresholdMiss:
    """A metric that missed its evaluation threshold (OJS ML Extensions §5.4); None: unreported."""

    metric: str
    threshold: dict[str, float]
    value: float | None

    def __str__(self) -> str:
        bounds = " and ".join(f"{k} {v:g}" for k, v in self.threshold.items())
        value, low, high = self.value, self.threshold.get("min"), self.threshold.get("max")
        if value is None:
            return f"{self.metric} not reported (threshold {bounds})"
        if value != value:  # NaN meets no threshold
            return f"{self.metric} is NaN (threshold {bounds})"
        if low is not None and value < low:
            return f"{self.metric} {value:g} < min {low:g}"
        if high is not None and value > high:
            return f"{self.metric} {value:g} > max {high:g}"
        return f"{self.metric} {value:g} (threshold {bounds})"

    def as_dict(self) -> dict[str, object]:
        return {"metric": self.metric, "threshold": dict(self.threshold), "value": self.value}


class ThresholdsNotMet(OJSMLError):
    """An evaluation missed its job's `ext_mlx_eval_thresholds` (OJS ML Extensions §5.4)."""

    def __init__(
        self,
        misses: list[ThresholdMiss] | list[dict[str, object]],
        results: dict[str, bool] | None = None,
    ) -> None:
        # The arguments are JSON, so a client's AsyncResult rebuilds the exception
        # from the result backend as ThresholdsNotMet(*args), attributes and all.
        self.misses: list[ThresholdMiss] = [_miss(m) for m in misses]
        self.results: dict[str, bool] = dict(results or {})
        super().__init__([m.as_dict() for m in self.misses], self.results)

    def __str__(self) -> str:
        listed = "; ".join(str(m) for m in self.misses)
        return f"evaluation thresholds not met (OJS ML Extensions §5.4): {listed}"

    def __repr__(self) -> str:  # what Celery's log and Flower show
        return f"ThresholdsNotMet({'; '.join(str(m) for m in self.misses)})"


def _miss(found: ThresholdMiss | dict[str, object]) -> ThresholdMiss:
    if isinstance(found, ThresholdMiss):
        return found
    threshold = found.get("threshold")
    value = found.get("value")
    if not isinstance(threshold, dict) or not (value is None or isinstance(value, int | float)):
        raise TypeError(f"not a threshold miss: {found!r}")
    return ThresholdMiss(str(found.get("metric")), dict(threshold), value)
