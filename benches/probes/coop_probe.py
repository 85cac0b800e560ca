"""Probe: does an 8x8 f32 cooperative-matrix GEMM run on this adapter, how exact is it, how fast?

    python benches/probes/coop_probe.py          # LFM2JIT_ADAPTER picks the adapter, as everywhere

C[M, N] = A[M, K] B[K, N] (row-major) with naga's `enable wgpu_cooperative_matrix;`: each
32-invocation workgroup computes R x R tiles of 8x8, loading A and B tiles straight from storage.
Prints the error against float64 (about 1e-6 is fp32; about 1e-3 would mean TF32 tensor cores)
and TFLOP/s. It exits with the reason when the adapter lacks the feature or wgpu refuses it
(wgpu-native 0.32 does: the feature is experimental and its C API cannot enable those).
So far it has only reached that refusal (on the H200); the kernel below has never been compiled.
"""
import os
import time

import numpy as np
import wgpu


def pick():
    wanted = os.environ.get("LFM2JIT_ADAPTER", "").lower()
    for a in wgpu.gpu.enumerate_adapters_sync():
        if wanted in str(a.info.get("device", "")).lower() and "cooperative-matrix" in a.features:
            return a
    raise SystemExit(f"no adapter{' matching ' + repr(wanted) if wanted else ''} offers cooperative-matrix")

def shader(R):
    accs = "\n".join(f"    var c{i}_{j} = coop_mat8x8<f32, C>();" for i in range(R) for j in range(R))
    loads = "\n".join([f"        let a{i} = coopLoad<coop_mat8x8<f32, A>>(&ma[(m0 + {8*i}u) * K + k], K);" for i in range(R)]
                      + [f"        let b{j} = coopLoad<coop_mat8x8<f32, B>>(&mb[k * N + n0 + {8*j}u], N);" for j in range(R)])
    fmas = "\n".join(f"        c{i}_{j} = coopMultiplyAdd(a{i}, b{j}, c{i}_{j});" for i in range(R) for j in range(R))
    stores = "\n".join(f"    coopStore(c{i}_{j}, &mc[(m0 + {8*i}u) * N + n0 + {8*j}u], N);" for i in range(R) for j in range(R))
    return f"""enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read> ma: array<f32>;
@group(0) @binding(1) var<storage, read> mb: array<f32>;
@group(0) @binding(2) var<storage, read_write> mc: array<f32>;
@group(0) @binding(3) var<uniform> dims: vec4<u32>;
@compute @workgroup_size(32)
fn main(@builtin(workgroup_id) wid: vec3<u32>) {{
    let M = dims.x; let N = dims.y; let K = dims.z;
    let n0 = wid.x * {8*R}u;
    let m0 = wid.y * {8*R}u;
{accs}
    for (var k = 0u; k < K; k += 8u) {{
{loads}
{fmas}
    }}
{stores}
}}
"""

adapter = pick()
try:
    dev = adapter.request_device_sync(required_features=["cooperative-matrix"])
except RuntimeError as e:
    raise SystemExit(f"{adapter.info.get('device')}: wgpu refused cooperative-matrix: {str(e).splitlines()[-1]}")


def run(M, N, K, R, reps):
    rng = np.random.default_rng(0)
    A = rng.standard_normal((M, K)).astype(np.float32); B = rng.standard_normal((K, N)).astype(np.float32)
    mk = lambda x, u: dev.create_buffer_with_data(data=x, usage=u)
    S = wgpu.BufferUsage.STORAGE
    ba, bb = mk(A, S), mk(B, S)
    bc = dev.create_buffer(size=M * N * 4, usage=S | wgpu.BufferUsage.COPY_SRC)
    bd = mk(np.array([M, N, K, 0], np.uint32), wgpu.BufferUsage.UNIFORM)
    mod = dev.create_shader_module(code=shader(R))
    pipe = dev.create_compute_pipeline(layout="auto", compute={"module": mod, "entry_point": "main"})
    bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}} for i, b in enumerate((ba, bb, bc, bd))])
    def go(n):
        enc = dev.create_command_encoder()
        p = enc.begin_compute_pass(); p.set_pipeline(pipe); p.set_bind_group(0, bg)
        for _ in range(n): p.dispatch_workgroups(N // (8 * R), M // (8 * R), 1)
        p.end(); dev.queue.submit([enc.finish()])
        dev.queue.read_buffer(bd)   # wait
    go(1)
    C = np.frombuffer(dev.queue.read_buffer(bc), np.float32).reshape(M, N)
    want = A.astype(np.float64) @ B.astype(np.float64)
    err = np.abs(C - want).max() / np.abs(want).max()
    t0 = time.perf_counter(); go(reps); dt = (time.perf_counter() - t0) / reps   # warm
    t0 = time.perf_counter(); go(reps); dt = (time.perf_counter() - t0) / reps
    print(f"coop f32 8x8 R={R} {M}x{N}x{K}: rel err {err:.2e}  {dt*1e3:.3f} ms  {2*M*N*K/dt/1e12:.1f} TFLOP/s", flush=True)



for R in (2, 4):
    run(512, 512, 512, R, 5)
    run(4096, 4096, 4096, R, 20)
