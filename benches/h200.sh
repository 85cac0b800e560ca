#!/usr/bin/env bash
# On the lent H200 (device tool), from the repository root, with the GPU kit carried:
#   bash benches/h200.sh tests            the whole test suite on the H200's Vulkan adapter (f16 and
#                                         every GPU path; the wheel tests are left out: the machine
#                                         has no index to build a wheel from), on wgpu-native and on Dawn
#                                         (matrix units) -> $OUT/h200_tests.log, $OUT/h200_tests_dawn.log
#   bash benches/h200.sh matrix           on Dawn: lfm2jit info, the matrix-unit tests, and the matmul and
#                                         matrix kernel benchmarks -> $OUT/h200_matrix.{log,json}, and the
#                                         matrix group again with LFM2JIT_DAWN_ROBUSTNESS=off -> h200_matrix_unclamped.json
#   bash benches/h200.sh speed [BASE]     benches/side_by_side.py in one run: lfm2jit fp32 and --f16 (the
#                                         default implementation: Dawn on the H200), PyTorch fp32, bf16
#                                         autocast and torch.compile -> $OUT/h200_sbs.json; then lfm2jit
#                                         fp32 on wgpu-native -> $OUT/h200_sbs_wgpu_native.json; with BASE (an
#                                         older checkout) its fp32 side on wgpu-native -> $OUT/h200_sbs_base.json
#   bash benches/h200.sh lora             on Dawn: the matrix-unit tests, LoRA's rank-8 products at every candidate
#                                         tile (-> $OUT/h200_lora_mtiles.json), then LFM2-1.2B shapes at 1x2048 with
#                                         --f16: LoRA r = 8 on a frozen f16 base, and full fine-tuning
#                                         -> $OUT/h200_lora_1.2B.json, h200_full_1.2B.json
#   bash benches/h200.sh decode           on Dawn: the generation tests (f16 decoding and the GPU token choice
#                                         included), then benches/decode.py at LFM2-350M shapes, batch 1 and 8, greedy
#                                         and sampled, lfm2jit f32/f16 (replayed decode steps) beside transformers
#                                         fp32/bf16 on CUDA -> $OUT/h200_generate_tests_dawn.log, $OUT/h200_decode.json
#   bash benches/h200.sh startup [BASE]   the caches' tests on Dawn, then benches/startup.py at LFM2-350M, $SHAPE (8x512), --f16: cold
#                                         and warm start-up on Dawn and on wgpu-native ($IMPLS) -> $OUT/startup_dawn.json,
#                                         startup_wgpu_native.json; each compile of that cold window timed alone on Dawn
#                                         (benches/probes/compile_times.py) -> $OUT/startup_compile_times.log; with BASE (an older checkout) the first --f16
#                                         8x512 window in one process on Dawn (the bench's train line), this
#                                         checkout's and BASE's -> $OUT/startup_train.json, startup_base_train.json
#   bash benches/h200.sh attention        on Dawn: the attention tests (the f16 ones on the matrix units), then the attention
#                                         group and each f16 attention kernel at every candidate tile
#                                         -> $OUT/h200_attention_tests_dawn.log, $OUT/h200_attention.json
#   bash benches/h200.sh gradsync         on Dawn, two ranks under mpiexec (mpi4py + mpich wheels from .gpu-kit/mpi) on the
#                                         one GPU: benches/grad_sync.py at LFM2-350M, 1x512 per rank, LoRA r = 8 (3 timed
#                                         steps) and full fine-tuning (2), each with the gradients staged in the backward and
#                                         after the pass -> $OUT/h200_grad_sync_lora.json, h200_grad_sync_full.json
#   bash benches/h200.sh limits           what WebGPU's default limits cost: the limits group (kernels on LFM2-1.2B's
#                                         embedding, in pieces and parts, beside the raised limits) on Dawn and on
#                                         wgpu-native, then the default-limits model tests -> $OUT/h200_limits{,_wgpu_native}.json
#   bash benches/h200.sh gtiles           on Dawn: the grouped-GEMM and experts tests, then benches/probes/grouped_tiles.py (the
#                                         experts' grouped forward and dX at other tile heights, with one expert, and gate_up's dW
#                                         over 1, 4 and 32 experts, f32 and f16 output) -> $OUT/<card>_grouped_tests_dawn.log,
#                                         <card>_grouped_tiles.log
#   bash benches/h200.sh gdw              on Dawn, issue 47's grouped dW: the grouped-GEMM and experts tests, the per-expert dW at
#                                         other tiles (benches/probes/grouped_tiles.py --dw), the grouped group in f16
#                                         -> $OUT/<card>_grouped_tests_dawn.log, <card>_grouped_dw_tiles.log, <card>_grouped_f16.json
#   bash benches/h200.sh lmchunks         on Dawn, issue 51's LM head at short T: the xent group (f16 hidden states) in chunks of
#                                         4096 / 8192 / 16384 rows, then T = 512's chunk GEMM at every candidate tile
#                                         -> $OUT/<card>_xent_chunks.json, <card>_mtiles_lm_head_512.json
#   bash benches/h200.sh kgroups          on Dawn, issue 51: the GEMM's tiles of two subgroup groups sharing each k-step (sg_k)
#                                         beside the planner's picks, at 4096^3 and LFM2-350M's T = 2048 / 512 shapes
#                                         -> $OUT/<card>_mtiles_kgroups.json
#   bash benches/h200.sh sass             on Dawn, issue 51: what the driver compiled the GEMM (planner's tiles and
#                                         variants) and attention's forward into: registers, shared memory, spills, HMMA /
#                                         LDSM / LDS / STS / BAR counts (benches/probes/sass_probe.py) -> $OUT/<card>_sass.log
#   bash benches/h200.sh double           on Dawn, issue 51's attention: the double and shuffle tests (streamed tiles double-buffered,
#                                         o in fragments; rows meeting by subgroup shuffles; causal blocks paired), then the
#                                         atiles group (each pick with and without them, labels /x2, /sh, /pr)
#                                         -> $OUT/<card>_attention_double_tests_dawn.log, <card>_atiles_double.json
#   bash benches/h200.sh fwddouble        on Dawn, issue 51: why the attention forward with double is wrong on NVIDIA: its template
#                                         with one suspect at a time changed (benches/probes/attention_double.py), the
#                                         wrong cases printed -> $OUT/<card>_attention_fwd_double.log
#   bash benches/h200.sh thin [BASE]      on Dawn, issue 51's LoRA: the rank-8 products at matrix and SIMT tiles 8 thin
#                                         (benches/probes/narrow_tiles.py), then LoRA r = 8 at LFM2-1.2B, --f16, 1x2048 with
#                                         this checkout (and PyTorch + PEFT bf16), then autotuned (into $OUT/tune, in the
#                                         untimed first window), and with BASE (an older checkout)
#                                         -> $OUT/<card>_narrow_simt.log, <card>_lora_1.2B_f16{,_tuned,_base}.json
#   bash benches/h200.sh moe              on Dawn: the routing, grouped-GEMM and LFM2-MoE tests, then the grouped group
#                                         (the experts' grouped GEMMs at LFM2-8B-A1B shapes beside a dense GEMM of the
#                                         same FLOPs) -> $OUT/<card>_moe_tests_dawn.log, $OUT/<card>_grouped.json; with
#                                         TUNED=1 only the grouped group of f16 operands, autotuned (grouped and dense alike)
#                                         -> $OUT/<card>_grouped_tuned.json
#   bash benches/h200.sh moelora          on Dawn: benches/side_by_side.py with LoRA r = 8 on a frozen f16 base at 1x2048,
#                                         lfm2jit (f32 and f16 activations; at 8B-A1B f16 only, its host init is long)
#                                         beside PyTorch + PEFT with a bf16 base, at LFM2-1.2B and LFM2-8B-A1B shapes,
#                                         then 8B-A1B f16 with --recompute-mlp (alone)
#                                         -> $OUT/<card>_moe_lora_{1.2B,8B-A1B_f16,8B-A1B_recompute}.json
#   bash benches/h200.sh ckpt             on Dawn: activation checkpointing at LFM2-1.2B shapes, 1x2048, --f16: LoRA r = 8
#                                         on a frozen f16 base and full fine-tuning, each without and with
#                                         --checkpoint-layers all -> $OUT/<card>_ckpt_{lora,full}_{none,all}.json
#   bash benches/h200.sh packing          on Dawn: the packing group at LFM2-350M shapes, windows of 16 sequences with the
#                                         shipped chat data's token lengths times 1 and times 8 (a long-chat set of the
#                                         same shape), --f16, 3 timed runs, --packing pad and concat
#                                         -> $OUT/<card>_packing_f16_x{1,8}.json
#   bash benches/h200.sh qlora [8B-A1B]   on Dawn: LoRA r = 8 at 1x2048 --f16 on a frozen base held as f16, int8 and nf4
#                                         at LFM2-2.6B shapes (tokens/s and peak per base); with 8B-A1B, that model with
#                                         its experts in nf4 alone (host init and quantizing take minutes)
#                                         -> $OUT/<card>_qlora_{2.6B_f16,2.6B_int8,2.6B_nf4 | 8B-A1B_nf4}.json
#   bash benches/h200.sh longctx          on Dawn: long context, LFM2-350M and LFM2-1.2B shapes at 1x16384 and 1x32768, full
#                                         fine-tuning and LoRA r = 8 on a frozen f16 base, each --f16 --checkpoint-layers all
#                                         (f32 activations of a 32k row would not fit; the reruns cost a forward), one timed
#                                         window, each run bounded (the section fits one 10-minute call); then the
#                                         "what fits" table: peak GiB and tokens/s, or why not
#                                         -> $OUT/<card>_longctx_<preset>_<kind>_<T>.json
#   bash benches/h200.sh staging          issue 51 in one call, on Dawn: the matrix-unit GEMM tests (vec4 staging on the real
#                                         units against float64) and every template variant through Tint, then the staging
#                                         group (fwd, dX, dW at 4096^3 and the LFM2-350M T = 2048 shapes, f16 and vec4 tiles,
#                                         one and two stages; attention's three kernels at T = 2048, f16 and vec4 tiles),
#                                         then --f16 train steps at 8x512 with each staging as the
#                                         default -> $OUT/<card>_staging_tests_dawn.log, <card>_staging.json,
#                                         <card>_staging_train_{f16,vec4}.json
#   bash benches/h200.sh compile          on Dawn, issue 52's cold start in one call: benches/startup.py at LFM2-350M 8x512 --f16
#                                         with Dawn's own asynchronous compiles, with LFM2JIT_COMPILE_THREADS=8, and with
#                                         LFM2JIT_DAWN_BLOB_CACHE=on; then benches/probes/compile_times.py (each compile of that
#                                         window alone, and serial / async / threads / helper-device compiles of it)
#                                         -> $OUT/<card>_startup_threads{0,8}_blobs_{off,on}.json, <card>_compile_times.log
#   bash benches/h200.sh nf4              on Dawn, issue 49's NF4 speed in one call: benches/probes/decoded_tiles.py (the
#                                         decoded GEMMs per tile beside f16's), then LoRA r = 8 at LFM2-2.6B 1x2048 --f16 on an
#                                         f16 and an nf4 base -> $OUT/<card>_decoded_tiles.log, <card>_qlora_2.6B_{f16,nf4}.json
#   bash benches/h200.sh robust [MODES]   issue 51's robustness on Dawn: the GEMMs and attention give the same bits in every
#                                         LFM2JIT_DAWN_ROBUSTNESS mode; then for each mode (default: on off): the device's toggles and the matrix-unit GEMM tests against float64 on it, the
#                                         matrix group (fwd, dX, dW at the LFM2-350M shapes and 4096^3) and --f16 train steps at
#                                         8x512 -> $OUT/<card>_robust.log, <card>_robust_<mode>.json, <card>_robust_train_<mode>.json
#   bash benches/h200.sh mpi              the host side of the gradient exchange: benches/readback.py (1 and 4 copy threads),
#                                         then benches/mpi_exchange.py (no GPU) with 2 ranks under MPICH's transports and
#                                         settings, and with 4 -> $OUT/h200_readback.json, $OUT/h200_mpi_exchange.log
set -uo pipefail
source .gpu-kit/env.sh
export LFM2JIT_ADAPTER=${LFM2JIT_ADAPTER:-NVIDIA} PYTHONUNBUFFERED=1   # the lent H200 or H100
python3 -c 'import wgpu; print([a.summary for a in wgpu.gpu.enumerate_adapters_sync()])'
start=$(date +%s)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o "H[0-9]*" | head -1 | tr A-Z a-z)   # h100 or h200: names result files
install_mpi() {   # mpi4py + the mpich wheel from the kit; MPIEXEC: the mpiexec beside this python
    python3 -m pip install -q --no-deps --no-index .gpu-kit/mpi/*.whl 2>&1 | tail -2
    MPIEXEC="$(python3 -c 'import sys, os; print(os.path.join(os.path.dirname(sys.executable), "mpiexec"))')"
    [ -x "$MPIEXEC" ] || MPIEXEC="$(command -v mpiexec || echo "$HOME/.local/bin/mpiexec")"
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # the device's own Open MPI runs as root
}
case "${1:-}" in
tests)
    # wgpu-native and Dawn side by side (separate processes; the tests are not timed)
    LFM2JIT_WEBGPU=wgpu-native python3 -m pytest -q -p no:cacheprovider --deselect tests/test_packaging.py \
        > "$OUT/h200_tests.log" 2>&1 &
    LFM2JIT_WEBGPU=dawn python3 -m pytest -q -p no:cacheprovider -rs --deselect tests/test_packaging.py \
        > "$OUT/h200_tests_dawn.log" 2>&1
    wait
    tail -3 "$OUT/h200_tests.log" "$OUT/h200_tests_dawn.log"
    ;;
matrix)
    export LFM2JIT_WEBGPU=dawn
    python3 -m lfm2jit info 2>&1
    python3 -c 'from lfm2jit import WgpuContext; c = WgpuContext.create(); print(c.info); print(c.subgroup_matrix_configs)'
    python3 -m pytest -q -p no:cacheprovider -rs tests/compiler/test_matrix_units.py tests/compiler/test_attention_matrix.py tests/runtime/test_webgpu.py -x 2>&1 \
        | tee "$OUT/h200_matrix.log" | tail -8
    python3 benches/bench.py --only ${BENCH_GROUPS:-ref matrix mtiles} --json "$OUT/h200_matrix.json" 2>&1 | grep -v "^mtiles" | tail -50
    # the same products at their default tiles on a device without Dawn's bounds clamping (opt-in)
    LFM2JIT_DAWN_ROBUSTNESS=off python3 benches/bench.py --only matrix --json "$OUT/h200_matrix_unclamped.json" 2>&1 | tail -30
    ;;
speed)
    timeout 420 python3 benches/side_by_side.py --steps 3 --torch-compile --json "$OUT/h200_sbs.json" 2>&1 | tail -22
    LFM2JIT_WEBGPU=wgpu-native timeout 150 python3 benches/side_by_side.py --steps 3 --ours fp32 --torch \
        --json "$OUT/h200_sbs_wgpu_native.json" 2>&1 | tail -8
    if [ -n "${2:-}" ]; then
        (cd "$2" && LFM2JIT_WEBGPU=wgpu-native python3 benches/side_by_side.py --steps 3 --skip-torch \
            --json "$OUT/h200_sbs_base.json" 2>&1 | tail -8)
    fi
    ;;
lora)
    export LFM2JIT_WEBGPU=dawn
    python3 -m pytest -q -p no:cacheprovider -rs tests/compiler/test_matrix_units.py tests/compiler/test_attention_matrix.py 2>&1 | tee "$OUT/h200_matrix_tests_dawn.log" | tail -3
    # T x r x in (x A^T as fwd, dA = dU^T X as dw) and T x out x r (U B^T as fwd, dU = dY B as dx) at 1.2B's widths
    python3 benches/bench.py --only mtiles --tile-shapes 2048x8x2048 2048x8x8192 2048x2048x8 2048x8192x8 \
        --json "$OUT/h200_lora_mtiles.json" 2>&1 | grep -v "^#" | awk '{printf "%-34s %-14s %10s %s\n", $2, $3, $4, $5}' | tail -70
    for run in "lora --lora 8 --lora-f16-base" "full"; do
        set -- $run
        name=$1; shift
        timeout 280 python3 -m lfm2jit.bench --only train --f16 --model-preset 1.2B --train-shapes 1x2048 "$@" \
            --json "$OUT/h200_${name}_1.2B.json" 2>&1 | tail -4
    done
    ;;
attention)
    export LFM2JIT_WEBGPU=dawn
    python3 -m pytest -q -p no:cacheprovider -rs tests/compiler/test_attention.py tests/compiler/test_attention_matrix.py 2>&1 \
        | tee "$OUT/${card}_attention_tests_dawn.log" | tail -3
    python3 benches/bench.py --only attention atiles --json "$OUT/${card}_attention.json" 2>&1 | grep -v "^#" | tail -60
    ;;
decode)
    export LFM2JIT_WEBGPU=dawn
    python3 -m pytest -q -p no:cacheprovider -rs tests/model/test_generate.py tests/model/test_decode.py \
        tests/trainer/test_evaluation.py tests/cli/test_cli_generate.py 2>&1 | tee "$OUT/h200_generate_tests_dawn.log" | tail -3
    timeout 500 python3 benches/decode.py --sample --json "$OUT/h200_decode.json" 2>&1 | grep -v "^  \|Loading\|causal_conv" | tail -20
    ;;
startup)
    LFM2JIT_WEBGPU=dawn timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 -rs tests/runtime/test_compile_cache.py \
        tests/runtime/test_engine.py tests/runtime/test_program.py 2>&1 | tail -4
    for impl in ${IMPLS:-dawn wgpu-native}; do
        LFM2JIT_WEBGPU=$impl timeout 240 python3 benches/startup.py --preset 350M --shape "${SHAPE:-8x512}" --f16 \
            --json "$OUT/startup_${impl/-/_}.json" 2>&1 | tail -3
    done
    LFM2JIT_WEBGPU=dawn timeout 200 python3 benches/probes/compile_times.py --preset 350M --shape "${SHAPE:-8x512}" \
        --f16 2>&1 | tee "$OUT/startup_compile_times.log" | tail -17
    if [ -n "${2:-}" ]; then      # the first window in one process, this checkout and BASE, no disk cache
        LFM2JIT_WEBGPU=dawn timeout 200 python3 benches/bench.py --only train --f16 --train-shapes "${SHAPE:-8x512}" --steps 1 \
            --json "$OUT/startup_train.json" 2>&1 | tail -2
        (cd "$2" && LFM2JIT_WEBGPU=dawn PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benches/bench.py --only train --f16 \
            --train-shapes "${SHAPE:-8x512}" --steps 1 --json "$OUT/startup_base_train.json" 2>&1 | tail -2)
    fi
    ;;
gradsync)
    export LFM2JIT_WEBGPU=dawn
    install_mpi
    for run in "lora --lora 8 --steps 3" "full --steps 2"; do
        set -- $run
        name=$1; shift
        timeout 300 "$MPIEXEC" -n 2 python3 benches/grad_sync.py --preset 350M --shape 1x512 "$@" \
            --json "$OUT/h200_grad_sync_${name}.json" 2>&1 | tail -4
    done
    ;;
limits)
    for impl in dawn wgpu-native; do
        suffix=$([ "$impl" = dawn ] || echo _wgpu_native)
        LFM2JIT_WEBGPU=$impl python3 -m lfm2jit.bench --only limits --json "$OUT/h200_limits$suffix.json" 2>&1 | grep "^#   \|limits" | tail -8
    done
    LFM2JIT_WEBGPU=dawn python3 -m pytest -q -p no:cacheprovider -rs tests/model/test_default_limits.py tests/compiler/test_binding_limits.py 2>&1 \
        | tee "$OUT/h200_default_limits_tests_dawn.log" | tail -3
    ;;
gtiles)
    # issue 47's grouped GEMMs: their tests on the real matrix units, then benches/probes/grouped_tiles.py
    export LFM2JIT_WEBGPU=dawn
    python3 -m pytest -q -p no:cacheprovider -rs tests/compiler/test_grouped_matmul.py tests/ops/test_experts.py 2>&1 \
        | tee "$OUT/${card}_grouped_tests_dawn.log" | tail -3
    timeout 420 python3 benches/probes/grouped_tiles.py 2>&1 | tee "$OUT/${card}_grouped_tiles.log" | tail -40
    ;;
gdw)
    # issue 47's grouped dW: the grouped tests on the real matrix units, the per-expert dW at other tiles
    # (benches/probes/grouped_tiles.py --dw), then the grouped group at the planner's tiles
    export LFM2JIT_WEBGPU=dawn
    python3 -m pytest -q -p no:cacheprovider -rs tests/compiler/test_grouped_matmul.py tests/ops/test_experts.py 2>&1 \
        | tee "$OUT/${card}_grouped_tests_dawn.log" | tail -3
    timeout 240 python3 benches/probes/grouped_tiles.py --dw 2>&1 | tee "$OUT/${card}_grouped_dw_tiles.log" | tail -24
    timeout 180 python3 -m lfm2jit.bench --only grouped --grouped-dtypes f16 --json "$OUT/${card}_grouped_f16.json" 2>&1 \
        | grep -v "^#   " | tail -12
    ;;
lmchunks)
    # issue 51's LM head at short T: f16 hidden states in chunks of 4096, 8192 and 16384 rows of E, then
    # the chunk GEMM of T = 512 at every candidate tile (the planner's pick beside the fastest)
    export LFM2JIT_WEBGPU=dawn
    timeout 200 python3 benches/bench.py --only xent --xent-dtypes f16 --xent-chunks 4096 8192 16384 \
        --json "$OUT/${card}_xent_chunks.json" 2>&1 | grep -v "^#   " | tail -12
    timeout 150 python3 benches/bench.py --only mtiles --tile-shapes 512x4096x1024 --products fwd fwd_w16 fwd_y32 dx dw \
        --json "$OUT/${card}_mtiles_lm_head_512.json" > /dev/null 2>&1
    python3 benches/probes/best_tiles.py "$OUT/${card}_mtiles_lm_head_512.json"
    ;;
kgroups)
    # issue 51: tiles of two subgroup groups sharing each k-step (MatrixTiles.sg_k) beside the planner's
    # picks, at 4096^3, LFM2-350M's T = 2048 and T = 512 shapes and the LM head's chunk at T = 512
    export LFM2JIT_WEBGPU=dawn
    timeout 420 python3 benches/bench.py --only mtiles --products fwd dx dw --tiles-matching x2x2/ --tile-shapes \
        4096x4096x4096 2048x4608x1024 2048x1024x4608 2048x3072x1024 2048x1024x1024 512x4608x1024 512x1024x4608 \
        512x4096x1024 --json "$OUT/${card}_mtiles_kgroups.json" > /dev/null 2>&1
    python3 benches/probes/best_tiles.py "$OUT/${card}_mtiles_kgroups.json"
    ;;
double)
    export LFM2JIT_WEBGPU=dawn
    timeout 180 python3 -m pytest -q -p no:cacheprovider tests/compiler/test_attention_matrix.py \
        -k "o_kept or backward_with or shuffles or paired or every_fitting" 2>&1 | tee "$OUT/${card}_attention_double_tests_dawn.log" | tail -2
    timeout 300 python3 benches/bench.py --only atiles --json "$OUT/${card}_atiles_double.json" 2>&1 \
        | grep -v "^#" | grep -v simt | tail -44
    ;;
fwddouble)
    export LFM2JIT_WEBGPU=dawn
    timeout 240 python3 benches/probes/attention_double.py 2>&1 | tee "$OUT/${card}_attention_fwd_double.log" \
        | awk '$5 != "-" && ($5 + 0 > 4e-3 || $5 == "nan") || /^#/' | tail -60
    ;;
thin)
    export LFM2JIT_WEBGPU=dawn
    timeout 200 python3 benches/probes/narrow_tiles.py 2048 8192 2048 2048 2>&1 | tee "$OUT/${card}_narrow_simt.log" | tail -9
    lora="--preset 1.2B --lora 8 --lora-f16-base --shapes 1x2048 --steps 4 --ours f16"
    timeout 170 python3 benches/side_by_side.py $lora --torch bf16 --json "$OUT/${card}_lora_1.2B_f16.json" 2>&1 | tail -6
    mkdir -p -m 700 "$OUT/tune"    # the tuner times its candidates in the first window, which is not timed
    LFM2JIT_CACHE_DIR="$OUT/tune" LFM2JIT_AUTOTUNE=1 timeout 240 python3 benches/side_by_side.py $lora \
        --json "$OUT/${card}_lora_1.2B_f16_tuned.json" 2>&1 | tail -3
    if [ -n "${2:-}" ]; then
        (cd "$2" && PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python3 benches/side_by_side.py $lora --torch \
            --json "$OUT/${card}_lora_1.2B_f16_base.json" 2>&1 | tail -4)
    fi
    ;;
sass)
    # issue 51: the binaries behind the GEMM and attention timings (registers cap the workgroups an SM holds)
    export LFM2JIT_WEBGPU=dawn
    timeout 300 python3 benches/probes/sass_probe.py --out "$OUT" 2>&1 | tee "$OUT/${card}_sass.log" | grep -v "^  file " | tail -60
    ;;
moe)
    export LFM2JIT_WEBGPU=dawn
    if [ -n "${TUNED:-}" ]; then
        mkdir -p -m 700 "$OUT/tune"
        LFM2JIT_AUTOTUNE=1 LFM2JIT_CACHE_DIR="$OUT/tune" python3 -m lfm2jit.bench --only grouped --grouped-dtypes f16 \
            --json "$OUT/${card}_grouped_tuned.json" 2>&1 | grep -v "^#   " | tail -24
        exit 0
    fi
    python3 -m pytest -q -p no:cacheprovider -rs tests/compiler/test_grouped_matmul.py tests/compiler/test_topk.py \
        tests/compiler/test_bucket_sort.py tests/compiler/test_gather_grad.py tests/ops/test_experts.py \
        tests/model/test_moe_model.py 2>&1 | tee "$OUT/${card}_moe_tests_dawn.log" | tail -3
    python3 -m lfm2jit.bench --only grouped --json "$OUT/${card}_grouped.json" 2>&1 | grep -v "^#   " | tail -24
    ;;
moelora)
    export LFM2JIT_WEBGPU=dawn
    for run in "1.2B 130" "8B-A1B 300 _f16 --ours f16" "8B-A1B 120 _recompute --recompute-mlp --ours f16 --torch"; do
        set -- $run
        preset=$1 limit=$2 suffix=${3:-}
        shift 3 2>/dev/null || shift $#
        timeout "$limit" python3 benches/side_by_side.py --preset "$preset" --ours fp32 f16 --torch bf16 --lora 8 \
            --lora-f16-base --shapes 1x2048 --steps 3 "$@" --json "$OUT/${card}_moe_lora_$preset$suffix.json" 2>&1 \
            | grep -v "^  \|Warning\|warn" | tail -12
    done
    ;;
ckpt)
    export LFM2JIT_WEBGPU=dawn
    for run in "lora none 0 --lora 8 --lora-f16-base" "lora all all --lora 8 --lora-f16-base" "full none 0" "full all all"; do
        set -- $run
        kind=$1 name=$2 layers=$3
        shift 3
        timeout 140 python3 -m lfm2jit.bench --only train --f16 --model-preset 1.2B --train-shapes 1x2048 --steps 2 \
            --checkpoint-layers "$layers" "$@" --json "$OUT/${card}_ckpt_${kind}_${name}.json" 2>&1 | grep "^train"
    done
    ;;
packing)
    export LFM2JIT_WEBGPU=dawn
    for scale in 1 8; do
        timeout "${PACKING_TIMEOUT:-280}" python3 -m lfm2jit.bench --only packing --model-preset 350M --packing-window 16 --f16 --steps 3 \
            --length-scale "$scale" --json "$OUT/${card}_packing_f16_x${scale}.json" 2>&1 | grep "^packing"
    done
    ;;
compile)
    export LFM2JIT_WEBGPU=dawn
    for run in "0 off" "8 off" "0 on"; do
        set -- $run
        LFM2JIT_COMPILE_THREADS=$1 LFM2JIT_DAWN_BLOB_CACHE=$2 timeout 150 python3 benches/startup.py --preset 350M \
            --shape 8x512 --f16 --json "$OUT/${card}_startup_threads$1_blobs_$2.json" 2>&1 | tail -3
    done
    timeout 280 python3 benches/probes/compile_times.py --preset 350M --shape 8x512 --f16 --top 12 --threads 8 2>&1 \
        | tee "$OUT/${card}_compile_times.log" | tail -20
    ;;
nf4)
    export LFM2JIT_WEBGPU=dawn
    timeout 200 python3 benches/probes/decoded_tiles.py 2>&1 | tee "$OUT/${card}_decoded_tiles.log" | tail -12
    for base in f16 nf4; do
        timeout 170 python3 -m lfm2jit.bench --only train --f16 --model-preset 2.6B --train-shapes 1x2048 --steps 2 \
            --lora 8 --base-dtype "$base" --json "$OUT/${card}_qlora_2.6B_$base.json" 2>&1 | grep "^train\|^# model" \
            || echo "train     2.6B $base: no line (timed out?)"
    done
    ;;
qlora)
    export LFM2JIT_WEBGPU=dawn
    runs=("2.6B f16 150" "2.6B int8 170" "2.6B nf4 170")
    [ "${2:-}" = 8B-A1B ] && runs=("8B-A1B nf4 560")
    for run in "${runs[@]}"; do
        set -- $run
        timeout "$3" python3 -m lfm2jit.bench --only train --f16 --model-preset "$1" --train-shapes 1x2048 --steps 2 \
            --lora 8 --base-dtype "$2" --json "$OUT/${card}_qlora_$1_$2.json" 2>&1 | grep "^train\|^# model" \
            || echo "train     $1 $2: no line (timed out after $3 s?)"
    done
    ;;
longctx)
    export LFM2JIT_WEBGPU=dawn
    for run in "350M 16384 50" "350M 32768 60" "1.2B 16384 75" "1.2B 32768 100"; do   # 570 s at most
        set -- $run
        preset=$1 t=$2 limit=$3
        for kind in full lora; do
            extra=$([ "$kind" = lora ] && echo "--lora 8 --lora-f16-base")
            timeout "$limit" python3 -m lfm2jit.bench --only train --f16 --checkpoint-layers all --model-preset "$preset" \
                --train-shapes "1x$t" --steps 1 $extra --json "$OUT/${card}_longctx_${preset}_${kind}_$t.json" 2>&1 \
                | grep "^train" || echo "train     $preset $kind 1x$t: no line (timed out after ${limit}s?)"
        done
    done
    python3 - "$OUT" "$card" <<'PY'
import json, sys
from pathlib import Path
out, card = Path(sys.argv[1]), sys.argv[2]
print(f"\nwhat fits on {card} (--f16 --checkpoint-layers all; LoRA r = 8 on an f16 base):")
print(f"{'model':6s} {'kind':5s} {'T':>6s} {'peak GiB':>9s} {'tok/s':>8s}")
for preset in ("350M", "1.2B"):
    for kind in ("full", "lora"):
        for t in (16384, 32768):
            path = out / f"{card}_longctx_{preset}_{kind}_{t}.json"
            lines = [x for x in json.loads(path.read_text())["lines"] if x["group"] == "train"] if path.exists() else []
            if not lines or lines[0]["error"]:     # an out-of-memory error, or no line in the time given
                why = f"failed: {lines[0]['error'][:70]}" if lines else "no result (timed out, or failed to start)"
                print(f"{preset:6s} {kind:5s} {t:6d} {'-':>9s} {'-':>8s}  {why}")
                continue
            x = lines[0]["extra"]
            print(f"{preset:6s} {kind:5s} {t:6d} {x['peak_bytes'] / 2**30:9.2f} {x['tokens_per_s']:8.0f}")
PY
    ;;
staging)
    export LFM2JIT_WEBGPU=dawn
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/compiler/test_template_variants.py \
        tests/compiler/test_matrix_units.py tests/compiler/test_attention_matrix.py -k "float64 or vec4 or accumulate or compiles" 2>&1 \
        | tee "$OUT/${card}_staging_tests_dawn.log" | tail -3
    timeout 240 python3 benches/bench.py --only staging --json "$OUT/${card}_staging.json" 2>&1 | grep "^staging"
    for staging in f16 vec4; do
        LFM2JIT_MATRIX_STAGING=$staging timeout 70 python3 -m lfm2jit.bench --only train --f16 --train-shapes 8x512 \
            --steps 2 --json "$OUT/${card}_staging_train_$staging.json" 2>&1 | grep "^train"
    done
    ;;
robust)
    export LFM2JIT_WEBGPU=dawn
    shift
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_robustness_modes.py 2>&1 | tail -1 \
        | sed "s/^/same bits in every mode: /" | tee "$OUT/${card}_robust.log"
    for mode in ${@:-on off}; do
        export LFM2JIT_DAWN_ROBUSTNESS=$mode
        timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_webgpu.py tests/compiler/test_matrix_units.py \
            -k "robustness or float64" 2>&1 | tail -1 | sed "s/^/$mode tests: /"
        timeout 150 python3 benches/bench.py --only matrix --json "$OUT/${card}_robust_$mode.json" 2>&1 | grep "^matrix" \
            | sed "s/^/$mode /"
        timeout 60 python3 -m lfm2jit.bench --only train --f16 --train-shapes 8x512 --steps 2 \
            --json "$OUT/${card}_robust_train_$mode.json" 2>&1 | grep "^train" | sed "s/^/$mode /"
    done | tee -a "$OUT/${card}_robust.log"
    ;;
mpi)
    export LFM2JIT_WEBGPU=dawn
    install_mpi
    python3 benches/readback.py --threads 1 4 --json "$OUT/h200_readback.json" 2>&1 | tail -16
    {
        echo "ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo absent); CPUs: $(nproc)"
        for setting in "" MPIR_CVAR_CH4_NETMOD=ucx MPIR_CVAR_CH4_NETMOD=ofi \
                MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD=2147483647 MPIR_CVAR_ASYNC_PROGRESS=1; do
            env $setting timeout 120 "$MPIEXEC" -n 2 python3 benches/mpi_exchange.py \
                --bucket-mib 8 32 --label "${setting:-default}" 2>&1 | tail -n +2
        done
        timeout 120 "$MPIEXEC" -n 4 python3 benches/mpi_exchange.py --bucket-mib 8 32 --label "4 ranks" 2>&1
    } | tee "$OUT/h200_mpi_exchange.log"
    ;;
*)
    echo "usage: bash benches/h200.sh tests | matrix | speed [BASE] | startup [BASE] | lora | attention | decode | gradsync | limits | gtiles | gdw | lmchunks | kgroups | double | fwddouble | thin [BASE] | sass | moe | moelora | qlora [8B-A1B] | ckpt | packing | longctx | staging | compile | nf4 | robust [MODES] | mpi" >&2; exit 2 ;;
esac
echo "took $(( $(date +%s) - start )) s"
