#!/usr/bin/env bash
# JSON-schema serving on CPU (SmolLM2), jump-forward on / off, both grammar backends
cd /work/main
export PYTHONPATH=$PWD
for cfg in "outlines:" "outlines:--disable-jump-forward" "xgrammar:" "xgrammar:--disable-jump-forward"; do
  be=${cfg%%:*}; extra=${cfg#*:}
  python -m radixlm serve --port 30222 --grammar-backend $be $extra > /tmp/json_ab_server.log 2>&1 &
  S=$!
  lab="$be${extra:+ nojf}"
  python benchmarks/bench_serving.py --base-url http://127.0.0.1:30222 --dataset json --num-prompts 32 --input-len 64 \
    --output-len 256 --max-concurrency 16 --label "$lab" --out "/tmp/json_ab_${be}${extra:+_nojf}.json" > /dev/null 2>&1
  curl -s localhost:30222/get_server_info | python -c "import json,sys; s=json.load(sys.stdin)['scheduler']; print('$lab', {k: v for k, v in s.items() if 'jump' in k or k in ('steps','decode_steps','extend_steps')}, s.get('grammar'))"
  kill -INT $S; wait $S
done
