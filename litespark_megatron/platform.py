"""Where a run goes: CUDA + NCCL when GPUs exist, else CPU + gloo; and the only module that patches a library.

megatron.training (megatron-core 0.19.2) is the trainer. It assumes CUDA throughout; on a CPU-only torch,
`apply_cpu_shims()` maps those assumptions to the CPU, one shim per assumption, each documented with the megatron
function it serves and the failure it fixes, and each tested by reproducing that failure without it
(tests/test_platform.py); two more, `compile` and `jit`, skip start-up costs on the CPU rather than failures.
They are applied only where torch has no CUDA, never on a GPU machine.
`LITESPARK_CPU_SHIMS=none|all|name,name` selects them.

Five library gaps hit any machine and are closed by `prepare_libraries()`:
- `helpers`: megatron.training's initialize compiles the dataset helpers with `make` in the installed package,
  but the wheel ships them compiled and no Makefile, so rank 0 exits 1 before training. The shipped helpers are
  imported instead (a clear error if they are missing).
- `distopt`: resuming megatron-core's distributed optimizer fails with fp32 parameters (its loader copies into
  views of the model's parameters with autograd on: `_load_optimizer_shards_without_autograd`) and, without
  Apex and TE, on torch's Adam (an assert before the first step, then a wrong step count:
  `_resume_distributed_optimizer_on_torch_adam`).
- `wgrad`: megatron-core's own linears (the output layer; every linear of the local backends) fuse weight-gradient
  accumulation only with Apex's `fused_weight_gradient_mlp_cuda`; without Apex, Transformer Engine's GEMM provides
  the same two functions (`provide_wgrad_accumulation_kernel`).
- `children`: megatron-core's checkpoint writer starts helper processes (the results queue's multiprocessing
  Manager, on every save; the persistent async-save worker) that block on queues forever once the trainer is
  killed (SIGKILL, the OOM killer): ~0.7 GB each, left running; data-loader workers linger for seconds
  (`helper_processes_die_with_the_trainer`).
- `rope`: megatron.training builds the model config without --rope-scaling-factor, so Llama 3's RoPE scaling ran
  with factor 8 whatever the flag said (`pass_rope_scaling_factor`).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

# Versions the shims were written against: a test fails when the installed ones differ.
MEGATRON_CORE_VERSION = "0.19.2"


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


@functools.lru_cache(maxsize=None)
def detect() -> Platform:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return Platform("cuda", "nccl", te_importable(), (major, minor) >= (8, 9), torch.cuda.get_device_name())
    return Platform("cpu", "gloo", False, False, "cpu")


def current_device() -> torch.device:
    """This rank's device: its GPU (set by megatron's initialize from LOCAL_RANK), or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------- every machine
def _use_shipped_dataset_helpers() -> None:
    """megatron.training.initialize._compile_dependencies -> megatron.core.datasets.utils.compile_helpers runs
    `make` in the installed package: the wheel has no Makefile (it ships helpers_cpp compiled), so make fails and
    compile_helpers calls sys.exit(1) on rank 0 of every job. Import the shipped module instead."""
    from megatron.core.datasets import utils

    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError as e:
            raise RuntimeError(f"megatron-core's compiled dataset helpers (helpers_cpp) do not import ({e}): "
                               "reinstall megatron-core from a wheel built for this Python") from None

    utils.compile_helpers = compile_helpers


