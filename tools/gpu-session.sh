#!/usr/bin/env bash
# A GPU session in two halves (issue 36): build here, run there.
#
#   tools/gpu-session.sh build DIR     # on a machine without a GPU (nvcc from PyPI, link stubs)
#   tools/gpu-session.sh run DIR OUT   # on the GPU machine (no Rust there), logs into OUT
#
# `build` puts into DIR (ignore it in git: echo DIR >> .git/info/exclude) the stripped `ava`
# binary, the `lion` plugin beside it (the refusal test loads it), `flash` (FlashAttention-2
# on the GPU), `nvme` (state streamed through a disk tier), `adam-8bit` (with its GPU step) and
# `selective` (the targets' configs use them), the GPU test binaries ($TESTS: ava-train gpu_ops, ava-plugins gpu_optim and gpu_attention, ava-cli
# gpu_train, the lion, adam-8bit, adafactor and adam-mini plugins' gpu_lion, gpu_adam_8bit,
# gpu_adafactor, gpu_adam_mini) and PyTorch's reference
# scripts when ../shared/gpu has them. Everything is built for a portable CPU
# (x86-64-v3) in target/gpu, so repeated builds reuse their work.
#
# `run` runs the parts AVA_GPU_PARTS names, in its order (default: ops bench attention kernels
# torch tests tiny): `ops` the fused ops' and flash's tests (gpu_ops), `bench` `ava bench train` on
# TinyLlama-1.1B's shape plain and checkpointed (with the estimator's peak beside each),
# `attention` `ava bench attention` beside PyTorch's SDPA and flash's kernels timed one by one,
# `kernels` the plugins' kernels (flash's, the optimizer's) of the bench's step timed one by one,
# `tests` the other test binaries (their output in OUT/<name>.log), `tiny` the tiny config on
# the GPU (standard and flash) beside the CPU, `torch` PyTorch's reference recipes for the
# bench's shape, `trim` the bench's plain step with the pool trimmed at every synchronization
# (the driver's default), `big` and `long` issue 37's targets (Llama-2-7B's shape in 16 GiB,
# TinyLlama-1.1B's at 32K and 64K tokens) beside PyTorch's 8-bit recipes. It stops at nothing
# but AVA_GPU_DEADLINE (seconds, default 540): past it, what is left is skipped, so one call
# returns every log it wrote.
set -uo pipefail

# The GPU test binaries: the engine's ops, the built-in optimizers, end-to-end training, the
# lion, adam-8bit, adafactor and adam-mini plugins' steps (each bit for bit the CPU's).
TESTS="gpu_ops gpu_optim gpu_attention gpu_train gpu_lion gpu_adam_8bit gpu_adafactor gpu_adam_mini"

usage() {
    echo "usage: $0 build DIR | run DIR OUT" >&2
    exit 2
}

