"""An inference service on celery-ojs-ml: warm GPU children, a cached model, dedup.

    celery -A examples.inference_app worker --ojs-ml-capabilities=profile:nvidia-a100x1 -c 2
    python -m examples.inference_app "a photo of a cat" "a photo of a dog" "a red car"

On a GPU host use `--ojs-ml-capabilities=auto`. Each pool child initialises CUDA
once and keeps it (warm children, the default), and `model(...)` loads the
model once per pool child (evicted LRU past `ojs_ml_model_cache_size`); the
loader below counts its runs to show it. A request repeated within 10 s is
answered by the first job (`ml_dedup`). Works without torch: the "model" is
then a stand-in. The broker (and store) is `$OJS_EXAMPLE_BROKER`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_ojs_ml import OJSML, model

BROKER = os.environ.get("OJS_EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
# The app's name is the module's, so task names match under `python -m` too.
app = Celery("examples.inference_app", broker=BROKER, backend=BROKER)
app.conf.ojs_ml_model_cache_size = 2
app.conf.ojs_ml_model_registry_access = True  # workers load any model version on demand (§4)
ml = OJSML(app)

MODEL = {"ext_ml_gpu_count": 1, "ext_ml_model_id": "tiny-encoder", "ext_ml_model_version": "1"}
LOADS = {"count": 0}
"""How often `load_encoder` ran in this process (to show the cache at work)."""


def load_encoder() -> Callable[[list[float]], list[float]]:
    """The expensive part, once per pool child: build the network on the child's GPU."""
    LOADS["count"] += 1
    try:
        import torch
    except ImportError:
        return lambda xs: [sum(xs)] * 4
    device = "cuda" if torch.cuda.is_available() else "cpu"
    net = torch.nn.Linear(16, 4).to(device)

    def encode(xs: list[float]) -> list[float]:
        with torch.inference_mode():
            return [float(v) for v in net(torch.tensor(xs, device=device)).tolist()]

    return encode


@app.task(bind=True, ml=MODEL, ml_dedup={"window_s": 10})
def encode(self: Any, text: str) -> dict[str, Any]:
    net = model(self, ("tiny-encoder", "1"), load_encoder)
    features = [float(ord(c) % 7) for c in text[:16].ljust(16)]
    return {"pid": os.getpid(), "loads": LOADS["count"], "embedding": net(features)}


def main(texts: list[str]) -> None:
    jobs = [encode.delay(text) for text in texts]
    again = encode.delay(texts[0])  # within the dedup window: nothing is published
    loads: dict[int, int] = {}
    for text, job in zip(texts, jobs, strict=True):
        out = job.get(timeout=60)
        loads[out["pid"]] = out["loads"]
        vector = [round(v, 2) for v in out["embedding"]]
        print(f"{text!r}: pool child {out['pid']}, embedding {vector}")
    same = "the first request's job" if again.id == jobs[0].id else "a new job"
    print(f"{texts[0]!r} again within 10 s: answered by {same}")
    print(f"model loads per pool child: {loads}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["hello"])
