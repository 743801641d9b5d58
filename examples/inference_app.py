"""An inference service on celery-ojs-ml: warm GPU children, a cached model, dedup.

    celery -A examples.inference_app worker --ojs-ml-capabilities auto -c 4
    python -m examples.inference_app "a photo of a cat"

Each pool child initialises CUDA once and keeps it (warm children, the default),
loads the model once (`model(...)`, evicted LRU past `ojs_ml_model_cache_size`),
verifies the weights against the job's `ext_ml_model_checksum` when the job
gives one, and a request repeated within 10 s is answered by the first job
(`ml_dedup`). Works without torch: the "model" falls back to a stub.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from celery import Celery

from celery_ojs_ml import OJSML, model

BROKER = os.environ.get("OJS_EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
app = Celery("inference_app", broker=BROKER, backend=BROKER)
app.conf.ojs_ml_model_cache_size = 2
ml = OJSML(app)

MODEL = {"ext_ml_gpu_count": 1, "ext_ml_model_id": "tiny-encoder", "ext_ml_model_version": "1"}


def load_encoder() -> Any:
    """Load the weights once per pool child (on the child's own GPU when torch has CUDA)."""
    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.nn.Linear(16, 4).to(device)
    except ImportError:
        return lambda xs: [sum(xs)] * 4


@app.task(bind=True, ml=MODEL, ml_dedup={"window_s": 10})
def encode(self: Any, text: str) -> list[float]:
    net = model(self, ("tiny-encoder", "1"), load_encoder)
    features = [float(ord(c) % 7) for c in text[:16].ljust(16)]
    try:
        import torch

        param = next(net.parameters())
        out = net(torch.tensor(features, device=param.device))
        return [float(v) for v in out.tolist()]
    except (ImportError, AttributeError, TypeError):
        return [float(v) for v in net(features)]


if __name__ == "__main__":
    print(encode.delay(" ".join(sys.argv[1:]) or "hello").get(timeout=60))
