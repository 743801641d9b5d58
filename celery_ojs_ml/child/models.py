"""The per-child model cache for tasks (`ml.model`) and its live advertisement.

    net = model(self, ("resnet", "v2"), lambda: load_resnet(PATH), path=PATH)  # once per child

Key decisions: a warm pool child keeps its CUDA context between tasks, so it keeps the
models it loaded too, keyed by (model id, version) and evicted least recently used.
Eviction comes before the loader runs (`make_room`): a model that declares `vram_gb`
gets room within the job's VRAM budget (`vram_budget`) before it allocates, so two
models never sit on the device together past the budget, and one that cannot fit alone
fails the job before loading (`ModelTooLarge`). After each change the child writes what
it holds to the store (`publish`), so the scheduler's locality term (§11.3) and the gate
see live facts within a heartbeat.
When the job gives `ext_ml_model_checksum`, the model's file (`path=`, else the job's
model URI) is verified before the loader runs, and again for every later job that
gives one; the digest is computed once per file (`model_files.verify_cached`), and a
mismatch fails the job (OJS ML §4, §15.2).

Layout: `<prefix>:{ml}:models:<worker>`  hash  child pid -> JSON {devices, models}
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from celery_ojs_ml.child.model_files import CHECKSUM, job_model_file, job_value, verify_cached
from celery_ojs_ml.child.sharing import share_of
from celery_ojs_ml.errors import OJSMLError
from celery_ojs_ml.wire import headers as h

log = logging.getLogger(__name__)
T = TypeVar("T")
Key = tuple[str, str]
_CACHE: OrderedDict[Key, tuple[Any, float | None]] = OrderedDict()
_STATS = {"loads": 0, "hits": 0}
_UNVERIFIED: set[Key] = set()
"""Models whose checksum could not be verified (no file known), warned about once."""


class ModelTooLarge(OJSMLError):
    """A model's declared `vram_gb` exceeds the VRAM its job's model cache may hold."""


def _key(key: Any) -> Key:
    if isinstance(key, str) and key:
        return (key, "")
    if isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key):
        return (key[0], key[1])
    raise TypeError(f"model key is {key!r}; use (model_id, model_version) or a model id string")


def model(
    task: Any,
    key: Any,
    loader: Callable[[], T],
    *,
    vram_gb: float | None = None,
    path: str | os.PathLike[str] | None = None,
) -> T:
    """The model under `key` for this pool child: loaded once by `loader`, then reused.

    `path` is the file the loader reads; with the job's `ext_ml_model_checksum` it is
    verified before the model is loaded or served (`ChecksumMismatch` fails the job).
    `vram_gb` is the model's VRAM: models are evicted to make room for it before the
    loader runs, and one that cannot fit alone raises `ModelTooLarge`.
    """
    k = _key(key)
    _verify(task, k, path)
    hit = _CACHE.get(k)
    if hit is not None:
        _CACHE.move_to_end(k)
        _STATS["hits"] += 1
        return hit[0]  # type: ignore[no-any-return]
    settings = _settings(task)
    size = int(getattr(settings, "model_cache_size", 2))
    budget = vram_budget(task)
    _fits_alone(k, vram_gb, budget)
    if make_room(size - 1, None if budget is None else budget - (vram_gb or 0.0)):
        _release_freed()
    value = loader()
    _STATS["loads"] += 1
    _CACHE[k] = (value, vram_gb)
    evict(size, budget)
    publish(task)
    return value


def _verify(task: Any, k: Key, path: str | os.PathLike[str] | None) -> None:
    """OJS ML §4: check the job's checksum against the model's file, when the job has one."""
    expected = job_value(task, CHECKSUM)
    if not expected:
        return
    file = os.fspath(path) if path is not None else job_model_file(task)
    if file is None:
        if k not in _UNVERIFIED:
            _UNVERIFIED.add(k)
            log.warning(
                "ojs-ml: the job gives ext_ml_model_checksum but model(%r) knows no file to "
                "verify; pass path=... or set ext_mlx_inference_model_uri (OJS ML §4)",
                k,
            )
        return
    verify_cached(file, str(expected))


def make_room(max_models: int, max_vram_gb: float | None) -> list[Key]:
    """Drop least recently used models until at most `max_models` remain and their
    declared VRAM is at most `max_vram_gb` (None: no VRAM bound); the dropped keys."""
    gone = []
    while _CACHE and (
        len(_CACHE) > max_models or (max_vram_gb is not None and _vram() > max_vram_gb)
    ):
        k, _ = _CACHE.popitem(last=False)
        gone.append(k)
        log.info("ojs-ml: evicted model %s@%s from pool child %s", k[0], k[1], os.getpid())
    return gone


def evict(max_models: int, max_vram_gb: float | None) -> list[Key]:
    """Drop least recently used models past the bounds, never the most recent one.

    After a load this catches what `make_room` could not know before it: models that
    declared no `vram_gb`, and a budget that a loader without `vram_gb` pushed past.
    """
    gone = []
    while len(_CACHE) > 1 and (
        len(_CACHE) > max_models or (max_vram_gb is not None and _vram() > max_vram_gb)
    ):
        gone += make_room(len(_CACHE) - 1, None)
    return gone


def vram_budget(task: Any) -> float | None:
    """The VRAM, GB, this child's cached models may declare together while `task` runs.

    The smaller of `ojs_ml_model_cache_vram_gb` and the VRAM the job holds: its GPU
    share's `memory_gb`, else `ext_ml_gpu_memory_gb` times its GPU count. None when
    neither is known (count bound only).
    """
    bounds = [getattr(_settings(task), "model_cache_vram_gb", None), _job_vram_gb(task)]
    known = [float(b) for b in bounds if isinstance(b, (int, float)) and b > 0]
    return min(known) if known else None


def _job_vram_gb(task: Any) -> float | None:
    share = share_of(task)
    if share is not None:
        found = share.get("memory_gb")
        return float(found) if isinstance(found, (int, float)) else None
    per_device = job_value(task, "ext_ml_gpu_memory_gb")
    if not isinstance(per_device, (int, float)) or isinstance(per_device, bool):
        return None
    count = job_value(task, "ext_ml_gpu_count")
    devices = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
    return float(per_device) * devices


def _fits_alone(k: Key, vram_gb: float | None, budget: float | None) -> None:
    if vram_gb is None or budget is None or vram_gb <= budget:
        return
    raise ModelTooLarge(
        f"model {k[0]}@{k[1] or '-'} declares vram_gb={vram_gb:g} but this job's model cache "
        f"holds at most {budget:g} GB (the smaller of ojs_ml_model_cache_vram_gb and the "
        "job's ext_ml_gpu_memory_gb or GPU share); raise ojs_ml_model_cache_vram_gb or ask "
        f'for more VRAM, e.g. "ext_ml_gpu_memory_gb": {vram_gb:g}'
    )


def _release_freed() -> None:
    """Let the memory of evicted models go before the next loader allocates: collect
    reference cycles and, where torch already runs CUDA here, return its cached blocks."""
    gc.collect()
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            cuda.empty_cache()
    except Exception as exc:  # best effort: the loader still runs
        log.debug("ojs-ml: torch.cuda.empty_cache failed: %s", exc)


def _vram() -> float:
    return sum(v or 0.0 for _, v in _CACHE.values())


def loaded() -> list[Key]:
    """The (model id, version) pairs this process holds, least recently used first."""
    return list(_CACHE)


def stats() -> dict[str, int]:
    """Loads and hits in this process (for tests and benchmarks)."""
    return dict(_STATS)


def clear() -> None:
    """Forget every model (tests)."""
    _CACHE.clear()
    _UNVERIFIED.clear()


def _settings(task: Any) -> Any:
    plugin = getattr(getattr(task, "app", None), "ojs_ml", None)
    return getattr(plugin, "settings", None)


def publish(task: Any) -> None:
    """Write this child's models to the store for its worker's heartbeat (best effort).

    The heartbeat (`worker.advertising.live_models`) merges every child's field into
    `models_loaded` (§11) and drops fields of children that are gone, and the gate
    prefers the devices of the idle child that holds the requested model.
    """
    request = getattr(task, "request", None)
    worker = getattr(request, h.NODE, None) or getattr(request, "hostname", None)
    plugin = getattr(getattr(task, "app", None), "ojs_ml", None)
    if not worker or plugin is None:
        return
    entry = {
        "devices": list(getattr(request, h.DEVICES, None) or []),
        "models": [{"model_id": m, **({"model_version": v} if v else {})} for m, v in _CACHE],
    }
    try:
        store = plugin.store
        store.client.hset(store.key("models", str(worker)), str(os.getpid()), json.dumps(entry))
    except Exception as exc:
        log.warning("ojs-ml: could not advertise the loaded models: %s", exc)
