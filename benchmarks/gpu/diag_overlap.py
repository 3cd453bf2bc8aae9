"""Why greedy outputs differ between overlap on and off (FlashInfer): the same prompts in one batch and one
by one, on both schedules. Equal alone but different batched = batch-shape numerics, not a scheduling bug.

    python benchmarks/gpu/diag_overlap.py TOKENIZER_DIR [BACKEND]
"""
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import radixlm  # noqa: E402
from tests.helpers import make_tiny_checkpoint  # noqa: E402

tok = AutoTokenizer.from_pretrained(sys.argv[1])
backend = sys.argv[2] if len(sys.argv) > 2 else "flashinfer"
ids = tok("The quick brown fox jumps over the lazy dog, and then some more words follow here.")["input_ids"] * 6
prompts = [ids[:n] for n in (5, 17, 40, 64, 81, 100, 33, 120)] + [ids[10:90]]
greedy = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
d = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "llama", "llama", tokenizer=tok, hidden_size=512,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=1024,
                         initializer_range=0.02)
base = dict(dtype="bfloat16", device="cuda", log_level="warning", max_total_tokens=8192, attention_backend=backend,
            cuda_graph_max_bs=16)
runs = {}
for name, kw in (("overlap", {}), ("no-overlap", {"disable_overlap_schedule": True}),
                 ("no-overlap-eager", {"disable_overlap_schedule": True, "disable_cuda_graph": True}),
                 ("overlap-eager", {"disable_cuda_graph": True})):
    e = radixlm.Engine(str(d), **base, **kw)
    batched = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=greedy)]
    e.flush_cache()
    alone = []
    for p in prompts:
        alone.append(e.generate(input_ids=p, sampling_params=greedy)["output_ids"])
        e.flush_cache()
    runs[name] = (batched, alone)
    del e
ref_b, ref_a = runs["overlap"]
for name, (b, a) in runs.items():
    print(f"{backend} {name:>16}: batched == overlap-batched {sum(x == y for x, y in zip(b, ref_b))}/9, "
          f"alone == overlap-alone {sum(x == y for x, y in zip(a, ref_a))}/9, "
          f"batched == own alone {sum(x == y for x, y in zip(b, a))}/9", flush=True)
