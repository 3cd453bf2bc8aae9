"""Owns the model, the KV memory pools, the attention backend and the sampler; runs one batch at a time."""
from __future__ import annotations

import logging

import torch

from radixlm.srt.layers.attention.torch_native import TorchNativeAttnBackend
from radixlm.srt.layers.sampler import SampleOutput, Sampler, SamplingBatchInfo
from radixlm.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlm.srt.model_executor.forward_batch import ForwardBatch
from radixlm.srt.model_loader.loader import LoadedModel

logger = logging.getLogger(__name__)

_CPU_KV_MEMORY_FRACTION = 0.2  # of MemAvailable
_CPU_MAX_KV_TOKENS = 65536
_DEFAULT_GPU_MEM_FRACTION = 0.85


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def create_attention_backend(name: str, device: torch.device):
    if name in ("auto", "torch_native"):
        return TorchNativeAttnBackend(device)
    raise ValueError(f"attention_backend {name!r} is not available yet; use torch_native")


class ModelRunner:
    def __init__(self, loaded: LoadedModel, args):
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.context_length = self.config.context_length
        self.vocab_size = self.config.vocab_size
        bytes_per_token = self.config.kv_bytes_per_token * torch.tensor([], dtype=self.dtype).element_size()
        self.max_total_tokens = args.max_total_tokens or self._default_kv_tokens(bytes_per_token, args)
        if self.max_total_tokens < 16:
            raise ValueError(f"KV cache of {self.max_total_tokens} tokens is too small")
        default_running = 128 if self.device.type == "cpu" else 1024
        self.max_running_requests = args.max_running_requests or min(default_running, self.max_total_tokens)
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_length + 1, self.device)
        self.token_to_kv_pool = TokenToKVPool(self.max_total_tokens, self.config.num_layers, self.config.num_kv_heads,
                                              self.config.head_dim, self.dtype, self.device)
        self.attn_backend = create_attention_backend(args.attention_backend, self.device)
        self.sampler = Sampler(self.vocab_size, self.device)
        logger.info("KV cache: %d tokens (%.2f GB), max running requests %d", self.max_total_tokens,
                    self.max_total_tokens * bytes_per_token / 1e9, self.max_running_requests)

    def _default_kv_tokens(self, bytes_per_token: int, args) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            fraction = args.mem_fraction_static or _DEFAULT_GPU_MEM_FRACTION
            budget = total * fraction - (total - free)
            if budget <= 0:
                raise ValueError(f"mem_fraction_static={fraction} leaves no room for the KV cache after the weights")
            return int(budget // bytes_per_token)
        tokens = int(_mem_available_bytes() * _CPU_KV_MEMORY_FRACTION // bytes_per_token)
        return max(1024, min(tokens, _CPU_MAX_KV_TOKENS))

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        fb.req_to_token_pool = self.req_to_token_pool
        fb.token_to_kv_pool = self.token_to_kv_pool
        fb.attn_backend = self.attn_backend
        with torch.inference_mode():
            self.attn_backend.init_forward_metadata(fb)
            return self.model(fb)

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        return self.sampler(logits, info)
