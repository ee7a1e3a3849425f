"""Where the job runs: CUDA + NCCL when GPUs exist, else CPU + gloo; process groups and seeds.

This is the only module that knows megatron-core 0.16.1 assumes CUDA. On a CPU-only torch build, `apply_cpu_shims()`
patches seven such assumptions (each documented with the exact failure it fixes, each tested by a test that
reproduces the failure with that one shim left out). The shims are idempotent and never applied when CUDA exists.
Set `LITESPARK_CPU_SHIMS=none` (or a comma list such as `dev,rng`) to choose which are applied.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
import random
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ALL_SHIMS = ("dev", "rng", "misc", "mode", "spnorm", "optckpt", "moe")
_applied: set = set()


# --------------------------------------------------------------------------------------------- detection
@dataclass(frozen=True)
class Platform:
    device_type: str          # "cuda" or "cpu"
    dist_backend: str         # "nccl" or "gloo"
    te: bool                  # Transformer Engine importable (only ever True with CUDA)
    fp8_capable: bool         # compute capability >= 8.9
    device_name: str


def te_importable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE raises OSError/ImportError/RuntimeError depending on what is missing
        return False
    return True


def detect() -> Platform:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return Platform("cuda", "nccl", te_importable(), (major, minor) >= (8, 9), torch.cuda.get_device_name())
    return Platform("cpu", "gloo", False, False, "cpu")


# --------------------------------------------------------------------------------------------- CPU shims
def _shim_dev():
    """`torch.cuda.current_device()` raises 'Torch not compiled with CUDA enabled' and megatron-core calls it in
    every forward (RoPE, TP gather/scatter buffers, VocabParallelEmbedding, SP all-gather, p2p buffers). Returning
    "cpu" makes `torch.empty(..., device=torch.cuda.current_device())` allocate on the CPU."""
    torch.cuda.current_device = lambda: "cpu"


def _cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's named RNG streams (data-parallel, model-parallel, expert) kept on the CPU generator."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    return CpuRNGStatesTracker


def _shim_rng():
    """`model_parallel_cuda_manual_seed` stores CUDA generator states (`torch.cuda.get_rng_state()` raises on a
    CPU build), and DotProductAttention always forks the 'model-parallel-rng' stream, so without a tracker the
    first forward fails with 'cuda rng state model-parallel-rng is not added'. Use a tracker over the CPU
    generator; activation recompute saves/restores the "cuda" state through the two helpers patched last."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker = _cpu_rng_tracker_class()
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _shim_misc():
    """`torch.cuda.synchronize()` raises on a CPU build; megatron calls it in timers, p2p and process-group
    set-up. There is nothing to wait for on the CPU."""
    torch.cuda.synchronize = lambda *a, **k: None


def _is_cuda(device) -> bool:
    if isinstance(device, bool) or device is None:
        return False
    if isinstance(device, int):
        return True  # a bare int means cuda:<int>
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class CudaToCpuMode(TorchFunctionMode):
    """megatron-core hard-codes CUDA in places a monkeypatch cannot reach: `device="cuda"` literals (the default
    causal mask, the optimizer's found-inf and loss-scale tensors, grad clipping, the schedules' token counter,
    dist_checkpointing), `.cuda()`, `pin_memory`, `record_stream`, and `param.type() == 'torch.cuda.FloatTensor'`
    checks in the optimizers and clip_grads. This mode rewrites those calls to their CPU meaning."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return func(*args, **kwargs)


def _shim_mode():
    # Entered once on the main thread and never left: every later megatron call sees it.
    CudaToCpuMode().__enter__()


def _shim_spnorm():
    """Without Apex/TE the local spec's norm is WrappedTorchNorm, which asserts 'sequence parallel not supported
    by torch LayerNorm'. A norm needs nothing from SP except that its weights are tagged `sequence_parallel` so
    finalize_model_grads all-reduces their partial grads over TP (what FusedLayerNorm and TENorm do)."""
    from megatron.core.transformer import torch_norm

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
        norm_class = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_class(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__


def _shim_optckpt():
    """DistributedOptimizer resume with torch's AdamW (the fallback without TE/Apex) is silently wrong:
    `load_state_dict` gives every parameter ONE shared 'step' tensor that AdamW then increments once per
    parameter, and `_set_main_param_and_optimizer_states` copies 'step' from the loaded tensors (a template value
    with dp_reshardable, a KeyError with fully_reshardable) outside no_grad. Give each parameter its own step,
    never take it from the tensors, and copy under no_grad."""
    from megatron.core.optimizer import distrib_optimizer

    original = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
        with torch.no_grad():
            for key, dst in {"param": main_param, **state}.items():
                if key != "step" and key in tensors:
                    dst.copy_(tensors[key])

    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = \
        _set_main_param_and_optimizer_states


class _NoEvent:
    def __init__(self, *a, **k): pass
    def record(self, *a, **k): pass
    def synchronize(self): pass
    def wait(self, *a, **k): pass
    def query(self): return True


class _NoStream:
    def __init__(self, *a, **k): pass
    def wait_stream(self, *a, **k): pass
    def wait_event(self, *a, **k): pass
    def record_event(self, *a, **k): return _NoEvent()
    def synchronize(self): pass
    def query(self): return True


def _shim_moe():
    """MoE layers on CPU: the alltoall dispatcher and shared experts create `torch.cuda.Stream()` ('requires CUDA
    support'); moe_utils references `te_general_gemm`, defined only when TE imports (NameError); and the alltoall
    dispatcher converts split sizes to numpy only for CUDA tensors, so gloo's all_to_all_single gets tensors
    ('incompatible function arguments')."""
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoEvent
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


_SHIMS = {"dev": _shim_dev, "rng": _shim_rng, "misc": _shim_misc, "mode": _shim_mode, "spnorm": _shim_spnorm,
          "optckpt": _shim_optckpt, "moe": _shim_moe}


def wanted_shims() -> tuple:
    value = os.environ.get("LITESPARK_CPU_SHIMS", "all").strip()
    if value in ("", "all"):
        return ALL_SHIMS
    if value == "none":
        return ()
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = set(names) - set(ALL_SHIMS)
    if unknown:
        raise ValueError(f"LITESPARK_CPU_SHIMS: unknown shim(s) {sorted(unknown)}; known: {', '.join(ALL_SHIMS)}")
    return names


def apply_cpu_shims() -> list:
    """Apply the wanted CPU shims once each. A no-op when CUDA is available. Returns the names applied so far."""
    if torch.cuda.is_available():
        return []
    for name in wanted_shims():
        if name not in _applied:
            _SHIMS[name]()
            _applied.add(name)
    return sorted(_applied)


def quiet_library_noise() -> None:
    """megatron-core warns on every import that TE/Apex are absent (expected on CPU: the fallbacks are what we
    use) and that it does not know the Litespark MLP class (it then passes no tp_group, which LitesparkMLP takes
    from parallel_state). Neither is actionable for a user."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex are|Apex is) not installed.*")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated.*")

    class _DropUnknownMLP(logging.Filter):
        def filter(self, record):
            return "Unknown MLP type" not in record.getMessage()

    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_DropUnknownMLP())


