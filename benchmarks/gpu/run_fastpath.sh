#!/usr/bin/env bash
# GPU runs for the fast path, in stages that each leave their results in DEST (the device tool's $OUT) as soon as
# they finish, so a call cut off at its time limit still returns what it measured:
#   test     the gpu test suite (python -m pytest -m gpu)
#   decode   decode step times per backend (graphs + eager) beside the plain PyTorch CUDA-graph step
#   offline  bench_offline random 256 x 512/256 and ShareGPT-like 1000
#   serving  run_serving.sh (random c1/c32/c128, shared prefix, KV-free check after /flush_cache), mixed chunk
#   itl      c32 (and c128) serving with mixed chunked prefill of ITL_CHUNKS tokens (the inter-token tail)
#   guard    c32 mixed serving with the CPU guard on (--scheduler-cpus auto) and off (none), GUARD_RUNS each
#   serve    one server config (SERVE_EXTRA flags, SERVE_WORKLOADS, SERVE_LABEL)
#   programs the frontend program workloads on the 8B shape (PROG_SCALE, PROG_REPEATS)
#   profile  kernel time by name at batch 1 and 32 per backend
# FlashInfer compiles its kernels in the background from the start (minutes on a fresh machine); stages and
# backends that need it wait for it. BUDGET (s, default 570) bounds the whole call; BACKENDS picks backends.
# Usage (device tool): bash benchmarks/gpu/run_fastpath.sh DEST [stages...]
set -u
DEST=$1; shift
STAGES=${*:-test decode}
BACKENDS=${BACKENDS:-triton flashinfer}
BUDGET=${BUDGET:-570}
exec > >(tee -a "$DEST/log.txt") 2>&1
left() { local n=$((BUDGET - SECONDS)); echo $((n > 1 ? n : 1)); }
source .gpu-bundle/activate
TOK=$PWD/.gpu-bundle/tokenizer
CFG=benchmarks/configs/llama-3.1-8b
# The repo root on the path (the radixlm package shim lives there); FlashInfer's JIT cache in an ignored folder
# of the repo, which a warm machine keeps between calls (its home directory it does not).
export PYTHONPATH=$PWD:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=$PWD/.fi-cache
export MAX_JOBS=16 RADIXLM_TEST_TOKENIZER=$TOK
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# FI_BUILD=0: no FlashInfer build (a Triton-only call, e.g. a latency run that its compile jobs would disturb)
[ "${FI_BUILD:-1}" = 1 ] && python - > "$DEST/fi_build.log" 2>&1 <<'PY' &
import logging, time, torch
logging.basicConfig(level=logging.INFO)
from radixlm.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
t = time.time()
b = FlashInferAttnBackend(32, 8, 128, torch.bfloat16, torch.bfloat16, torch.zeros(2, 8, dtype=torch.int32, device="cuda"),
                          1024, 8, torch.device("cuda"))
b.warmup()
print(f"flashinfer build+warmup {time.time() - t:.1f} s")
PY
FI=$!
fi_ready() { [ "$1" != flashinfer ] && return 0; wait $FI 2> /dev/null; tail -1 "$DEST/fi_build.log"; }
stage() { [[ " $STAGES " == *" $1 "* ]]; }
pack() { tar czf "$DEST/$1.tgz" -C /tmp/r "$1" 2> /dev/null; }
mkdir -p /tmp/r/{test,decode,offline,serving,programs}
if stage test; then  # what needs no FlashInfer while it builds, then the rest
  echo "== test ($(left) s left)"
  timeout $(left) python -m pytest -q -p no:cacheprovider --tb=short -o faulthandler_timeout=120 -m gpu \
    -k "not flashinfer" 2>&1 | grep -v "Loading\|it/s\]" | tail -60 | tee /tmp/r/test/pytest_gpu.txt
  pack test
  fi_ready flashinfer; echo "== test flashinfer ($(left) s left)"
  timeout $(left) python -m pytest -q -p no:cacheprovider --tb=short -o faulthandler_timeout=120 -m gpu \
    -k flashinfer 2>&1 | grep -v "Loading\|it/s\]" | tail -40 | tee /tmp/r/test/pytest_gpu_flashinfer.txt
  pack test
fi
if stage decode; then
  timeout $(left) python .gpu-bundle/plain_graph_decode.py 1024 512 1,32,128 2>&1 | tee /tmp/r/decode/plain_graph.txt
  for b in $BACKENDS; do
    fi_ready $b; echo "== decode $b ($(left) s left)"
    timeout $(left) python benchmarks/bench_decode.py --model-path $CFG --load-format dummy --tokenizer-path $TOK \
      --attention-backend $b --batch-sizes 1 32 128 --context 512 --eager --mixed ${MIXED:-32:512 0:512 128:128} \
      --out /tmp/r/decode/decode_$b.json 2>&1 | grep -v -i warn
    pack decode
  done
