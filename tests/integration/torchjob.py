"""A small, fully deterministic PyTorch CPU training loop with checkpoint/resume.

Used by the `ml.torch_train` task (inside real workers) and by the test itself
for the uninterrupted reference run. Determinism: fixed seeds, one thread,
deterministic algorithms, and each epoch's data drawn from its own generator
seeded by the epoch number, so a resumed run sees exactly the same batches.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch warns once when NumPy is absent
    import torch

SEED = 1234
FEATURES = 16
BATCHES = 20


def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_epoch(model: torch.nn.Module, optim: torch.optim.Optimizer, epoch: int) -> float:
    gen = torch.Generator().manual_seed(SEED + epoch)
    x = torch.randn(BATCHES, 32, FEATURES, generator=gen)
    w = torch.linspace(-1, 1, FEATURES)
    loss = torch.zeros(())
    for i in range(BATCHES):
        optim.zero_grad()
        target = torch.sin(x[i] @ w).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(model(x[i]), target)
        loss.backward()
        optim.step()
    return float(loss.detach())


def state_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, buf)
    return buf.getvalue()


def load_state(model: torch.nn.Module, optim: torch.optim.Optimizer, raw: bytes) -> None:
    state: dict[str, Any] = torch.load(io.BytesIO(raw), weights_only=True)
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])


def weights_bytes(model: torch.nn.Module) -> bytes:
    """The final weights, serialised exactly, for a bit-for-bit comparison."""
    return b"".join(
        bytes(p.detach().contiguous().view(torch.uint8).flatten().tolist())
        for p in model.parameters()
    )


def reference(epochs: int) -> bytes:
    model, optim = setup()
    for epoch in range(epochs):
        train_epoch(model, optim, epoch)
    return weights_bytes(model)
