#!/usr/bin/env bash
# Speculative decoding (n-gram drafts, issue 34) on one GPU: the gpu tests (greedy answers equal to plain
# decoding with graphs+overlap, eager, no overlap, a JSON schema), then bench_speculative's forced workload on the
# 8B shape with dummy weights (drafts right token by token with probability P, k draft tokens) drafting at every
# batch size, to find where a verify step stops paying; the plain run of the same Engine configuration is the
# anchor in every row. Usage (device tool): bash benchmarks/gpu/run_speculative.sh DEST  (P=0.7 K=4 BATCHES="...")
set -u
DEST=$1
mkdir -p "$DEST"
exec > >(tee -a "$DEST/spec_log.txt") 2>&1
source .gpu-bundle/activate
export PYTHONPATH=$PWD:$PYTHONPATH RADIXLM_TEST_TOKENIZER=$PWD/.gpu-bundle/tokenizer
nvidia-smi --query-gpu=name --format=csv,noheader -i "${CUDA_VISIBLE_DEVICES:-0}"
[ "${SKIP_TESTS:-0}" = 1 ] || timeout 240 python -m pytest -q -m gpu tests/gpu/test_speculative_cuda.py 2>&1 | grep -v -i warn | tail -6 |
  tee "$DEST/pytest_speculative.txt"
# two Engines of the 8B shape share the GPU: a KV pool of 32k tokens each
timeout 300 python benchmarks/bench_speculative.py --model-path benchmarks/configs/llama-3.1-8b --workloads forced \
  --forced-acceptance "${P:-0.7}" --draft-tokens "${K:-4}" --batch-sizes ${BATCHES:-1 4 16 64} --output-len 128 \
  --repeats 2 --out "$DEST/spec_forced_8b.json" --plot "$DEST/spec_forced_8b.png" load_format=dummy \
  tokenizer_path=$PWD/.gpu-bundle/tokenizer attention_backend=triton max_total_tokens=32768 \
  speculative_max_batch_size=1024 2>&1 | grep -v -i warn | tail -8
