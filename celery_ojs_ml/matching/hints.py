"""Scheduling hints as soft-score terms: spot preference and data locality (OJS ML
Extensions §7, §7.2).

Key decision: the hints are advisory ("backends MAY use them to optimize placement but
MUST NOT require them", §7), so they never filter a worker: each adds one weighted
term to matching's soft-constraint score (`match.score`), as a preferred affinity
rule does. A worker says what it is with two own labels (docs/labels.md):

* `spot`: `true` on spot or preemptible capacity (any other value, or none: on-demand);
* `data_locality`: comma-separated URI prefixes of the data it is close to, e.g.
  `s3://ml-data-us-east-1/,hdfs://rack-7/`; a job's `ext_mlx_scheduling_data_locality`
  is local there when one of them is a prefix of it at a path boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SPOT_LABEL = "spot"
DATA_LABEL = "data_locality"
SPOT_PREFERRED_WEIGHT = 50
"""`spot_preferred`: the weight of running on a spot worker."""
ON_DEMAND_ONLY_WEIGHT = 100
"""`on_demand_only`: the weight of running on a worker not labelled spot."""
DATA_LOCALITY_WEIGHT = 50
"""`ext_mlx_scheduling_data_locality`: the weight of a worker close to the data."""
_PREFERENCES = frozenset({"spot_preferred", "on_demand_only"})
_TRUE = frozenset({"true", "1", "yes"})
_MAX_URI = 2048


@dataclass(frozen=True, slots=True)
class Hints:
    """A job's §7 placement hints; the empty value (`NO_HINTS`) changes no score."""

    spot_preference: str | None = None
    """`spot_preferred` or `on_demand_only` (§7); None: `any` or unset."""
    data_locality: str | None = None
    """The `ext_mlx_scheduling_data_locality` URI (§7.2); None: unset."""

    @classmethod
    def of(cls, attrs: Mapping[str, Any]) -> Hints:
        """The hints of a job's `ext_mlx_*` attributes (or message headers); a value
        the validator would refuse is ignored, never an error (they are advisory)."""
        spot = attrs.get("ext_mlx_scheduling_spot_preference")
        uri = attrs.get("ext_mlx_scheduling_data_locality")
        return cls(
            spot if spot in _PREFERENCES else None,
            uri if isinstance(uri, str) and 0 < len(uri) <= _MAX_URI else None,
        )

    def __bool__(self) -> bool:
        return self.spot_preference is not None or self.data_locality is not None


NO_HINTS = Hints()


def is_spot(labels: Mapping[str, str]) -> bool:
    """Whether a worker's labels say it runs on spot capacity (`spot: true`)."""
    return labels.get(SPOT_LABEL, "").strip().lower() in _TRUE


def _uri(text: str) -> str:
    """A URI with its scheme lower-cased (the validator lower-cases the job's)."""
    scheme, sep, rest = text.strip().partition("://")
    return scheme.lower() + sep + rest if sep else text.strip()


def near_data(uri: str, labels: Mapping[str, str]) -> bool:
    """Whether one of the worker's `data_locality` prefixes holds `uri` (whole segments:
    `s3://data` holds `s3://data/x`, not `s3://data2/x`)."""
    wanted = _uri(uri).rstrip("/")
    for prefix in (_uri(p).rstrip("/") for p in labels.get(DATA_LABEL, "").split(",")):
        if prefix and (wanted == prefix or wanted.startswith(prefix + "/")):
            return True
    return False


def hint_terms(hints: Hints, labels: Mapping[str, str]) -> list[tuple[int, bool]]:
    """(weight, satisfied) of each hint the job gives, on a worker with `labels`."""
    terms: list[tuple[int, bool]] = []
    if hints.spot_preference == "spot_preferred":
        terms.append((SPOT_PREFERRED_WEIGHT, is_spot(labels)))
    elif hints.spot_preference == "on_demand_only":
        terms.append((ON_DEMAND_ONLY_WEIGHT, not is_spot(labels)))
    if hints.data_locality is not None:
        terms.append((DATA_LOCALITY_WEIGHT, near_data(hints.data_locality, labels)))
    return terms
