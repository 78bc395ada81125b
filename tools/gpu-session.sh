#!/usr/bin/env bash
# A GPU session in two halves: build here, run there.
#
#   tools/gpu-session.sh build DIR     # on a machine without a GPU (nvcc from PyPI, link stubs)
#   tools/gpu-session.sh run DIR OUT   # on the GPU machine (no Rust there)
#
# `build` puts into DIR (ignore it in git: echo DIR >> .git/info/exclude) the stripped `ava`
# binary, the `lion` plugin beside it (the refusal test loads it), `flash` (FlashAttention-2
# on the GPU), `nvme` (state streamed through a disk tier), `adam-8bit` (with its GPU step) and
# `selective` (the targets' configs use them), the GPU test binaries ($TESTS) and PyTorch's
# reference scripts when ../shared/gpu has them. Everything is built for a portable CPU
# (x86-64-v3) in target/gpu, so repeated builds reuse their work.
#
# `run` runs the parts AVA_GPU_PARTS names, in its order; the default puts first what a
# session needs most, "does it work" and "how fast beside PyTorch":
#   ops        the fused ops' and flash's tests (gpu_ops)
#   bench      `ava bench train` on TinyLlama-1.1B's shape, plain and checkpointed: tokens/s,
#              the step's profile, the estimator's predicted step and peak beside each
#   torch      PyTorch's eager amp recipe on the same shape, plain and checkpointed
#   tests      the other test binaries
#   attention  `ava bench attention` beside PyTorch's SDPA, and flash's kernels one by one
#   kernels    the plugins' kernels of the bench's step (flash's, the optimizer's) one by one
#   compile    PyTorch's recipe under torch.compile (the last target's reference)
#   tiny       the tiny config on the GPU (standard, flash) beside the CPU
# and, named only: `trim` (the plain step with the pool trimmed at every synchronization),
# `big` and `long` (Llama-2-7B's shape in 16 GiB; TinyLlama-1.1B's at 32K and 64K tokens)
# beside PyTorch's 8-bit recipes.
#
# What comes back from a run on the GPU machine is at most 8 files in OUT (two folders deep)
# and the last 12,000 characters printed. So `run` writes its logs to a folder of its own
# (AVA_GPU_WORK, default a new one under /tmp), never into OUT, and after every part rewrites
# exactly two files in OUT: summary.txt (the GPU, each test binary's verdict, each
# benchmark's headline with PyTorch's beside it and the ratio, what was skipped) and
# logs.tar.xz (every log; `tar -xJf logs.tar.xz`). A run stopped at any point leaves both as
# of its last finished part. It prints a line or two a part and, last, the summary.
#
# Every step runs under AVA_GPU_DEADLINE (seconds after `run` started, default 420: a 15
# minute lease holds the machine's start, this run, a fix and a shorter second run) and a cap
# of its own; a step with under 20 seconds left is skipped, saying so.
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

# Seconds left before AVA_GPU_DEADLINE: each step's own limit is cut to what is left.
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

# One test binary, its output in LOGS/<name>.log; one line on the screen.
test_binary() {
    local dir=$1 t=$2
    {
        time within "${AVA_GPU_TEST_CAP:-300}" "$dir/$t" --test-threads 1
        echo "exit status $?"
    } >"$LOGS/$t.log" 2>&1
    echo "  $(verdict "$LOGS/$t.log")"
    pack
}

