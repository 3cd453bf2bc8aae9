#!/usr/bin/env bash
# GPU runs for the fast path, in stages that each leave their results in DEST (the device tool's $OUT) as soon as
# they finish, so a call cut off at its time limit still returns what it measured:
#   test     Triton kernels, backends, scheduler and model tests on CUDA (tiny checkpoints)
#   check    every attention backend vs transformers and each other; graphs vs eager, overlap on/off, mixed
#   decode   decode step times per backend (graphs + eager) beside the plain PyTorch CUDA-graph step
#   ab       batch-1/32 decode with a switch (AB_ENV, default RADIXLM_PDL: programmatic dependent launch) on,
#            off, on (AB_ON/AB_OFF: its values, default 1/0), the plain graph step beside; `pdl` is the same stage
#   wake     how late the host wakes after the device's last copy, per way of waiting (wake_latency.py)
#   offline  bench_offline random 256 x 512/256 and ShareGPT-like 1000
#   serving  run_serving.sh (random c1/c32/c128, shared prefix, KV-free check after /flush_cache), mixed chunk
#   cudatests  engine, scheduler, sampler, piecewise tests on CUDA with the SmolLM2 GGUF (CUDATESTS overrides)
#   quicktest  kernel + piecewise-graph + attention-backend tests;  serve  one server config (SERVE_* env)
#   facts    the host: NUMA layout and balancing, huge pages, GPU topology, the busiest processes
#   tailab   the c32 tail per server setting (TAILAB_MODES; default the upload ring vs per-call pinning)
# FlashInfer compiles its kernels in the background from the start (about 280 s on a fresh machine); stages and
# backends that need it wait for it. BUDGET (s, default 570) bounds the whole call; BACKENDS picks backends.
# Usage (device tool): bash benchmarks/gpu/run_fastpath.sh DEST [stages...]
set -u
DEST=$1; shift
STAGES=${*:-test check decode}
BACKENDS=${BACKENDS:-triton torch_native flashinfer}
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
mkdir -p /tmp/r/{test,check,decode,offline,serving}
# Stages run in this order: test check decode ab offline serving cudatests smolcheck fibisect programs wake quicktest serve
# facts tailab itl diag profile
if stage test; then
  echo "== test ($(left) s left)"
  timeout $((BUDGET / 5)) python -m pytest -q -p no:cacheprovider --tb=short tests/kernels tests/srt/test_attention_backends.py \
    2>&1 | tail -40 | tee /tmp/r/test/pytest_kernels.txt
  pack test
  # These engines resolve `auto` to FlashInfer, so they wait for its build; a hung test dumps its stacks.
  fi_ready flashinfer
  timeout $((BUDGET / 5)) python -m pytest -q -p no:cacheprovider --tb=short -o faulthandler_timeout=90 \
    tests/srt/test_model_correctness.py tests/srt/test_scheduler.py 2>&1 | tail -60 | tee /tmp/r/test/pytest_engine.txt
  pack test
fi
if stage check; then
  for b in $BACKENDS; do
    fi_ready $b; echo "== check $b ($(left) s left)"
    timeout $(left) python benchmarks/gpu/check_backends.py --tokenizer $TOK --backends $b \
      --out /tmp/r/check/check_$b.json 2>&1 | grep -v -i "warn\|shards\|loading"
    pack check
  done
fi
if stage decode; then
  timeout $(left) python .gpu-bundle/plain_graph_decode.py 1024 512 1,32,128 2>&1 | tee /tmp/r/decode/plain_graph.txt
  for b in $BACKENDS; do
    fi_ready $b; echo "== decode $b ($(left) s left)"
    timeout $(left) python benchmarks/bench_decode.py --model-path $CFG --load-format dummy --tokenizer-path $TOK \
      --attention-backend $b --batch-sizes 1 32 128 --context 512 --eager --mixed ${MIXED:-32:512 0:512 128:128} \
      --out /tmp/r/decode/decode_$b.json 2>&1 \
      | grep -v -i warn
    pack decode
  done
