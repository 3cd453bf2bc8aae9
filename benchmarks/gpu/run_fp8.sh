#!/usr/bin/env bash
# FP8 runs on one GPU (issue 30), in stages that each leave their results in DEST as soon as they finish:
#   test     the gpu suite's FP8 tests (kernels compiled, fp8 logits vs bf16, greedy across graphs/eager/overlap)
#   kernels  bench_fp8_mm.py: every skinny FP8 candidate per projection of
#            the 8B and 70B shapes (KSHAPES) at batch 1-256 (KBATCHES), beside the bf16 weight's best
#   decode8  bench_decode on the 8B shape, bf16, fp8, fp8 with the LM head too, and that with an e4m3 KV pool
#            (triton backend), beside the plain PyTorch graph step
#   kv8      the 8B shape in fp8 (fp8 head), bf16 KV then fp8 KV, context 2048
#   decode70 bench_decode on the 70B shape in fp8 at batch 1 and 8, the LM head fp8 then bf16 (fits one 80 GB card)
#   profile8 the 8B shape in fp8 (fp8 head) at batch 1, profiled: a kernel-time table per step (DEST/profile8.txt)
#   profile70 the 70B shape in fp8 (fp8 head) at batch 1 and 8, profiled: a kernel-time table per step (DEST/profile70.txt)
#   steady70 the 70B shape in fp8 (fp8 head, e4m3 pool) at batch 1, 64 and 160 (STEADY_BATCHES) at context 1,500,
#            profiled: the serving runs' steady decode step (DEST/steady70.txt)
#   ab70     the 70B fp8 step at batch 1 and 8 from BEFORE (default .before: tools/export_rev.sh REV, carried) and
#            from this tree, in turn, twice: a change's effect on one machine
#   offline8 bench_offline on the 8B shape, 256 prompts x 512 in / 256 out, bf16 then fp8 (fp8 head)
#   serve70  radixlm serving the 70B shape in fp8 (fp8 head, KV70: the pool's dtype, default fp8_e4m3) on this one
#            GPU: 1,000 in / 1,000 out, 64 users (128 prompts), then 256 users at once (256 prompts) (EXTRA70: more
#            server flags, TAG70 appended to the file names)
#   vllm70   vLLM (PEER_SITE) on the same runs, `--quantization fp8 --load-format dummy` (VLLM_EXTRA: more flags)
# Usage (device tool): bash benchmarks/gpu/run_fp8.sh DEST [stages...]; BUDGET (s, default 570) bounds the call.
set -u
DEST=$1; shift
STAGES=${*:-test kernels decode8}
BUDGET=${BUDGET:-570}
exec > >(tee -a "$DEST/log.txt") 2>&1
left() { local n=$((BUDGET - SECONDS)); echo $((n > 1 ? n : 1)); }
cap() { local n; n=$(left); echo $(($1 < n ? $1 : n)); }  # cap SECONDS: at most that, at most what is left
stage() { [[ " $STAGES " == *" $1 "* ]]; }
source .gpu-bundle/activate
export PYTHONPATH=$PWD:$PYTHONPATH
TOK=$PWD/.gpu-bundle/tokenizer
export RADIXLM_TEST_TOKENIZER=$TOK
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
source benchmarks/gpu/serve_lib.sh
# decode CONFIG QUANT OUTNAME BATCHES... (HEAD=--fp8-lm-head: fp8 head; KV=fp8_e4m3: fp8 pool; PROFILE=FILE: a
# kernel-time table per batch; ROOT=DIR: the runtime of another tree, e.g. tools/export_rev.sh's)
decode() {
  local cfg=$1 q=$2 name=$3 root=${ROOT:-$PWD}; shift 3
  echo "== decode $cfg $q ${HEAD:-} kv ${KV:-auto} ctx ${CONTEXT:-512} from $root ($(left) s left)"
  PYTHONPATH=$root:$PYTHONPATH timeout $(left) python "$root/benchmarks/bench_decode.py" --model-path $cfg \
    --load-format dummy --tokenizer-path $TOK --attention-backend triton --quantization $q ${HEAD:-} \
    --kv-cache-dtype ${KV:-auto} --batch-sizes "$@" --context ${CONTEXT:-512} --extend-cuda-graph off \
    ${PROFILE:+--profile "$PROFILE"} --out "$DEST/$name.json" 2>&1 | grep -v -i warn | grep -v "skinny matmul:" |
    tail -12
}
if stage test; then
  timeout $(left) python -m pytest -q -m gpu tests/kernels/test_kernels.py tests/gpu/test_fp8_cuda.py -k fp8 2>&1 |
    grep -v -i warn | tail -15 | tee "$DEST/pytest_fp8.txt"
