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

    def __init__(self, violations: list[Violation] | Violation) -> None:
        if isinstance(violations, Violation):
            violations = [violations]
        self.violations: list[Violation] = list(violations)
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
