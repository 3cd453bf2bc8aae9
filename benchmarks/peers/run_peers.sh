#!/usr/bin/env bash
# One engine's half of the side-by-side comparison on the GPU machine: its OpenAI server driven by our
# bench_serving.py (same prompts, same client, same flags for both), then its offline API on bench_offline's
# prompts. Run it once per engine on the same machine, one call after the other (README.md):
#   bash benchmarks/peers/run_peers.sh DEST vllm     [serve offline]
#   bash benchmarks/peers/run_peers.sh DEST radixlm  [serve offline]
# Both engines: benchmarks/configs/llama-3.1-8b with dummy bf16 weights, the same full-vocabulary tokenizer,
# context 8192, 0.85 of the GPU's memory. vLLM runs from the wheelhouse install (PEER_SITE, default
# /tmp/vllm-site: install_wheelhouse.sh) with nothing of ours on its path. WORKLOADS picks serving runs;
# VLLM_SO_BACKEND vLLM's structured-output backend (default xgrammar; guidance is llguidance).
set -u
DEST=$1; ENGINE=$2; shift 2
STAGES=" ${*:-serve offline} "
WORKLOADS=" ${WORKLOADS:-c1 c32 c128 prefix json} "
PEER_SITE=${PEER_SITE:-/tmp/vllm-site}
MEM=0.85; CTX=8192; PORT=${PORT:-30000}; CFG=benchmarks/configs/llama-3.1-8b
mkdir -p "$DEST"
exec > >(tee -a "$DEST/${ENGINE}_log.txt") 2>&1
source .gpu-bundle/activate  # our server, the tokenizer builder and the benchmark client (aiohttp) use the bundle
BUNDLE_PATH=$PYTHONPATH
TOK=/tmp/tok_full
[ -d $TOK ] || python benchmarks/gpu/full_vocab_tokenizer.py .gpu-bundle/tokenizer $TOK 128256 > /dev/null
want() { [[ "$WORKLOADS" == *" $1 "* ]]; }
stage() { [[ "$STAGES" == *" $1 "* ]]; }
vllm_env() { env -u PYTHONPATH PYTHONPATH=$PEER_SITE VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
    HF_HUB_OFFLINE=1 "$@"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

if [ "$ENGINE" = vllm ]; then
    VERSION=$(vllm_env python -c "import vllm; print(vllm.__version__)" 2> /dev/null) || { echo "vllm not importable"; exit 1; }
    FLAGS="--load-format dummy --dtype bfloat16 --tokenizer $TOK --served-model-name llama-8b-dummy --port $PORT
           --gpu-memory-utilization $MEM --max-model-len $CTX --no-enable-flashinfer-autotune
           --structured-outputs-config {\"backend\":\"${VLLM_SO_BACKEND:-xgrammar}\",\"disable_any_whitespace\":true}"
    start_server() { vllm_env setsid python -m vllm.entrypoints.cli.main serve $CFG $FLAGS > "$DEST/vllm_server.log" 2>&1 & }
else
    VERSION=$(git rev-parse --short HEAD 2> /dev/null || echo unknown)
    FLAGS="--load-format dummy --tokenizer-path $TOK --served-model-name llama-8b-dummy --port $PORT
           --mem-fraction-static $MEM --context-length $CTX ${EXTRA:-}"
    start_server() { PYTHONPATH=$PWD:$BUNDLE_PATH FLASHINFER_WORKSPACE_BASE=$PWD/.fi-cache \
        python -m radixlm.launch_server --model-path $CFG $FLAGS > "$DEST/radixlm_server.log" 2>&1 & }
fi
python - "$DEST/${ENGINE}_meta.json" "$ENGINE" "$VERSION" "$FLAGS" <<'PY'
import json, subprocess, sys
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
json.dump({"engine": sys.argv[2], "version": sys.argv[3], "server_flags": " ".join(sys.argv[4].split()), "gpu": gpu},
          open(sys.argv[1], "w"), indent=2)
PY
echo "== $ENGINE $VERSION"

if stage serve; then
    T0=$SECONDS; start_server; SERVER=$!
    URL=http://127.0.0.1:$PORT
    for _ in $(seq 900); do
        curl -sf $URL/health > /dev/null && break
        kill -0 $SERVER 2> /dev/null || { echo "server died:"; tail -40 "$DEST/${ENGINE}_server.log"; exit 1; }
        sleep 1
    done
    echo "server up after $((SECONDS - T0)) s"
    B="python benchmarks/bench_serving.py --base-url $URL --eos-token-id 128001"
    $B --label warmup --num-prompts 32 --input-len 64 --output-len 16 --max-concurrency 32 --wait 5 > /dev/null ||
        { tail -40 "$DEST/${ENGINE}_server.log"; exit 1; }
    want c1 && $B --label $ENGINE-c1 --dataset random --num-prompts 8 --input-len 512 --output-len 128 \
        --max-concurrency 1 --out "$DEST/${ENGINE}_random_c1.json" > /dev/null
    want c32 && $B --label $ENGINE-c32 --dataset random --num-prompts 128 --input-len 512 --output-len 128 \
        --max-concurrency 32 --out "$DEST/${ENGINE}_random_c32.json" > /dev/null
    want c128 && $B --label $ENGINE-c128 --dataset random --num-prompts 512 --input-len 512 --output-len 128 \
        --max-concurrency 128 --out "$DEST/${ENGINE}_random_c128.json" > /dev/null
    want prefix && $B --label $ENGINE-prefix --dataset shared-prefix --groups 8 --num-prompts 128 --system-len 1500 \
        --input-len 40 --output-len 64 --max-concurrency 64 --out "$DEST/${ENGINE}_shared_prefix.json" > /dev/null
    want json && $B --label $ENGINE-json --dataset json --num-prompts 256 --input-len 64 --output-len 256 \
        --max-concurrency 64 --out "$DEST/${ENGINE}_json.json" > /dev/null
    # vLLM's server has been seen to hang on SIGINT after a failed request: give it 30 s, then kill its group
    kill -INT $SERVER
    for _ in $(seq 30); do kill -0 $SERVER 2> /dev/null || break; sleep 1; done
    # killed as a group: vLLM's engine core is a grandchild that kept the GPU's memory when only the parent went
    kill -0 $SERVER 2> /dev/null && { echo "server did not stop in 30 s: killed"; kill -9 -- -$SERVER 2> /dev/null; kill -9 $SERVER; }
    wait $SERVER 2> /dev/null
    # the next engine (or stage) needs the GPU's memory back: wait until no process holds more than 1 GiB
    for _ in $(seq 60); do
        used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -1)
        [ "${used:-0}" -lt 1024 ] && break
        sleep 1
    done
    echo "GPU memory in use after the server stopped: ${used:-?} MiB"
fi

if stage offline; then
    for w in "random --num-prompts 256 --input-len 512 --output-len 256" "sharegpt --num-prompts 1000"; do
        name=${w%% *}
        if [ "$ENGINE" = vllm ]; then
            vllm_env python benchmarks/peers/vllm_offline.py --model-path $CFG --tokenizer-path $TOK --workload $w \
                --gpu-memory-utilization $MEM --max-model-len $CTX --out "$DEST/vllm_offline_$name.json" \
                > "$DEST/vllm_offline_$name.log" 2>&1 || tail -30 "$DEST/vllm_offline_$name.log"
        else
            PYTHONPATH=$PWD:$BUNDLE_PATH FLASHINFER_WORKSPACE_BASE=$PWD/.fi-cache python benchmarks/bench_offline.py \
                --model-path $CFG --load-format dummy --tokenizer-path $TOK --workload $w \
                --out "$DEST/radixlm_offline_$name.json" mem_fraction_static=$MEM context_length=$CTX \
                > "$DEST/radixlm_offline_$name.log" 2>&1 || tail -30 "$DEST/radixlm_offline_$name.log"
        fi
        grep "output tok/s" "$DEST/${ENGINE}_offline_$name.log"
    done
fi
python benchmarks/peers/report_peers.py "$DEST" || true
