"""The tokenizer's vocabulary as the raw bytes each token stands for, which grammar engines match against.

Byte-level BPE vocabularies (GPT-2 style, SmolLM2, Llama 3, Qwen) spell bytes with printable stand-in
characters; SentencePiece ones use '▁' for a space and <0xNN> for byte fallback. Special tokens are left out:
they never match grammar text (EOS is handled by the engines on its own)."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """Stand-in character -> byte of byte-level BPE: printable Latin-1 bytes stand for themselves, the other
    bytes are shifted to code points from 256 upward, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


@dataclass
class TokenBytes:
    by_id: dict[int, bytes]  # every ordinary token's bytes
    special_ids: set[int]
    size: int  # the tokenizer's token count


@functools.lru_cache(maxsize=4)
def _token_bytes_cached(tokenizer_id: int, tokenizer) -> TokenBytes:
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    byte_level = _is_byte_level(tokenizer)
    dec = _byte_level_decoder()
    by_id = {}
    for text, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if byte_level:
            try:
                by_id[i] = bytes(dec[c] for c in text)
            except KeyError:  # an added, non-special token spelled in plain text
                by_id[i] = text.encode()
        elif text.startswith("<0x") and text.endswith(">") and len(text) == 6:
            by_id[i] = bytes([int(text[3:5], 16)])
        else:
            by_id[i] = text.replace("\u2581", " ").encode()
    return TokenBytes(by_id, special, len(tokenizer))


def token_bytes(tokenizer) -> TokenBytes:
    return _token_bytes_cached(id(tokenizer), tokenizer)
