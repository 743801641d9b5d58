"""Pure matching of OJS ML requirements against worker capabilities."""

from celery_ojs_ml.matching.filters import FreeCapacity, Reason, Verdict, describe, rule_holds
from celery_ojs_ml.matching.format import pending_message
from celery_ojs_ml.matching.hints import NO_HINTS, Hints
from celery_ojs_ml.matching.match import MatchResult, has_model, match, rank, score

__all__ = [
    "NO_HINTS",
    "FreeCapacity",
    "Hints",
    "MatchResult",
    "Reason",
    "Verdict",
    "describe",
    "has_model",
    "match",
    "pending_message",
    "rank",
    "rule_holds",
    "score",
]
