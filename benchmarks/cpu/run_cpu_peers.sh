#!/usr/bin/env bash
# CPU side-by-side of radixlm and llama.cpp (llama-cpp-python) on the same GGUF, in one run (issue 12).
#
#   bash benchmarks/cpu/run_cpu_peers.sh [DEST]        # DEST default: benchmarks/results/cpu-2core/peers
#   SMOKE=1 bash benchmarks/cpu/run_cpu_peers.sh /tmp/peers-smoke   # tiny settings: checks the harness only
#
# Strictly one heavy thing at a time (a 2-core machine: two at once would measure the contention):
#   1. decode step, ours: bench_decode.py --batch-sizes 1 16 --context 64, --quantization none and gguf
#   2. decode step, llama.cpp: llamacpp_decode.py --context 64 (single stream)
#   3. serving: `radixlm serve $OURS_FLAGS`, then `python -m llama_cpp.server`, each driven by the same
#      bench_serving.py command (random 128/32, 32 prompts, concurrency 8), each stopped before the next starts
#   4. report_cpu_peers.py DEST: the table (and DEST/peers.png when matplotlib is importable)
# Environment: MODEL (the GGUF), THREADS (default nproc), OURS_FLAGS (default --quantization gguf
# --max-running-requests 4),
# LLAMA_FLAGS (extra llama_cpp.server flags), STAGES (default "decode llama serve"), SMOKE=1,
# and NUM_PROMPTS INPUT_LEN OUTPUT_LEN CONCURRENCY REPEATS STEPS to override the sizes one by one.
set -u
DEST=${1:-benchmarks/results/cpu-2core/peers}
MODEL=${MODEL:-$HOME/.cache/radixlm/models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-$(nproc)}
# At most 4 running requests: on 2 cores a 128-token prefill (~60 ms) is most of the work, and every running
# stream waits for every other stream's prefill, so 8 at once double the mean ITL for ~10% more throughput
# (llama.cpp's server, for comparison, decodes one request at a time). Queued requests wait in TTFT instead.
OURS_FLAGS=${OURS_FLAGS:---quantization gguf --max-running-requests 4}
LLAMA_FLAGS=${LLAMA_FLAGS:-}
STAGES=" ${STAGES:-decode llama serve} "
OURS_PORT=${OURS_PORT:-30000}; LLAMA_PORT=${LLAMA_PORT:-30011}
if [ "${SMOKE:-0}" = 1 ]; then d=(8 32 8 4 3 8); else d=(32 128 32 8 20 32); fi
NUM_PROMPTS=${NUM_PROMPTS:-${d[0]}}; INPUT_LEN=${INPUT_LEN:-${d[1]}}; OUTPUT_LEN=${OUTPUT_LEN:-${d[2]}}
CONCURRENCY=${CONCURRENCY:-${d[3]}}; REPEATS=${REPEATS:-${d[4]}}; STEPS=${STEPS:-${d[5]}}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the radixlm shim package lives in the repo root
export TQDM_DISABLE=1  # no weight-loading progress bars in the log

# Fail before measuring anything: a half run with no peer is not a side-by-side.
python -c "import llama_cpp, llama_cpp.server" 2> /dev/null || {
    echo "error: llama_cpp (with its server) is not importable; install it with" >&2
    echo "  CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install -e '.[cpu-peers]'   (benchmarks/cpu/README.md)" >&2
    exit 2; }
[ -f "$MODEL" ] || { echo "error: no GGUF at $MODEL (set MODEL=...)" >&2; exit 2; }
mkdir -p "$DEST"
exec > >(tee -a "$DEST/log.txt") 2>&1
stage() { [[ "$STAGES" == *" $1 "* ]]; }