fi
if stage ab || stage pdl; then  # AB_ENV (default RADIXLM_PDL) =1 / 0 / 1: batch-1/32 decode per backend
  V=${AB_ENV:-RADIXLM_PDL}
  timeout $(left) python .gpu-bundle/plain_graph_decode.py 1024 512 1,32 2>&1 | tee /tmp/r/decode/plain_graph_ab.txt
  for b in ${AB_BACKENDS:-triton flashinfer}; do
    fi_ready $b
    for run in on1 off on2; do
      val=${AB_ON:-1}; [ $run = off ] && val=${AB_OFF:-0}
      echo "== ab $V=$val $b ($(left) s left)"
      env $V=$val timeout $(left) python benchmarks/bench_decode.py --model-path $CFG --load-format dummy \
        --tokenizer-path $TOK --attention-backend $b --batch-sizes 1 32 --context 512 \
        --out /tmp/r/decode/ab_${V}_${run}_$b.json 2>&1 | grep -v -i "warn\|skinny"
    done
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
if stage cudatests; then  # the engine/scheduler/server tests on CUDA with the real SmolLM2 GGUF (joined beforehand)
  fi_ready flashinfer; echo "== cudatests ($(left) s left)"
  ls -la ~/.cache/radixlm/models/ 2>&1 | tail -2
  timeout ${CUDATESTS_S:-300} python -m pytest -q -p no:cacheprovider --tb=short -o faulthandler_timeout=150 \
    ${CUDATESTS:-tests/srt/test_engine.py tests/srt/test_scheduler.py tests/srt/test_sampler.py tests/srt/test_piecewise.py tests/srt/test_extend_graph.py} \
    -k "not clean_cache_dir" 2>&1 | grep -v "Loading\|it/s\]" > /tmp/r/test/pytest_cuda_engine.txt
  tail -30 /tmp/r/test/pytest_cuda_engine.txt
  pack test
fi
if stage smolcheck; then  # SmolLM2 (head 64, GQA group 3) on CUDA per backend and dtype vs the CPU engine
  fi_ready flashinfer; echo "== smolcheck ($(left) s left)"
  timeout $(left) python benchmarks/gpu/smol_cuda_check.py --out /tmp/r/test/smol_cuda_check.json 2>&1 \
    | grep -v "Loading\|it/s\]\|warn"
  pack test
fi
if stage fibisect; then  # which SmolLM2 prompts FlashInfer gets wrong (vs Triton), graphs and prefill backends
  fi_ready flashinfer; echo "== fibisect ($(left) s left)"
  timeout $(left) python benchmarks/gpu/fi_bisect.py --out /tmp/r/test/fi_bisect.json 2>&1 | grep -v "Loading\|it/s\]"
  pack test
fi
if stage programs; then  # issue 10's program workloads on the 8B shape, radix on/off and plain client, PROG_REPEATS
  fi_ready flashinfer; echo "== programs ($(left) s left)"; mkdir -p /tmp/r/programs
  [ -d /tmp/tok_full ] || python benchmarks/gpu/full_vocab_tokenizer.py $TOK /tmp/tok_full 128256 > /dev/null
  timeout $(left) python benchmarks/programs/bench_programs.py --scale ${PROG_SCALE:-32} --threads 64 \
    --repeats ${PROG_REPEATS:-3} --server-args "model_path=$CFG load_format=dummy tokenizer_path=/tmp/tok_full \
    grammar_backend=xgrammar" --out /tmp/r/programs/programs.json --plot /tmp/r/programs/programs.png 2>&1 \
    | grep -v -i "warn\|Loading" | tail -30
  tar czf "$DEST/programs.tgz" -C /tmp/r programs 2> /dev/null
fi
if stage wake; then  # how late the host wakes after the device's last copy, per way of waiting
  echo "== wake ($(left) s left)"
  timeout $(left) python benchmarks/gpu/wake_latency.py --out /tmp/r/decode/wake_latency.json 2>&1 | tail -8
  pack decode
fi
if stage quicktest; then  # the kernel and piecewise-graph tests only (no GGUF needed)
  echo "== quicktest ($(left) s left)"
  timeout $((BUDGET / 4)) python -m pytest -q -p no:cacheprovider --tb=short tests/kernels tests/srt/test_piecewise.py \
    tests/srt/test_attention_backends.py tests/srt/test_extend_graph.py tests/srt/test_host_transfer.py 2>&1 | tail -30 \
    | tee /tmp/r/test/pytest_quick.txt
  pack test
fi
if stage serve; then  # one server config (SERVE_EXTRA flags) on SERVE_WORKLOADS, into serving/SERVE_LABEL
  case "${SERVE_EXTRA:-}" in *"--attention-backend triton"*) ;; *) fi_ready flashinfer;; esac; echo "== serve ${SERVE_LABEL:-custom} ($(left) s left)"
  EXTRA="${SERVE_EXTRA:-}" WORKLOADS="${SERVE_WORKLOADS:-c32 c1 c128 prefix}" timeout $(left) \
    bash benchmarks/gpu/run_serving.sh $TOK /tmp/r/serving/${SERVE_LABEL:-custom} 2>&1 | tail -12
  pack serving