build() {
    local dir=$1
    set -e
    # shellcheck source=cuda-build-env.sh
    source "$(dirname "$0")/cuda-build-env.sh"
    export RUSTFLAGS="-C target-cpu=x86-64-v3"
    mkdir -p "$dir"
    local target=target/gpu
    # adam-8bit with its `cuda` step and selective: the configs of issue 37's targets use them.
    cargo build --release --features ava-cli/cuda,ava-plugin-adam-8bit/cuda -p ava-cli -p ava-plugin-lion \
        -p ava-plugin-flash -p ava-plugin-nvme -p ava-plugin-adam-8bit -p ava-plugin-selective --target-dir "$target"
    # Copied now: the test build below compiles lion with its `cuda` feature, and the refusal
    # test needs this one, built without it (a CPU-only optimizer).
    local lib
    for lib in lion flash nvme adam_8bit selective; do cp "$target/release/libava_plugin_$lib.so" "$dir/"; done
    cp "$target/release/ava" "$dir/"
    local json
    json=$(cargo test --release --target-dir "$target" --no-run --message-format=json \
        --features ava-cli/cuda,ava-plugin-lion/cuda,ava-plugin-adam-8bit/cuda,ava-plugin-adafactor/cuda,ava-plugin-adam-mini/cuda \
        -p ava-train --test gpu_ops -p ava-plugins --test gpu_optim --test gpu_attention -p ava-cli --test gpu_train \
        -p ava-plugin-lion --test gpu_lion -p ava-plugin-adam-8bit --test gpu_adam_8bit \
        -p ava-plugin-adafactor --test gpu_adafactor -p ava-plugin-adam-mini --test gpu_adam_mini)
    for t in $TESTS; do
        local exe
        exe=$(echo "$json" | python3 -c "
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get('reason') == 'compiler-artifact' and m['target']['name'] == '$t' and m.get('executable'):
        print(m['executable'])")
        cp "$exe" "$dir/$t"
    done
    strip "$dir"/ava "$dir"/gpu_* "$dir"/libava_plugin_*.so
    # The binaries travel compressed (a call carries 64 MiB); `run` unpacks them.
    (cd "$dir" && tar -cf - ava gpu_* libava_plugin_*.so | xz -T2 -6 >bundle.tar.xz && rm -f ava gpu_* libava_plugin_*.so)
    if [ -d ../shared/gpu ]; then cp ../shared/gpu/*_ref.py "$dir/" 2>/dev/null || true; fi
    # What was built: `run` shows it first, so a session can tell a stale DIR from a fresh one.
    echo "built from $(git rev-parse --short HEAD), $(git status --porcelain | wc -l) paths changed since, $(date -u +%FT%TZ)" |
        tee "$dir/BUILT_AT"
    du -sh "$dir"
}

# Seconds left before AVA_GPU_DEADLINE (seconds after `run` started; default 540, under the
# device tool's 600-second call): each step's own limit is cut to what is left, and a step
# with under 20 seconds left is skipped, saying so, so that a call returns its logs before the
# tool stops it.
left() {
    echo $((DEADLINE - SECONDS))
}

# `within N CMD...`: CMD under `timeout` with N seconds or what is left, whichever is less; a
# line in the log says when it was skipped or cut off.
within() {
    local n=$1 l
    shift
    l=$(left)
    [ "$l" -lt "$n" ] && n=$l
    if [ "$n" -lt 20 ]; then
        echo "skipped (${l}s left before AVA_GPU_DEADLINE): $*"
        return 124
    fi
    timeout -k 10 "$n" "$@"
    local rc=$?
    # 124: stopped by SIGTERM; 137: killed 10 s later, having ignored it.
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "stopped after ${n}s: $*"; fi
    return $rc
}

# One test binary, its log in OUT/<name>.log and its verdicts on the screen.
test_binary() {
    local dir=$1 out=$2 t=$3
    echo "== $t"
    ( time within 420 "$dir/$t" --test-threads 1 ) >"$out/$t.log" 2>&1
    grep -E "^test |test result|panicked|skipped|stopped after" "$out/$t.log" | tail -30
}

run() {
    local dir=$1 out=$2
    DEADLINE=${AVA_GPU_DEADLINE:-540}
    SECONDS=0
    mkdir -p "$out"
    if [ -f "$dir/bundle.tar.xz" ]; then xz -dc "$dir/bundle.tar.xz" | tar -xf - -C "$dir"; fi
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
    export AVA_TEST_BIN=$(realpath "$dir/ava")
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
    [ -f "$dir/BUILT_AT" ] && tee "$out/built_at.txt" <"$dir/BUILT_AT"
    # The parts run in the order AVA_GPU_PARTS names them (the header says what each does);
    # `tests` skips gpu_ops when `ops` ran it.
    local parts=${AVA_GPU_PARTS:-ops bench attention kernels torch tests tiny} part t ran_ops=
    for part in $parts; do
        echo "== part $part ($(left)s left)"
        case $part in
            ops) test_binary "$dir" "$out" gpu_ops; ran_ops=1 ;;
            tests)
                for t in $TESTS; do
                    [ "$t" = gpu_ops ] && [ -n "$ran_ops" ] && continue
                    test_binary "$dir" "$out" "$t"
                done
                ;;
            tiny) part_tiny "$dir" "$out" ;;
            bench) part_bench "$dir" "$out" ;;
            torch) part_torch "$dir" "$out" ;;
            trim) part_trim "$dir" "$out" ;;
            kernels) part_kernels "$dir" "$out" ;;
            big) part_big "$dir" "$out" ;;
            long) part_long "$dir" "$out" ;;
            attention) part_attention "$dir" "$out" ;;
            *) echo "unknown part '$part' in AVA_GPU_PARTS: ops, tests, tiny, bench, torch, trim, kernels, big, long, attention" ;;
        esac
    done
    echo "== done after ${SECONDS}s"
}

part_tiny() {
    local dir=$1 out=$2 run
    echo "== tiny: the GPU (standard, flash) and the CPU"
    for run in ${AVA_TINY_RUNS:-cuda:standard cuda:flash cpu:standard}; do
        local dev=${run%%:*} attn=${run##*:}
        ( time within 90 "$dir/ava" train --set train.device=$dev --set plugins.attention=$attn \
            --set train.out_dir="$out/tiny-$dev-$attn" --set train.log_every=50 ) >"$out/tiny-$dev-$attn.log" 2>&1
        tail -n 4 "$out/tiny-$dev-$attn.log" | head -n 2
    done
}

part_bench() {
    local dir=$1 out=$2 ckpt
    echo "== TinyLlama-1.1B's shape, T 2048 x 4: plain and checkpointed (PyTorch's recipes: part torch)"
    for ckpt in none full; do
        within 150 "$dir/ava" bench train -c configs/gpu-tinyllama-1b.yaml --steps 8 --warmup 3 \
            --set plugins.checkpoint=$ckpt >"$out/bench-1b-$ckpt.txt" 2>&1
        cat "$out/bench-1b-$ckpt.txt"
        # What the estimator predicted for the peak just measured (its last line).
        within 60 "$dir/ava" estimate -c configs/gpu-tinyllama-1b.yaml --device cuda --set plugins.checkpoint=$ckpt \
            -q 2>&1 | tail -n 1 | tee "$out/estimate-1b-$ckpt.txt"
    done
}

# The bench's plain step again with the device pool giving its unused memory back at every
# synchronization (the driver's default; AVA_CUDA_POOL_TRIM=1): what keeping the reserve is worth.
part_trim() {
    local dir=$1 out=$2
    echo "== TinyLlama-1.1B's shape, T 2048 x 4, the pool trimmed at every synchronization"
    AVA_CUDA_POOL_TRIM=1 within 150 "$dir/ava" bench train -c configs/gpu-tinyllama-1b.yaml --steps 8 --warmup 3 \
        --set plugins.checkpoint=none >"$out/bench-1b-none-trimmed.txt" 2>&1
    cat "$out/bench-1b-none-trimmed.txt"
}

part_torch() {
    local dir=$1 out=$2 flag
    [ -f "$dir/torch_ref.py" ] || { echo "no torch_ref.py in $dir"; return; }
    echo "== PyTorch (eager amp), TinyLlama-1.1B's shape, T 2048 x 4, plain and checkpointed"
    for flag in "" --ckpt; do
        within 120 python3 "$dir/torch_ref.py" --shape 1b --mode amp --seq 2048 --batch 4 --steps 6 \
            --warmup 2 $flag 2>&1 | tail -n 1 | tee "$out/torch-1b$flag.json"
    done
}

# PyTorch's 8-bit recipes need bitsandbytes: a wheel in DIR or in gpu-wheels/ at the root
# (bitsandbytes-*.whl; ../shared/gpu/README.md says how to download it: `python3 -m pip
# download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_24_x86_64 -d gpu-wheels bitsandbytes==0.50.2`, 43 MB, so it travels, carried as
# gpu-wheels, in the call of `big` and `long` only) is installed into DIR/py. Prints the
# wheel's path when there is one.
bitsandbytes() {
    local dir=$1 out=$2 wheel
    wheel=$(ls "$dir"/bitsandbytes-*.whl gpu-wheels/bitsandbytes-*.whl 2>/dev/null | head -n 1)
    [ -n "$wheel" ] || return 0
    if [ ! -d "$dir/py/bitsandbytes" ]; then
        python3 -m pip install -q --no-deps -t "$dir/py" "$wheel" >"$out/bnb-install.log" 2>&1 || return 0
    fi
    echo "$wheel"
}

part_big() {
    local dir=$1 out=$2 wheel mode
    wheel=$(bitsandbytes "$dir" "$out")
    [ -n "$wheel" ] && export PYTHONPATH="$dir/py:${PYTHONPATH:-}"
    echo "== Llama-2-7B's shape in 16 GiB: 8-bit Adam in backward, its state in host memory; then PyTorch's recipes"
    within 420 "$dir/ava" bench train -c configs/gpu-llama2-7b-16gib.yaml --steps 5 --warmup 2 \
        >"$out/bench-7b-16gib.txt" 2>&1
    cat "$out/bench-7b-16gib.txt"
    within 60 "$dir/ava" estimate -c configs/gpu-llama2-7b-16gib.yaml --device cuda -q 2>&1 | tail -n 1 |
        tee "$out/estimate-7b-16gib.txt"
    if [ -f "$dir/torch_ref.py" ] && [ -n "$wheel" ]; then
        for mode in bnb8-inbwd bnb8; do
            within 240 python3 "$dir/torch_ref.py" --shape 7b --mode $mode --ckpt --seq 2048 --batch 1 --steps 5 \
                --warmup 2 2>&1 | tail -n 1 | tee "$out/torch-7b-$mode.json"
        done
    fi
}

part_long() {
    local dir=$1 out=$2 wheel seq
    wheel=$(bitsandbytes "$dir" "$out")
    [ -n "$wheel" ] && export PYTHONPATH="$dir/py:${PYTHONPATH:-}"
    echo "== TinyLlama-1.1B's shape at 32K and 64K tokens: Ava, then PyTorch (bf16, 8-bit AdamW, checkpointing)"
    for seq in 32768 65536; do
        within 300 "$dir/ava" bench train -c configs/gpu-tinyllama-1b-64k.yaml --set data.seq_len=$seq \
            --steps 3 --warmup 1 >"$out/bench-1b-$seq.txt" 2>&1
        cat "$out/bench-1b-$seq.txt"
        within 60 "$dir/ava" estimate -c configs/gpu-tinyllama-1b-64k.yaml --device cuda --set data.seq_len=$seq \
            -q 2>&1 | tail -n 1 | tee "$out/estimate-1b-$seq.txt"
        if [ -f "$dir/torch_ref.py" ] && [ -n "$wheel" ]; then
            within 240 python3 "$dir/torch_ref.py" --shape 1b --mode bnb8 --ckpt --seq $seq --batch 1 --steps 3 \
                --warmup 1 2>&1 | tail -n 1 | tee "$out/torch-1b-$seq.json"
        fi
    done
    echo "== the same at 64K with the block inputs parked in host memory"
    within 300 "$dir/ava" bench train -c configs/gpu-tinyllama-1b-64k.yaml --steps 3 --warmup 1 \
        --set 'plugins.checkpoint={name: selective, every: 1, offload: true}' >"$out/bench-1b-65536-parked.txt" 2>&1
    cat "$out/bench-1b-65536-parked.txt"
}

part_attention() {
    local dir=$1 out=$2
    local shape=(--heads 32 --kv-heads 4 --head-dim 64)
    echo "== attention alone: flash on the GPU, then PyTorch SDPA (flash backend)"
    within 150 "$dir/ava" bench attention --device cuda --kernels flash --seq 2048,4096,8192,16384,32768 \
        "${shape[@]}" >"$out/attn-ava.txt" 2>&1
    cat "$out/attn-ava.txt"
    if [ -f "$dir/attn_ref.py" ]; then
        within 120 python3 "$dir/attn_ref.py" --seq 2048,4096,8192,16384,32768 "${shape[@]}" 2>&1 |
            tee "$out/attn-torch.txt"
    fi
    # Each kernel's own time (AVA_CUDA_KERNEL_TIMES: two events around every launch, the host
    # waiting for each), summed per kernel and T: which of flash's kernels the time goes to.
    echo "== flash's kernels one by one (ms a launch, mean of every launch of the bench: warm-up and repeats)"
    local seq
    for seq in 2048 8192; do
        rm -f "$out/kernels-attn-$seq.tsv"
        AVA_CUDA_KERNEL_TIMES="$out/kernels-attn-$seq.tsv" within 60 "$dir/ava" bench attention --device cuda \
            --kernels flash --seq $seq "${shape[@]}" --repeats 3 >"$out/kernels-attn-$seq.log" 2>&1 ||
            tail -n 5 "$out/kernels-attn-$seq.log"
        echo "T $seq:"
        kernel_sums "$out/kernels-attn-$seq.tsv"
    done
}

# An AVA_CUDA_KERNEL_TIMES file summed per kernel and grid (an optimizer's kernels run on a
# grid per parameter size): launches, ms a launch, ms in all.
kernel_sums() {
    [ -f "$1" ] || { echo "  (no $1: nothing launched through ava_kernels::cuda, or the run failed)"; return; }
    awk -F'\t' '{ k = $2 "\t" $3; n[k]++; ms[k] += $5 }
        END { for (k in n) { split(k, p, "\t"); printf "  %-30s grid %-14s %5d launches %9.4f ms a launch %10.3f ms in all\n", p[1], p[2], n[k], ms[k] / n[k], ms[k] } }' \
        "$1" | sort
}

# Each kernel launched through ava_kernels::cuda (flash's, the optimizer's) in the bench's
# plain step, timed one by one: 1 warm-up, 2 measured and 2 profiled steps, so "ms in all" is
# about 5 steps' worth.
part_kernels() {
    local dir=$1 out=$2
    echo "== TinyLlama-1.1B's shape: the plugins' kernels one by one (5 steps: 1 warm-up, 2 measured, 2 profiled)"
    rm -f "$out/kernels-1b.tsv"
    AVA_CUDA_KERNEL_TIMES="$out/kernels-1b.tsv" within 120 "$dir/ava" bench train -c configs/gpu-tinyllama-1b.yaml \
        --steps 2 --warmup 1 --set plugins.checkpoint=none >"$out/bench-1b-kernels.txt" 2>&1 ||
        tail -n 5 "$out/bench-1b-kernels.txt"
    kernel_sums "$out/kernels-1b.tsv"
}

case "${1:-}" in
    build) [ $# -eq 2 ] || usage; build "$2" ;;
    run) [ $# -eq 3 ] || usage; run "$2" "$3" ;;
    *) usage ;;
esac