def patch_mla_without_te() -> bool:
    """Without Transformer Engine (CPU, or a GPU machine without it) megatron-core 0.16.1 cannot build its MLA
    attention with any modules: `megatron.core.extensions.transformer_engine` defines the TE classes over a
    MagicMock, so the MLA module's `from ... import TELinear` succeeds and sets its HAVE_TE = True, and
    `isinstance(self.linear_proj, TELinear)` then raises 'isinstance() arg 2 must be a type'. Tell the MLA module
    that TE is absent, which is true. A no-op (returns False) when TE's classes are real types."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not mla.HAVE_TE or isinstance(mla.TELinear, type):
        return False
    mla.HAVE_TE = False
    return True


class _TEWgradAccumulation:
    """Apex's `fused_weight_gradient_mlp_cuda` API on Transformer Engine's GEMM: main_grad += dY^T X, accumulated
    by the GEMM itself in main_grad's dtype (what Apex's kernel and TE's own linears do), with no bf16 weight
    gradient written and added afterwards."""

    @staticmethod
    def _accumulate(total_input, grad_output, main_grad):
        gemm, extra = _te_general_gemm()
        # TE's wgrad convention (its Linear's backward): A = input [tokens, in], B = grad [tokens, out], "NT".
        gemm(total_input, grad_output, out_dtype=main_grad.dtype, layout="NT", grad=True, accumulate=True,
             out=main_grad, **extra())

    wgrad_gemm_accum_fp32 = _accumulate
    wgrad_gemm_accum_fp16 = _accumulate


@functools.lru_cache(maxsize=None)
def _te_general_gemm():
    """TE's general_gemm and a function giving its version-specific extra keywords: older TE releases take a cuBLAS
    workspace from their module base, newer ones (2.20) manage their own."""
    import inspect

    from transformer_engine.pytorch.cpp_extensions import general_gemm

    if "workspace" in inspect.signature(general_gemm).parameters:
        from transformer_engine.pytorch.module.base import get_workspace

        return general_gemm, lambda: {"workspace": get_workspace()}
    return general_gemm, dict


def provide_wgrad_accumulation_kernel() -> Optional[str]:
    """Make megatron-core's own linears (the output layer; every linear of the local backends) accumulate weight
    gradients into main_grad inside the GEMM, as TE's linears do. megatron-core takes that kernel only from Apex's
    `fused_weight_gradient_mlp_cuda` and refuses `gradient_accumulation_fusion` without it; where Apex is absent
    and Transformer Engine is installed, TE's GEMM provides the same two functions. Returns which kernel serves:
    "apex", "te", or None (neither: the fusion cannot run here)."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "fused_weight_gradient_mlp_cuda", None) is _TEWgradAccumulation:
        return "te"
    if layers._grad_accum_fusion_available:
        return "apex"
    if not te_importable():
        return None
    layers.fused_weight_gradient_mlp_cuda = _TEWgradAccumulation
    layers._grad_accum_fusion_available = True
    return "te"


# --------------------------------------------------------------------------------------------- process groups
def init_distributed(args, platform: Optional[Platform] = None) -> Platform:
    """Start torch.distributed (torchrun's env, or a single process), megatron's parallel_state and the seeds."""
    platform = platform or detect()
    if platform.device_type == "cpu":
        apply_cpu_shims()
    patch_mla_without_te()
    backend = platform.dist_backend if args.distributed_backend == "auto" else args.distributed_backend
    for key, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, default)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    if platform.device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))

    from megatron.core import parallel_state

    from .config import virtual_pipeline_size

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(args),
        context_parallel_size=args.context_parallel_size,
        # Experts are spread over ranks taken from the data-parallel ones (expert tensor parallelism = TP).
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        # megatron's optimizers use gloo groups for CPU-side state exchange (as Megatron-LM does by default).
        create_gloo_process_groups=True,
    )
    set_seeds(args.seed, platform)
    return platform


def set_seeds(seed: int, platform: Platform) -> None:
    """Python, numpy and torch get `seed` + the pipeline rank (as Megatron-LM does); megatron's tracker gets the
    model-parallel streams. Data-parallel replicas share seeds: dropout is then identical across DP ranks."""
    import numpy as np
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def shutdown() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def current_device() -> torch.device:
    """This rank's device: its GPU (set by init_distributed from LOCAL_RANK), or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
