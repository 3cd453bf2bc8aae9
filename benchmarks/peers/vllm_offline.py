"""vLLM's offline API on the same prompts as benchmarks/bench_offline.py (same token ids, same output lengths,
greedy, ignore_eos): the peer row of the offline comparison. Runs in the peer's environment (PYTHONPATH holding
the wheelhouse install, see README.md), so it imports nothing of ours but benchmarks/workloads.py.

    python benchmarks/peers/vllm_offline.py --model-path benchmarks/configs/llama-3.1-8b --tokenizer-path TOK \\
        --workload random --num-prompts 256 --input-len 512 --output-len 256 --out DEST/vllm_offline_random.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workloads import offline_report, offline_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tokenizer-path", required=True)
    ap.add_argument("--workload", choices=("random", "sharegpt"), default="random")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=args.model_path,
        tokenizer=args.tokenizer_path,
        load_format="dummy",
        dtype="bfloat16",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        seed=0,
    )
    llm = LLM(**kwargs)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    data = offline_workload(args, vocab)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in data]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in data]
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()  # the timed run starts cold, like ours after flush_cache
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    offline_report(
        args,
        data,
        sum(len(o.outputs[0].token_ids) for o in outs),
        elapsed,
        label="vllm ",
        engine="vllm",
        version=vllm.__version__,
        device=torch.cuda.get_device_name(),
        engine_args={k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")},
    )


if __name__ == "__main__":
    main()
