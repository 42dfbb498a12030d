#!/usr/bin/env bash
# Serving on one GPU, through the gateway: our token engine on CUDA (random-weight Qwen2.5-7B shape, bf16,
# Qwen3 tokenizer from the built-in bundle) behind `render-service serve --engine`, 64 concurrent streams of
# 1024-token prompts and 128 output tokens. What it is for: TTFT under concurrent load, where mixed
# prefill + decode steps used to compile a Triton kernel for each new count of decoding sequences.
# Run from the repository root on the GPU machine (python3 there holds torch; OUT is where results go):
#   OUT=$OUT bash bench/results/serve_gpu/run.sh
set -euo pipefail
PY=${PY:-python3}
OUT=${OUT:-bench/results/serve_gpu}
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
wait_up() {  # python, not curl: the GPU machine's image may lack curl
  $PY -c "import httpx, sys, time
for _ in range(900):
    try:
        if httpx.get(sys.argv[1] + '/health', timeout=2).status_code == 200: sys.exit(0)
    except httpx.HTTPError: pass
    time.sleep(0.2)
sys.exit(sys.argv[1] + ' not up')" "$1"
}

BUNDLE=$($PY -c "from render_service.default_bundle import default_bundle_dir; print(default_bundle_dir())")
t0=$(date +%s)
$PY -m token_engine.cli make-random-model "$WORK/m" --preset qwen2.5-7b --dtype bfloat16 --tokenizer "$BUNDLE" >/dev/null
echo "model written in $(( $(date +%s) - t0 )) s"
$PY -m token_engine.cli serve "$WORK/m" --device cuda --host 127.0.0.1 --port 8100 --max-num-seqs 64 \
  --max-model-len 4096 --log-level warning > "$OUT/engine.log" 2>&1 & PIDS+=($!)
wait_up http://127.0.0.1:8100
echo "engine up after $(( $(date +%s) - t0 )) s"
$PY -m render_service.cli serve "$WORK/m" --host 127.0.0.1 --port 8200 --engine http://127.0.0.1:8100 \
  --served-model-name qwen2.5-7b-random --log-level warning > "$OUT/gateway.log" 2>&1 & PIDS+=($!)
wait_up http://127.0.0.1:8200
$PY -m bench.cli serve --base-url http://127.0.0.1:8200 --endpoint /v1/completions --tokenizer "$BUNDLE" \
  --dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts 128 --request-rate inf \
  --max-concurrency 64 --ignore-eos --seed 0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
  --save-result --result-dir "$OUT" --result-filename h200_c64.json --label h200-c64 --disable-tqdm
$PY -c "import httpx; print(httpx.get('http://127.0.0.1:8100/metrics').text)" > "$OUT/engine_metrics.txt"
grep -E '^splitserve:engine_step_phase_seconds_(sum|count)' "$OUT/engine_metrics.txt"
