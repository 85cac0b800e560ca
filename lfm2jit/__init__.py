"""lfm2jit: a tensor DSL compiled to WGSL compute kernels, and the runtime that runs them.

Follow the path by imports: dsl (parse) -> ir (check, differentiate, partition) -> schedule (a
typed spec per part) -> codegen (render WGSL) -> driver (kernels, caches, dumps); runtime (device,
tensors, recording) knows none of them, and engine joins driver and runtime. tune's tile classes
and heuristics sit below schedule (planners ask them for tiles), its autotuner above it; ops (the
shipped kernels, which register their names with the driver) sits on top.
"""
from .driver import Backward, Kernel, Module, compile_source, grad
from .dsl.errors import DslError
from .engine import ComputeEngine
from .ops import library
from .runtime import ShaderCompileError, Tensor, WgpuContext

__all__ = ["Backward", "ComputeEngine", "DslError", "Kernel", "Module", "ShaderCompileError", "Tensor",
           "WgpuContext", "compile_source", "grad", "library"]
__version__ = "0.1.0"
