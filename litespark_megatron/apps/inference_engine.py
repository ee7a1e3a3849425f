"""Generation with HF transformers, timed: a Llama directory loaded, prompts of exactly P tokens, exactly N new tokens
each (greedy, a static KV cache, end-of-sequence ignored), warm-up calls first, the clock read after the device has
finished (CUDA synchronized).

    time to first token (TTFT)  a call that generates 1 token: the prefill of P tokens and the first token
    decode latency per token    (a call of N tokens - TTFT) / (N - 1): one decode step, for the whole batch
    IT                          tokens generated / seconds of the N-token calls (EfficientLLM's inference
                                throughput: every sequence of the batch counts)

Memory-bandwidth use of decode: each decode step reads every weight once and the KV cache of the context so far,
so bytes per step / decode latency is the bandwidth decode achieves, and its fraction of the GPU's peak (MBU) says
how close decode is to its limit (for a 16-bit model at batch 1 it is the limit; a 4-bit model reads a quarter).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..errors import UserError

# Peak HBM bandwidth (GB/s) of the GPUs the project measures on, from NVIDIA's data sheets, by the name
# torch.cuda.get_device_name reports (the first name contained in it wins: H100 NVL before H100 PCIe before H100).
PEAK_BANDWIDTH_GBS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5 (HBM3)
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB
)


def peak_bandwidth_gbs(device_name: str) -> Optional[float]:
    for name, gbs in PEAK_BANDWIDTH_GBS:
        if name in device_name:
            return gbs
    return None


# --------------------------------------------------------------------------------------------- loading
def check_llama_dir(path: str) -> dict:
    """The config of an HF Llama directory, refused in one line when it is not one."""
    if not os.path.isdir(path):
        raise UserError(f"--hf {path}: no such directory")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise UserError(f"--hf {path}: no config.json: not a Hugging Face model directory (litespark-convert export "
                        f"writes one)")
    try:
        config = json.loads(open(config_path, encoding="utf-8").read())
    except (OSError, ValueError) as e:
        raise UserError(f"--hf {path}: config.json is not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("model_type") != "llama":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise UserError(f"--hf {path}: a {kind or 'untyped'} model, not a Llama (config.json model_type must be "
                        f"'llama')")
    if not any(name.endswith((".safetensors", ".bin")) for name in os.listdir(path)):
        raise UserError(f"--hf {path}: no weights (*.safetensors) in the directory")
    return config


def load_llama(path: str, dtype: str, device, quantization_config=None):
    """LlamaForCausalLM from `path` in `dtype` ("bf16"/"fp16") on `device`, SDPA attention, in eval mode."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    extra = {"quantization_config": quantization_config, "device_map": {"": device}} if quantization_config else {}
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa", **extra)
    if quantization_config is None:
        model = model.to(device)
    return model.eval()


# --------------------------------------------------------------------------------------------- timing
def synchronizer(device) -> Callable[[], None]:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.synchronize
    return lambda: None


@dataclass
class GenerationTiming:
    batch_size: int
    prompt_tokens: int
    new_tokens: int
    ttft_s: float  # mean over the timed calls
    total_s: float  # mean seconds of one N-token call
    calls: int

    @property
    def generated_tokens(self) -> int:
        return self.batch_size * self.new_tokens

    @property
    def decode_s_per_token(self) -> Optional[float]:
        """One decode step (all sequences of the batch); None for N = 1 (no decode step)."""
        if self.new_tokens < 2:
            return None
        return max(self.total_s - self.ttft_s, 0.0) / (self.new_tokens - 1)

    @property
    def it_tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_s

    def as_dict(self) -> dict:
        return dict(batch_size=self.batch_size, prompt_tokens=self.prompt_tokens, new_tokens=self.new_tokens,
                    generated_tokens=self.generated_tokens, ttft_s=self.ttft_s, total_s=self.total_s,
                    decode_s_per_token=self.decode_s_per_token, it_tokens_per_s=self.it_tokens_per_s,
                    timed_calls=self.calls)