fi
if stage kernels; then
  timeout $(left) python benchmarks/gpu/bench_fp8_mm.py --shapes ${KSHAPES:-8b 70b} --batches ${KBATCHES:-1 8 16 32 64 128 256} \
    --out "$DEST" 2>&1 |
    grep -v -i warn
fi
if stage decode8; then
  timeout $(left) python .gpu-bundle/plain_graph_decode.py 1024 512 1,32,128 2>&1 | tail -6 | tee "$DEST/plain_graph.txt"
  decode benchmarks/configs/llama-3.1-8b none decode8b_bf16 1 32 128
  decode benchmarks/configs/llama-3.1-8b fp8 decode8b_fp8 1 32 128
  HEAD=--fp8-lm-head decode benchmarks/configs/llama-3.1-8b fp8 decode8b_fp8_head 1 32 128
  KV=fp8_e4m3 HEAD=--fp8-lm-head decode benchmarks/configs/llama-3.1-8b fp8 decode8b_fp8_head_kv8 1 32 128
fi
if stage kv8; then  # the 8B shape in fp8 with the fp8 head, bf16 pool then e4m3 pool, at a longer context
  CONTEXT=2048 HEAD=--fp8-lm-head decode benchmarks/configs/llama-3.1-8b fp8 decode8b_fp8_head_ctx2048 1 32 128
  CONTEXT=2048 KV=fp8_e4m3 HEAD=--fp8-lm-head decode benchmarks/configs/llama-3.1-8b fp8 decode8b_fp8_kv8_ctx2048 1 32 128
fi
if stage decode70; then  # HEADS70="fp8": the fp8 head only
  HEAD=--fp8-lm-head decode benchmarks/configs/llama-3.1-70b fp8 decode70b_fp8_head 1 8
  [[ "${HEADS70:-fp8 bf16}" == *bf16* ]] && decode benchmarks/configs/llama-3.1-70b fp8 decode70b_fp8 1 8
fi
if stage profile8; then
  PROFILE=$DEST/profile8.txt HEAD=--fp8-lm-head decode benchmarks/configs/llama-3.1-8b fp8 profile8 1
  grep -A16 "^timeline" "$DEST/profile8.txt"
fi
if stage profile70; then
  PROFILE=$DEST/profile70.txt HEAD=--fp8-lm-head decode benchmarks/configs/llama-3.1-70b fp8 profile70 1 8
  grep -A16 "^timeline" "$DEST/profile70.txt"
fi
if stage steady70; then
  CONTEXT=1500 KV=fp8_e4m3 PROFILE=$DEST/steady70.txt HEAD=--fp8-lm-head \
    decode benchmarks/configs/llama-3.1-70b fp8 steady70 ${STEADY_BATCHES:-1 64 160}
  grep -A14 "^timeline" "$DEST/steady70.txt"
fi
if stage ab70; then
  before=$PWD/${BEFORE:-.before}
  [ -d "$before/srt" ] || { echo "ab70: no $before (tools/export_rev.sh REV, then carry it)"; exit 1; }
  echo "ab70: before is $(cat "$before/REV" 2>/dev/null || echo '?')"
  for round in 1 2; do
    ROOT=$before HEAD=--fp8-lm-head decode benchmarks/configs/llama-3.1-70b fp8 "ab70_before_$round" 1 8
    HEAD=--fp8-lm-head decode benchmarks/configs/llama-3.1-70b fp8 "ab70_now_$round" 1 8
  done
fi
if stage offline8; then
  for q in none fp8; do
    echo "== offline 8b $q ($(left) s left)"
    head=""; [ $q = fp8 ] && head=fp8_lm_head=true
    timeout "$(cap 240)" python benchmarks/bench_offline.py --model-path benchmarks/configs/llama-3.1-8b \
      --load-format dummy --tokenizer-path "$TOK" --num-prompts 256 --input-len 512 --output-len 256 \
      --out "$DEST/offline8b_$q.json" attention_backend=triton quantization=$q $head 2>&1 | grep -v -i warn | tail -4
  done
fi
WORK70=${WORK70:-1000:1000:128 1000:1000:256:256}  # RADIXLM_STEP_TRACE=DIR: the servers' step records
if stage serve70; then
  HEAD=--fp8-lm-head EXTRA="--kv-cache-dtype ${KV70:-fp8_e4m3} ${EXTRA70:-}" SERVE_CAP=300 \
    serve benchmarks/configs/llama-3.1-70b fp8 1 "llama70b_fp8_kv${KV70:-fp8_e4m3}${TAG70:-}" $WORK70
fi
if stage vllm70; then
  ENGINE=vllm EXTRA="${VLLM_EXTRA:-}" SERVE_CAP=300 serve benchmarks/configs/llama-3.1-70b fp8 1 vllm70b_fp8 $WORK70
fi
