"""The wgpu runtime: a device (WgpuContext), GPU tensors, and the engine that runs kernels."""
from .context import AdapterError, WgpuContext
from .engine import ComputeEngine, ShaderCompileError
from .tensor import Tensor

__all__ = ["AdapterError", "ComputeEngine", "ShaderCompileError", "Tensor", "WgpuContext"]
