"""The LFM2 model on lfm2jit kernels: config, checkpoints, forward and backward."""
from .checkpoint import CheckpointError
from .config import ConfigError, Lfm2Config
from .lfm2 import DeviceIds, Lfm2Model

__all__ = ["CheckpointError", "ConfigError", "DeviceIds", "Lfm2Config", "Lfm2Model"]
