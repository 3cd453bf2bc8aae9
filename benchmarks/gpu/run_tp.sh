#!/usr/bin/env bash
# Tensor parallelism on one host of several GPUs (issue 32), in stages that each leave their results in DEST as
# soon as they finish (TPS: the tp sizes to run, default every power of two up to the GPUs there):
#   test      the gpu suite's tensor-parallel tests (NCCL, graphs on/off, overlap on/off, fp8, a killed rank)
#   decode    bench_decode on the 8B shape, bf16, at each tp (batch 1/32/128, context 512), NCCL share of a
#             step; the plain PyTorch graph step on one GPU beside it
#   decode8   the same in fp8 (fp8 LM head)
#   nccl      decode and decode8 at each tp > 1 with --disable-custom-all-reduce (NCCL all-reduces and separate
#             norms: the fused all-reduce + norm's A/B), files *_nccl_tp*.json
#   arbench   the fused all-reduce + norm kernel against NCCL + the norm kernel, per call, at each tp > 1
#   profile70 bench_decode on the 70B shape in fp8 at each tp > 1, batch 64 at context 1,500 (the serve70 runs'
#             steady state): step time and a kernel-time table (attention, GEMMs, NCCL) per rank-0 step; KVTP
#             fp8_e4m3 profiles the serve70 runs' KV pool (files *_kv8_*; default: the model's bf16); DEXTRA
#             with --disable-custom-all-reduce: NCCL and the norm kernels (files *_nccl_*)
#   serve70   radixlm serve on the 70B shape in fp8 at each tp > 1: 64 users, 512 in / 256 out then
#             1,000 in / 1,000 out, random words (about a token each with the full-vocabulary tokenizer); the KV
#             pool in KVTP (default fp8_e4m3, as the one-GPU runs; auto: the model's bf16, the files without _kv8)
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

decode() {  # decode QUANT NAME TP (HEAD=--fp8-lm-head, DEXTRA: more bench_decode flags)
  local q=$1 name=$2 tp=$3
  echo "== decode 8b $q ${HEAD:-} ${DEXTRA:-} tp $tp ($(left) s left)"
  timeout "$(cap 240)" python benchmarks/bench_decode.py --model-path benchmarks/configs/llama-3.1-8b \
    --load-format dummy --tokenizer-path "$TOK" --attention-backend triton --quantization "$q" ${HEAD:-} \
    --batch-sizes 1 32 128 --context 512 --extend-cuda-graph off --tp-size "$tp" ${DEXTRA:-} \
    --out "$DEST/${name}_tp$tp.json" 2>&1 | grep -v -i warn | grep -v "skinny matmul:" | tail -6
}

source benchmarks/gpu/serve_lib.sh  # serve CONFIG QUANT TP NAME WORKLOADS..., report JSON

if stage test; then
  timeout "$(cap 420)" python -m pytest -q -m gpu tests/gpu/test_tp_cuda.py tests/gpu/test_allreduce_norm_cuda.py 2>&1 | grep -v -i warn | tail -25 |
    tee "$DEST/pytest_tp.txt"
fi
if stage arbench; then
  for tp in $TPS; do
    [ "$tp" -gt 1 ] || continue
    echo "== all-reduce + norm per call, tp $tp ($(left) s left)"
    timeout "$(cap 180)" python benchmarks/gpu/bench_allreduce_norm.py --world "$tp" --out "$DEST/arnorm_tp$tp.json" 2>&1 |
      grep -v -i warn | tail -16
  done
fi
if stage decode; then
  timeout "$(cap 60)" python .gpu-bundle/plain_graph_decode.py 1024 512 1,32,128 2>&1 | tail -4 | tee "$DEST/plain_graph.txt"
  for tp in $TPS; do decode none decode8b_bf16 "$tp"; done
fi
WORKTP=${WORKTP:-512:256:128 1000:1000:128}  # the serve70 and vllm70 workloads
if stage serve70; then
  for tp in $TPS; do
    [ "$tp" -gt 1 ] || continue
    kv=${KVTP:-fp8_e4m3}; tag=""; [ "$kv" = fp8_e4m3 ] && tag=_kv8
    HEAD=--fp8-lm-head EXTRA="--kv-cache-dtype $kv ${EXTRA:-}" serve benchmarks/configs/llama-3.1-70b fp8 "$tp" \
      "llama70b_fp8${tag}_tp$tp" $WORKTP
  done
fi
if stage vllm70; then
  for tp in $TPS; do
    [ "$tp" -gt 1 ] || continue
    ENGINE=vllm serve benchmarks/configs/llama-3.1-70b fp8 "$tp" "vllm70b_fp8_tp$tp" $WORKTP
  done
fi
if stage decode8; then
  for tp in $TPS; do HEAD=--fp8-lm-head decode fp8 decode8b_fp8_head "$tp"; done
fi
if stage nccl; then
  for tp in $TPS; do
    [ "$tp" -gt 1 ] || continue
    DEXTRA=--disable-custom-all-reduce decode none decode8b_bf16_nccl "$tp"
    HEAD=--fp8-lm-head DEXTRA=--disable-custom-all-reduce decode fp8 decode8b_fp8_head_nccl "$tp"
  done
fi
if stage profile70; then
  for tp in $TPS; do
    [ "$tp" -gt 1 ] || continue
    kv=${KVTP:-auto}; tag=""; [ "$kv" = fp8_e4m3 ] && tag=_kv8
    [[ "${DEXTRA:-}" == *--disable-custom-all-reduce* ]] && tag=${tag}_nccl
    echo "== profile 70b fp8 kv $kv ${DEXTRA:-} tp $tp ($(left) s left)"
    timeout "$(cap 300)" python benchmarks/bench_decode.py --model-path benchmarks/configs/llama-3.1-70b \
      --load-format dummy --tokenizer-path "$TOK" --attention-backend triton --quantization fp8 --fp8-lm-head \
      --kv-cache-dtype "$kv" --batch-sizes ${PBS:-1 64} --context 1500 --extend-cuda-graph off --tp-size "$tp" ${DEXTRA:-} \
      --profile "$DEST/profile70${tag}_tp$tp.txt" --out "$DEST/profile70${tag}_tp$tp.json" 2>&1 | grep -v -i warn |
      grep -v "skinny matmul:" | tail -4
    grep -A14 "^timeline" "$DEST/profile70${tag}_tp$tp.txt"
  done
fi
if stage prefix; then
  for tp in ${PREFIX_TPS:-1 2}; do PREFIX=1 serve benchmarks/configs/llama-3.1-8b none "$tp" "llama8b_bf16_tp$tp"; done
fi
echo "== done in $SECONDS s"
