#!/usr/bin/env bash
# One device call: Triton kernels and backends tested on CUDA, all backends vs transformers and each other,
# decode step times per backend (graphs and eager) beside the plain PyTorch CUDA-graph step, and the FlashInfer
# modules it compiled packed into $DEST (parts under 16 MB) for later calls to carry back (.fi-cache), where they
# are installed as FlashInfer's AOT modules, which load without ninja. Small results go to $DEST/results.tgz.
# Usage (device tool): bash benchmarks/gpu/run_fastpath.sh DEST [stages...]
#   stages: test check decode pack (the default), offline, serving
set -u
DEST=$1; shift
STAGES=${*:-test check decode pack}
OUT=/tmp/results; mkdir -p $OUT
source .gpu-bundle/activate
TOK=.gpu-bundle/tokenizer
CFG=benchmarks/configs/llama-3.1-8b
export MAX_JOBS=16
if ls .fi-cache/fi.tgz.* > /dev/null 2>&1; then  # modules compiled by an earlier call
  AOT=$(python -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)")
  mkdir -p "$AOT" && cat .fi-cache/fi.tgz.* | tar xzf - -C "$AOT" && echo "flashinfer modules restored: $(ls $AOT | wc -l)"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# FlashInfer compiles while the Triton tests run.
python - > "$OUT/fi_build.log" 2>&1 <<'PY' &
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
case " $STAGES " in *" test "*)
  python -m pytest -q -p no:cacheprovider tests/kernels tests/srt/test_attention_backends.py 2>&1 | tail -4 ;; esac
wait $FI; tail -2 "$OUT/fi_build.log"
case " $STAGES " in *" check "*)
  python benchmarks/gpu/check_backends.py --tokenizer $TOK --out "$OUT/check_backends.json" 2>&1 | grep -v -i "warn\|shards\|loading" ;; esac
case " $STAGES " in *" decode "*)
  for b in flashinfer triton; do
    python benchmarks/bench_decode.py --model-path $CFG --load-format dummy --tokenizer-path $TOK \
      --attention-backend $b --batch-sizes 1 32 128 --context 512 --eager --out "$OUT/decode_$b.json" 2>&1 | grep -v -i warn
  done
  python benchmarks/bench_decode.py --model-path $CFG --load-format dummy --tokenizer-path $TOK \
    --attention-backend torch_native --batch-sizes 1 32 128 --context 512 --out "$OUT/decode_torch_native.json" 2>&1 | grep -v -i warn
  python .gpu-bundle/plain_graph_decode.py 1024 512 1,32,128 2>&1 | tee "$OUT/plain_graph.txt" ;; esac
case " $STAGES " in *" offline "*)
  python benchmarks/bench_offline.py --model-path $CFG --load-format dummy --tokenizer-path $TOK --workload random \
    --num-prompts 256 --input-len 512 --output-len 256 --out "$OUT/offline_random.json" 2>&1 | grep -v -i warn
  python benchmarks/bench_offline.py --model-path $CFG --load-format dummy --tokenizer-path $TOK --workload sharegpt \
    --num-prompts 1000 --out "$OUT/offline_sharegpt.json" 2>&1 | grep -v -i warn ;; esac
case " $STAGES " in *" serving "*)
  bash benchmarks/gpu/run_serving.sh $TOK $OUT 2>&1 | tail -8
  EXTRA="--enable-mixed-chunk" bash benchmarks/gpu/run_serving.sh $TOK $OUT/mixed 2>&1 | tail -8 ;; esac
case " $STAGES " in *" pack "*)
  OPS=$(ls -d ~/.cache/flashinfer/*/*/cached_ops 2> /dev/null | head -1)
  [ -n "$OPS" ] && (cd "$OPS" && tar czf - */*.so) | split -b 15M - "$DEST/fi.tgz." ;; esac
tar czf "$DEST/results.tgz" -C $OUT . && ls -la "$DEST"
