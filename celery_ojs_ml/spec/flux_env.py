"""A jobspec's `attributes.system.cwd` and `environment` (Flux RFC 25 §Attributes, RFC 14).

Responsibility: say what is wrong with a working directory or an environment a
job asks for, in teaching words, and turn a valid environment into `str -> str`.
The same checks run at publish (`parse_jobspec`) and again at the worker's gate
(`worker.run_env`), which cannot trust the message.

Key decisions:
- Names the plugin sets itself are refused, not dropped: a job that asks for
  `CUDA_VISIBLE_DEVICES` or `RANK` expects that value, and silently running it
  with another would be worse than the error. Refused: the device and share
  variables (`CUDA_VISIBLE_DEVICES`, `CUDA_DEVICE_ORDER`, `CUDA_MPS_*`), the TPU
  chip selection (`TPU_*`), a gang's rendezvous (`MASTER_ADDR`, `MASTER_PORT`,
  `WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`) and what makes a
  program the task starts load other code (`LD_*`, `DYLD_*`, `PYTHONPATH`,
  `PYTHONHOME`, `PYTHONSTARTUP`, `BASH_ENV`).
- Bounded: at most `MAX_VARIABLES` names of `MAX_NAME_CHARS`, values of
  `MAX_VALUE_CHARS`, `MAX_TOTAL_CHARS` in all; a `cwd` of at most
  `MAX_CWD_CHARS`, absolute. Whether the directory exists is for the worker
  that runs the job to say.
- A YAML number is a value as its text (`OMP_NUM_THREADS: 4` is `"4"`); a
  boolean, null or container is refused (YAML `yes` would become `True`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.errors import Violation
from celery_ojs_ml.spec.flux_wording import ATTRIBUTES, show

CWD_PATH = "attributes.system.cwd"
ENV_PATH = "attributes.system.environment"
MAX_VARIABLES = 128
MAX_NAME_CHARS = 128
MAX_VALUE_CHARS = 4096
MAX_TOTAL_CHARS = 32768
MAX_CWD_CHARS = 4096
RESERVED_NAMES = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "BASH_ENV",
    }
)
"""Variables the plugin sets for a run, or that load code into what the task starts."""
RESERVED_PREFIXES = ("CUDA_MPS_", "TPU_", "LD_", "DYLD_")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_FIX = 'e.g. "environment": {"OMP_NUM_THREADS": "4", "HF_HOME": "/scratch/hf"}'
_CWD_FIX = 'give an absolute directory on the worker, e.g. "cwd": "/scratch/run-1"'


def is_reserved(name: str) -> bool:
    """Whether a job may not set `name` (see the module doc)."""
    return name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES)


def cwd_violations(system: Mapping[str, Any]) -> list[Violation]:
    """What is wrong with `attributes.system.cwd` ([] when absent or fine)."""
    if "cwd" not in system:
        return []
    cwd = system["cwd"]
    ok = isinstance(cwd, str) and cwd.startswith("/") and "\x00" not in cwd
    if ok and len(cwd) <= MAX_CWD_CHARS:
        return []
    if ok:
        problem = f"has {len(cwd)} characters, over {MAX_CWD_CHARS}"
    else:
        problem = f"is {show(cwd)} but must be an absolute path"
    return [Violation(CWD_PATH, problem, ATTRIBUTES, _CWD_FIX)]


def environment_violations(system: Mapping[str, Any]) -> list[Violation]:
    """What is wrong with `attributes.system.environment` ([] when absent or fine)."""
    if "environment" not in system:
        return []
    env = system["environment"]
    if not isinstance(env, Mapping):
        problem = f"is {show(env)} but must be a mapping of variable names to values"
        return [Violation(ENV_PATH, problem, ATTRIBUTES, _ENV_FIX)]
    if len(env) > MAX_VARIABLES:
        problem = f"has {len(env)} variables, over {MAX_VARIABLES}"
        return [Violation(ENV_PATH, problem, ATTRIBUTES, "set only what the task needs")]
    found = [v for name, value in env.items() if (v := _variable(name, value)) is not None]
    total = sum(len(str(k)) + len(str(v)) for k, v in env.items())
    if not found and total > MAX_TOTAL_CHARS:
        problem = f"takes {total} characters, over {MAX_TOTAL_CHARS}"
        fix = "pass large data in the task's arguments or a file"
        found.append(Violation(ENV_PATH, problem, ATTRIBUTES, fix))
    return found


def _variable(name: Any, value: Any) -> Violation | None:
    path = f"{ENV_PATH}.{name}"
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_NAME_CHARS:
        problem = f"names {show(name)}, not a variable name of letters, digits and _"
        return Violation(ENV_PATH, problem, ATTRIBUTES, _ENV_FIX)
    if is_reserved(name):
        problem = "is set by the worker for each run (devices, gang rendezvous) or loads code"
        fix = f"remove {name}: the plugin sets it from the job's resources"
        return Violation(path, problem, ATTRIBUTES, fix)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        problem = f"is {show(value)} but must be a string or a number"
        return Violation(path, problem, ATTRIBUTES, f'quote it, e.g. "{name}": "1"')
    if len(str(value)) > MAX_VALUE_CHARS:
        problem = f"has {len(str(value))} characters, over {MAX_VALUE_CHARS}"
        return Violation(path, problem, ATTRIBUTES, "pass large data in a file")
    return None


def environment_of(env: Mapping[str, Any]) -> dict[str, str]:
    """A valid environment as `str -> str` (numbers as their text)."""
    return {str(k): str(v) for k, v in env.items()}


def run_env_problem(cwd: Any, env: Any) -> str | None:
    """Why a message's cwd and environment headers cannot be used; None when they can."""
    system: dict[str, Any] = {}
    if cwd is not None:
        system["cwd"] = cwd
    if env is not None:
        system["environment"] = env
    found = cwd_violations(system) + environment_violations(system)
    return "; ".join(str(v) for v in found) or None
