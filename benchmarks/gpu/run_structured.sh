#!/usr/bin/env bash
# Structured output on the GPU default (CUDA graphs, overlap on; Triton attention, so no FlashInfer build): per
# grammar backend, the `json` workload of bench_serving.py (256 chat requests with response_format json_schema,
# c=64, temperature 0) streamed and not, every answer validated with jsonschema and every stream checked for its
# end; with the first backend also the same concurrency unconstrained (the ITL anchor, same server, same call;
# once with fixed lengths near the JSON answers', once with each answer as long as its constrained twin's)
# and a disconnect soak (half the streams dropped mid-answer) with the scheduler's RSS before and after.
# Usage (device tool): bash benchmarks/gpu/run_structured.sh DEST [backends...]   (default: auto xgrammar)
set -u
DEST=$1; shift
GRAMMARS=${*:-auto xgrammar}
BUDGET=${BUDGET:-570}
PORT=${PORT:-30000}
URL=http://127.0.0.1:$PORT
exec > >(tee -a "$DEST/log.txt") 2>&1
left() { local n=$((BUDGET - SECONDS)); echo $((n > 1 ? n : 1)); }
source .gpu-bundle/activate
# CODE=dir: the runtime from another checkout (an A/B of two commits in one call); the benchmarks from here
export PYTHONPATH=${CODE:+$CODE:}$PWD:$PYTHONPATH
TOK=/tmp/tok_full  # every sampled id streams as visible text (see full_vocab_tokenizer.py)
[ -d $TOK ] || python benchmarks/gpu/full_vocab_tokenizer.py .gpu-bundle/tokenizer $TOK 128256
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
JSON="--dataset json --num-prompts 256 --input-len 64 --output-len 256 --max-concurrency 64"
rss() { echo $(( $(awk '{print $2}' /proc/$1/statm) * 4 / 1024 )); }
# TRACE=1: the server records its steps (srt/diagnostics/step_trace.py); after each run the trace is cut
# (steps_<run>.jsonl) and summarized per kind of step: the host's ms in step() and the time from one step's start
# to the next's, to see where a constrained step's time goes
[ "${TRACE:-0}" = 1 ] && export RADIXLM_STEP_TRACE=/tmp/steps.jsonl
cut_trace() {
    [ "${TRACE:-0}" = 1 ] || return 0
    curl -s -X POST $URL/flush_cache > /dev/null
    [ -f /tmp/steps.jsonl ] && mv /tmp/steps.jsonl /tmp/steps_$1.jsonl
    [ "$1" = warmup ] && return 0
    python - /tmp/steps_$1.jsonl $1 <<'PY'
import json, statistics, sys
steps = [json.loads(line) for line in open(sys.argv[1])]
def q(v, p):
    return sorted(v)[min(len(v) - 1, int(p * len(v)))] if v else float("nan")
for mode in ("decode", "extend"):
    rows = [i for i, s in enumerate(steps) if s.get("mode") == mode]
    if not rows:
        continue
    host = [steps[i]["ms"] for i in rows]
    gap = [(steps[i + 1]["t"] - steps[i]["t"]) * 1e3 for i in rows if i + 1 < len(steps)]
    late = sum(not steps[i].get("sampled_early", True) for i in rows)
    print(f"  {sys.argv[2]} {mode}: {len(rows)} steps ({late} sampled late), host ms in step p50 {q(host, .5):.2f} "
          f"p90 {q(host, .9):.2f}; start to next start ms p50 {q(gap, .5):.2f} p90 {q(gap, .9):.2f} "
          f"mean {statistics.fmean(gap) if gap else float('nan'):.2f}")
PY
}
first=1
for g in $GRAMMARS; do
    python -m radixlm.launch_server --model-path benchmarks/configs/llama-3.1-8b --load-format dummy \
        --tokenizer-path $TOK --served-model-name llama-8b-dummy --port $PORT --attention-backend triton \
        --grammar-backend $g ${EXTRA:-} > "$DEST/server_$g.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 300); do
        curl -sf $URL/health > /dev/null && break
        kill -0 $SERVER 2> /dev/null || { echo "server died:"; tail -30 "$DEST/server_$g.log"; exit 1; }
        sleep 1
    done
    echo "== $g: up at ${SECONDS}s"
    python benchmarks/bench_serving.py --base-url $URL --label warmup $JSON --num-prompts 64 > /dev/null
    cut_trace warmup
    timeout $(left) python benchmarks/bench_serving.py --base-url $URL --label json-$g-stream $JSON \
        --out "$DEST/json_${g}_stream.json" > /dev/null
    cut_trace json_${g}_stream
    timeout $(left) python benchmarks/bench_serving.py --base-url $URL --label json-$g-whole $JSON --no-stream \
        --out "$DEST/json_${g}_whole.json" > /dev/null
    cut_trace json_${g}_whole
    # how auto served the schema: compiled once, moved to outlines (promotion) after its first requests?
    curl -s $URL/metrics | grep -E "^radixlm_grammar_(promotions|compiles|cache_hits)_total" | tee "$DEST/grammar_$g.txt"
    if [ $first = 1 ]; then
        # unconstrained at the same concurrency, output length near the JSON answers' (EOS banned)
        timeout $(left) python benchmarks/bench_serving.py --base-url $URL --label plain-c64 --dataset random \
            --num-prompts 256 --input-len 64 --output-len 80 --range-ratio 0.9 --max-concurrency 64 \
            --eos-token-id 128001 --out "$DEST/plain_c64.json" > /dev/null
        cut_trace plain_c64
        # the same, each answer as long as the constrained stream's answer of the same index: the anchor that
        # leaves only the grammar's cost (the JSON answers' lengths vary, so their streams see more admissions)
        timeout $(left) python benchmarks/bench_serving.py --base-url $URL --label plain-c64-matched --dataset random \
            --num-prompts 256 --input-len 64 --max-concurrency 64 --eos-token-id 128001 \
            --output-lens-from "$DEST/json_${g}_stream.json" --out "$DEST/plain_c64_matched.json" > /dev/null
        cut_trace plain_c64_matched
        [ "${SOAK:-1}" = 1 ] || { first=0; kill -INT $SERVER; wait $SERVER; continue; }
        sched=$(curl -s $URL/get_server_info | python -c "import json,sys; print(json.load(sys.stdin)['process_ids']['scheduler'])")
        r0=$(rss $sched)
        for round in 1 2; do
            timeout $(left) python benchmarks/bench_serving.py --base-url $URL --label soak-$round --dataset random \
                --num-prompts 512 --input-len 200 --output-len 128 --max-concurrency 64 --abort-fraction 0.5 \
                --eos-token-id 128001 --seed $round --out "$DEST/soak_$round.json" > /dev/null
            sleep 2
            echo "soak round $round: scheduler RSS $r0 -> $(rss $sched) MB"
        done
        python - "$DEST" $r0 $(rss $sched) $URL <<'PY'
