# Serving runs shared by run_tp.sh and run_fp8.sh (sourced; they define DEST, TOK, left and cap first).
# serve CONFIG QUANT TP NAME WORKLOADS...: one server (radixlm, or vLLM from PEER_SITE with ENGINE=vllm; HEAD and
# EXTRA: more server flags; PORT: its port, default 30000 + TP), a warm-up, then bench_serving per workload
# IN:OUT:PROMPTS[:USERS] on random prompts (the full-vocabulary tokenizer: about a token a word), EOS banned; JSON
# as DEST/NAME_IN_OUT[_cUSERS].json.

serve() {  # serve CONFIG QUANT TP NAME WORKLOADS... (each IN:OUT:PROMPTS[:USERS], 64 users unless given)
  local cfg=$1 q=$2 tp=$3 name=$4; shift 4
  if [ ! -d /tmp/tok_full ]; then  # built aside and renamed: two scripts serving side by side may both build it
    python benchmarks/gpu/full_vocab_tokenizer.py "$TOK" /tmp/tok_full.$$ 128256 > /dev/null
    mv -T /tmp/tok_full.$$ /tmp/tok_full 2> /dev/null || rm -rf /tmp/tok_full.$$
  fi
  local port=${PORT:-$((30000 + tp))} url log="$DEST/server_${name}.log"
  url=http://127.0.0.1:$port
  echo "== serve $name: ${ENGINE:-radixlm} $cfg $q tp $tp ($(left) s left)"
  local t0=$SECONDS
  if [ "${ENGINE:-radixlm}" = vllm ]; then  # its own site only (nothing of ours on its path), its own session
    setsid env -u PYTHONPATH PYTHONPATH="${PEER_SITE:-/tmp/vllm-site}" VLLM_USE_FLASHINFER_SAMPLER=0 \
      VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 python -m vllm.entrypoints.cli.main serve "$cfg" --load-format dummy \
      --dtype bfloat16 --quantization "$q" --tensor-parallel-size "$tp" --tokenizer /tmp/tok_full \
      --served-model-name "$name" --port $port --max-model-len 4096 --gpu-memory-utilization 0.9 \
      --no-enable-flashinfer-autotune ${EXTRA:-} > "$log" 2>&1 &
  else
    python -m radixlm.launch_server --model-path "$cfg" --load-format dummy --tokenizer-path /tmp/tok_full \
      --served-model-name "$name" --port $port --tp-size "$tp" --quantization "$q" ${HEAD:-} \
      --attention-backend triton --log-level info ${EXTRA:-} > "$log" 2>&1 &
  fi
  local server=$!
  local ok=0
  while [ "$(left)" -gt 5 ]; do
    curl -sf "$url/health" > /dev/null && { ok=1; break; }
    kill -0 $server 2> /dev/null || break
    sleep 1
  done
  if [ $ok = 0 ]; then echo "server $name did not come up:"; tail -25 "$log"; kill -9 -- -$server $server 2> /dev/null; return 1; fi
  echo "up in $((SECONDS - t0)) s"
  grep -E "KV cache:|captured|tuning took|loaded" "$log" | head -6
  python benchmarks/bench_serving.py --base-url "$url" --label warmup --num-prompts 16 --input-len 64 \
    --output-len 8 --max-concurrency 16 --eos-token-id 128001 > /dev/null
  for w in "$@"; do
    IFS=: read -r il ol np users <<< "$w"
    users=${users:-64}
    local tag=${name}_${il}_${ol}
    [ "$users" = 64 ] || tag=${tag}_c$users
    # PROFILE_STEPS=N (radixlm): the workload's first N scheduler steps under torch.profiler (/start_profile); its
    # kernel summary is kept as DEST/profile_TAG.summary.txt, the Chrome trace is dropped (raw traces stay out).
    # The profiler slows those steps: the run's figures are then not for tables.
    if [ -n "${PROFILE_STEPS:-}" ] && [ "${ENGINE:-radixlm}" = radixlm ]; then
      curl -sf -X POST "$url/start_profile" -H 'Content-Type: application/json' \
        -d "{\"output_dir\": \"/tmp/prof_$tag\", \"num_steps\": $PROFILE_STEPS}" > /dev/null || echo "profile not started"
    fi
    timeout "$(cap ${SERVE_CAP:-400})" python benchmarks/bench_serving.py --base-url "$url" --label "$tag" \
      --dataset random --num-prompts "$np" --input-len "$il" --output-len "$ol" --range-ratio 1 \
      --max-concurrency "$users" --eos-token-id 128001 --out "$DEST/$tag.json" > /dev/null
    report "$DEST/$tag.json"
    if [ -n "${PROFILE_STEPS:-}" ] && [ "${ENGINE:-radixlm}" = radixlm ]; then
      curl -s -X POST "$url/stop_profile" > /dev/null  # written already after N steps: where it went
      cp /tmp/prof_$tag/*.summary.txt "$DEST/profile_$tag.summary.txt" 2> /dev/null && head -30 "$DEST/profile_$tag.summary.txt"
    fi
  done
  if [ -n "${PREFIX:-}" ]; then
    timeout "$(cap 300)" python benchmarks/bench_serving.py --base-url "$url" --label "${name}_prefix" \
      --dataset shared-prefix --groups 8 --num-prompts 128 --system-len 1500 --input-len 40 --output-len 64 \
      --max-concurrency 64 --eos-token-id 128001 --out "$DEST/${name}_prefix.json" > /dev/null
    report "$DEST/${name}_prefix.json"
    curl -s "$url/metrics" | grep "^radixlm_cache_hit_rate"
  fi
  curl -s "$url/get_server_info" > "$DEST/server_info_${name}.json"
  kill -INT $server  # vLLM has been seen to hang on SIGINT: 30 s, then its whole session is killed
  for _ in $(seq 30); do kill -0 $server 2> /dev/null || break; sleep 1; done
  kill -0 $server 2> /dev/null && { echo "server $name did not stop in 30 s: killed"; kill -9 -- -$server $server 2> /dev/null; }
  wait $server; echo "server exit code: $?"
  sleep 3  # let the GPU memory go before the next server
}

report() {
  [ -f "$1" ] || { echo "no result $1"; return; }
  python - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
t = d["input_throughput"] + d["output_throughput"]
print(f"{d['label']:>22} ok {d['completed']:>3} fail {d['failed']} in {d['mean_prompt_tokens']:.0f} out "
      f"{d['mean_output_tokens']:.0f} | total tok/s {t:7.0f} output tok/s {d['output_throughput']:7.0f} | TTFT p50 "
      f"{d['ttft_ms']['p50']:6.0f} p99 {d['ttft_ms']['p99']:6.0f} ms | ITL p50 {d['itl_ms']['p50']:5.1f} p99 "
      f"{d['itl_ms']['p99']:5.1f} ms")
PY
}