def _resume_distributed_optimizer_on_torch_adam() -> None:
    """Without Apex and TE, megatron-core's DistributedOptimizer wraps torch's Adam, whose step count is a 0-dim
    tensor per parameter (Apex's and TE's keep it per param group). Resuming it fails three ways in 0.19.2:
    - state_dict() takes 'step' from that per-parameter state and asserts it holds one value; load_checkpoint
      asks for it before the first step, when the state is empty (bare `assert len(steps) == 1`): it is 0 there.
    - load_state_dict() puts ONE step tensor into every parameter's state; torch's Adam increments each
      parameter's step in place, so after a resume it advances by the number of parameters per step (bias
      correction off, losses diverge from the uninterrupted run).
    - the dp_reshardable loader copies every state tensor from the checkpoint, 'step' included, though that
      format does not save 'step' (it comes from the param groups): the pre-load placeholder, 0, overwrites the
      restored count.
    Each is fixed where it happens; the DP resume test is bit-exact only with all three."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if distrib_optimizer.HAVE_APEX_OR_TE or getattr(cls.state_dict, "_litespark", False):
        return
    original_state_dict, original_load = cls.state_dict, cls.load_state_dict
    original_set = cls._set_main_param_and_optimizer_states

    def state_dict(self):
        if len(self.optimizer.state) > 0:
            return original_state_dict(self)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self.optimizer.state[p]["step"] = torch.tensor(0.0)
        try:
            return original_state_dict(self)
        finally:
            self.optimizer.state.clear()

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        return original_set(self, model_param, {**tensors, "step": None})  # None: not a tensor, not copied

    state_dict._litespark = True
    cls.state_dict, cls.load_state_dict = state_dict, load_state_dict
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def _load_optimizer_shards_without_autograd() -> None:
    """DistributedOptimizer.load_parameter_state_from_dp_reshardable (the format megatron.training saves by
    default) copies into the main parameters outside no_grad; with fp32 training those are views of the model's
    leaf parameters, and the copy raises 'a view of a leaf Variable that requires grad is being used in an
    in-place operation'. Its sibling loaders carry @torch.no_grad(); this one gets it too."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls.load_parameter_state_from_dp_reshardable
    if getattr(original, "_litespark", False):
        return
    wrapped = torch.no_grad()(original)
    wrapped._litespark = True
    cls.load_parameter_state_from_dp_reshardable = wrapped


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
    """Make megatron-core's own linears accumulate weight gradients into main_grad inside the GEMM, as TE's linears
    do. megatron-core takes that kernel only from Apex's `fused_weight_gradient_mlp_cuda` and refuses
    `gradient_accumulation_fusion` without it; where Apex is absent and Transformer Engine is installed, TE's GEMM
    provides the same two functions. Returns which kernel serves: "apex", "te", or None (neither: the fusion cannot
    run here)."""
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


def pass_rope_scaling_factor() -> None:
    """megatron.training.argument_utils.gpt_config_from_args passes --use-rope-scaling to the GPTModelConfig but
    not --rope-scaling-factor, so the model's Llama 3 RoPE scaling always used the config's default factor, 8: a
    Llama 3.2 model (factor 32) was trained with 8 and exported with 32. The factor is passed too. Idempotent."""
    from megatron.training import argument_utils

    original = argument_utils.gpt_config_from_args
    if getattr(original, "_litespark", False):
        return

    @functools.wraps(original)
    def gpt_config_from_args(args, *rest, **kwargs):
        config = original(args, *rest, **kwargs)
        config.rope_scaling_factor = args.rope_scaling_factor
        return config

    gpt_config_from_args._litespark = True
    argument_utils.gpt_config_from_args = gpt_config_from_args


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
    _use_shipped_dataset_helpers()
    _resume_distributed_optimizer_on_torch_adam()
    _load_optimizer_shards_without_autograd()
    pass_rope_scaling_factor()
    if plat.device_type != "cpu":
        provide_wgrad_accumulation_kernel()
    helper_processes_die_with_the_trainer()
    return plat


# What a scheduler sends every process of a job to stop it or warn of its end (SLURM signals each process of a job
# step; Megatron-LM's --exit-signal is one of these).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


HELPER_PARENT = "LITESPARK_HELPER_PARENT"


def die_with_parent() -> None:
    """In a helper process: the kernel kills it when the process that started it ends, however it ends (Linux
    PR_SET_PDEATHSIG). If that process is already gone, exit now. (The kernel ties the signal to the thread that
    started the helper; torch and megatron-core start these from the trainer's main thread.)
    Its life being the trainer's, it ignores the stop signals: a scheduler's SIGTERM to every process of the job
    would otherwise kill the checkpoint writer's helpers while the trainer, which handles it, saves with them. (A
    data-loader worker that torch gives up on at shutdown and sends SIGTERM then ends with the trainer instead.)"""
    import ctypes
    import signal

    # A spawned helper runs this only after its interpreter started and imported (a second or more): its trainer
    # may have died by then, and its parent is then whoever adopted it (PID 1, or a subreaper: a container's init,
    # a job step's). The trainer's pid, in the environment it was spawned with, says which parent is its own.
    parent = int(os.environ.pop(HELPER_PARENT, 0)) or os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        return  # not Linux: the helpers keep megatron-core's own lifetime
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if parent == 1 or os.getppid() != parent:
        os._exit(0)


