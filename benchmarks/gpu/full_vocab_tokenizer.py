"""A stand-in tokenizer whose every id up to the model's vocabulary decodes to visible text.

The GPU runs use the SmolLM2 tokenizer (49,152 ids) with the Llama-3.1-8B shape (128,256 ids): a sampled id
past 49,151 decodes to nothing, streamed chunks then carry several tokens and per-chunk inter-token latency
means little. This adds one plain token per missing id (" t49152", ...), so each sampled token streams as
its own chunk; prompts tokenize as before (the added strings never occur in them).

    python benchmarks/gpu/full_vocab_tokenizer.py SRC_DIR DST_DIR 128256
"""

import sys

from transformers import AutoTokenizer

src, dst, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(src)
missing = vocab - len(tok)
if missing > 0:
    tok.add_tokens([f" t{i}" for i in range(len(tok), vocab)])
tok.save_pretrained(dst)
print(f"{dst}: {len(tok)} ids ({max(missing, 0)} added)")
