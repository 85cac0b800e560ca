"""lfm2jit: a tensor DSL compiled to WGSL compute kernels, and the runtime that runs them.

Follow the path by imports: dsl (parse) -> ir (check) -> schedule (choose a template) ->
codegen (render WGSL) -> runtime (pipelines, dispatches).
"""
from .compiler import Backward, Kernel, Module, compile_source, grad
from .dsl.errors import DslError
from .runtime import ComputeEngine, Tensor, WgpuContext

__all__ = ["Backward", "ComputeEngine", "DslError", "Kernel", "Module", "Tensor", "WgpuContext", "compile_source", "grad"]
__version__ = "0.1.0"
