#!/usr/bin/env bash
# Serving benchmark on a GPU machine: our server on the Llama-3.1-8B-shaped model with random bf16 weights,
# driven by bench_serving.py (random and shared-prefix datasets), then a clean SIGINT shutdown.
# Usage (device tool): source .gpu-bundle/activate && bash benchmarks/gpu/run_serving.sh TOKENIZER_DIR OUT_DIR
set -u
TOK=$1; OUT=$2; PORT=${PORT:-30000}; mkdir -p "$OUT"
WORKLOADS=" ${WORKLOADS:-c32 c1 c128 prefix aborts} "  # which of the runs below (also: json)
want() { [[ "$WORKLOADS" == *" $1 "* ]]; }
if [ "${FULL_VOCAB:-1}" = 1 ]; then  # every sampled id streams as visible text (see full_vocab_tokenizer.py)
    [ -d /tmp/tok_full ] || python benchmarks/gpu/full_vocab_tokenizer.py "$TOK" /tmp/tok_full 128256
    TOK=/tmp/tok_full
fi
# EXTRA: more server flags (e.g. --enable-mixed-chunk, --attention-backend triton)
# TRACE=1: the server records its steps (RADIXLM_STEP_TRACE) and the client its chunk times, beside the results.
CT=""
if [ "${TRACE:-0}" = 1 ]; then export RADIXLM_STEP_TRACE=$OUT/steps.jsonl; CT=--save-chunk-times; fi
NG=""; [ "${CLIENT_GUARD:-1}" = 0 ] && NG=--no-cpu-guard  # CLIENT_GUARD=0: the clients where the kernel puts them
python -m radixlm.launch_server --model-path benchmarks/configs/llama-3.1-8b --load-format dummy \
    --tokenizer-path "$TOK" --served-model-name llama-8b-dummy --port "$PORT" ${EXTRA:-} > "$OUT/server.log" 2>&1 &
SERVER=$!
URL=http://127.0.0.1:$PORT
for _ in $(seq 600); do  # fail fast if the server dies while loading
    curl -sf $URL/health > /dev/null && break
    kill -0 $SERVER 2> /dev/null || { echo "server died:"; tail -30 "$OUT/server.log"; exit 1; }
    sleep 1
done
python benchmarks/bench_serving.py --base-url $URL --label warmup --num-prompts 16 --input-len 64 \
    --output-len 8 --max-concurrency 16 --wait 5 --eos-token-id 128001 > /dev/null || { tail -30 "$OUT/server.log"; exit 1; }
# C32_RUNS (default 1) runs of c32 (random_c32.json, random_c32_2.json, ...), new prompts each run: no prefix
# cache hits from the last
for n in $(seq ${C32_RUNS:-1}); do
    want c32 || break
    sfx=$([ $n = 1 ] || echo _$n)
    python benchmarks/bench_serving.py --base-url $URL --label random-c32$sfx --dataset random --num-prompts 128 \
        --input-len 512 --output-len 128 --max-concurrency 32 --eos-token-id 128001 --out "$OUT/random_c32$sfx.json" \
        --seed $((n - 1)) $CT $NG > /dev/null
done
want c1 && python benchmarks/bench_serving.py --base-url $URL --label random-c1 --dataset random --num-prompts 8 \
    --input-len 512 --output-len 128 --max-concurrency 1 --eos-token-id 128001 --out "$OUT/random_c1.json" > /dev/null
want c128 && python benchmarks/bench_serving.py --base-url $URL --label random-c128 --dataset random --num-prompts 512 \
    --input-len 512 --output-len 128 --max-concurrency 128 --eos-token-id 128001 --out "$OUT/random_c128.json" $CT $NG > /dev/null
want prefix && python benchmarks/bench_serving.py --base-url $URL --label shared-prefix --dataset shared-prefix --groups 8 \
    --num-prompts 128 --system-len 1500 --input-len 40 --output-len 64 --max-concurrency 64 --eos-token-id 128001 \
    --out "$OUT/shared_prefix.json" $CT $NG > /dev/null
# JSON schema (chat + response_format, as run_peers.sh runs it): EXTRA picks the grammar backend / jump-forward.
want json && python benchmarks/bench_serving.py --base-url $URL --label json --dataset json --num-prompts 256 \
    --input-len 64 --output-len 256 --max-concurrency 64 --out "$OUT/json.json" $CT $NG > /dev/null
# Clients hanging up mid-stream (a quarter of them), on both workloads: their KV must come back too.
want aborts && python benchmarks/bench_serving.py --base-url $URL --label aborts-random --dataset random --num-prompts 128 \
    --input-len 512 --output-len 128 --max-concurrency 64 --abort-fraction 0.25 --eos-token-id 128001 \
    --out "$OUT/aborts_random.json" > /dev/null
want aborts && python benchmarks/bench_serving.py --base-url $URL --label aborts-prefix --dataset shared-prefix --groups 8 \
    --num-prompts 64 --system-len 1500 --input-len 40 --output-len 64 --max-concurrency 64 --abort-fraction 0.25 \
    --eos-token-id 128001 --out "$OUT/aborts_prefix.json" > /dev/null
for _ in $(seq 30); do  # the flush is refused while the last hang-ups are still being aborted
    curl -sf -X POST $URL/flush_cache > /dev/null && break; sleep 1
done
curl -s $URL/get_server_info > "$OUT/server_info.json"  # after the flush: every KV slot must be free
python - "$OUT/server_info.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
st = s["scheduler"]
print("kv_free", st.get("kv_free"), "of", st.get("kv_total"), "OK" if st.get("kv_free") == st.get("kv_total") else "LEAK")
if "cpu_guard" in st:
    print("scheduler CPU guard:", st["cpu_guard"], "http server CPU guard:", s.get("http_cpu_guard"))
PY
kill -INT $SERVER; wait $SERVER; echo "server exit code: $?"
python - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("random_c*.json")) + [pathlib.Path(sys.argv[1]) / f for f in
        ("shared_prefix.json", "json.json", "aborts_random.json", "aborts_prefix.json")]:
    if f.exists():
        d = json.loads(f.read_text())
        print(f"{d['label']:>14} ok {d['completed']:>3} fail {d['failed']} abort {d.get('aborted', 0)} req/s {d['request_throughput']:.2f} "
              f"out tok/s {d['output_throughput']:.0f} TTFT mean {d['ttft_ms']['mean']:.0f} ms p99 "
              f"{d['ttft_ms']['p99']:.0f} ITL mean {d['itl_ms']['mean']:.1f} ms p99 {d['itl_ms']['p99']:.1f}"
              + (f" valid JSON {d['valid_json']}" if d.get("valid_json") is not None else ""))
PY