# A test binary's log in one line: passed and failed counts (libtest's `test result:` lines),
# the failing tests by name, the time, and why there is no verdict when there is none.
verdict() {
    local log=$1 name passed failed failing real
    name=$(basename "$log" .log)
    real=$(sed -n 's/^real[[:space:]]*//p' "$log" | tail -n 1)
    if ! grep -q '^test result:' "$log"; then
        # The skip or the cut-off, else the last line the binary printed and its exit status;
        # and the tests that finished before it stopped.
        local why so_far
        why=$(grep -E -m 1 '^(skipped|stopped after)' "$log" ||
            echo "$(grep -v -E '^(real|user|sys)[[:space:]]|^exit status|^$' "$log" | tail -n 1 | cut -c 1-160);" \
                "$(grep '^exit status' "$log")")
        passed=$(grep -c '^test .* \.\.\. ok$' "$log")
        failing=$(sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p' "$log" | paste -sd ' ' - | cut -c 1-300)
        so_far="; before it: $passed passed${failing:+, FAILED: $failing}"
        echo "$name: NO VERDICT ($why)${real:+ after $real}$so_far"
        return
    fi
    passed=$(grep '^test result:' "$log" | grep -o '[0-9]* passed' | awk '{ s += $1 } END { print s + 0 }')
    failed=$(grep '^test result:' "$log" | grep -o '[0-9]* failed' | awk '{ s += $1 } END { print s + 0 }')
    failing=$(sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p' "$log" | paste -sd ' ' - | cut -c 1-300)
    if [ "$failed" -eq 0 ]; then
        echo "$name: ok, $passed passed, 0 failed${real:+ ($real)}"
    else
        echo "$name: FAILED, $passed passed, $failed failed: $failing${real:+ ($real)}"
    fi
}

# The first failing test's panic in two lines, for the summary (every failure is in the log).
panics() {
    grep -A 2 -m 1 'panicked at' "$1" | grep -v -E '^(test result:|note: |--$|$)' | cut -c 1-200 | sed 's/^/      /'
}

# `field FILE KEY`: a number from a JSON line of PyTorch's reference scripts.
field() {
    grep -o "\"$2\": [-0-9.e]*" "$1" 2>/dev/null | head -n 1 | sed 's/.*: //'
}

# `ratio A B`: A / B to two places, or "-" when either is missing.
ratio() {
    if [ -n "$1" ] && [ -n "$2" ]; then awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "-" }'; else echo "-"; fi
}

# `ava bench train`'s headline (tokens/s, median step, device peak, measured/predicted), or
# why there is none.
bench_headline() {
    local f=$1 tok step peak pred
    [ -f "$f" ] || { echo "not run"; return; }
    tok=$(sed -n 's/^tokens\/s *\([0-9.]*\).*/\1/p' "$f" | head -n 1)
    if [ -z "$tok" ]; then
        echo "no result: $(grep -E -m 1 '^(skipped|stopped after)|[Ee]rror' "$f" | cut -c 1-200)"
        return
    fi
    step=$(sed -n 's/^step time *\([0-9.]*\) ms.*/\1/p' "$f" | head -n 1)
    peak=$(sed -n 's/^device peak *\([0-9.]* [KMGT]*i*B\).*/\1/p' "$f" | head -n 1)
    pred=$(grep -o 'measured/predicted ×[0-9.]*' "$f" | head -n 1)
    echo "$tok tokens/s, step $step ms, peak $peak${pred:+, $pred}"
}

# PyTorch's headline from torch_ref.py's JSON line, or why there is none.
torch_headline() {
    local f=$1 tok
    [ -f "$f" ] || { echo "not run"; return; }
    tok=$(field "$f" tokens_per_s)
    if [ -z "$tok" ]; then
        echo "no result: $(tail -n 1 "$f" | cut -c 1-200)"
        return
    fi
    echo "$tok tokens/s, step $(field "$f" step_ms) ms, peak $(field "$f" peak_alloc_gib) GiB allocated"
}

# One recipe's line: Ava's headline, PyTorch's, and Ava / PyTorch in tokens/s.
recipe_lines() {
    local label=$1 ava=$2 torch=$3 a t
    a=$(sed -n 's/^tokens\/s *\([0-9.]*\).*/\1/p' "$ava" 2>/dev/null | head -n 1)
    t=$(field "$torch" tokens_per_s)
    echo "  $label"
    echo "    Ava      $(bench_headline "$ava")"
    echo "    PyTorch  $(torch_headline "$torch")"
    echo "    Ava / PyTorch tokens/s: $(ratio "$a" "$t")"
}

# Flash's forward and forward + backward against SDPA's, T by T, from the two scripts' output.
attention_lines() {
    [ -f "$LOGS/attn-ava.txt" ] || { echo "  not run"; return; }
    awk '
        FNR == NR { if ($2 == "flash" && $1 ~ /^[0-9]+$/) { fwd[$1] = $3; both[$1] = $5; seen[$1] = 1 } next }
        /"seq"/ {
            match($0, /"seq": [0-9]+/); t = substr($0, RSTART + 7, RLENGTH - 7)
            match($0, /"fwd_ms": [0-9.]+/); sf[t] = substr($0, RSTART + 10, RLENGTH - 10)
            match($0, /"fwd_bwd_ms": [0-9.]+/); sb[t] = substr($0, RSTART + 14, RLENGTH - 14)
        }
        END {
            printf "  %6s  %10s %10s  %12s %12s  %s\n", "T", "flash fwd", "SDPA fwd", "flash f+b", "SDPA f+b", "SDPA/flash f+b"
            for (t in seen) {
                r = (t in sb && both[t] > 0) ? sprintf("%.2fx", sb[t] / both[t]) : "-"
                printf "  %6s  %10s %10s  %12s %12s  %s\n", t, fwd[t], (t in sf ? sf[t] : "-"), both[t], (t in sb ? sb[t] : "-"), r
            }
        }' "$LOGS/attn-ava.txt" "$(ls "$LOGS/attn-torch.txt" 2>/dev/null || echo /dev/null)" | sort -n -k 1,1 | sed -n '1,12p'
    grep -E -m 2 '^(skipped|stopped after)' "$LOGS/attn-ava.txt"
}

# summary.txt from the logs as they are: safe to call after any part.
summarize() {
    local t f
    {
        echo "Ava GPU session: $(cat "$LOGS/gpu.txt" 2>/dev/null || echo 'no GPU seen (nvidia-smi failed)')"
        [ -f "$LOGS/built_at.txt" ] && echo "binaries $(cat "$LOGS/built_at.txt")"
        echo "parts asked: $PARTS; ${SECONDS}s of AVA_GPU_DEADLINE=${DEADLINE}s used"
        sed 's/^/  /' "$LOGS/parts.txt" 2>/dev/null
        echo
        echo "Tests on the device (passed/failed; failing tests by name):"
        for t in $TESTS; do
            f="$LOGS/$t.log"
            if [ -f "$f" ]; then
                echo "  $(verdict "$f")"
                grep -q '^test .* \.\.\. FAILED$' "$f" && panics "$f"
            else
                echo "  $t: not run"
            fi
        done
        echo
        echo "TinyLlama-1.1B's shape, T 2048 x 4, bf16 compute, f32 masters, AdamW, flash:"
        recipe_lines "plain (no checkpointing)" "$LOGS/bench-1b-none.txt" "$LOGS/torch-1b.json"
        recipe_lines "full checkpointing" "$LOGS/bench-1b-full.txt" "$LOGS/torch-1b--ckpt.json"
        [ -f "$LOGS/torch-1b--compile.json" ] &&
            echo "  torch.compile: $(torch_headline "$LOGS/torch-1b--compile.json"); Ava plain / compile: $(ratio \
                "$(sed -n 's/^tokens\/s *\([0-9.]*\).*/\1/p' "$LOGS/bench-1b-none.txt" 2>/dev/null | head -n 1)" \
                "$(field "$LOGS/torch-1b--compile.json" tokens_per_s)")"
        for t in none full; do
            f="$LOGS/estimate-1b-$t.txt"
            [ -f "$f" ] && echo "  estimate (checkpoint $t): $(cut -c 1-200 "$f")"
        done
        [ -f "$LOGS/bench-1b-none-trimmed.txt" ] &&
            echo "  pool trimmed at every synchronization: $(bench_headline "$LOGS/bench-1b-none-trimmed.txt")"
        echo
        echo "Attention alone (ms; B 1, 32/4 heads, D 64, causal, bf16):"
        attention_lines
        if [ -f "$LOGS/kernels-1b.txt" ]; then
            echo
            echo "The plugins' kernels in the bench's step (the 8 largest totals; 5 steps):"
            sort -t '|' -k 2 -g -r "$LOGS/kernels-1b.txt" 2>/dev/null | head -n 8 | cut -d '|' -f 1 | cut -c 1-150
        fi
        if ls "$LOGS"/tiny-*.log >/dev/null 2>&1; then
            echo
            echo "configs/tiny.yaml (the last lines of each run):"
            for f in "$LOGS"/tiny-*.log; do
                echo "  $(basename "$f" .log): $(grep -E 'val|loss' "$f" | tail -n 1 | cut -c 1-160)"
            done
        fi
        for f in "$LOGS"/bench-7b-16gib.txt "$LOGS"/bench-1b-32768.txt "$LOGS"/bench-1b-65536.txt \
            "$LOGS"/bench-1b-65536-parked.txt; do
            [ -f "$f" ] && echo "$(basename "$f" .txt): $(bench_headline "$f")"
        done
        for f in "$LOGS"/torch-7b-*.json "$LOGS"/torch-1b-3*.json "$LOGS"/torch-1b-6*.json; do
            [ -f "$f" ] && echo "$(basename "$f" .json): $(torch_headline "$f")"
        done
        echo
        echo "Every log: logs.tar.xz beside this file (tar -xJf logs.tar.xz)."
    } >"$WORK/summary.txt"
}

# OUT/summary.txt and OUT/logs.tar.xz from the logs as they are (over 15 MiB packed, the
# kernel-time tables and metrics files are left out, saying so).
pack() {
    summarize
    tar -C "$WORK" -cJf "$WORK/logs.tar.xz" logs summary.txt 2>/dev/null
    if [ "$(stat -c %s "$WORK/logs.tar.xz" 2>/dev/null || echo 0)" -gt $((15 << 20)) ]; then
        echo "(logs.tar.xz leaves out *.tsv and *.jsonl: with them it was over 15 MiB)" >>"$WORK/summary.txt"
        tar -C "$WORK" -cJf "$WORK/logs.tar.xz" --exclude='*.tsv' --exclude='*.jsonl' logs summary.txt 2>/dev/null
    fi
    # Renamed into place, so a run killed here leaves the last whole pair (and at most a .new);
    # the archive first, so a summary that names a part never comes before that part's logs.
    cp "$WORK/logs.tar.xz" "$OUT/logs.tar.xz.new" && mv -f "$OUT/logs.tar.xz.new" "$OUT/logs.tar.xz"
    cp "$WORK/summary.txt" "$OUT/summary.txt.new" && mv -f "$OUT/summary.txt.new" "$OUT/summary.txt"
}

# On exit, however it comes (the end, a signal, an error): the last pack and the summary
# printed, its text the last thing on the screen.
finish() {
    local rc=$?
    trap - EXIT
    echo "== done after ${SECONDS}s (exit $rc)"
    echo "$(date -u +%T) end (${SECONDS}s)" >>"$LOGS/parts.txt"
    pack
    echo
    local n
    n=$(wc -c <"$OUT/summary.txt")
    if [ "$n" -gt 9000 ]; then
        head -c 9000 "$OUT/summary.txt"
        echo
        echo "(summary cut at 9,000 of its $n characters: the rest is in summary.txt)"
    else
        cat "$OUT/summary.txt"
    fi
    exit "$rc"
}

run() {
    local dir=$1
    OUT=$2
    DEADLINE=${AVA_GPU_DEADLINE:-420}
    PARTS=${AVA_GPU_PARTS:-ops bench torch tests attention kernels compile tiny}
    SECONDS=0
    WORK=${AVA_GPU_WORK:-$(mktemp -d /tmp/ava-gpu.XXXXXX)}
    LOGS=$WORK/logs
    mkdir -p "$OUT" "$LOGS" "$WORK/runs"
    trap finish EXIT
    trap 'echo "stopped by a signal"; exit 143' TERM INT HUP
    if [ -f "$dir/bundle.tar.xz" ]; then xz -dc "$dir/bundle.tar.xz" | tar -xf - -C "$dir"; fi
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
    AVA_TEST_BIN=$(realpath "$dir/ava")
    export AVA_TEST_BIN
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$LOGS/gpu.txt" 2>&1
    cat "$LOGS/gpu.txt"
    [ -f "$dir/BUILT_AT" ] && tee "$LOGS/built_at.txt" <"$dir/BUILT_AT"
    # `tests` skips gpu_ops when `ops` ran it.
    local part t ran_ops='' start
    for part in $PARTS; do
        echo "== part $part ($(left)s left)"
        start=$SECONDS
        case $part in
            ops) test_binary "$dir" gpu_ops; ran_ops=1 ;;
            tests)
                for t in $TESTS; do
                    [ "$t" = gpu_ops ] && [ -n "$ran_ops" ] && continue
                    test_binary "$dir" "$t"
                done
                ;;
            tiny) part_tiny "$dir" ;;
            bench) part_bench "$dir" ;;
            torch) part_torch "$dir" ;;
            compile) part_compile "$dir" ;;
            trim) part_trim "$dir" ;;
            kernels) part_kernels "$dir" ;;
            big) part_big "$dir" ;;
            long) part_long "$dir" ;;
            attention) part_attention "$dir" ;;
            *) echo "unknown part '$part' in AVA_GPU_PARTS: ops bench torch tests attention kernels compile tiny trim big long" ;;
        esac
        echo "$part $((SECONDS - start))s" >>"$LOGS/parts.txt"
        pack
    done
}

