#!/usr/bin/env bash
# The serving runs committed next to this file: our gateway over CPU token engines (tiny random-weight
# Qwen3, real Qwen3 tokenizer), collocated (one engine) and disaggregated (prefill + decode engines, KV over
# NIXL host memory), the same random dataset and rate sweep against each. Run from the repository root:
#   bash bench/results/serve_cpu/run.sh
set -euo pipefail
PY=.venv/bin/python
OUT=bench/results/serve_cpu
WORK=$(mktemp -d)
port() { $PY -c "from bench.peers import free_port; print(free_port())"; }
wait_up() { for _ in $(seq 1 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done; echo "$1 not up" >&2; return 1; }
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

$PY -m token_engine.cli make-random-model "$WORK/tiny" --arch qwen3 --preset tiny --dtype float32 \
  --tokenizer shared/fixtures/qwen3-0.6b --overrides '{"tie_word_embeddings": false}' >/dev/null
ENGINE_FLAGS=(--host 127.0.0.1 --dtype float32 --max-model-len 2048 --block-size 16 --num-gpu-blocks-override 1024
              --max-num-seqs 32 --log-level warning)
GATEWAY_FLAGS=(--host 127.0.0.1 --served-model-name tiny --engine-block-size 16 --log-level warning)
BENCH_FLAGS=(--dataset-name random --random-input-len 256 --random-output-len 32 --random-range-ratio 0.25
             --num-prompts 24 --request-rate 1,2,4,inf --max-concurrency 16 --ignore-eos --seed 0
             --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir "$OUT"
             --disable-tqdm)

kv() { echo "{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\", \"engine_id\": \"$1\"}"; }

# collocated: one engine, role both
E=$(port); G=$(port)
OMP_NUM_THREADS=1 $PY -m token_engine.cli serve "$WORK/tiny" --port "$E" "${ENGINE_FLAGS[@]}" & PIDS+=($!)
wait_up "http://127.0.0.1:$E"
$PY -m render_service.cli serve "$WORK/tiny" --port "$G" --engine "http://127.0.0.1:$E" "${GATEWAY_FLAGS[@]}" & PIDS+=($!)
wait_up "http://127.0.0.1:$G"
$PY -m bench.cli serve --base-url "http://127.0.0.1:$G" --label collocated --result-filename collocated.json "${BENCH_FLAGS[@]}"
for p in "${PIDS[@]}"; do kill "$p"; done; wait || true; PIDS=()

# disaggregated: prefill engine -> KV over NIXL -> decode engine
P=$(port); D=$(port); G=$(port)
OMP_NUM_THREADS=1 VLLM_NIXL_SIDE_CHANNEL_PORT=$(port) $PY -m token_engine.cli serve "$WORK/tiny" --port "$P" \
  "${ENGINE_FLAGS[@]}" --kv-transfer-config "$(kv bench-prefill)" & PIDS+=($!)
OMP_NUM_THREADS=1 VLLM_NIXL_SIDE_CHANNEL_PORT=$(port) $PY -m token_engine.cli serve "$WORK/tiny" --port "$D" \
  "${ENGINE_FLAGS[@]}" --kv-transfer-config "$(kv bench-decode)" & PIDS+=($!)
wait_up "http://127.0.0.1:$P"; wait_up "http://127.0.0.1:$D"
$PY -m render_service.cli serve "$WORK/tiny" --port "$G" --prefill "http://127.0.0.1:$P" --decode "http://127.0.0.1:$D" \
  "${GATEWAY_FLAGS[@]}" & PIDS+=($!)
wait_up "http://127.0.0.1:$G"
$PY -m bench.cli serve --base-url "http://127.0.0.1:$G" --label disaggregated --result-filename disaggregated.json "${BENCH_FLAGS[@]}"
# evidence that the KV really moved over NIXL: the engines' connector metrics after the sweep
for role in prefill decode; do
  url=$([ $role = prefill ] && echo "http://127.0.0.1:$P" || echo "http://127.0.0.1:$D")
  curl -s "$url/metrics" | grep -iE "kv_transfer|nixl|kv_lease|remote" | grep -vE "^#|_bucket|_created" > "$OUT/disaggregated-$role-kv-metrics.txt" || true
done

# multi-turn (collocated engine is gone; reuse the disaggregated stack): TTFT by turn
$PY -m bench.cli serve --base-url "http://127.0.0.1:$G" --endpoint /v1/chat/completions --label disaggregated-multiturn \
  --dataset-name sharegpt --dataset-path bench<local path> --sharegpt-output-len 16 --num-prompts 8 \
  --multi-turn 3 --request-rate 1 --ignore-eos --seed 0 --save-result --result-dir "$OUT" \
  --result-filename disaggregated-multiturn.json --disable-tqdm

$PY -m bench.cli plot "$OUT"/collocated-*qps.json "$OUT"/disaggregated-*qps.json --output "$OUT/collocated_vs_disaggregated.png"
