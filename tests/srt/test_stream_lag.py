"""Streams end whole when the HTTP handler lags behind the scheduler.

The real HTTP app and TokenizerManager, over real ZMQ sockets; in place of the scheduler and detokenizer, a
socket peer that answers each request with all of its updates in one message. The tokenizer manager then
queues every update of a request (text deltas, logprobs, the final one) before any handler wakes: the lag a
busy GPU server shows when two updates of one stream reach the HTTP process between two wake-ups of its
handler, made deterministic. Every route must still send each delta, each logprob and one finish per answer.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from radixlm.srt.entrypoints.http_server import create_app
from radixlm.srt.managers.io_struct import BatchStrOutput, FinishReason, GenerateReq, SchedulerIn, TokenOutput
from radixlm.srt.managers.tokenizer_manager import TokenizerManager
from radixlm.srt.metrics import Metrics
from radixlm.srt.server_args import ServerArgs
from tests.helpers import smollm_tokenizer

PIECES = ["Hel", "lo", " there", "!"]  # one delta per update, one token each
STOP = FinishReason.stop(2)


@pytest.fixture(scope="module")
def tokenizer():
    return smollm_tokenizer()


def _updates(msg: GenerateReq, pieces: list[str], finish: FinishReason) -> list[TokenOutput]:
    """A request's whole life as updates: one per piece, the last carrying the finish reason."""
    outs = []
    for k, piece in enumerate(pieces):
        tid = 1000 + k
        lp = [(-0.5 - k, tid)] if msg.return_logprob else None
        top = [[(-0.5 - k, tid), (-3.0, 7)][: max(msg.top_logprobs_num, 1)]] if msg.top_logprobs_num else None
        outs.append(
            TokenOutput(
                msg.rid,
                [tid],
                len(msg.input_ids),
                k + 1,
                0,
                delta=piece,
                finished_reason=finish if k == len(pieces) - 1 else None,
                output_logprobs=lp,
                output_top_logprobs=top,
            )
        )
    return outs


async def _serve(tokenizer, tmp_path, body: dict, route: str, pieces=PIECES, finish=STOP) -> tuple[int, str]:
    """POST `body` to `route` on the real app while a socket peer answers every request at once; the response
    text (the whole event stream)."""
    endpoints = {n: f"ipc://{tmp_path}/{n}" for n in ("scheduler", "detokenizer", "tokenizer")}
    args = ServerArgs(scheduler_cpus="none")
    info = {
        "context_length": 8192,
        "max_total_tokens": 20000,
        "vocab_size": len(tokenizer),
        "eos_token_ids": [2],
        "device": "cpu",
        "architecture": "LlamaForCausalLM",
        "dtype": "float32",
    }
    tm = TokenizerManager(args, tokenizer, info, endpoints, Metrics("m"))
    ctx = zmq.asyncio.Context()
    sched = ctx.socket(zmq.PULL)
    sched.bind(endpoints["scheduler"])
    await tm.start()
    to_tm = ctx.socket(zmq.PUSH)
    to_tm.connect(endpoints["tokenizer"])
    app = create_app(tm, args, info, "m", "m", lambda: True)
    want = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)

    async def scheduler_peer():
        decoder, encoder = msgspec.msgpack.Decoder(SchedulerIn), msgspec.msgpack.Encoder()
        reqs = []
        while len(reqs) < want:
            msg = decoder.decode(await sched.recv())
            if isinstance(msg, GenerateReq):
                reqs.append(msg)
        outs = [o for m in reqs for o in _updates(m, pieces, finish)]
        await to_tm.send(encoder.encode(BatchStrOutput(outs)))  # every update of every request in one go

    peer = asyncio.create_task(scheduler_peer())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await asyncio.wait_for(client.post(route, json=body), 30)
        await asyncio.wait_for(peer, 5)
    finally:
        peer.cancel()
        tm._recv_task.cancel()
        ctx.destroy(linger=0)
        tm.to_scheduler.context.destroy(linger=0)
    return r.status_code, r.text


def _events(text: str) -> list[dict]:
    lines = [ln[len("data: ") :] for ln in text.split("\n") if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-300:]
    return [json.loads(x) for x in lines[:-1]]


def _run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("n", [1, 3])
def test_chat_stream_keeps_every_update(tokenizer, tmp_path, n):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
        "n": n,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    status, text = _run(_serve(tokenizer, tmp_path, body, "/v1/chat/completions"))
    assert status == 200
    events = _events(text)
    for i in range(n):
        mine = [c for e in events for c in e["choices"] if c["index"] == i]
        assert "".join(c["delta"].get("content") or "" for c in mine) == "".join(PIECES)
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]
        assert mine[-1]["finish_reason"] == "stop"  # nothing of this answer after its end
        lps = [x for c in mine if c.get("logprobs") for x in c["logprobs"]["content"]]
        assert [x["logprob"] for x in lps] == [-0.5 - k for k in range(len(PIECES))]
        assert all(len(x["top_logprobs"]) == 2 for x in lps)
    assert events[-1]["usage"]["completion_tokens"] == n * len(PIECES)


@pytest.mark.parametrize("n", [1, 2])
def test_completion_stream_keeps_every_update(tokenizer, tmp_path, n):
    body = {"model": "m", "prompt": ["Once", "Twice"], "stream": True, "n": n, "logprobs": 1, "max_tokens": 8}
    status, text = _run(_serve(tokenizer, tmp_path, body, "/v1/completions"))
    assert status == 200
    events = _events(text)
    for i in range(2 * n):
        mine = [c for e in events for c in e["choices"] if c["index"] == i]
        assert "".join(c["text"] for c in mine) == "".join(PIECES)
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]
        lps = [lp for c in mine if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
        assert lps == [-0.5 - k for k in range(len(PIECES))]


def test_native_generate_stream_chunks_are_as_of_their_update(tokenizer, tmp_path):
    body = {"text": "Once", "stream": True, "return_logprob": True, "sampling_params": {"max_new_tokens": 8}}
    status, text = _run(_serve(tokenizer, tmp_path, body, "/generate"))
    assert status == 200
    events = _events(text)
    # one chunk per update, each with the text and tokens so far; only the last one finished
    assert [e["text"] for e in events] == ["".join(PIECES[: k + 1]) for k in range(len(PIECES))]
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4]
    assert [e["meta_info"]["finish_reason"] for e in events] == [None] * (len(PIECES) - 1) + [STOP.to_dict()]
    assert [len(e["meta_info"]["output_token_logprobs"]) for e in events] == [1, 2, 3, 4]


def test_tool_call_stream_ends_with_the_call(tokenizer, tmp_path):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = [call[:5], call[5:30], call[30:]]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "stream": True,
        "tools": tools,
        "tool_choice": "required",
    }
    status, text = _run(_serve(tokenizer, tmp_path, body, "/v1/chat/completions", pieces=pieces))
    assert status == 200
    choices = [c for e in _events(text) for c in e["choices"]]
    calls = [tc for c in choices for tc in (c["delta"].get("tool_calls") or [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["tool_calls"]


def test_failed_request_streams_one_error(tokenizer, tmp_path):
    """A request the scheduler fails, with updates before the failure still queued: the stream carries its
    text so far and one error event, then ends."""
    fail = FinishReason.abort("the server ran out of device memory", status_code=503)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    status, text = _run(_serve(tokenizer, tmp_path, body, "/v1/chat/completions", finish=fail))
    events = _events(text)
    errors = [e for e in events if "error" in e]
    assert status == 200 and len(errors) == 1 and "device memory" in errors[0]["error"]["message"]
    content = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
    assert content == "".join(PIECES[:-1])
