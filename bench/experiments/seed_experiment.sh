#!/usr/bin/env bash
# The seed experiment: collocated vs P/D (pull, push with conditional disaggregation) on two GPUs,
# ~8k-token prompts and 256 output tokens, Poisson arrivals, prefix caching off; then 5-turn conversations
# with bidirectional KV reuse. Our engine on a random-weight Qwen2.5-7B shape (bf16) with the built-in Qwen3
# tokenizer, the gateway in front, `splitserve-bench serve` as the client.
#
# Run from the repository root on the GPU machine (python3 there holds torch; OUT is where results go):
#   OUT=/tmp/out bash bench/experiments/seed_experiment.sh                          # 2 GPUs, the whole experiment
#   OUT=/tmp/out PHASES="preflight collocated" RATES=0.4 bash bench/experiments/seed_experiment.sh      # a part of it
#   OUT=/tmp/out GPUS=1 NUM_PROMPTS=8 RATES="0.5 2" TURN_CONVERSATIONS=4 bash bench/experiments/seed_experiment.sh
#                                          # dry run on one GPU: both engines share GPU 0 (not the experiment)
#   OUT=/tmp/out DEVICE=cpu PRESET=tiny INPUT_LEN=256 OUTPUT_LEN=16 NUM_PROMPTS=4 RATES=2 TURN_CONVERSATIONS=2 \
#     PY=.venv/bin/python bash bench/experiments/seed_experiment.sh    # the script's own smoke test on a CPU box
#
# One engine per GPU, both `NixlPushConnector` with kv_role kv_both: such an engine computes plain requests
# (collocated), and serves pull and push P/D, so the three configurations differ only in the gateway in front
# of the same two engines: collocated = `--engine E0 E1`; pull = `--prefill E0 --decode E1`; push =
# the same with `--pd-transfer-mode push --pd-min-uncached-tokens $MIN_UNCACHED`.
# The full sweep is 6 rates x 100 prompts x 3 configurations (about an hour); PHASES and RATES split it
# across calls. Results: $OUT/<config>-<rate>qps.json (vLLM's result keys), $OUT/seed_rates.png (p99 ITL and
# median TTFT vs rate), $OUT/multiturn-<config>.json (TTFT by turn), preflight and handoff JSON, engine logs.
set -euo pipefail
PY=${PY:-python3}
OUT=${OUT:-bench/results/seed_experiment}
GPUS=${GPUS:-2}
PHASES=${PHASES:-"preflight collocated pull push multiturn plot"}
RATES=${RATES:-"0.2 0.4 0.6 1 2 inf"}
NUM_PROMPTS=${NUM_PROMPTS:-100}
INPUT_LEN=${INPUT_LEN:-8192}
OUTPUT_LEN=${OUTPUT_LEN:-256}
MIN_UNCACHED=${MIN_UNCACHED:-512}
TURN_CONVERSATIONS=${TURN_CONVERSATIONS:-20}
PRESET=${PRESET:-qwen2.5-7b}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
wait_up() {  # python, not curl: the GPU machine's image may lack curl
  $PY -c "import httpx, sys, time
for _ in range(1800):
    try:
        if httpx.get(sys.argv[1] + '/health', timeout=2).status_code == 200: sys.exit(0)
    except httpx.HTTPError: pass
    time.sleep(0.2)
sys.exit(sys.argv[1] + ' not up')" "$1"
}
stop_all() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
has() { [[ " $PHASES " == *" $1 "* ]]; }
# KV memory: one engine per GPU sizes itself (90% of the GPU); two engines on one GPU (or CPU) get a fixed
# block count each, since an engine that starts second would count the first one's memory as used.
KV_BLOCKS=${KV_BLOCKS:-}
if [ "$DEVICE" = cpu ]; then DEV0=cpu; DEV1=cpu; DTYPE=float32; KV_BLOCKS=${KV_BLOCKS:-2048}
elif [ "$GPUS" = 1 ]; then DEV0=cuda:0; DEV1=cuda:0; DTYPE=bfloat16; KV_BLOCKS=${KV_BLOCKS:-12000}
else DEV0=cuda:0; DEV1=cuda:1; DTYPE=bfloat16; fi
MEMORY=(--gpu-memory-utilization 0.90)
[ -n "$KV_BLOCKS" ] && MEMORY=(--num-gpu-blocks-override "$KV_BLOCKS")
echo "seed experiment: GPUS=$GPUS PHASES='$PHASES' RATES='$RATES' NUM_PROMPTS=$NUM_PROMPTS" | tee "$OUT/command.txt"

if has preflight; then
  # Before anything else, as the upstream guide advises: the transfer path, then one 8k prompt's handoff.
  $PY -m token_engine.cli preflight --prefill-device "$DEV0" --decode-device "$DEV1" --large-blocks 512 \
    > "$OUT/preflight.txt" 2>&1 || echo "preflight FAILED (see $OUT/preflight.txt)"
  tail -2 "$OUT/preflight.txt"
  $PY -m bench.pd_handoff_bench --prefill-device "$DEV0" --decode-device "$DEV1" --tokens "$INPUT_LEN" \
    --requests 50 --out "$OUT/handoff_8k.json" > "$OUT/handoff_8k.log" 2>&1 || echo "handoff bench FAILED"
  tail -3 "$OUT/handoff_8k.log"