fi
if stage facts; then  # what the host is: NUMA layout and balancing, huge pages, GPU topology, who else runs
  echo "== facts"
  { uname -r; lscpu | grep -i "numa\|model name\|^cpu(s)\|thread"; cat /proc/sys/kernel/numa_balancing
    cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag
    nvidia-smi topo -m; nvidia-smi -q | grep -i "persistence\|bus id"
    ps -eo pid,pcpu,rss,comm --sort=-pcpu | head -15; } 2>&1 | tee /tmp/r/serving/facts.txt
  { cat /proc/interrupts /proc/softirqs; ps -eLo pid,tid,psr,pcpu,comm --sort=-pcpu | head -40; } \
    >> /tmp/r/serving/facts.txt 2>&1
fi
if stage tailab; then  # c32 tail per server setting, servers alternating (TAILAB_ROUNDS, C32_RUNS)
  # TAILAB_MODES: label:VAR=value,--flag=value,... (environment and server flags; default: the upload ring vs
  # per-call pinning). TAILAB_TRACE=0: no step trace (its stall watcher takes the GIL every 2 ms); a mode's own
  # TRACE=0/1 overrides it
  for r in $(seq ${TAILAB_ROUNDS:-2}); do
    for spec in ${TAILAB_MODES:-ring:RADIXLM_UPLOAD=ring pin:RADIXLM_UPLOAD=pin}; do
      mode=${spec%%:*}; envs=""; flags=""; echo "== tailab $mode$r ($(left) s left)"
      for tok in $(echo "${spec#*:}" | tr , ' '); do
        case $tok in --*) flags="$flags $tok";; *) envs="$envs $tok";; esac
      done
      env C32_RUNS=${C32_RUNS:-2} TRACE=${TAILAB_TRACE:-1} $envs EXTRA="${SERVE_EXTRA:---attention-backend triton \
        --enable-mixed-chunk --chunked-prefill-size 256}$flags" WORKLOADS=c32 timeout $(left) \
        bash benchmarks/gpu/run_serving.sh $TOK /tmp/r/serving/tailab_$mode$r 2>&1 \
        | grep "random-c32\|CPU guard\|stalls:\|^  [a-z_]* [0-9]\|hiccup"
      grep -h "moved off\|pinned to" /tmp/r/serving/tailab_$mode$r/server.log | cut -c1-200
      pack serving
    done
  done
fi
if stage itl; then  # mixed chunked prefill with small chunks: inter-token latency tail at concurrency 32
  fi_ready flashinfer
  for c in ${ITL_CHUNKS:-512 1024}; do
    echo "== serving c32, mixed chunk $c ($(left) s left)"
    EXTRA="--enable-mixed-chunk --chunked-prefill-size $c" WORKLOADS="${ITL_WORKLOADS:-c32 c128}" timeout $(left) \
      bash benchmarks/gpu/run_serving.sh $TOK /tmp/r/serving/mixed_chunk$c 2>&1 | tail -4
    pack serving
  done
fi
if stage diag; then  # overlap on/off: batch-shape numerics or a scheduling bug?
  for b in ${DIAG_BACKENDS:-flashinfer triton}; do
    fi_ready $b; echo "== diag overlap $b ($(left) s left)"
    timeout $(left) python benchmarks/gpu/diag_overlap.py $TOK $b 2>&1 | grep -v -i "warn\|shards\|loading" \
      | tee -a /tmp/r/check/diag_overlap.txt
    pack check
  done
fi
if stage profile; then  # kernel time by name at batch 1 and 32: where a decode step goes
  for b in ${PROFILE_BACKENDS:-flashinfer triton}; do
    fi_ready $b; echo "== profile $b ($(left) s left)"
    timeout $(left) python benchmarks/bench_decode.py --model-path $CFG --load-format dummy --tokenizer-path $TOK \
      --attention-backend $b --batch-sizes 1 32 --context 512 --eager --repeats 10 \
      --profile /tmp/r/decode/profile_$b.txt 2>&1 | grep -v -i warn
    pack decode
  done
fi
kill $FI 2> /dev/null
echo "done in $SECONDS s"
