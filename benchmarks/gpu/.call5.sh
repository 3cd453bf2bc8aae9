set -u
source .gpu-bundle/activate
export PYTHONPATH=$PWD:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=$PWD/.fi-cache
python benchmarks/gpu/full_vocab_tokenizer.py .gpu-bundle/tokenizer /tmp/tok_full 128256
python -c "import openai; print('openai', openai.__version__)"
timeout 200 python benchmarks/peers/profile_prefix.py /tmp/tok_full $OUT/trace_random_mixed256.json workload=random gc_ab=true enable_mixed_chunk=true chunked_prefill_size=256 2>&1 | grep "^random" | sed 's/.tokens_mean[^}]*}//g' | cut -c1-700
timeout 330 python benchmarks/programs/bench_programs.py --scale 8 --threads 32 \
  --server-args "model_path=benchmarks/configs/llama-3.1-8b load_format=dummy tokenizer_path=/tmp/tok_full grammar_backend=xgrammar" \
  --out $OUT/programs.json --plot $OUT/programs.png 2>&1 | grep -v -i "warn" | tail -24
