"""Our forward vs transformers' on CUDA in bf16, tiny random Llama (and the other architectures).

    python benchmarks/gpu/check_cuda_logits.py --tokenizer DIR
Prints the relative norm error of the logits against a float32 transformers reference on the same GPU.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import radixlm  # noqa: E402
from tests.helpers import forward_logits, hf_logits, make_tiny_checkpoint  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tokenizer", required=True)
ap.add_argument("--out", default=None)
args = ap.parse_args()
tok = AutoTokenizer.from_pretrained(args.tokenizer)
ids = tok("The quick brown fox jumps over the lazy dog, and then some more words follow here.")["input_ids"] * 4
rows = []
for arch in ("llama", "mistral", "qwen2", "qwen3"):
    d = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / arch, arch, tokenizer=tok, tie=arch == "qwen3")
    ref_model, ref32 = hf_logits(d, ids, dtype=torch.float32, device="cuda")
    _, ref16 = hf_logits(d, ids, dtype=torch.bfloat16, device="cuda")
    engine = radixlm.Engine(str(d), dtype="bfloat16", device="cuda", log_level="warning", max_total_tokens=4096)
    ours = forward_logits(engine, ids)
    split = forward_logits(engine, ids, split=len(ids) // 3)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    row = {"arch": arch, "tokens": len(ids), "ours_bf16_vs_hf_fp32": rel(ours, ref32),
           "hf_bf16_vs_hf_fp32": rel(ref16, ref32), "two_extends_vs_one": rel(split, ours),
           "argmax_agree_fp32": (ours.argmax(-1) == ref32.argmax(-1)).float().mean().item()}
    rows.append(row)
    print(json.dumps(row))
if args.out:
    Path(args.out).write_text(json.dumps(rows, indent=2))
