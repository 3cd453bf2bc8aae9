"""Long prompts are tokenized on the tokenizer manager's own thread, so the event loop keeps streaming other
requests' tokens meanwhile; short ones stay inline; errors reach the request either way."""

import asyncio
import concurrent.futures
import threading

import pytest

from radixlm.srt.errors import InvalidRequest
from radixlm.srt.managers.tokenizer_manager import TokenizerManager
from tests.helpers import smollm_tokenizer


class _Recording:
    """The real tokenizer, noting which thread each call ran on."""

    def __init__(self, tok):
        self.tok, self.threads = tok, []

    def __call__(self, *a, **kw):
        self.threads.append(threading.current_thread().name)
        return self.tok(*a, **kw)


def _manager(tok) -> TokenizerManager:
    tm = TokenizerManager.__new__(TokenizerManager)  # only the tokenizing half: no sockets, no child processes
    tm.tokenizer = tok
    tm._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    return tm


def test_long_prompts_tokenize_off_the_loop():
    real = smollm_tokenizer()
    rec = _Recording(real)
    tm = _manager(rec)
    long_text = "The quick brown fox jumps over the lazy dog. " * 40
    short = "Hello there"

    async def run():
        ticks = 0

        async def ticker():  # the loop stays free to run other work while the long prompt is tokenized
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        got = await tm.tokenize_many([long_text, [5, 6, 7]])
        inline = await tm.tokenize_many([short])
        t.cancel()
        return got, inline, ticks

    got, inline, ticks = asyncio.run(run())
    assert got[0] == (real(long_text, add_special_tokens=True)["input_ids"], long_text)
    assert got[1] == ([5, 6, 7], None)
    assert inline[0][0] == real(short, add_special_tokens=True)["input_ids"]
    assert rec.threads[0].startswith("tokenize") and rec.threads[1] == threading.current_thread().name
    assert ticks > 0
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        asyncio.run(tm.tokenize_many([long_text + "\ud800"]))
