"""OJS ML spec layer: models, validation and normalisation. No Celery, no I/O."""

from celery_ojs_ml.spec.classes import band, class_id, hard_constraints, has_hard_constraints
from celery_ojs_ml.spec.envelope import Job, ParseOptions, parse_job, requirements_of
from celery_ojs_ml.spec.normalize import Bounds, Normalized, normalize
from celery_ojs_ml.spec.policy import QueueLimits, QueuePolicy
from celery_ojs_ml.spec.resources import AffinityRule, AffinitySpec, MLRequirements
from celery_ojs_ml.spec.workflow import Workflow, is_workflow, parse_workflow

__all__ = [
    "AffinityRule",
    "AffinitySpec",
    "Bounds",
    "Job",
    "MLRequirements",
    "Normalized",
    "ParseOptions",
    "QueueLimits",
    "QueuePolicy",
    "Workflow",
    "band",
    "class_id",
    "hard_constraints",
    "has_hard_constraints",
    "is_workflow",
    "normalize",
    "parse_job",
    "parse_workflow",
    "requirements_of",
]
