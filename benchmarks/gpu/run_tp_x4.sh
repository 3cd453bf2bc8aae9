#!/usr/bin/env bash
# Issue 32 on one host of four GPUs, in few device calls: stages that share the host's GPUs between runs that
# need fewer of them (every figure names the GPUs it ran on; the runs side by side share only the host's CPUs,
# 64 cores on the lent kinds, and no NVLink pair):
#   first    GPUs 0-1: the tp-2 gpu tests, then the 8B decode at tp 1 and 2 with the plain graph step beside
#            it; GPU 2: the one-GPU gpu suite (everything but the tp tests); then all four: the tp-4 tests
#   pair2    the 70B FP8 serving at tp 2, radixlm on GPUs 0-1 and vLLM (PEER_SITE) on GPUs 2-3 at the same time,
#            same client and workloads (run_tp.sh serve70 / vllm70)
#   four     the same at tp 4 on all four GPUs, radixlm then vLLM
# Usage (device tool): bash benchmarks/gpu/run_tp_x4.sh DEST stage...
set -u
DEST=$1; shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
here=benchmarks/gpu
mkdir -p "$DEST"
bundle() {  # the bundle's Python with this tree on its path (run_tp.sh sets up its own)
  source .gpu-bundle/activate
  export PYTHONPATH=$PWD:$PYTHONPATH RADIXLM_TEST_TOKENIZER=$PWD/.gpu-bundle/tokenizer
}
for stage in "$@"; do
  case $stage in
  first)
    (
      bundle
      CUDA_VISIBLE_DEVICES=2 timeout 420 python -m pytest -q -m gpu tests --ignore tests/gpu/test_tp_cuda.py \
        -p no:cacheprovider --tb=short 2>&1 | grep -v -i warn | tail -40 > "$DEST/pytest_one_gpu.txt"
    ) &
    one=$!
    CUDA_VISIBLE_DEVICES=0,1 TPS="1 2" BUDGET=${BUDGET_FIRST:-420} bash $here/run_tp.sh "$DEST/tp2" test decode
    wait $one
    tail -3 "$DEST/pytest_one_gpu.txt"
    (
      bundle
      t=tests/gpu/test_tp_cuda.py
      timeout 240 python -m pytest -q -m gpu "$t::test_bf16_logits_within_one_gpus_rounding[4]" \
        "$t::test_fp32_greedy_identical_to_one_gpu_with_graphs_eager_and_overlap[4]" 2>&1 | grep -v -i warn |
        tail -15 | tee "$DEST/pytest_tp4.txt"
    )
    ;;
  pair2)
    CUDA_VISIBLE_DEVICES=0,1 TPS=2 bash $here/run_tp.sh "$DEST/r2" serve70 &
    r=$!
    CUDA_VISIBLE_DEVICES=2,3 TPS=2 PORT=30102 bash $here/run_tp.sh "$DEST/v2" vllm70
    wait $r
    ;;
  four)
    TPS=4 bash $here/run_tp.sh "$DEST/r4" serve70
    TPS=4 bash $here/run_tp.sh "$DEST/v4" vllm70
    ;;
  *) echo "unknown stage $stage" ;;
  esac
done
