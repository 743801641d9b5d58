"""A 2-rank data-parallel training job as a gang (Flux RFC 25 node>slot).

Start two workers (on one host for a try-out; each rank needs its own worker):

    OJS_EXAMPLE_ADDR=127.0.0.1 celery -A examples.gang_training worker -n a@%h \
        --ojs-ml-capabilities profile:nvidia-a100x2
    OJS_EXAMPLE_ADDR=127.0.0.1 celery -A examples.gang_training worker -n b@%h \
        --ojs-ml-capabilities profile:nvidia-a100x2
    python -m examples.gang_training

`ml.gang` places both ranks at once on distinct workers (or neither), and each
rank finds torch.distributed's `env://` variables set (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK, LOCAL_RANK). If a rank's worker dies, the gang is placed
again whole and resumes from its last committed checkpoint. Needs
`pip install 'celery-ojs-ml[torch]'`.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from celery import Celery

from celery_ojs_ml import OJSML, checkpoint

BROKER = os.environ.get("OJS_EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
app = Celery("gang_training", broker=BROKER, backend=BROKER)
app.conf.ojs_ml_advertise_address = os.environ.get("OJS_EXAMPLE_ADDR")  # None: primary address
ml = OJSML(app)
TRAIN = {
    "ext_ml_cpu_cores": 1,
    "ext_ml_checkpoint_enabled": True,
    "ext_ml_checkpoint_storage_uri": "file:///tmp/ojs-example-ckpt/",
}


@app.task(bind=True, ml=TRAIN)
def train(self: Any, epochs: int = 5) -> float:
    """All-reduce one value per epoch; checkpoint each epoch; resume where the ranks agree."""
    import torch
    import torch.distributed as dist

    ckpt = checkpoint(self)
    last = ckpt.resume()
    mine = (last.epoch + 1) if last and last.epoch is not None else 0
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    try:
        start = torch.tensor([float(mine)])
        dist.all_reduce(start, op=dist.ReduceOp.MIN)  # resume from the earliest rank's epoch
        total = 0.0
        for epoch in range(int(start.item()), epochs):
            grad = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(grad)  # the gradient sum across ranks
            total = float(grad.item())
            ckpt.save(epoch=epoch, step=epoch, files={"state.json": b"{}"})
        return total
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(ml.gang(train.s(5), 2).get(timeout=600))  # [3.0, 3.0]