part_tiny() {
    local dir=$1 run
    for run in ${AVA_TINY_RUNS:-cuda:standard cuda:flash cpu:standard}; do
        local dev=${run%%:*} attn=${run##*:}
        ( time within 90 "$dir/ava" train --set train.device=$dev --set plugins.attention=$attn \
            --set train.out_dir="$WORK/runs/tiny-$dev-$attn" --set train.log_every=50 ) >"$LOGS/tiny-$dev-$attn.log" 2>&1
        cp "$WORK/runs/tiny-$dev-$attn/metrics.jsonl" "$LOGS/tiny-$dev-$attn.metrics.jsonl" 2>/dev/null
        echo "  tiny $dev $attn: $(grep -E 'val|loss' "$LOGS/tiny-$dev-$attn.log" | tail -n 1 | cut -c 1-120)"
    done
}

part_bench() {
    local dir=$1 ckpt
    for ckpt in none full; do
        within 150 "$dir/ava" bench train -c configs/gpu-tinyllama-1b.yaml --steps 8 --warmup 3 \
            --set plugins.checkpoint=$ckpt >"$LOGS/bench-1b-$ckpt.txt" 2>&1
        echo "  Ava, checkpoint $ckpt: $(bench_headline "$LOGS/bench-1b-$ckpt.txt")"
        # What the estimator predicted for the peak just measured (its last line).
        within 60 "$dir/ava" estimate -c configs/gpu-tinyllama-1b.yaml --device cuda --set plugins.checkpoint=$ckpt \
            -q 2>&1 | tail -n 1 >"$LOGS/estimate-1b-$ckpt.txt"
    done
}

# The bench's plain step again with the device pool giving its unused memory back at every
# synchronization (the driver's default; AVA_CUDA_POOL_TRIM=1): what keeping the reserve is worth.
part_trim() {
    local dir=$1
    AVA_CUDA_POOL_TRIM=1 within 150 "$dir/ava" bench train -c configs/gpu-tinyllama-1b.yaml --steps 8 --warmup 3 \
        --set plugins.checkpoint=none >"$LOGS/bench-1b-none-trimmed.txt" 2>&1
    echo "  trimmed: $(bench_headline "$LOGS/bench-1b-none-trimmed.txt")"
}

part_torch() {
    local dir=$1 flag
    [ -f "$dir/torch_ref.py" ] || { echo "  no torch_ref.py in $dir"; return; }
    for flag in "" --ckpt; do
        within 120 python3 "$dir/torch_ref.py" --shape 1b --mode amp --seq 2048 --batch 4 --steps 6 \
            --warmup 2 $flag >"$LOGS/torch-1b$flag.log" 2>&1
        tail -n 1 "$LOGS/torch-1b$flag.log" >"$LOGS/torch-1b$flag.json"
        echo "  PyTorch eager${flag:+ $flag}: $(torch_headline "$LOGS/torch-1b$flag.json")"
    done
}

# PyTorch's plain recipe under torch.compile: the last of the speed targets.
part_compile() {
    local dir=$1
    [ -f "$dir/torch_ref.py" ] || { echo "  no torch_ref.py in $dir"; return; }
    within 200 python3 "$dir/torch_ref.py" --shape 1b --mode amp --seq 2048 --batch 4 --steps 6 --warmup 3 \
        --compile >"$LOGS/torch-1b--compile.log" 2>&1
    tail -n 1 "$LOGS/torch-1b--compile.log" >"$LOGS/torch-1b--compile.json"
    echo "  PyTorch torch.compile: $(torch_headline "$LOGS/torch-1b--compile.json")"
}

# PyTorch's 8-bit recipes need bitsandbytes: a wheel in DIR or in gpu-wheels/ at the root
# (bitsandbytes-*.whl; ../shared/gpu/README.md says how to download it: `python3 -m pip
# download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_24_x86_64 -d gpu-wheels bitsandbytes==0.50.2`, 43 MB, so it travels, carried as
# gpu-wheels, in the call of `big` and `long` only) is installed into WORK/py. Prints the
# wheel's path when there is one.
bitsandbytes() {
    local dir=$1 wheel
    wheel=$(ls "$dir"/bitsandbytes-*.whl gpu-wheels/bitsandbytes-*.whl 2>/dev/null | head -n 1)
    [ -n "$wheel" ] || return 0
    if [ ! -d "$WORK/py/bitsandbytes" ]; then
        python3 -m pip install -q --no-deps -t "$WORK/py" "$wheel" >"$LOGS/bnb-install.log" 2>&1 || return 0
    fi
    echo "$wheel"
}

part_big() {
    local dir=$1 wheel mode
    wheel=$(bitsandbytes "$dir")
    [ -n "$wheel" ] && export PYTHONPATH="$WORK/py:${PYTHONPATH:-}"
    within 420 "$dir/ava" bench train -c configs/gpu-llama2-7b-16gib.yaml --steps 5 --warmup 2 \
        >"$LOGS/bench-7b-16gib.txt" 2>&1
    echo "  Ava 7B in 16 GiB: $(bench_headline "$LOGS/bench-7b-16gib.txt")"
    within 60 "$dir/ava" estimate -c configs/gpu-llama2-7b-16gib.yaml --device cuda -q 2>&1 | tail -n 1 \
        >"$LOGS/estimate-7b-16gib.txt"
    if [ -f "$dir/torch_ref.py" ] && [ -n "$wheel" ]; then
        for mode in bnb8-inbwd bnb8; do
            within 240 python3 "$dir/torch_ref.py" --shape 7b --mode $mode --ckpt --seq 2048 --batch 1 --steps 5 \
                --warmup 2 >"$LOGS/torch-7b-$mode.log" 2>&1
            tail -n 1 "$LOGS/torch-7b-$mode.log" >"$LOGS/torch-7b-$mode.json"
            echo "  PyTorch 7B $mode: $(torch_headline "$LOGS/torch-7b-$mode.json")"
        done
    else
        echo "  no PyTorch 8-bit recipes: no torch_ref.py or no bitsandbytes wheel (carry gpu-wheels)"
    fi
}

part_long() {
    local dir=$1 wheel seq
    wheel=$(bitsandbytes "$dir")
    [ -n "$wheel" ] && export PYTHONPATH="$WORK/py:${PYTHONPATH:-}"
    for seq in 32768 65536; do
        within 300 "$dir/ava" bench train -c configs/gpu-tinyllama-1b-64k.yaml --set data.seq_len=$seq \
            --steps 3 --warmup 1 >"$LOGS/bench-1b-$seq.txt" 2>&1
        echo "  Ava T $seq: $(bench_headline "$LOGS/bench-1b-$seq.txt")"
        within 60 "$dir/ava" estimate -c configs/gpu-tinyllama-1b-64k.yaml --device cuda --set data.seq_len=$seq \
            -q 2>&1 | tail -n 1 >"$LOGS/estimate-1b-$seq.txt"
        if [ -f "$dir/torch_ref.py" ] && [ -n "$wheel" ]; then
            within 240 python3 "$dir/torch_ref.py" --shape 1b --mode bnb8 --ckpt --seq $seq --batch 1 --steps 3 \
                --warmup 1 >"$LOGS/torch-1b-$seq.log" 2>&1
            tail -n 1 "$LOGS/torch-1b-$seq.log" >"$LOGS/torch-1b-$seq.json"
            echo "  PyTorch T $seq: $(torch_headline "$LOGS/torch-1b-$seq.json")"
        fi
    done
    # The same at 64K with the block inputs parked in host memory.
    within 300 "$dir/ava" bench train -c configs/gpu-tinyllama-1b-64k.yaml --steps 3 --warmup 1 \
        --set 'plugins.checkpoint={name: selective, every: 1, offload: true}' >"$LOGS/bench-1b-65536-parked.txt" 2>&1
    echo "  Ava T 65536, inputs parked: $(bench_headline "$LOGS/bench-1b-65536-parked.txt")"
}

part_attention() {
    local dir=$1
    local shape=(--heads 32 --kv-heads 4 --head-dim 64)
    within 150 "$dir/ava" bench attention --device cuda --kernels flash --seq 2048,4096,8192,16384,32768 \
        "${shape[@]}" >"$LOGS/attn-ava.txt" 2>&1
    if [ -f "$dir/attn_ref.py" ]; then
        within 120 python3 "$dir/attn_ref.py" --seq 2048,4096,8192,16384,32768 "${shape[@]}" >"$LOGS/attn-torch.txt" 2>&1
    fi
    attention_lines
    # Each kernel's own time (AVA_CUDA_KERNEL_TIMES: two events around every launch, the host
    # waiting for each), summed per kernel and T: which of flash's kernels the time goes to.
    local seq
    for seq in 2048 8192; do
        rm -f "$LOGS/kernels-attn-$seq.tsv"
        AVA_CUDA_KERNEL_TIMES="$LOGS/kernels-attn-$seq.tsv" within 60 "$dir/ava" bench attention --device cuda \
            --kernels flash --seq $seq "${shape[@]}" --repeats 3 >"$LOGS/kernels-attn-$seq.log" 2>&1
        kernel_sums "$LOGS/kernels-attn-$seq.tsv" >"$LOGS/kernels-attn-$seq.txt"
    done
}

# An AVA_CUDA_KERNEL_TIMES file summed per kernel and grid (an optimizer's kernels run on a
# grid per parameter size): launches, ms a launch, ms in all; each line ends with `|` and
# the total, for sorting.
kernel_sums() {
    [ -f "$1" ] || { echo "  (no $(basename "$1"): nothing launched through ava_kernels::cuda, or the run failed)|0"; return; }
    awk -F'\t' '{ k = $2 "\t" $3; n[k]++; ms[k] += $5 }
        END { for (k in n) { split(k, p, "\t"); printf "  %-30s grid %-14s %5d launches %9.4f ms a launch %10.3f ms in all|%f\n", p[1], p[2], n[k], ms[k] / n[k], ms[k], ms[k] } }' \
        "$1" | sort
}

# Each kernel launched through ava_kernels::cuda (flash's, the optimizer's) in the bench's
# plain step, timed one by one: 1 warm-up, 2 measured and 2 profiled steps, so "ms in all" is
# about 5 steps' worth.
part_kernels() {
    local dir=$1
    rm -f "$LOGS/kernels-1b.tsv"
    AVA_CUDA_KERNEL_TIMES="$LOGS/kernels-1b.tsv" within 120 "$dir/ava" bench train -c configs/gpu-tinyllama-1b.yaml \
        --steps 2 --warmup 1 --set plugins.checkpoint=none >"$LOGS/bench-1b-kernels.txt" 2>&1
    kernel_sums "$LOGS/kernels-1b.tsv" >"$LOGS/kernels-1b.txt"
    echo "  $(wc -l <"$LOGS/kernels-1b.txt") kernel/grid pairs timed (kernels-1b.txt in the logs)"
}

case "${1:-}" in
    build) [ $# -eq 2 ] || usage; build "$2" ;;
    run) [ $# -eq 3 ] || usage; run "$2" "$3" ;;
    *) usage ;;
esac
