#!/usr/bin/env bash
# GPU validation, run from the repository root on a CUDA machine; logs go to $OUT (or ./gpu_out):
#   the GPU test suite (server tests included), the engine benchmark with transformers and the
#   bf16 parity check in the same run, and the server load benchmark (engine process and engine
#   thread).
# The GPU image may lack the server's packages: put wheels in .whl/ (they are installed from
# there, offline); without them the server tests and benchmark are skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT:-gpu_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader

site=""
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && site=/tmp/site || echo "wheel install failed"
else
    echo "no .whl/: server tests and benchmark skipped"
fi

ignore=()
[ -n "$site" ] || ignore=(--ignore=tests/server)
PYTHONPATH=.:tests:$site timeout 300 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider \
    "${ignore[@]}" tests/ 2>&1 | tee "$out/gpu_tests.log" | tail -15

PYTHONPATH=. timeout 240 python3 -m benchmarks.bench_engine --workloads b,parity,a \
    --hf-requests 32 --hf-batch 32 --parity-requests 16 --out "$out" 2>&1 \
    | tee "$out/bench_engine.log" | grep -E "^\(|parity|transformers|Traceback|Error"

if [ -n "$site" ]; then
    args=(--make-model qwen2.5-0.5b --prompt-len 64 512 --output-len 64 256
          --requests-per-client 4 --repeats 3 --loop asyncio --http h11)
    PYTHONPATH=.:$site timeout 280 python3 -m benchmarks.bench_server "${args[@]}" \
        --engine-process --json "$out/server_process.json" 2>&1 \
        | tee "$out/bench_server_process.log" | grep "^|"
    PYTHONPATH=.:$site timeout 280 python3 -m benchmarks.bench_server "${args[@]}" \
        --json "$out/server_thread.json" 2>&1 | tee "$out/bench_server_thread.log" | grep "^|"
fi
