"""A 2-rank data-parallel training job as a gang (Flux RFC 25 node>slot).

Start two workers (on one host for a try-out; each rank needs its own worker),
then the job:

    export OJS_EXAMPLE_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo  # one host: rendezvous on loopback
    celery -A examples.gang_training worker -n a@%h --ojs-ml-capabilities=profile:nvidia-a100x1 -c 1
    celery -A examples.gang_training worker -n b@%h --ojs-ml-capabilities=profile:nvidia-a100x1 -c 1
    python -m examples.gang_training

`ml.gang` places both ranks at once on distinct workers (or neither), and each
rank finds torch.distributed's `env://` variables set (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK, LOCAL_RANK). If a rank's worker dies, the gang is placed
again whole and resumes from its last committed checkpoint. Needs
`pip install 'celery-ojs-ml[torch]'`. The broker (and store) is
`$OJS_EXAMPLE_BROKER`, checkpoints go under `$OJS_EXAMPLE_CKPT` (default
`file:///tmp/ojs-example-ckpt/`), and `$OJS_EXAMPLE_ADDR` is the address a
worker advertises to the other ranks when it holds rank 0.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from celery import Celery

from celery_ojs_ml import OJSML, checkpoint

BROKER = os.environ.get("OJS_EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
CKPT = os.environ.get("OJS_EXAMPLE_CKPT", "file:///tmp/ojs-example-ckpt/")
# The app's name is the module's, so task names match under `python -m` too.
app = Celery("examples.gang_training", broker=BROKER, backend=BROKER)
app.conf.ojs_ml_checkpoint_prefixes = [CKPT]  # file:// storage must be allowed explicitly
app.conf.ojs_ml_advertise_address = os.environ.get("OJS_EXAMPLE_ADDR")  # None: primary address
ml = OJSML(app)
TRAIN = {
    "ext_ml_gpu_count": 1,  # per rank
    "ext_ml_checkpoint_enabled": True,
    "ext_ml_checkpoint_storage_uri": CKPT,
}


@app.task(bind=True, ml=TRAIN)
def train(self: Any, epochs: int = 5) -> dict[str, Any]:
    """All-reduce one value per epoch; checkpoint each epoch; resume where the ranks agree."""
    import torch
    import torch.distributed as dist

    ckpt = checkpoint(self)
    last = ckpt.resume()
    mine = (last.epoch + 1) if last and last.epoch is not None else 0
    # gloo runs anywhere; on real GPUs use "nccl" and move the tensors to the rank's GPU
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
        rank, worker = dist.get_rank(), self.request.hostname
        return {"rank": rank, "worker": worker, "epochs": epochs, "sum": total}
    finally:
        dist.destroy_process_group()


def main() -> None:
    for rank in ml.gang(train.s(5), 2).get(timeout=600):
        print(
            f"rank {rank['rank']} on {rank['worker']}: {rank['epochs']} epochs, sum {rank['sum']}"
        )


if __name__ == "__main__":
    main()
