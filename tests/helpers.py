"""Shared test utilities: tiny random HF checkpoints and direct model forwards."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from radixlm._net import free_local_port as free_port
from radixlm.srt.model_executor.forward_batch import ForwardBatch, ForwardMode

# test-started servers and routers die with the test's process: a worker killed (for memory, say) must not leave
# them running for the rest of the suite
from radixlm.srt.utils import kill_on_parent_death

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
GRAMMAR_BACKENDS = ("outlines", "xgrammar", "llguidance")


def smollm_tokenizer():
    """The embedded model's tokenizer (cached after the first conversion from GGUF); RADIXLM_TEST_TOKENIZER
    names a saved copy instead, for machines without the GGUF (the GPU machine)."""
    import os

    if os.environ.get("RADIXLM_TEST_TOKENIZER"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.environ["RADIXLM_TEST_TOKENIZER"])
    from radixlm.srt.model_loader.default_model import default_model_path
    from radixlm.srt.model_loader.gguf_loader import GGUFCheckpoint

    return GGUFCheckpoint(default_model_path()).load_tokenizer()


def make_tiny_checkpoint(
    path: Path,
    arch: str,
    *,
    tie: bool = False,
    dtype=torch.float32,
    seed: int = 0,
    rope_scaling: dict | None = None,
    vocab_size: int | None = None,
    shards: int = 1,
    tokenizer=None,
    **sizes,
) -> Path:
    """A small random model saved with transformers' own save_pretrained, with the SmolLM2 tokenizer."""
    import transformers

    tok = tokenizer or smollm_tokenizer()
    vocab = vocab_size or len(tok)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
    )
    common.update(sizes)  # e.g. hidden_size / num_attention_heads / head_dim for GPU-kernel-sized heads
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        if rope_scaling:
            cfg.rope_parameters = {"rope_theta": 10000.0, **rope_scaling}
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**{"head_dim": 32, **common})
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    if arch == "qwen2":  # make the qkv biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
                layer.self_attn.v_proj.bias.normal_(0, 0.5)
    max_shard = None
    if shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        max_shard = f"{total // shards // 1000 + 1}KB"
    kwargs = {"max_shard_size": max_shard} if max_shard else {}
    model.save_pretrained(path, **kwargs)
    tok.save_pretrained(path)
    return Path(path)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||, in float64 (either may be bf16, fp8-dequantized or on a GPU)."""
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def forward_logits(engine, ids: list[int], split: int | None = None) -> torch.Tensor:
    """Logits for every position of `ids` from our model, optionally computed as two extends
    (ids[:split], then the rest attending to the cached prefix). Uses and returns the engine's pools' slots."""
    runner = engine.runner
    row = runner.req_to_token_pool.alloc()
    slots = runner.token_to_kv_pool.alloc(len(ids))
    runner.req_to_token_pool.write(row, 0, slots)
    pieces = [(0, len(ids))] if split is None else [(0, split), (split, len(ids))]
    out = []
    try:
        for start, end in pieces:
            fb = ForwardBatch.build(
                ForwardMode.EXTEND,
                runner.device,
                input_ids=ids[start:end],
                positions=list(range(start, end)),
                req_pool_indices=[row],
                seq_lens=[end],
                out_cache_loc=slots[start:end],
                logits_indices=list(range(end - start)),
                extend_prefix_lens=[start],
                extend_seq_lens=[end - start],
            )
            out.append(runner.forward(fb))
    finally:
        runner.token_to_kv_pool.free(slots)
        runner.req_to_token_pool.free(row)
    return torch.cat(out)


def hf_logits(model_dir, ids: list[int], dtype=torch.float32, device="cpu", gguf_file: str | None = None):
    import transformers

    kwargs = {"dtype": dtype}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).to(device).eval()
    with torch.no_grad():
        return model, model(torch.tensor([ids], device=device)).logits[0].float()


def assert_runner_matches_eager(r, graphed) -> None:
    """Model runner `r`'s eager forward against `graphed(spec)` (a graph runner's path) on a mixed batch (3
    decodes at context 5 + a 21-token prompt: 24 tokens, padded to a 32 bucket) and on a prompt filling its
    bucket exactly: the same logits of every row, and no slot of the pool written but the batch's own and
    slot 0 (the reserved padding slot, where padding rows go)."""
    from radixlm.srt.model_executor.synthetic import mixed_spec, release

    kv = r.token_to_kv_pool
    for decodes, prompt in ((3, 21), (0, 16)):
        ids = torch.randint(3, 200, (decodes + prompt,), generator=torch.Generator().manual_seed(prompt)).tolist()
        spec, slots, rows = mixed_spec(r, decodes, 5, prompt, ids, all_logits=True)
        torch.manual_seed(0)
        for buf in (kv.k_buffer, kv.v_buffer):  # the batch's new slots and the padding slot start as noise
            for layer in buf:
                layer[slots].normal_()
        eager = r.forward(spec.build(r.device, None))
        untouched = [b[layer].clone() for b in (kv.k_buffer, kv.v_buffer) for layer in range(len(b))]
        got = graphed(spec)
        assert got.shape == eager.shape == (decodes + prompt, r.vocab_size)
        assert ((got - eager).norm() / eager.norm()).item() < 1e-5
        after = [b[layer] for b in (kv.k_buffer, kv.v_buffer) for layer in range(len(b))]
        for before, now in zip(untouched, after):
            assert torch.allclose(now[1:], before[1:], rtol=1e-5, atol=1e-6)
        release(r, slots, rows)


def generate_through_runner(make_engine, attach) -> tuple[list, list, list[int], object]:
    """Greedy outputs of three ragged prompts (one of 40 tokens, so chunks of 16 with decodes riding along)
    with mixed chunks on: from a plain engine, and from one whose graph runner `attach(engine)` installed
    (it returns the list the runner appends each batch's token count to). Returns (expected, got, those
    counts, the second engine)."""
    prompts = [[1, 504, 3575, 282, 4649, 314, 7042, 30, 198], [5, 6, 7], list(range(10, 50))]
    greedy = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    plain = make_engine(enable_mixed_chunk=True, chunked_prefill_size=16)
    expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=greedy)]
    engine = make_engine(enable_mixed_chunk=True, chunked_prefill_size=16)
    sizes = attach(engine)
    got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
    return expected, got, sizes, engine


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))


class ServerProcess:
    """`python -m radixlm.launch_server` as a real subprocess on a free port; waits for /health."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 180):
        import subprocess
        import sys
        import time

        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "radixlm.launch_server", "--port", str(self.port), "--log-level", "warning", *args]
        self.log = open(os.devnull, "w") if os.environ.get("RADIXLM_TEST_QUIET") else None
        self.proc = subprocess.Popen(
            cmd, env={**os.environ, **(env or {})}, stdout=self.log, stderr=self.log, preexec_fn=kill_on_parent_death
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.proc.kill()
        raise RuntimeError("server did not become healthy in time")

    def stop(self, timeout: float = 30) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def assert_engine_idle(engine) -> None:
    """Nothing queued, running or waiting for a grammar; after a cache flush every KV slot, request row and
    radix node is free and the scheduler's invariants hold."""
    sch = engine.scheduler
    assert not sch.waiting and not sch.running and sch.chunked is None
    assert not sch.grammar.queue and not sch.has_work()
    assert not engine.has_unfinished_requests()
    assert engine.flush_cache()
    assert sch.kv_pool.available_size() == sch.kv_pool.size
    assert sch.req_pool.available_size() == sch.req_pool.size
    assert sch.tree_cache.total_size() == 0 and sch.tree_cache.protected_size() == 0
    sch.check_invariants()


def assert_server_idle(url: str) -> None:
    """The server's scheduler runs and queues nothing, no grammar waits, no request is in flight, and after
    /flush_cache every KV slot is free again."""
    import httpx

    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    s = info["scheduler"]
    assert s["num_running"] == 0 and s["num_waiting"] == 0 and s["grammar"]["waiting"] == 0, s
    assert info["requests_in_flight"] == 0, info
    r = httpx.post(f"{url}/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    s = httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler"]
    assert s["kv_free"] == s["kv_total"], s


def group_alive(pgid: int) -> list[str]:
    """The live processes of process group `pgid`, but for zombies and multiprocessing's resource tracker (a
    server's tracker exits by itself once the server is gone, maybe a moment after it)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid and "resource_tracker" not in cmd:  # state, ppid, pgrp
            alive.append(f"{entry}: {cmd}")
    return alive


class RouterProcess:
    """`radixlm router` as a real subprocess on a free port; waits until it answers."""

    def __init__(self, *args: str, healthy: bool = True):
        import subprocess
        import sys
        import time

        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "radixlm.cli", "router", "--port", str(self.port), "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, preexec_fn=kill_on_parent_death)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "router exited during start-up"
            try:
                code = httpx.get(f"{self.url}/health", timeout=1).status_code
                if code == 200 or (not healthy and code == 503):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("router did not start")

    def stop(self) -> None:
        import signal
        import subprocess

        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
