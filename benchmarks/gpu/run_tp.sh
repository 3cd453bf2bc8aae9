#!/usr/bin/env bash
# Tensor parallelism on one host of several GPUs (issue 32), in stages that each leave their results in DEST as
# soon as they finish (TPS: the tp sizes to run, default every power of two up to the GPUs there):
#   test      the gpu suite's tensor-parallel tests (NCCL, graphs on/off, overlap on/off, fp8, a killed rank)
#   decode    bench_decode on the 8B shape, bf16, at each tp (batch 1/32/128, context 512), NCCL share of a
#             step; the plain PyTorch graph step on one GPU beside it
#   decode8   the same in fp8 (fp8 LM head)
#   profile70 bench_decode on the 70B shape in fp8 at each tp > 1, batch 64 at context 1,500 (the serve70 runs'
#             steady state): step time and a kernel-time table (attention, GEMMs, NCCL) per rank-0 step
#   serve70   radixlm serve on the 70B shape in fp8 at each tp > 1: 64 users, 512 in / 256 out then
#             1,000 in / 1,000 out, random words (about a token each with the full-vocabulary tokenizer)
#   prefix    the 8B shape, bf16, shared prefixes (8 groups x 1,500 words, c = 64), tp 1 then tp 2
#   vllm70    vLLM (PEER_SITE, default /tmp/vllm-site: benchmarks/peers/install_wheelhouse.sh) on the serve70
#             runs at each tp > 1: `--tensor-parallel-size TP --quantization fp8 --load-format dummy`, same client
# Usage (device tool): bash benchmarks/gpu/run_tp.sh DEST [stages...]; BUDGET (s, default 1380) bounds the run.
set -u
DEST=$1; shift
STAGES=${*:-test decode serve70 decode8 prefix}
BUDGET=${BUDGET:-1380}
mkdir -p "$DEST"
exec > >(tee -a "$DEST/log.txt") 2>&1
# NVLink multicast stays off on the lent machines, in every process started from here
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
left() { local n=$((BUDGET - SECONDS)); echo $((n > 1 ? n : 1)); }
cap() { local n; n=$(left); echo $(($1 < n ? $1 : n)); }  # cap SECONDS: at most that, at most what is left
stage() { [[ " $STAGES " == *" $1 "* ]]; }
source .gpu-bundle/activate
export PYTHONPATH=$PWD:$PYTHONPATH
TOK=$PWD/.gpu-bundle/tokenizer
export RADIXLM_TEST_TOKENIZER=$TOK
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
TPS=${TPS:-$(for n in 1 2 4 8; do [ $n -le "$GPUS" ] && echo -n "$n "; done)}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -12
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
echo "tp sizes: $TPS"

decode() {  # decode QUANT NAME TP (HEAD=--fp8-lm-head)
  local q=$1 name=$2 tp=$3
  echo "== decode 8b $q ${HEAD:-} tp $tp ($(left) s left)"
  timeout "$(cap 240)" python benchmarks/bench_decode.py --model-path benchmarks/configs/llama-3.1-8b \
    --load-format dummy --tokenizer-path "$TOK" --attention-backend triton --quantization "$q" ${HEAD:-} \
    --batch-sizes 1 32 128 --context 512 --extend-cuda-graph off --tp-size "$tp" \
    --out "$DEST/${name}_tp$tp.json" 2>&1 | grep -v -i warn | grep -v "skinny matmul:" | tail -6
}

serve() {  # serve CONFIG QUANT TP NAME WORKLOADS... (each workload IN:OUT:PROMPTS); ENGINE=vllm: the peer
  local cfg=$1 q=$2 tp=$3 name=$4; shift 4
  [ -d /tmp/tok_full ] || python benchmarks/gpu/full_vocab_tokenizer.py "$TOK" /tmp/tok_full 128256 > /dev/null
  local port=$((30000 + tp)) url log="$DEST/server_${name}.log"
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
    IFS=: read -r il ol np <<< "$w"
    timeout "$(cap 400)" python benchmarks/bench_serving.py --base-url "$url" --label "${name}_${il}_${ol}" \
      --dataset random --num-prompts "$np" --input-len "$il" --output-len "$ol" --range-ratio 1 \
      --max-concurrency 64 --eos-token-id 128001 --out "$DEST/${name}_${il}_${ol}.json" > /dev/null
    report "$DEST/${name}_${il}_${ol}.json"
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

if stage test; then
  timeout "$(cap 420)" python -m pytest -q -m gpu tests/gpu/test_tp_cuda.py 2>&1 | grep -v -i warn | tail -25 |
    tee "$DEST/pytest_tp.txt"
fi
if stage decode; then
  timeout "$(cap 60)" python .gpu-bundle/plain_graph_decode.py 1024 512 1,32,128 2>&1 | tail -4 | tee "$DEST/plain_graph.txt"
  for tp in $TPS; do decode none decode8b_bf16 "$tp"; done
fi
if stage serve70; then
  for tp in $TPS; do
    [ "$tp" -gt 1 ] || continue
    HEAD=--fp8-lm-head serve benchmarks/configs/llama-3.1-70b fp8 "$tp" "llama70b_fp8_tp$tp" 512:256:128 1000:1000:128
  done
fi
if stage vllm70; then
  for tp in $TPS; do
    [ "$tp" -gt 1 ] || continue
    ENGINE=vllm serve benchmarks/configs/llama-3.1-70b fp8 "$tp" "vllm70b_fp8_tp$tp" 512:256:128 1000:1000:128
  done
fi
if stage decode8; then
  for tp in $TPS; do HEAD=--fp8-lm-head decode fp8 decode8b_fp8_head "$tp"; done
fi
if stage profile70; then
  for tp in $TPS; do
    [ "$tp" -gt 1 ] || continue
    echo "== profile 70b fp8 tp $tp ($(left) s left)"
    timeout "$(cap 300)" python benchmarks/bench_decode.py --model-path benchmarks/configs/llama-3.1-70b \
      --load-format dummy --tokenizer-path "$TOK" --attention-backend triton --quantization fp8 --fp8-lm-head \
      --batch-sizes 1 64 --context 1500 --extend-cuda-graph off --tp-size "$tp" --profile "$DEST/profile70_tp$tp.txt" \
      --out "$DEST/profile70_tp$tp.json" 2>&1 | grep -v -i warn | grep -v "skinny matmul:" | tail -4
    grep -A14 "^timeline" "$DEST/profile70_tp$tp.txt"
  done
fi
if stage prefix; then
  for tp in ${PREFIX_TPS:-1 2}; do PREFIX=1 serve benchmarks/configs/llama-3.1-8b none "$tp" "llama8b_bf16_tp$tp"; done
fi
echo "== done in $SECONDS s"
