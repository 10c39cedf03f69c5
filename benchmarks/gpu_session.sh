#!/usr/bin/env bash
# Everything a GPU session checks and measures, in one call of at most ~405 s, most valuable first:
#   1. step_profile  where the demo GPT's training step spends its time, for eager, Inductor and
#                    seqfast (kernel groups, launches, host enqueue time, device busy fraction),
#                    and what each fused call runs
#   2. train_step    the headline: tokens/s and peak memory of three models (the demo GPT, a GPT-2
#                    through SDPA, a LLaMA-style model) vs eager and Inductor
#   3. pytest_gpu    the GPU test tier: every generated kernel against its reference on the device
#   4. ceilings      copy bandwidth and bf16 matmul rate, measured in the same run
#   5. train_step_graphs   the three models again under mode="reduce-overhead" (CUDA graphs)
#   6. attention, loss, norm, pointwise, attention_mods   kernel benchmarks (--short sizes)
#   7. memory_budget
#   8. compile_time  the demo GPT's first step with Inductor and seqfast, cold and warm caches
# Each step runs under `timeout` with its own budget, so one that fails or hangs costs only that.
# The budgets form a schedule: a step may also use what the steps before it left unused (at most
# twice its own budget), never what is planned for the steps after it, and nothing runs past the
# deadline (SESSION_SECONDS, 395 s after the start; a step's kill grace and the summary add ~10 s).
# The budgets add up to more than the deadline: the last steps run only in the time the first
# ones save, and are listed as skipped otherwise (run them by name in a second call). Kernel
# compiles (Triton's JIT at each kernel's first launch) happen inside the steps and count.
#
#   bash benchmarks/gpu_session.sh [STEP ...]     (default: every step, in the order above)
#   steps: step_profile train_step pytest_gpu ceilings train_step_graphs attention loss norm
#          pointwise attention_mods memory_budget compile_time
#   BENCH_SIZE=--quick SESSION_SECONDS=900 bash benchmarks/gpu_session.sh   (a smoke run on a CPU)
#
# Writes into ${OUT:-benchmarks/out}: session.log (everything), pytest_gpu.txt, results.md (the
# benchmark tables, for benchmarks/results/<device>.md) and summary.md, which is also printed last
# and opens with the headline table (benchmarks/headline.py: train step tokens/s and peak memory,
# attention against SDPA and FlexAttention, residual + norm against copy bandwidth, linear +
# cross-entropy's peak memory, each from this run's checked tables).
# Needs no network and installs nothing: the repository goes on PYTHONPATH, and a minimal
# dist-info beside it declares the `torch_dynamo_backends` entry point that makes
# torch.compile(backend="seqfast") find the backend, as `pip install -e .` would.
set -u -o pipefail

out="${OUT:-benchmarks/out}"
mkdir -p "$out"
log="$out/session.log"
: >"$log"
summary="$out/summary.md"
py="${PYTHON:-python3}"
size="${BENCH_SIZE:---short}" # the benchmarks' size option
deadline=$((SECONDS + ${SESSION_SECONDS:-395}))
schedule=-1 # where the budgets planned so far end; set when the first step starts
work="$(mktemp -d)"
statuses=()
steps=(step_profile train_step pytest_gpu ceilings train_step_graphs attention loss norm pointwise
    attention_mods memory_budget compile_time)
for name in "$@"; do
    [[ " ${steps[*]} " == *" $name "* ]] || {
        echo "unknown step '$name'; the steps: ${steps[*]}" >&2
        exit 2
    }
done

say() { echo "$*" | tee -a "$log"; }

# step NAME BUDGET_S COMMAND...: COMMAND under `timeout` (SIGINT first, so Python prints where it
# was and pytest its summary; SIGKILL 8 s later), its output appended to session.log as it comes
# (no pipe: a stray grandchild holding one open could not stall the script) and copied to
# $work/NAME.log; its status joins the summary. BUDGET_S 0: a retry within the schedule as it
# stands. Sets last_rc and last_took.
step() {
    local name=$1 planned=$2
    shift 2
    ((schedule < 0)) && schedule=$SECONDS
    schedule=$((schedule + planned))
    local budget=$((schedule - SECONDS)) left=$((deadline - SECONDS))
    ((planned > 0 && budget > 2 * planned)) && budget=$((2 * planned))
    ((budget > left)) && budget=$left
    last_rc=-1 last_took=0
    if ((budget < 10)); then
        statuses+=("$(printf '%-15s skipped: %ss left before the deadline' "$name" "$left")")
        say "== $name: skipped, ${left}s left"
        return 0
    fi
    say "== $name (budget ${budget}s, at ${SECONDS}s): $*"
    local t0=$SECONDS offset state
    offset=$(stat -c %s "$log")
    timeout -s INT -k 8 "$budget" "$@" >>"$log" 2>&1
    last_rc=$?
    last_took=$((SECONDS - t0))
    tail -c +$((offset + 1)) "$log" >"$work/$name.log"
    case $last_rc in
        0) state="ok" ;;
        124 | 137) state="TIMED OUT (rc $last_rc)" ;;
        *) state="FAILED (rc $last_rc)" ;;
    esac
    statuses+=("$(printf '%-15s %-18s %4ss of %ss' "$name" "$state" "$last_took" "$budget")")
    say "== $name: $state in ${last_took}s"
    if ((last_rc != 0)); then # what it printed last, for the summary
        {
            echo "### $name: $state"
            echo '```'
            grep -v '^row: ' "$work/$name.log" | grep -v '^\s*$' | tail -n 5 | cut -c1-160
            echo '```'
        } >>"$work/notes.md"
    fi
    return 0
}

