"""The WebGPU runtime: a device (WgpuContext), GPU tensors, the buffer pool, and the recorder that
turns shaders into pipelines and dispatches. It imports nothing of the compiler."""
from .context import AdapterError, WgpuContext
from .recorder import ShaderCompileError
from .tensor import Tensor

__all__ = ["AdapterError", "ShaderCompileError", "Tensor", "WgpuContext"]