@contextlib.contextmanager
def _helpers_born_ignoring_stop_signals():
    """Helpers spawned in this block know their trainer's pid (for die_with_parent) and are born ignoring the stop
    signals. A spawned helper is a fresh interpreter for
    a second or more before `die_with_parent` runs in it, and the save that starts it is typically the one a
    scheduler's SIGTERM asked for, while the scheduler is still signalling every process of the job (node by node):
    the signal killed the helper at birth and failed the save on that rank (seen under CPU load). A signal ignored
    at exec stays ignored (a blocked one does not: spawning clears the mask), so the stop signals are ignored
    around each fork and exec of multiprocessing's spawn, a few milliseconds, and restored at once: a stop signal
    to the trainer inside those milliseconds is lost. Main thread only (signal.signal); elsewhere the signals are
    left alone."""
    import threading
    from multiprocessing import util

    os.environ[HELPER_PARENT] = str(os.getpid())  # for die_with_parent in the helpers spawned here
    try:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        with _stop_signals_ignored_at_spawn(util):
            yield
    finally:
        os.environ.pop(HELPER_PARENT, None)


@contextlib.contextmanager
def _stop_signals_ignored_at_spawn(util):
    import signal

    original = util.spawnv_passfds

    def spawnv_passfds(*args, **kwargs):
        # (None: a handler Python did not install and could not restore: that signal is left alone)
        numbers = (getattr(signal, name) for name in STOP_SIGNALS)
        before = {n: h for n in numbers if (h := signal.getsignal(n)) is not None}
        for number in before:
            signal.signal(number, signal.SIG_IGN)
        try:
            return original(*args, **kwargs)
        finally:
            for number, handler in before.items():
                signal.signal(number, handler)

    util.spawnv_passfds = spawnv_passfds
    try:
        yield
    finally:
        util.spawnv_passfds = original


def _persistent_async_loop(*args, **kwargs):
    """megatron-core's persistent async-save worker loop, in a worker that dies with its trainer."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    die_with_parent()
    return PersistentAsyncCaller.async_loop(*args, **kwargs)


def helper_processes_die_with_the_trainer() -> None:
    """Helper processes end with the trainer, however it ends:
    - every child forked through multiprocessing (data-loader workers, megatron-core's temporal async-save worker)
      runs `die_with_parent` first (multiprocessing's after-fork hook);
    - `filesystem_async.get_write_results_queue()` makes its queue from a spawned `Manager()` on the first save (also
      for synchronous saves); the queue is made here, by a Manager whose server process runs `die_with_parent`
      first. Started lazily, at the first save, as megatron-core does.
    - `PersistentAsyncCaller` (--use-persistent-ckpt-worker) spawns `async_loop`; its target becomes
      `_persistent_async_loop` (module-level, so the spawned process can import it), the same loop after
      `die_with_parent`.
    Idempotent."""
    import multiprocessing.util

    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async

    if getattr(filesystem_async.get_write_results_queue, "__litespark__", False):
        return
    multiprocessing.util.register_after_fork(die_with_parent, lambda function: function())
    original = filesystem_async.get_write_results_queue

    @functools.wraps(original)
    def get_write_results_queue(mp_mode: str = "spawn"):
        if filesystem_async._results_queue is None:
            import multiprocessing.managers

            manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context(mp_mode))
            with _helpers_born_ignoring_stop_signals():
                manager.start(initializer=die_with_parent)
            filesystem_async._results_queue = manager.Queue()
            filesystem_async._litespark_manager = manager  # the queue lives as long as its manager
        return filesystem_async._results_queue

    get_write_results_queue.__litespark__ = True
    filesystem_async.get_write_results_queue = get_write_results_queue

    caller = async_utils.PersistentAsyncCaller
    original_get_process = caller._get_process.__func__

    def _get_process(cls, *args, **kwargs):
        if cls._persistent_process is None:
            loop = cls.__dict__["async_loop"]
            cls.async_loop = staticmethod(_persistent_async_loop)
            try:
                with _helpers_born_ignoring_stop_signals():
                    return original_get_process(cls, *args, **kwargs)
            finally:
                cls.async_loop = loop
        return original_get_process(cls, *args, **kwargs)

    caller._get_process = classmethod(_get_process)


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