import json, sys, urllib.request
dest, r0, r1, url = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rounds = [json.load(open(f"{dest}/soak_{n}.json")) for n in (1, 2)]
info = json.loads(urllib.request.urlopen(f"{url}/get_server_info").read())
json.dump({"rss_mb_before": r0, "rss_mb_after": r1, "aborted": sum(r["aborted"] for r in rounds),
           "completed": sum(r["completed"] for r in rounds), "requests_in_flight": info["requests_in_flight"],
           "scheduler": {k: info["scheduler"][k] for k in ("num_running", "num_waiting", "kv_free", "kv_total",
                                                           "kv_cached", "aborted_requests")}},
          open(f"{dest}/soak.json", "w"), indent=1)
PY
        first=0
    fi
    kill -INT $SERVER; wait $SERVER
done
python - "$DEST" <<'PY'
import glob, json, os, sys
dest = sys.argv[1]
print(f"{'run':<26} {'done':>5} {'valid':>6} {'cut':>4} {'finish':>24} {'req/s':>7} {'out tok/s':>9} {'ITL p50':>8} "
      f"{'ITL mean':>8} {'ITL p99':>8}")
for f in sorted(glob.glob(f"{dest}/json_*.json")) + [f"{dest}/plain_c64.json", f"{dest}/plain_c64_matched.json"]:
    if not os.path.exists(f):
        continue
    d = json.load(open(f))
    itl = d["itl_ms"]
    fmt = lambda v: f"{v:8.2f}" if v is not None else "       -"  # noqa: E731
    print(f"{d['label']:<26} {d['completed']:>5} {str(d['valid_json']):>6} {d['cut']:>4} "
          f"{json.dumps(d['finish_reasons']):>24} {d['request_throughput']:>7.2f} {d['output_throughput']:>9.0f} "
          f"{fmt(itl['p50'])} {fmt(itl['mean'])} {fmt(itl['p99'])}")
if os.path.exists(f"{dest}/soak.json"):
    print("soak:", open(f"{dest}/soak.json").read().replace("\n", " "))
PY
