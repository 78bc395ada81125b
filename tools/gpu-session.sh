#!/usr/bin/env bash
# A GPU session in two halves (issue 36): build here, run there.
#
#   tools/gpu-session.sh build DIR     # on a machine without a GPU (nvcc from PyPI, link stubs)
#   tools/gpu-session.sh run DIR OUT   # on the GPU machine (no Rust there), logs into OUT
#
# `build` puts into DIR (ignore it in git: echo DIR >> .git/info/exclude) the stripped `ava`
# binary, the `lion` plugin beside it (the refusal test loads it), the GPU test binaries
# (ava-train gpu_ops, ava-plugins gpu_optim, ava-cli gpu_train) and PyTorch's reference
# scripts when ../shared/gpu has them. Everything is built for a portable CPU
# (x86-64-v3) in target/gpu, so repeated builds reuse their work.
#
# `run` runs each test binary (their output in OUT/<name>.log), then the tiny config on the
# GPU timed beside the CPU, then PyTorch's reference on the small shape when present, and
# prints a summary; it stops at nothing, so one call gathers everything.
set -uo pipefail

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
    cargo build --release --features ava-cli/cuda -p ava-cli -p ava-plugin-lion --target-dir "$target"
    local json
    json=$(cargo test --release --features ava-cli/cuda --target-dir "$target" --no-run --message-format=json \
        -p ava-train --test gpu_ops -p ava-plugins --test gpu_optim -p ava-cli --test gpu_train)
    for t in gpu_ops gpu_optim gpu_train; do
        local exe
        exe=$(echo "$json" | python3 -c "
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get('reason') == 'compiler-artifact' and m['target']['name'] == '$t' and m.get('executable'):
        print(m['executable'])")
        cp "$exe" "$dir/$t"
    done
    cp "$target/release/ava" "$target/release/libava_plugin_lion.so" "$dir/"
    strip "$dir"/ava "$dir"/gpu_* "$dir"/libava_plugin_lion.so
    if [ -d ../shared/gpu ]; then cp ../shared/gpu/*_ref.py "$dir/" 2>/dev/null || true; fi
    du -sh "$dir"
}

run() {
    local dir=$1 out=$2
    mkdir -p "$out"
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
    export AVA_TEST_BIN=$dir/ava
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
    for t in gpu_ops gpu_optim gpu_train; do
        echo "== $t"
        ( time "$dir/$t" --test-threads 1 ) >"$out/$t.log" 2>&1
        grep -E "^test |test result" "$out/$t.log" | tail -20
    done
    echo "== tiny on the GPU and the CPU"
    for dev in cuda cpu; do
        ( time "$dir/ava" train --set train.device=$dev --set train.out_dir="$out/tiny-$dev" --set train.log_every=50 ) \
            >"$out/tiny-$dev.log" 2>&1
        tail -n 4 "$out/tiny-$dev.log"
    done
    if [ -f "$dir/torch_ref.py" ]; then
        echo "== PyTorch, small shape"
        python3 "$dir/torch_ref.py" --shape small --mode amp 2>&1 | tail -n 2 | tee "$out/torch-small.json"
    fi
}

case "${1:-}" in
    build) [ $# -eq 2 ] || usage; build "$2" ;;
    run) [ $# -eq 3 ] || usage; run "$2" "$3" ;;
    *) usage ;;
esac
