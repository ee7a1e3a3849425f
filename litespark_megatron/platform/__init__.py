"""Where a run goes (CUDA + NCCL when GPUs exist, else CPU + gloo), and the house of every library patch.

Nothing outside this package replaces a function or attribute of megatron, megatron-core or torch
(tests/test_patch_house.py fails if a module does). Each patch says the library function it serves and the failure
it fixes, and a test reproduces that failure without it (tests/test_platform.py, test_telemetry.py,
test_checkpoint_dir.py): when megatron-core is upgraded, these are the files to read again.

    detection.py         which machine: `detect()` -> Platform(device_type, dist_backend, te, fp8_capable, ...)
    (this module)        the CPU shims, and `prepare_libraries()`, everything a run patches before megatron.training
                         starts
    library_gaps.py      the gaps every machine hits: helpers, distopt, wgrad, rope, help, docstrings
    helper_processes.py  the `children` gap: the checkpoint writer's helpers end with the trainer
    callbacks.py         the one module that wraps megatron.training's loop (training_log, evaluate, saves, loads)
                         and fires events to its listeners (telemetry, the watchdog, the checkpoint directory)
    optimizer_overrides.py  per-parameter optimizer overrides added to megatron.training's (LoRA-plus)
    fused_adam.py        megatron-core's Adam stepped by Litespark's kernel, the clipping coefficient handed to it
                         (--litespark-adam)
    checkpoint_contents.py  checkpoints of the trainable parameters alone (--save-adapters-only)
    fp8_state.py         Transformer Engine's FP8 delayed-scaling state loaded back on resume (its pickle checked)
    float8_reshape.py    Transformer Engine's Float8Tensor.reshape given its shape as one tuple

megatron.training (megatron-core 0.19.2) is the trainer. It assumes CUDA throughout; on a CPU-only torch,
`apply_cpu_shims()` maps those assumptions to the CPU, one shim per assumption, each documented with the megatron
function it serves and the failure it fixes, and each tested by reproducing that failure without it
(tests/test_platform.py); two more, `compile` and `jit`, skip start-up costs on the CPU rather than failures.
They are applied only where torch has no CUDA, never on a GPU machine.
`LITESPARK_CPU_SHIMS=none|all|name,name` selects them.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

from .checkpoint_contents import save_trainable_only  # noqa: F401
from .detection import Platform, current_device, detect, te_importable  # noqa: F401
from .float8_reshape import reshape_takes_a_shape_tuple  # noqa: F401
from .fp8_state import load_fp8_scaling_state  # noqa: F401
from .helper_processes import STOP_SIGNALS, die_with_parent, helper_processes_die_with_the_trainer  # noqa: F401
from .library_gaps import (load_optimizer_shards_without_autograd, pass_rope_scaling_factor,  # noqa: F401
                           provide_wgrad_accumulation_kernel, read_config_docstrings_once,
                           resume_distributed_optimizer_on_torch_adam, use_shipped_dataset_helpers)
from .fused_adam import adam_in_use, use_litespark_adam  # noqa: F401
from .optimizer_overrides import add_optimizer_overrides  # noqa: F401

# Versions the shims were written against: a test fails when the installed ones differ.
MEGATRON_CORE_VERSION = "0.19.2"


def single_process_defaults() -> None:
    """Started without torchrun (`python -m litespark_megatron ...`): one process, a free local port; what
    torchrun would have put in the environment for megatron.training's env:// rendezvous."""
    for key, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, default)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def prepare_libraries() -> Platform:
    """Everything a run needs patched before megatron.training starts, on this machine. Idempotent."""
    single_process_defaults()
    plat = detect()
    if plat.device_type == "cpu":
        apply_cpu_shims()  # first: the `compile` shim must be in place before megatron is imported
    use_shipped_dataset_helpers()
    read_config_docstrings_once()
    resume_distributed_optimizer_on_torch_adam()
    load_optimizer_shards_without_autograd()
    pass_rope_scaling_factor()
    if plat.device_type != "cpu":
        provide_wgrad_accumulation_kernel()
    if plat.te:
        load_fp8_scaling_state()
        reshape_takes_a_shape_tuple()
    helper_processes_die_with_the_trainer()
    return plat