wanted() { # whether step $1 is among the arguments (every step when none was given)
    (($# == 1)) && return 0
    local name=$1 s
    shift
    for s in "$@"; do [[ $s == "$name" ]] && return 0; done
    return 1
}

# ---------------------------------------------------------------------------------------------
# environment: the repository importable, the backend's entry point declared, facts recorded

export PYTHONUNBUFFERED=1
site="$work/site"
mkdir -p "$site/seqcompile-0.0.0+session.dist-info"
printf 'Metadata-Version: 2.1\nName: seqcompile\nVersion: 0.0.0+session\n' \
    >"$site/seqcompile-0.0.0+session.dist-info/METADATA"
printf '[torch_dynamo_backends]\nseqfast = seqcompile.backend:seqfast\n' \
    >"$site/seqcompile-0.0.0+session.dist-info/entry_points.txt"
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"

# which code ran: the commit where .git came along, and a hash of the Python sources in any case
commit="$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown')"
sources="$(find seqcompile benchmarks tests -name '*.py' -o -name '*.jinja' | LC_ALL=C sort |
    xargs cat | sha256sum | cut -c1-12)"
say "== session at $(date -u +%FT%TZ) in $PWD; .git HEAD $commit (can lag the tree sent), sources $sources"
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv 2>&1 | tee -a "$log" >"$work/device.txt"
timeout 120 "$py" - >"$work/facts.txt" 2>&1 <<'EOF'
import importlib.metadata as md
import torch, triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs,"
          f" L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB, {p.total_memory / 2**30:.1f} GiB")
else:
    print("device: NO CUDA DEVICE VISIBLE TO TORCH")
for name in ("pytest", "pytest-xdist", "pytest-timeout"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} not installed")
from torch._dynamo.backends.registry import lookup_backend
import seqcompile.backend
assert lookup_backend("seqfast") is seqcompile.backend.seqfast, "seqfast is another backend"
print("backend seqfast: found through the entry point")
EOF
facts_rc=$?
tee -a "$log" <"$work/facts.txt"
[[ $facts_rc == 0 ]] || say "== environment check FAILED (rc $facts_rc): see above"
no_cuda=""
if grep -q '^device: NO CUDA' "$work/facts.txt"; then
    no_cuda="torch sees no CUDA device: the GPU tests skip themselves"
    [[ $size == --quick ]] || no_cuda+=", and the benchmarks are skipped"
    say "== WARNING: $no_cuda"
fi

# ---------------------------------------------------------------------------------------------
# measurements, appended to results.md; every executor is checked before it is timed

bench() { # bench NAME BUDGET MODULE ARGS...
    local name=$1 budget=$2 module=$3
    shift 3
    wanted "$name" ${selected[@]+"${selected[@]}"} || return 0
    if [[ -n $no_cuda && $size != --quick ]]; then # full-scale sizes on a CPU: no
        statuses+=("$(printf '%-15s skipped: no CUDA device' "$name")")
        return 0
    fi
    step "$name" "$budget" "$py" -m "benchmarks.$module" "$@" --output "$out/results.md"
}
selected=("$@")
last_rc=0 last_took=0
# 1-2. where the step's time goes, then the headline models (~40-60 s per GPT-2-small compile:
# step_profile compiles twice, train_step six times at --short)
bench step_profile 90 step_profile "$size"
bench train_step 150 train_step "$size" --modes default

# ---------------------------------------------------------------------------------------------
# 3. the GPU test tier: tests/test_gpu.py (138 tests) and every registry sample on CUDA (111). Its
# kernels take ~0.5-3 s each to compile (first launch) and it compiles a few hundred, ~8
# CPU-minutes in all; the longest test, plan_batch's, plans twice (~100 s each on this project's
# 2-core CPU host) before it trains. pytest-xdist spreads them over 12 processes (16 cores), the
# whole-model tests first; a per-test timeout (thread method: the worker exits, xdist starts
# another) keeps one hung kernel from holding the whole tier.