fi
if stage offline; then
  fi_ready flashinfer; echo "== offline ($(left) s left)"
  timeout $(left) python benchmarks/bench_offline.py --model-path $CFG --load-format dummy --tokenizer-path $TOK \
    --workload random --num-prompts 256 --input-len 512 --output-len 256 --out /tmp/r/offline/offline_random.json 2>&1 | grep -v -i warn
  pack offline
  timeout $(left) python benchmarks/bench_offline.py --model-path $CFG --load-format dummy --tokenizer-path $TOK \
    --workload sharegpt --num-prompts 1000 --out /tmp/r/offline/offline_sharegpt.json 2>&1 | grep -v -i warn
  pack offline
fi
if stage serving; then
  fi_ready flashinfer; echo "== serving ($(left) s left)"
  timeout $(left) bash benchmarks/gpu/run_serving.sh $TOK /tmp/r/serving/default 2>&1 | tail -8
  pack serving
  EXTRA="--enable-mixed-chunk" timeout $(left) bash benchmarks/gpu/run_serving.sh $TOK /tmp/r/serving/mixed 2>&1 | tail -8
  pack serving
fi
if stage itl; then  # mixed chunked prefill with small chunks: inter-token latency tail at concurrency 32
  case "${ITL_EXTRA:-}" in *"--attention-backend triton"*) ;; *) fi_ready flashinfer;; esac
  for c in ${ITL_CHUNKS:-256}; do
    echo "== serving c32, mixed chunk $c ($(left) s left)"
    EXTRA="--enable-mixed-chunk --chunked-prefill-size $c ${ITL_EXTRA:-}" C32_RUNS=${C32_RUNS:-1} \
      WORKLOADS="${ITL_WORKLOADS:-c32}" timeout $(left) bash benchmarks/gpu/run_serving.sh $TOK /tmp/r/serving/mixed_chunk$c 2>&1 | tail -4
    pack serving
  done
fi
if stage guard; then  # the CPU guard's default: c32 mixed serving with it on and off, GUARD_RUNS runs each
  for mode in auto none; do
    echo "== guard $mode ($(left) s left)"
    EXTRA="--attention-backend triton --enable-mixed-chunk --chunked-prefill-size 256 --scheduler-cpus $mode" \
      C32_RUNS=${GUARD_RUNS:-3} WORKLOADS=c32 timeout $(left) bash benchmarks/gpu/run_serving.sh $TOK \
      /tmp/r/serving/guard_$mode 2>&1 | grep "random-c32"
    pack serving
  done
fi
if stage serve; then  # one server config (SERVE_EXTRA flags) on SERVE_WORKLOADS, into serving/SERVE_LABEL
  case "${SERVE_EXTRA:-}" in *"--attention-backend triton"*) ;; *) fi_ready flashinfer;; esac; echo "== serve ${SERVE_LABEL:-custom} ($(left) s left)"
  EXTRA="${SERVE_EXTRA:-}" WORKLOADS="${SERVE_WORKLOADS:-c32 c1 c128 prefix}" timeout $(left) \
    bash benchmarks/gpu/run_serving.sh $TOK /tmp/r/serving/${SERVE_LABEL:-custom} 2>&1 | tail -12
  pack serving
fi
if stage programs; then  # the program workloads on the 8B shape, radix on/off and plain client, PROG_REPEATS
  fi_ready flashinfer; echo "== programs ($(left) s left)"
  [ -d /tmp/tok_full ] || python benchmarks/gpu/full_vocab_tokenizer.py $TOK /tmp/tok_full 128256 > /dev/null
  timeout $(left) python benchmarks/programs/bench_programs.py --scale ${PROG_SCALE:-32} --threads 64 \
    --repeats ${PROG_REPEATS:-3} --server-args "model_path=$CFG load_format=dummy tokenizer_path=/tmp/tok_full \
    grammar_backend=xgrammar" --out /tmp/r/programs/programs.json --plot /tmp/r/programs/programs.png 2>&1 \
    | grep -v -i "warn\|Loading" | tail -30
  pack programs
fi
if stage profile; then  # kernel time by name at batch 1 and 32: where a decode step goes
  for b in ${PROFILE_BACKENDS:-$BACKENDS}; do
    fi_ready $b; echo "== profile $b ($(left) s left)"
    timeout $(left) python benchmarks/bench_decode.py --model-path $CFG --load-format dummy --tokenizer-path $TOK \
      --attention-backend $b --batch-sizes 1 32 --context 512 --eager --repeats 10 \
      --profile /tmp/r/decode/profile_$b.txt 2>&1 | grep -v -i warn
    pack decode
  done
fi
kill $FI 2> /dev/null
echo "done in $SECONDS s"
