#!/usr/bin/env bash
# The GPU figures in one command (under 5 minutes on one GPU): the cuda cells of the default
# matrix and the cuda cases of the throughput suite, written under OUT (default results/gpu).
#
#     bash benchmarks/gpu_run.sh [OUT]
#
#   OUT/default/                 `icl-bench run` of the default matrix restricted to device = cuda
#   OUT/throughput_cuda.json     pytest-benchmark JSON of the cuda cases (every solver and reference)
#   OUT/throughput_cuda.md, .csv benchmarks/experiments/summarize.py tables of that JSON
#   OUT/gpu_run.log              what ran, with the GPU's name, and each step's exit status
#
# The suite's calls move --bench-values context values each (2**24 here: B = 167772 prompts at
# N = 100, so a call is not dominated by kernel launches). Each step has its own time limit, so
# the whole script stays under 5 minutes; a step cut short is reported in the log, not hidden.
# Without CUDA (torch.cuda.is_available() is False) nothing runs, no figure is written, and the
# script says so and exits 0: GPU figures exist only where a GPU ran them (docs/throughput.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-results/gpu}"
RUN_LIMIT="${GPU_RUN_MATRIX_S:-150}"   # seconds for the matrix run
BENCH_LIMIT="${GPU_RUN_BENCH_S:-120}"  # seconds for the throughput suite

if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'; then
    echo "gpu_run: no CUDA device here (torch.cuda.is_available() is False): nothing run, no GPU figure written"
    exit 0
fi
mkdir -p "$OUT"
LOG="$OUT/gpu_run.log"
{
    date -u +"started %Y-%m-%dT%H:%M:%SZ"
    python -c 'import torch; print("torch", torch.__version__, "GPU", torch.cuda.get_device_name(0))'
    git rev-parse HEAD 2>/dev/null | sed 's/^/git /'
} | tee "$LOG"

# the default matrix (wherever this checkout keeps it), restricted to the cuda cells
CONFIG=""
for c in icl_bench/configs/default.toml benchmarks/default.toml; do [ -f "$c" ] && CONFIG="$c" && break; done
python - "$CONFIG" "$OUT/default_cuda.toml" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
text, n = re.subn(r'(?m)^device\s*=.*$', 'device = ["cuda"]', text)
assert n == 1, "default matrix: no device line to restrict"
open(sys.argv[2], "w").write(text)
EOF
# Each step has a limit; at it the step gets SIGINT (then SIGKILL 10 s later) and stops as on Ctrl-C,
# keeping what finished: pytest-benchmark the JSON of the finished cases (on SIGTERM it wrote
# nothing: a review), the run its cells and resume line.
# The throughput suite first, and its summary: its figures are the ones the GPU targets are read from.
timeout -s INT -k 10 "$BENCH_LIMIT" python -m pytest benchmarks/test_throughput.py --benchmark-only -q -k cuda \
    --bench-values 16777216 --benchmark-max-time 0.2 --benchmark-min-rounds 3 \
    --benchmark-json="$OUT/throughput_cuda.json" -p no:cacheprovider > "$OUT/throughput_cuda.txt" 2>&1
echo "throughput suite: exit $? (124 = cut at ${BENCH_LIMIT} s, the finished cases kept; output in throughput_cuda.txt)" | tee -a "$LOG"
if [ -s "$OUT/throughput_cuda.json" ]; then
    python -m benchmarks.experiments.summarize "$OUT/throughput_cuda.json" --out "$OUT/throughput_cuda" > /dev/null
    echo "summary: exit $? -> $OUT/throughput_cuda.md" | tee -a "$LOG"
fi

rm -rf "$OUT/default"
timeout -s INT -k 10 "$RUN_LIMIT" python -m icl_bench run --config "$OUT/default_cuda.toml" --out "$OUT/default" \
    --no-progress 2>&1 | tail -n 40 | tee -a "$LOG"
echo "matrix run: exit ${PIPESTATUS[0]} (124 = cut at ${RUN_LIMIT} s: its finished cells are in $OUT/default)" | tee -a "$LOG"
date -u +"finished %Y-%m-%dT%H:%M:%SZ" | tee -a "$LOG"
