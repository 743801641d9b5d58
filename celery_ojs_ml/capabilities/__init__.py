"""Worker capabilities: the §11 model, its three spec forms, detection, profiles.

Pure except for `probe`, the one place that talks to NVML and psutil.
"""

from celery_ojs_ml.capabilities.model import (
    Capabilities,
    GpuCapability,
    LoadedModel,
    TpuCapability,
)
from celery_ojs_ml.capabilities.parse import capabilities_to_dict, parse_capabilities
from celery_ojs_ml.capabilities.probe import GpuDevice, probe, probe_devices
from celery_ojs_ml.capabilities.profiles import PROFILES, resolve_capabilities

__all__ = [
    "PROFILES",
    "Capabilities",
    "GpuCapability",
    "GpuDevice",
    "LoadedModel",
    "TpuCapability",
    "capabilities_to_dict",
    "parse_capabilities",
    "probe",
    "probe_devices",
    "resolve_capabilities",
]
