"""The LFM2 model on lfm2jit kernels: config, checkpoints, forward and backward, LoRA adapters."""
from .checkpoint import CheckpointError
from .config import ConfigError, Lfm2Config
from .ids import DeviceIds
from .lfm2 import Lfm2Model
from .lora import AdapterError, LoraConfig
from .moe_config import Lfm2MoeConfig

__all__ = ["AdapterError", "CheckpointError", "ConfigError", "DeviceIds", "Lfm2Config", "Lfm2Model", "Lfm2MoeConfig", "LoraConfig"]