if wanted pytest_gpu "$@"; then
    opts=(-m gpu -q -rfE --tb=short --durations=25 -p no:cacheprovider --continue-on-collection-errors)
    plain=("${opts[@]}")
    if grep -q '^pytest-timeout [0-9]' "$work/facts.txt"; then
        plain+=(--timeout=160) # signal method: the test fails, the run goes on
    fi
    if grep -q '^pytest-xdist [0-9]' "$work/facts.txt"; then
        opts+=(-n "${PYTEST_WORKERS:-12}" --max-worker-restart=6)
        grep -q '^pytest-timeout [0-9]' "$work/facts.txt" && opts+=(--timeout=160 --timeout-method=thread)
    else
        opts=("${plain[@]}")
    fi
    step pytest_gpu 190 "$py" -m pytest "${opts[@]}"
    if [[ $last_rc == 3 || $last_rc == 4 ]] && ((last_took < 60)); then
        # an internal or usage error (a plugin's option, say) before any test ran: once more, plain
        step pytest_gpu_plain 0 "$py" -m pytest "${plain[@]}"
        cp "$work/pytest_gpu_plain.log" "$work/pytest_gpu.log" 2>/dev/null
    fi
    cp "$work/pytest_gpu.log" "$out/pytest_gpu.txt" 2>/dev/null
fi

# 4-7. budgets: ceilings is three copies and two matmuls; train_step_graphs compiles each model
# twice more (seqfast and Inductor under CUDA graphs); attention compiles 8 kernel
# variants x 4 kernels (~2.5 s each; GPT-2's head dim 64, a mask's block lists and LLaMA's
# grouped heads beside 128) and FlexAttention for its 5 cases without dropout (~10 s each);
# loss 2 cases x 2 compiles; norm and pointwise 4 cases with an
# Inductor compile each; attention_mods 3 FlexAttention compiles (~10 s each) and 3 x 4 kernels;
# memory_budget compiles GPT-2 small three times
bench ceilings 20 ceilings "$size"
bench train_step_graphs 120 train_step "$size" --modes reduce-overhead
bench attention 140 attention "$size"
bench loss 30 loss "$size"
bench norm 30 norm_kernels "$size"
bench pointwise 25 pointwise_kernels "$size"
bench attention_mods 45 attention_mods "$size"
bench memory_budget 60 memory_budget "$size" --no-inductor
# the demo GPT's first step, cold and warm caches, four processes (--quick is its only size)
bench compile_time 90 compile_time $([[ $size == --quick ]] && echo --quick)

# ---------------------------------------------------------------------------------------------
# the summary, printed last (the caller may see only the end of the output: each part is capped)

timeout 10 nvidia-smi --query-gpu=clocks.sm,temperature.gpu,memory.used --format=csv,noheader \
    >"$work/device_after.txt" 2>&1
# the headline: a few numbers read from this run's tables (benchmarks/headline.py), shown first
timeout 30 "$py" -m benchmarks.headline "$out/results.md" >"$work/headline.md" 2>&1
{
    echo "# GPU session summary"
    echo
    echo "- $(date -u +%FT%TZ), ${SECONDS}s in all; .git HEAD $commit (can lag the tree sent), sources $sources"
    echo "- nvidia-smi: $(tail -n +2 "$work/device.txt" | head -1)"
    echo "- after (clocks.sm, temperature, memory.used): $(head -1 "$work/device_after.txt")"
    sed 's/^/- /' "$work/facts.txt" | cut -c1-200 | head -10
    [[ -z $no_cuda ]] || echo "- WARNING: $no_cuda"
    echo
    head -c 3000 "$work/headline.md"
    echo
    if [[ -f $out/results.md ]]; then
        echo "## Tables (results.md in full; rows of steps cut short: 'row:' lines in session.log)"
        echo
        grep -v -e '^- date:' -e '^- torch ' "$out/results.md" | cut -c1-400 | head -c 4000
        echo
    fi
    if [[ -f $out/pytest_gpu.txt ]]; then
        echo "## pytest -m gpu"
        echo
        echo '```'
        grep -E '^(FAILED|ERROR) ' "$out/pytest_gpu.txt" | cut -c1-160 | head -20
        grep -E '(passed|failed|errors?|skipped|no tests ran|deselected)[^=]* in [0-9.]+s|Interrupted|KeyboardInterrupt' \
            "$out/pytest_gpu.txt" | tail -2 | cut -c1-300
        echo '```'
        echo
    fi
    if [[ -f $work/notes.md ]]; then
        echo "## The last lines of steps that did not finish cleanly"
        echo
        head -c 2000 "$work/notes.md"
        echo
    fi
    echo "## Steps"
    echo
    echo '```'
    printf '%s\n' ${statuses[@]+"${statuses[@]}"}
    echo '```'
} >"$summary"
cat "$summary" >>"$log"
rm -rf "$work"
# a file over 16 MiB would not come back at all: keep its first 4 and last 10 MiB
for f in "$log" "$out/pytest_gpu.txt"; do
    if [[ -f $f ]] && (($(stat -c %s "$f") > 15 * 2 ** 20)); then
        { head -c $((4 * 2 ** 20)) "$f"; printf '\n[... cut to fit: middle left out ...]\n'; tail -c $((10 * 2 ** 20)) "$f"; } >"$f.cut"
        mv "$f.cut" "$f"
    fi
done
echo
echo "=================================================================================="
cat "$summary"
