#!/usr/bin/env bash
# Builds Ava's `cuda` feature on a machine with no GPU and no CUDA toolkit (CI, a laptop),
# for binaries that run on a GPU machine. Source it from the project root:
#
#   source tools/cuda-build-env.sh && cargo build --release --features cuda
#
# What it does, once per $AVA_CUDA_HOME (default ~/.cache/ava-cuda, about 110 MB):
#   1. installs nvcc from NVIDIA's PyPI wheels into a virtual environment (no CUDA toolkit,
#      no root) and puts it on PATH, with CUDA_ROOT pointing at it;
#   2. writes link stubs for the CUDA libraries candle's cudarc links against (libcuda,
#      cuBLAS, cuRAND, NVRTC, ...): shared objects with the real sonames whose functions do
#      nothing, so the link succeeds; the real libraries are loaded where the binary runs;
#   3. exports CUDA_COMPUTE_CAP (default 90: H100/H200; 80 A100, 89 RTX 4090) unless set.
# `cargo check`/clippy need only nvcc (candle-kernels' build script makes PTX); linking a
# binary needs the stubs. cudarc's build script searches $CUDA_ROOT/lib/stubs, so no RUSTFLAGS
# change (which would rebuild everything) is needed.
#
# On a machine with a CUDA 12.4+ toolkit, skip this file: set CUDA_COMPUTE_CAP and build.
# Where the binary runs, the CUDA libraries must be found by the loader, e.g.
#   export LD_LIBRARY_PATH=/usr/local/cuda/lib64

ava_cuda_version=${AVA_CUDA_VERSION:-13.0}
AVA_CUDA_HOME=${AVA_CUDA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/ava-cuda}

ava_cuda_fail() {
    echo "tools/cuda-build-env.sh: $*" >&2
    return 1
}

ava_cuda_nvcc() {
    local venv="$AVA_CUDA_HOME/venv"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || { ava_cuda_fail "cannot make a Python venv in $venv (python3 -m venv)"; return 1; }
    fi
    local site
    site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])') || return 1
    export CUDA_ROOT="$site/nvidia/cu${ava_cuda_version%%.*}"
    if [ ! -x "$CUDA_ROOT/bin/nvcc" ]; then
        echo "tools/cuda-build-env.sh: installing nvcc $ava_cuda_version from PyPI into $venv" >&2
        local v="==$ava_cuda_version.*"
        "$venv/bin/pip" install -q "nvidia-cuda-nvcc$v" "nvidia-nvvm$v" "nvidia-cuda-crt$v" \
            "nvidia-cuda-runtime$v" "nvidia-cuda-cccl$v" ||
            { ava_cuda_fail "pip could not install the nvcc wheels (needs PyPI)"; return 1; }
    fi
    export PATH="$CUDA_ROOT/bin:$PATH"
}

# The newest cudarc 0.19 source in cargo's registry (fetched through the workspace if absent).
ava_cuda_cudarc_src() {
    local registry="${CARGO_HOME:-$HOME/.cargo}/registry/src"
    local found
    found=$(ls -d "$registry"/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$found" ]; then
        cargo fetch -q >/dev/null 2>&1 || true
        found=$(ls -d "$registry"/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -n 1)
    fi
    echo "$found"
}

ava_cuda_stubs() {
    local stubs="$CUDA_ROOT/lib/stubs"
    # It must exist before cudarc's build script runs, which adds it to the link search.
    mkdir -p "$stubs"
    local cudarc
    cudarc=$(ava_cuda_cudarc_src)
    [ -n "$cudarc" ] || { ava_cuda_fail "cudarc 0.19's source is not in cargo's registry; run cargo fetch"; return 1; }
    [ -f "$stubs/.made-from-$(basename "$cudarc")" ] && return 0
    local tmp lib soname module
    tmp=$(mktemp -d)
    while read -r lib soname module; do
        [ -f "$cudarc/src/$module/sys/mod.rs" ] || continue
        # Every function cudarc declares, as an empty one: enough for the linker.
        grep -oE '^pub unsafe fn [A-Za-z0-9_]+' "$cudarc/src/$module/sys/mod.rs" |
            awk '{ print "void " $4 "(void) {}" }' | sort -u >"$tmp/$lib.c"
        cc -shared -fPIC -o "$stubs/lib$lib.so" -Wl,-soname,"$soname" "$tmp/$lib.c" ||
            { rm -rf "$tmp"; ava_cuda_fail "could not build the $lib link stub"; return 1; }
    done <<EOF
cuda libcuda.so.1 driver
nvrtc libnvrtc.so.${ava_cuda_version%%.*} nvrtc
curand libcurand.so.10 curand
cublas libcublas.so.${ava_cuda_version%%.*} cublas
cublasLt libcublasLt.so.${ava_cuda_version%%.*} cublaslt
cudart libcudart.so.${ava_cuda_version%%.*} runtime
EOF
    rm -rf "$tmp"
    touch "$stubs/.made-from-$(basename "$cudarc")"
}

if ava_cuda_nvcc && ava_cuda_stubs; then
    export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
    echo "tools/cuda-build-env.sh: nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP" >&2
else
    ava_cuda_fail "the CUDA build environment is not ready (see above)"
fi
unset -f ava_cuda_fail ava_cuda_nvcc ava_cuda_cudarc_src ava_cuda_stubs
unset ava_cuda_version
