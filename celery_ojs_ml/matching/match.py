"""Match one job against one worker, score soft constraints, and rank a fleet.

Key decision: hard constraints decide eligibility (FITS/WAIT/NEVER with every
failed reason); soft ones only order eligible workers. The score is one plain
number normalised to 0-100 from the preferred-rule weights (§7.2), a
model-locality weight (§11.3) and the weights of the Extensions §7 placement
hints (`matching.hints`); a job with no soft constraints scores 100
everywhere, so the ranking falls back to the caller's tie-break.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching.filters import FILTERS, FreeCapacity, Reason, Verdict, rule_holds
from celery_ojs_ml.matching.hints import NO_HINTS, Hints, hint_terms
from celery_ojs_ml.spec.resources import MLRequirements

DEFAULT_LOCALITY_WEIGHT = 50
DEFAULT_RULE_WEIGHT = 1


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The verdict for one worker, the reasons behind it, and its 0-100 score."""

    verdict: Verdict
    reasons: tuple[Reason, ...] = field(default=())
    score: float = 0.0

    @property
    def eligible(self) -> bool:
        """Whether the worker can ever run the job (FITS or WAIT)."""
        return self.verdict is not Verdict.NEVER

    def as_dict(self) -> dict[str, Any]:
        """The JSON contract of `celery-ojs-ml match --json` (plus the verdict)."""
        return {
            "eligible": self.eligible,
            "verdict": self.verdict.value,
            "reasons": [r.as_dict() for r in self.reasons],
            "score": self.score,
        }


def match(
    req: MLRequirements,
    worker: Capabilities,
    free: FreeCapacity | None = None,
    *,
    locality_weight: int = DEFAULT_LOCALITY_WEIGHT,
) -> MatchResult:
    """Check every hard constraint; the verdict is the worst reason's."""
    reasons = hard_reasons(req, worker, free)
    if any(r.verdict is Verdict.NEVER for r in reasons):
        return MatchResult(Verdict.NEVER, reasons, 0.0)
    verdict = Verdict.WAIT if reasons else Verdict.FITS
    return MatchResult(verdict, reasons, score(req, worker, locality_weight=locality_weight))


def hard_reasons(
    req: MLRequirements, worker: Capabilities, free: FreeCapacity | None = None
) -> tuple[Reason, ...]:
    """Every hard constraint `worker` (with `free`) misses; `match` without the score."""
    return tuple(r for f in FILTERS for r in f(req, worker, free))


def score(
    req: MLRequirements,
    worker: Capabilities,
    *,
    locality_weight: int = DEFAULT_LOCALITY_WEIGHT,
    running: Sequence[Mapping[str, str]] = (),
    hints: Hints = NO_HINTS,
) -> float:
    """Weighted share of satisfied soft constraints, 0-100 (§7.2, §7.3, §11.3, and the
    Extensions §7 `hints`: spot preference and data locality, `matching.hints`).

    A preferred anti-affinity rule (§7.3) is satisfied when it holds neither on
    the worker nor on any of its `running` jobs' labels.
    """
    labels = worker.derived_labels()
    got = total = 0
    preferred = req.ext_ml_affinity.preferred if req.ext_ml_affinity else ()
    for rule in preferred:
        weight = DEFAULT_RULE_WEIGHT if rule.weight is None else rule.weight
        total += weight
        got += weight if rule_holds(rule, labels) else 0
    avoid = req.ext_ml_anti_affinity.preferred if req.ext_ml_anti_affinity else ()
    for rule in avoid:
        weight = DEFAULT_RULE_WEIGHT if rule.weight is None else rule.weight
        total += weight
        near = any(rule_holds(rule, x) for x in (labels, *running) if rule.key in x)
        got += 0 if near else weight
    if req.ext_ml_model_id and locality_weight:
        total += locality_weight
        got += locality_weight if has_model(worker, req) else 0
    for weight, held in hint_terms(hints, labels):
        total += weight
        got += weight if held else 0
    return round(100.0 * got / total, 2) if total else 100.0


def has_model(worker: Capabilities, req: MLRequirements) -> bool:
    """Whether the worker has the job's model (and version, when given) loaded."""
    return any(
        m.model_id == req.ext_ml_model_id
        and (req.ext_ml_model_version is None or m.model_version == req.ext_ml_model_version)
        for m in worker.models_loaded
    )


def rank(
    req: MLRequirements,
    workers: Mapping[str, Capabilities],
    free: Mapping[str, FreeCapacity] | None = None,
) -> list[tuple[str, MatchResult]]:
    """Every worker's result, best first: FITS before WAIT before NEVER, then by score."""
    order = {Verdict.FITS: 0, Verdict.WAIT: 1, Verdict.NEVER: 2}
    results = [(name, match(req, w, (free or {}).get(name))) for name, w in workers.items()]
    return sorted(results, key=lambda item: (order[item[1].verdict], -item[1].score, item[0]))