# --------------------------------------------------------------------------------------------- CPU shims
_TORCH_COMPILE = torch.compile


class _DeferMegatronCompile(importlib.abc.MetaPathFinder):
    """While a megatron module is executed (imported), `torch.compile` is `_compile_on_first_call`."""

    def __init__(self):
        self._finding = False

    def find_spec(self, name, path=None, target=None):
        if self._finding or not (name == "megatron" or name.startswith("megatron.")):
            return None
        self._finding = True  # find the real spec with the other finders
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            compile_now, torch.compile = torch.compile, _compile_on_first_call
            try:
                execute(module)
            finally:
                torch.compile = compile_now

        spec.loader.exec_module = exec_module
        return spec


def _compile_on_first_call(model=None, **options):
    """torch.compile(model, **options), done when the result is first called (also as a decorator factory)."""
    if model is None:
        return lambda fn: _compile_on_first_call(fn, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = _TORCH_COMPILE(model, **options)
        return compiled(*args, **kwargs)

    return call


def _shim_compile():
    """megatron-core decorates functions with torch.compile when its modules are imported (`jit_fuser` on the
    bias-SwiGLU/GeLU and bias-dropout-add fusions, the MoE router's top-k). On torch 2.13 the first decoration
    imports TorchDynamo and TorchInductor: 2 to 3 s of every process's start on 2 CPU cores, for functions the
    Litespark layer never calls. Here each is compiled when first called instead; nothing else changes. Works
    only for megatron modules imported after it, so prepare_libraries() applies it before anything else."""
    if not any(isinstance(finder, _DeferMegatronCompile) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeferMegatronCompile())


def _shim_init():
    """megatron.training.training.pretrain calls initialize_megatron() without allow_no_cuda, which asserts
    'Megatron requires CUDA.'. Pass allow_no_cuda=True."""
    from megatron.training import training

    original = training.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    training.initialize_megatron = initialize_megatron


def _shim_dev():
    """megatron.training.initialize._initialize_distributed builds the model-parallel groups, and _set_random_seed
    seeds the model-parallel RNG tracker, only `if torch.cuda.device_count() > 0`: on the CPU there would be no
    TP/PP groups at all ('parallel state is not initialized'). The CPU is the one device: count 1, `set_device` a
    no-op, and `current_device()` "cpu" so that megatron-core's `torch.empty(..., device=current_device())` buffers
    (RoPE, TP/SP gathers, p2p) land on the CPU ('Torch not compiled with CUDA enabled')."""
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
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
    """megatron-core's model-parallel RNG tracker (tensor_parallel.random: model_parallel_cuda_manual_seed, the
    dropout and recompute forks) and the rerun state machine (_save_state / _restore_state, every step) keep CUDA
    generator states: 'Found no NVIDIA driver'. Keep them on the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker = _cpu_rng_tracker_class()
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _shim_misc():
    """`torch.cuda.synchronize()` (timers, p2p, checkpointing) and the memory counters megatron.training reports
    (training_log's report_memory) raise on a CPU build. Nothing to wait for; no GPU memory in use."""
    torch.cuda.synchronize = lambda *a, **k: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)


def _is_cuda(device) -> bool:
    if isinstance(device, bool) or device is None:
        return False
    if isinstance(device, int):
        return True  # a bare int means cuda:<int>
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class CudaToCpuMode(TorchFunctionMode):
    """megatron hard-codes CUDA in places a monkeypatch cannot reach: `device="cuda"` literals (pretrain's start
    time all-reduce, training_log's loss accumulators, the optimizer's found-inf and loss-scale tensors, grad
    clipping, the schedules' token counter, dist_checkpointing), `.cuda()` (the batch), `pin_memory`,
    `record_stream`, and `param.type() == 'torch.cuda.FloatTensor'` checks in the optimizers and clip_grads. This
    mode rewrites those calls to their CPU meaning."""

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


class _NoEvent:
    def __init__(self, *a, **k): pass
    def record(self, *a, **k): pass
    def synchronize(self): pass
    def wait(self, *a, **k): pass
    def query(self): return True
    def elapsed_time(self, other): return 0.0


class _NoStream:
    def __init__(self, *a, **k): pass
    def wait_stream(self, *a, **k): pass
    def wait_event(self, *a, **k): pass
    def record_event(self, *a, **k): return _NoEvent()
    def synchronize(self): pass
    def query(self): return True


def _shim_streams():
    """CUDA streams and events: megatron-core's MoE dispatchers and shared experts create `torch.cuda.Stream()`
    ('requires CUDA support'); the distributed optimizer and CP use events. On the CPU everything is in order."""
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoEvent
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: _NoStream()


def _shim_spnorm():
    """Without Apex/TE the stock local spec's norm is WrappedTorchNorm, which asserts 'sequence parallel not
    supported by torch LayerNorm'. A norm needs nothing from SP except that its weights are tagged
    `sequence_parallel` so finalize_model_grads all-reduces their partial grads over TP (what TENorm does)."""
    from megatron.core.transformer import torch_norm

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
        if config.layernorm_zero_centered_gamma:  # what megatron-core's own __new__ refuses, refused alike
            raise ValueError("zero_centered_gamma not supported by torch LayerNorm")
        norm_class = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_class(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__


def _shim_moe():
    """MoE on the CPU: moe_utils references `te_general_gemm`, defined only when TE imports (NameError); and the
    alltoall dispatcher converts split sizes to numpy only for CUDA tensors, so gloo's all_to_all_single gets
    tensors ('incompatible function arguments')."""
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


def _shim_arch():
    """megatron.training.arguments.validate_args reads the GPU's architecture when TP or CP > 1
    (get_device_arch_version: 'Found no NVIDIA driver'), then asserts CUDA_DEVICE_MAX_CONNECTIONS=1, which orders
    the communication kernels of a GPU. The CPU has no architecture and no kernels to order."""
    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: 0
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _shim_jit():
    """megatron.training.training.pretrain calls set_jit_fusion_options(), which on torch >= 2.2 only warms up
    megatron-core's torch.compile'd bias-SwiGLU/GeLU and bias-dropout-add on tensors of the run's shapes. On a CPU,
    TorchInductor compiles them to C++ in every process: 2.7 s of the 14.5 s a 3-step tiny run takes on 2 cores,
    for kernels the Litespark layer never calls. A stock layer that calls them compiles them on first use."""
    from megatron.training import training

    training.set_jit_fusion_options = lambda *args, **kwargs: None


_SHIMS = {"compile": _shim_compile, "init": _shim_init, "arch": _shim_arch, "dev": _shim_dev, "rng": _shim_rng,
          "misc": _shim_misc, "mode": _shim_mode, "streams": _shim_streams, "spnorm": _shim_spnorm, "moe": _shim_moe,
          "jit": _shim_jit}
ALL_SHIMS = tuple(_SHIMS)
_applied: set = set()


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
    """megatron-core warns that it does not know the Litespark MLP class (it then passes no tp_group, which
    LitesparkMLP takes from parallel_state); not actionable for a user. (Its import-time TE/Apex fallback warnings
    are dropped by the package's __init__, before megatron-core is first imported.)"""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r"full scope is deprecated.*")

    class _DropUnknownMLP(logging.Filter):
        def filter(self, record):
            return "Unknown MLP type" not in record.getMessage()

    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_DropUnknownMLP())