SERVER=""
stop_server() {
    # TERM: uvicorn shuts down on it, and an INT was seen lost while our server was still starting. Servers run
    # in their own session (setsid), so the group id is the pid and the scheduler/detokenizer children get it too.
    [ -n "$SERVER" ] || return 0
    kill -TERM -- -"$SERVER" 2> /dev/null
    for _ in $(seq 30); do kill -0 "$SERVER" 2> /dev/null || break; sleep 0.5; done
    kill -KILL -- -"$SERVER" 2> /dev/null
    wait "$SERVER" 2> /dev/null
    SERVER=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM  # runs the EXIT trap

python - "$DEST/meta.json" "$MODEL" "$THREADS" "$OURS_FLAGS" "$LLAMA_FLAGS" <<'PY'
import json, os, platform, subprocess, sys
import llama_cpp, torch
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
json.dump({"cpu": cpu, "threads": int(sys.argv[3]), "model": sys.argv[2], "radixlm_commit": rev,
           "torch": torch.__version__, "llama_cpp_python": llama_cpp.__version__,
           "ours_flags": sys.argv[4], "llama_flags": sys.argv[5], "loadavg_1m_at_start": os.getloadavg()[0]},
          open(sys.argv[1], "w"), indent=2)
PY
# Other work on a 2-core machine skews both sides (llama.cpp's spinning threads most): say so in the log.
awk -v n="$(nproc)" '$1 > 0.25 * n { print "warning: load average " $1 " before the run; the machine is not quiet" }' /proc/loadavg
echo "== $(date -u +%FT%TZ) threads=$THREADS model=$MODEL -> $DEST"

if stage decode; then
    for q in none gguf; do
        python benchmarks/bench_decode.py --model-path "$MODEL" --quantization $q --batch-sizes 1 16 --context 64 \
            --repeats "$REPEATS" --out "$DEST/radixlm_decode_$q.json" || echo "bench_decode --quantization $q failed"
    done
fi
if stage llama; then
    python benchmarks/cpu/llamacpp_decode.py --model-path "$MODEL" --context 64 --steps "$STEPS" \
        --repeats "$(( REPEATS < 5 ? REPEATS : 5 ))" --n-threads "$THREADS" --out "$DEST/llamacpp_decode.json" ||
        echo "llamacpp_decode failed"
fi

# serve ENGINE PORT READY_PATH CMD...: start, wait until READY_PATH answers, warm up, measure, stop.
serve() {
    local engine=$1 port=$2 ready=$3; shift 3
    local url=http://127.0.0.1:$port t0 ok=0
    # Something already answering on the port would be measured instead of the server we start.
    if curl -s -o /dev/null "$url$ready"; then echo "$engine: port $port is in use; set OURS_PORT/LLAMA_PORT"; return 1; fi
    t0=$(date +%s.%N)
    setsid "$@" > "$DEST/${engine}_server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 600); do
        curl -sf "$url$ready" > /dev/null && { ok=1; break; }
        kill -0 "$SERVER" 2> /dev/null || break
        sleep 0.2
    done
    if [ $ok != 1 ]; then echo "$engine server did not come up:"; tail -30 "$DEST/${engine}_server.log"; stop_server; return 1; fi
    python -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" "$t0" "$(date +%s.%N)" \
        > "$DEST/${engine}_ready_s.txt"
    echo "$engine server ready after $(cat "$DEST/${engine}_ready_s.txt") s"
    local B=(python benchmarks/bench_serving.py --base-url "$url" --dataset random)
    # A few requests first so neither side pays one-time costs (first-call allocations, lazy init) in the figures.
    "${B[@]}" --label warmup --num-prompts 4 --input-len 16 --output-len 4 --max-concurrency 2 > /dev/null ||
        echo "$engine warmup failed"
    "${B[@]}" --label "$engine" --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
        --max-concurrency "$CONCURRENCY" --out "$DEST/${engine}_serving_random.json" > /dev/null ||
        echo "$engine bench_serving failed"
    stop_server
}

if stage serve; then
    # shellcheck disable=SC2086  # the flag strings are meant to split into words
    serve radixlm "$OURS_PORT" /health python -m radixlm.cli serve --model-path "$MODEL" --host 127.0.0.1 \
        --port "$OURS_PORT" $OURS_FLAGS
    # llama_cpp.server has no /health; /v1/models answers once the model is loaded. --n_threads must be given:
    # its default is half the cores. --interrupt_requests False: with the default True a new request cancels the
    # running one and most requests of a concurrent benchmark fail.
    # shellcheck disable=SC2086
    serve llamacpp "$LLAMA_PORT" /v1/models python -m llama_cpp.server --model "$MODEL" --host 127.0.0.1 \
        --port "$LLAMA_PORT" --n_threads "$THREADS" --n_ctx 2048 --interrupt_requests False $LLAMA_FLAGS
fi

python benchmarks/cpu/report_cpu_peers.py "$DEST"