def generate_exactly(model, prompts, new_tokens: int, compile: bool = False):
    """Greedy generation of exactly `new_tokens` per prompt with a static KV cache: min = max new tokens, and no
    end-of-sequence token (the model may well predict one). Raises if the count is not exact. `compile`: let
    transformers compile the decode step (it does so by itself on a GPU with a static cache unless told not to, so
    an eager measurement must say so)."""
    import torch

    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                             eos_token_id=None, pad_token_id=0, disable_compile=not compile)
    produced = out.shape[1] - prompts.shape[1]
    if produced != new_tokens or out.shape[0] != prompts.shape[0]:
        raise RuntimeError(f"generate returned {tuple(out.shape)} for {tuple(prompts.shape)} prompts and "
                           f"{new_tokens} new tokens")
    return out


def time_generation(model, prompts, new_tokens: int, warmup: int, calls: int, sync: Callable[[], None],
                    clock: Callable[[], float] = time.perf_counter, on_timed: Optional[Callable] = None,
                    compile: bool = False) -> GenerationTiming:
    """TTFT and N-token call times, each the mean of `calls` timed calls after `warmup` untimed ones of both kinds.
    `on_timed(start)`/`on_timed(stop)` brackets the N-token calls (the energy meter counts only them)."""
    for _ in range(warmup):
        generate_exactly(model, prompts, 1, compile)
        generate_exactly(model, prompts, new_tokens, compile)
    ttft, total = 0.0, 0.0
    for _ in range(calls):
        sync()
        t0 = clock()
        generate_exactly(model, prompts, 1, compile)
        sync()
        ttft += clock() - t0
    if on_timed:
        on_timed("start")
    for _ in range(calls):
        sync()
        t0 = clock()
        generate_exactly(model, prompts, new_tokens, compile)
        sync()
        total += clock() - t0
    if on_timed:
        on_timed("stop")
    return GenerationTiming(batch_size=prompts.shape[0], prompt_tokens=prompts.shape[1], new_tokens=new_tokens,
                            ttft_s=ttft / calls, total_s=total / calls, calls=calls)


# --------------------------------------------------------------------------------------------- bandwidth
def kv_cache_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes of K and V one token keeps in every layer."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype_bytes


def decode_bytes_per_step(weights_read: int, config, dtype_bytes: int, batch: int, prompt: int, new: int) -> float:
    """Bytes one decode step reads: the weights once, and each sequence's KV cache at the mean context length of
    the decode steps (P + N/2)."""
    return weights_read + batch * (prompt + new / 2) * kv_cache_bytes_per_token(config, dtype_bytes)


def embedding_bytes(model) -> int:
    """Bytes of the input embedding table: a decode step gathers a row of it, it does not read it (an output layer
    tied to it reads it all, through the output layer)."""
    from .inference_variants import tensor_bytes

    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embed
    return 0 if tied else tensor_bytes(embed)


# --------------------------------------------------------------------------------------------- memory
def reset_peak_memory(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> dict:
    """GPU: torch's peak allocated bytes since the last reset. CPU: the process's peak resident set (the whole
    process: Python, torch and the libraries too, and never reset)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return dict(peak_memory_gb=torch.cuda.max_memory_allocated(device) / 1e9,
                    peak_memory_kind="GPU memory allocated by torch (peak)")
    import resource

    return dict(peak_memory_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
                peak_memory_kind="host RSS of the whole process (peak), CPU run")


def prompts_from(stream: Sequence[int], batch: int, length: int):
    """`batch` prompts of exactly `length` tokens: consecutive slices of the token stream, reused from its start
    when the stream is shorter than batch x length."""
    import torch

    if not stream:
        raise UserError("no prompt tokens: the evaluation text is empty")
    need = batch * length
    ids = [stream[i % len(stream)] for i in range(need)]
    return torch.tensor(ids, dtype=torch.long).view(batch, length)