fi

BUNDLE=$($PY -c "from render_service.bundle.default_bundle import default_bundle_dir; print(default_bundle_dir())")
need_engines=0
for phase in collocated pull push multiturn; do has $phase && need_engines=1; done
[ $need_engines = 1 ] || { has plot || exit 0; }

if [ $need_engines = 1 ]; then
  $PY -m token_engine.cli make-random-model "$WORK/m" --preset "$PRESET" --dtype "$DTYPE" --tokenizer "$BUNDLE" \
    --overrides '{"max_position_embeddings": 32768}' >/dev/null
fi
engine() {  # engine NAME DEVICE PORT SIDE_PORT PREFIX_CACHING(on|off)
  local kv="{\"kv_connector\": \"NixlPushConnector\", \"kv_role\": \"kv_both\", \"engine_id\": \"$1\",
    \"kv_connector_extra_config\": {\"bidirectional_kv_xfer\": true, \"kv_lease_duration\": 120}}"
  local cache=--no-enable-prefix-caching
  [ "$5" = on ] && cache=--enable-prefix-caching
  local device=cuda visible=${2#cuda:}
  [ "$2" = cpu ] && { device=cpu; visible=; }
  CUDA_VISIBLE_DEVICES=$visible VLLM_NIXL_SIDE_CHANNEL_PORT=$4 $PY -m token_engine.cli serve "$WORK/m" \
    --device $device --dtype "$DTYPE" --host 127.0.0.1 --port "$3" \
    --max-model-len $((INPUT_LEN + OUTPUT_LEN + 1024)) --max-num-seqs 64 "${MEMORY[@]}" $cache --log-level warning \
    --kv-transfer-config "$kv" > "$OUT/engine-$1.log" 2>&1 & PIDS+=($!)
}
gateway() {  # gateway PORT FLAGS...
  local port=$1; shift
  $PY -m render_service.cli serve "$WORK/m" --host 127.0.0.1 --port "$port" --served-model-name seed-7b \
    --log-level warning "$@" > "$OUT/gateway-$port.log" 2>&1 & PIDS+=($!)
  wait_up "http://127.0.0.1:$port"
}
start_pair() {  # start_pair PREFIX_CACHING: E0 on GPU 0 (prefill in P/D), E1 on the other (decode)
  engine e0 "$DEV0" 8100 5600 "$1"
  engine e1 "$DEV1" 8101 5601 "$1"
  wait_up http://127.0.0.1:8100
  wait_up http://127.0.0.1:8101
  gateway 8200 --engine http://127.0.0.1:8100 http://127.0.0.1:8101
  gateway 8201 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8101 --pd-transfer-mode pull
  gateway 8202 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8101 --pd-transfer-mode push \
    --pd-min-uncached-tokens "$MIN_UNCACHED"
}
declare -A PORT=([collocated]=8200 [pull]=8201 [push]=8202)

if has collocated || has pull || has push; then
  start_pair off
  for config in collocated pull push; do
    has $config || continue
    for rate in $RATES; do
      $PY -m bench.cli serve --base-url "http://127.0.0.1:${PORT[$config]}" --endpoint /v1/completions \
        --tokenizer "$BUNDLE" --label "$config" --dataset-name random --random-input-len "$INPUT_LEN" \
        --random-output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" --request-rate "$rate" --ignore-eos \
        --seed 0 --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 --goodput ttft:2000 tpot:30 \
        --save-result --result-dir "$OUT" --result-filename "$config-${rate}qps.json" --disable-tqdm
    done
  done
  for port in 8100 8101; do
    $PY -c "import httpx, sys; print(httpx.get(sys.argv[1]).text)" "http://127.0.0.1:$port/metrics" \
      | grep -E '^(splitserve:kv_handoff|vllm:nixl|splitserve:engine_step_phase_seconds_(sum|count))' \
      > "$OUT/engine-$port-metrics.txt" || true
  done
  stop_all
fi

if has multiturn; then
  # 5-turn conversations: collocated with prefix caching (its KV reuse), P/D with bidirectional reuse
  # (decode holds each turn's KV; the next turn's prefill pulls it and computes only the new tokens).
  start_pair on
  for config in collocated pull push; do
    $PY -m bench.cli serve --base-url "http://127.0.0.1:${PORT[$config]}" --endpoint /v1/chat/completions \
      --tokenizer "$BUNDLE" --label "multiturn-$config" --dataset-name sharegpt \
      --dataset-path bench/data/sharegpt_sample.json --sharegpt-output-len "$OUTPUT_LEN" \
      --num-prompts "$TURN_CONVERSATIONS" --multi-turn 5 --request-rate 0.5 --ignore-eos --seed 0 \
      --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 --save-result --result-dir "$OUT" \
      --result-filename "multiturn-$config.json" --disable-tqdm
  done
  stop_all
fi

if has plot; then
  shopt -s nullglob
  files=("$OUT"/collocated-*qps.json "$OUT"/pull-*qps.json "$OUT"/push-*qps.json)
  [ ${#files[@]} -gt 0 ] && $PY -m bench.cli plot "${files[@]}" --output "$OUT/seed_rates.png"
fi
echo "done: $OUT"
