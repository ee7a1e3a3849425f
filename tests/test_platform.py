"""platform.py: each CPU shim fixes a real failure of megatron.training on a CPU-only torch (the run fails without it,
with that exact error in that megatron function; every other test runs with all of them), the library gaps it
closes on every machine, and the versions the shims were written for."""
import inspect
import os
import sys

import pytest
import torch

from conftest import child_env, free_port, run, running, train
from litespark_megatron import platform

F = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "2",
     "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0", "--eval-interval", "10"]
MOE = ["--num-experts", "2", "--moe-token-dispatcher-type", "alltoall"]

# What CUDA says without a GPU: a CPU-only machine's, or a GPU machine's with its GPUs hidden (the suite's CPU pass).
NO_GPU = ("Found no NVIDIA driver", "No CUDA GPUs are available")
# shim -> (processes, extra flags, what megatron raises without it (one of), the megatron function it is raised in)
FAILURES = {
    "init": (1, [], "Megatron requires CUDA.", "initialize_megatron"),
    "arch": (2, ["--tensor-model-parallel-size", "2"], NO_GPU, "get_device_arch_version"),
    "dev": (1, [], "pipeline_model parallel group is not initialized", "get_pipeline_model_parallel_group"),
    "rng": (1, [], NO_GPU, "model_parallel_cuda_manual_seed"),
    "misc": (1, [], NO_GPU, "megatron/core/timers.py"),
    "mode": (1, [], NO_GPU, "program_start_global = torch.tensor("),
    "streams": (1, MOE, "", "token_dispatcher.py"),
    "spnorm": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--spec", "stock-local"],
               "sequence parallel not supported by torch LayerNorm", "torch_norm.py"),
    # torch 2.13 names its own function, torch 2.11 the process group's method it calls
    "moe": (2, MOE + ["--expert-model-parallel-size", "2"], ("all_to_all_single(): incompatible function arguments",
                                                             "alltoall_base(): incompatible function arguments"),
            "mappings.py"),
}


def test_every_shim_has_a_scenario():
    assert set(FAILURES) | {"compile", "jit"} == set(platform.ALL_SHIMS)


def test_jit_shim_skips_only_a_warm_up():
    """`jit` is a cost, not a failure: megatron.training's set_jit_fusion_options does nothing on torch >= 2.2 but
    warm up torch.compile'd fusions (C++ compilation on a CPU), and pretrain reaches it by its module-global name.
    If megatron starts doing more there, or calls it another way, this fails and the shim needs a new look."""
    from megatron.training import initialize, training

    source = inspect.getsource(initialize.set_jit_fusion_options)
    assert "pass  # we're using torch.compile for jit fusion" in source
    assert source.rstrip().endswith("_warmup_jit_function(tp_size=tp_size)"), source
    assert "set_jit_fusion_options(tp_size=args.tensor_model_parallel_size)" in inspect.getsource(training.pretrain)


def test_config_docstrings_are_read_once_per_class_and_are_megatrons(monkeypatch):
    """`docstrings` is a cost, not a failure: megatron.training's ArgumentGroupFactory reads the help texts of a
    config class's fields from the class's source for every parser megatron.training builds. Read once per class,
    they are the texts megatron reads (its own function, with the same classes), each caller gets its own copy, and
    another factory of the class reads no source. If megatron stops reading them there, this fails and the gap
    needs a new look."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import argument_utils

    factory_class = argument_utils.ArgumentGroupFactory
    assert "self._get_field_docstrings(src_cfg_class)" in inspect.getsource(factory_class.__init__)
    platform.read_config_docstrings_once()
    platform.read_config_docstrings_once()  # idempotent: one wrapper
    once = factory_class._get_field_docstrings
    assert once._litespark and not getattr(once.__wrapped__, "_litespark", False)
    reads = []
    getsource = argument_utils.inspect.getsource
    monkeypatch.setattr(argument_utils.inspect, "getsource", lambda obj: reads.append(obj) or getsource(obj))
    first = factory_class(TransformerConfig)
    before = len(reads)
    second = factory_class(TransformerConfig)
    assert len(reads) == before  # the second factory read no source
    assert second.field_docstrings == first.field_docstrings and second.field_docstrings is not first.field_docstrings
    texts = once.__wrapped__(first, TransformerConfig)  # megatron's own reading (its bases through the wrapper)
    assert first.field_docstrings == texts and len(texts) > 100
    assert texts["num_layers"].startswith("Number of transformer layers")


COMPILED_AT_IMPORT = (
    "import sys; from litespark_megatron import platform\n"
    "if sys.argv[1] == 'shim': platform.apply_cpu_shims()\n"
    "import megatron.core, megatron.training.training\n"
    "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu\n"
    "print('torch._inductor' in sys.modules, bias_swiglu.__code__.co_qualname)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims: on a GPU megatron.training needs none")
def test_compile_shim_defers_megatrons_torch_compile(py):
    """`compile` is a cost, not a failure: importing megatron-core decorates its fusions with torch.compile, which
    imports TorchInductor. If megatron stops doing that, the first half fails and the shim can go. With the shim
    the functions are wrappers that compile on their first call."""
    without, with_shim = py("-c", COMPILED_AT_IMPORT, "none"), py("-c", COMPILED_AT_IMPORT, "shim")
    assert without.returncode == 0 and with_shim.returncode == 0, without.stderr[-2000:] + with_shim.stderr[-2000:]
    assert without.stdout.split()[0] == "True", without.stdout
    assert with_shim.stdout.split() == ["False", "_compile_on_first_call.<locals>.call"], with_shim.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims: on a GPU megatron.training needs none")
def test_the_trainer_prepares_the_libraries_before_it_imports_megatron(py):
    """The shim works only for megatron modules imported after it: the trainer's preparation (everything before
    training) must leave TorchInductor unimported, or every trainer start pays for it again."""
    flags = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size",
             "4", "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0", "--eval-interval", "10"]
    proc = py("-c", f"import sys; from litespark_megatron import pretrain; pretrain.prepare({flags!r})\n"
                    "print('megatron.training' in sys.modules, 'torch._inductor' in sys.modules)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["True", "False"], proc.stdout[-2000:]


def test_compile_on_first_call_compiles_once_with_the_callers_options(monkeypatch):
    calls = []
    monkeypatch.setattr(platform, "_TORCH_COMPILE",
                        lambda fn, **options: calls.append(options) or (lambda *a: ("compiled", fn(*a))))

    @platform._compile_on_first_call(dynamic=True)
    def double(x):
        return 2 * x

    assert calls == [] and double.__name__ == "double"
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert calls == [{"dynamic": True}]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims: on a GPU megatron.training needs none")
@pytest.mark.parametrize("shim", list(FAILURES))
def test_shim_fixes_its_failure(shim):
    nproc, flags, message, where = FAILURES[shim]
    without = ",".join(s for s in platform.ALL_SHIMS if s != shim)
    env = child_env(LITESPARK_CPU_SHIMS=without, MASTER_PORT=free_port())
    if shim == "arch":  # refused while the arguments are validated, before any process starts its group
        env["WORLD_SIZE"] = "2"
        nproc = 1
    proc = train(nproc, *F, *flags, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"{shim}: the run passed without its shim"
    messages = message if isinstance(message, tuple) else (message,)
    assert any(m in text for m in messages) and where in text, text[-4000:]


def test_shims_are_idempotent_and_selectable(py):
    code = ("import torch; from litespark_megatron import platform as p; a = p.apply_cpu_shims(); "
            "f = torch.cuda.current_device; b = p.apply_cpu_shims(); "
            "assert a == b and torch.cuda.current_device is f, (a, b); print(','.join(a))")
    proc = py("-c", code, LITESPARK_CPU_SHIMS="dev,misc")
    assert proc.returncode == 0, proc.stderr[-2000:]
    if torch.cuda.is_available():  # never on a machine with CUDA, whatever is asked
        assert proc.stdout.strip() == "", proc.stdout
        return
    assert proc.stdout.strip().splitlines()[-1] == "dev,misc"
    proc = py("-c", "from litespark_megatron import platform as p; p.apply_cpu_shims()", LITESPARK_CPU_SHIMS="dev,gpu")
    assert proc.returncode != 0 and "unknown shim(s) ['gpu']" in proc.stderr


def test_written_for_this_megatron_core():
    """The shims reach into megatron.training's functions by name: a new megatron-core needs them checked again."""
    from importlib.metadata import version

    assert version("megatron-core") == platform.MEGATRON_CORE_VERSION


def test_detect_on_this_machine():
    plat = platform.detect()
    if torch.cuda.is_available():
        assert plat.device_type == "cuda" and plat.dist_backend == "nccl"
    else:
        assert plat == platform.Platform("cpu", "gloo", False, False, "cpu")


def test_dataset_helpers_come_from_the_wheel(py):
    """megatron.training's initialize runs `make` in the installed package (no Makefile there: exit 1 on rank 0);
    the helpers the wheel ships are imported instead."""
    code = ("from litespark_megatron import platform; platform.prepare_libraries()\n"
            "from megatron.core.datasets import utils; utils.compile_helpers()\n"
            "from megatron.core.datasets import helpers_cpp; print('OK', helpers_cpp.__name__)")
    proc = py("-c", code)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("OK"), proc.stderr[-2000:]
    original = run([__import__("sys").executable, "-c",
                    "from megatron.core.datasets.utils import compile_helpers; compile_helpers()"])
    assert original.returncode == 1, "megatron-core's compile_helpers passes again: the workaround can go"


WGRAD_KERNEL = """
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from litespark_megatron import platform

plat = platform.prepare_libraries()
torch.distributed.init_process_group(plat.dist_backend)
parallel_state.initialize_model_parallel(1, 1)
kernel = platform.provide_wgrad_accumulation_kernel()
print("KERNEL", kernel)
if kernel is not None:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)  # the linear's weight init forks the model-parallel RNG stream
    cfg = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, bf16=True,
                            params_dtype=torch.bfloat16, gradient_accumulation_fusion=True)
    linear = ColumnParallelLinear(256, 384, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                  gather_output=False).cuda()
    linear.weight.main_grad = torch.zeros(linear.weight.shape, dtype=torch.float32, device="cuda")
    x = torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 2, 384, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # two micro-batches accumulate
        linear(x)[0].backward(dy)
    want = 2 * (dy.reshape(-1, 384).double().t() @ x.detach().reshape(-1, 256).double())
    err = (linear.weight.main_grad.double() - want).abs().max().item() / want.abs().max().item()
    print("REL ERR", err, "GRAD", linear.weight.grad)
"""


@pytest.mark.gpu
def test_wgrad_accumulation_kernel_needs_apex_or_te(py):
    """megatron-core's own linears fuse weight-gradient accumulation only with Apex's kernel; without Apex it comes
    from TE's GEMM, and with neither (CPU) there is none. On a GPU with TE: main_grad holds the sum of two
    micro-batches' dY^T X (fp32 accumulation of bf16 products: relative error < 1e-2, bf16 inputs), and no bf16
    .grad was written."""
    r = py("-c", WGRAD_KERNEL, MASTER_PORT=free_port())
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith(("KERNEL", "REL ERR"))]
    if not torch.cuda.is_available():
        assert lines == ["KERNEL None"], r.stdout
        return
    assert lines[0] in ("KERNEL te", "KERNEL apex") or not platform.te_importable(), r.stdout
    if platform.te_importable():
        assert lines[1].endswith("GRAD None") and float(lines[1].split()[2]) < 1e-2, r.stdout


def test_megatron_linears_still_take_the_apex_kernel_by_name():
    """provide_wgrad_accumulation_kernel replaces layers.fused_weight_gradient_mlp_cuda and the
    _grad_accum_fusion_available flag: if megatron-core renames either, or stops calling the two functions in its
    linears' backward, the shim no longer serves and this fails."""
    from megatron.core.tensor_parallel import layers

    source = inspect.getsource(layers)
    assert hasattr(layers, "_grad_accum_fusion_available")
    for call in ("fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(",
                 "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16("):
        assert call in source, call


DISTOPT_ON_TORCH_ADAM = """
import sys, torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from litespark_megatron import platform

platform.prepare_libraries() if sys.argv[1] == "fixed" else platform.apply_cpu_shims()
# A file store, not a TCP port: a port taken by another test between its choice and the bind failed this test once.
torch.distributed.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True)
class Tiny(MegatronModule):
    def __init__(self):
        super().__init__(cfg)
        init = torch.nn.init.normal_
        self.a = ColumnParallelLinear(8, 8, config=cfg, init_method=init, bias=False, skip_bias_add=True)
        self.b = ColumnParallelLinear(8, 8, config=cfg, init_method=init, bias=False, skip_bias_add=True)
    def forward(self, x):
        return self.b(self.a(x)[0])[0]
def optimizer():
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), Tiny())
    return model, get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [model])
model, opt = optimizer()
try:  # before the first step: what load_checkpoint asks for
    print("BEFORE FIRST STEP", [g["step"] for g in opt.state_dict()["optimizer"]["param_groups"]])
except AssertionError:
    print("BEFORE FIRST STEP assert")
for _ in range(2):
    model.zero_grad_buffer(); opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
opt.load_state_dict(opt.state_dict())
steps = [s["step"] for s in opt.chained_optimizers[0].optimizer.state.values()]
print("AFTER LOAD", len(steps), "params", len({id(t) for t in steps}), "step tensors", sorted({float(t) for t in steps}))
"""


@pytest.mark.skipif(platform.te_importable(), reason="with TE (or Apex) megatron-core uses their Adam: no gap")
def test_distributed_optimizer_on_torch_adam_resumes(py, tmp_path):
    """Resuming megatron-core's distributed optimizer on torch's Adam: before the first step its state dict
    asserts (load_checkpoint asks for it then), and a loaded state shares one step tensor among all parameters,
    which torch's Adam then increments once per parameter. Fixed: step 0 before the first step; after a load,
    each parameter its own step. (The placeholder-overwrites-step gap is caught by the DP resume test.)"""
    original = py("-c", DISTOPT_ON_TORCH_ADAM, "original", tmp_path / "store-original")
    lines = [line for line in original.stdout.splitlines() if line.startswith(("BEFORE", "AFTER"))]
    assert lines == ["BEFORE FIRST STEP assert", "AFTER LOAD 2 params 1 step tensors [2.0]"], \
        "megatron-core's distributed optimizer on torch Adam changed: recheck the workaround\n" + original.stdout \
        + original.stderr[-3000:]
    fixed = py("-c", DISTOPT_ON_TORCH_ADAM, "fixed", tmp_path / "store-fixed")
    lines = [line for line in fixed.stdout.splitlines() if line.startswith(("BEFORE", "AFTER"))]
    assert lines == ["BEFORE FIRST STEP [0.0]", "AFTER LOAD 2 params 2 step tensors [2.0]"], \
        fixed.stdout + fixed.stderr[-3000:]


HELPERS_OF_A_KILLED_TRAINER = """
import os, signal, sys, time
from litespark_megatron import platform
from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async

if __name__ == "__main__":  # the helpers are spawned: they import this file again
    if sys.argv[1] == "patched":
        platform.helper_processes_die_with_the_trainer()
    filesystem_async.get_write_results_queue()  # what every save does first: a Manager's server process
    async_utils.PersistentAsyncCaller._get_process(0)  # --use-persistent-ckpt-worker's writer
    time.sleep(3)  # both started
    children = []
    for task in os.listdir("/proc/self/task"):
        children += open(f"/proc/self/task/{task}/children").read().split()
    open(sys.argv[2], "w").write(" ".join(children))
    os.kill(os.getpid(), signal.SIGKILL)
"""


HELPERS_SENT_A_STOP_SIGNAL = """
import os, signal, sys, time
from litespark_megatron import platform
from megatron.core.dist_checkpointing.strategies import filesystem_async

if __name__ == "__main__":  # the Manager is spawned: it imports this file again
    if sys.argv[1] == "patched":
        platform.helper_processes_die_with_the_trainer()
    queue = filesystem_async.get_write_results_queue()  # what every save does first: a Manager's server process
    queue.put("before")
    for task in os.listdir("/proc/self/task"):  # what SLURM does: the stop signal to every process of the job
        for child in open(f"/proc/self/task/{task}/children").read().split():
            os.kill(int(child), signal.SIGTERM)
    time.sleep(2)
    try:
        queue.put("after")
        print("QUEUE", queue.get(), queue.get())
    except Exception as e:
        print("QUEUE", type(e).__name__)
"""


def _queue_lines(tmp_path, script_text: str, mode: str):
    """Run a trainer script (one of the above) with MODE; it must exit 0: its process and its QUEUE lines."""
    import sys

    script = tmp_path / "trainer.py"
    script.write_text(script_text)
    proc = run([sys.executable, str(script), mode], timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [line for line in proc.stdout.splitlines() if line.startswith("QUEUE")]


@pytest.mark.parametrize("mode", ["patched", "megatron-core"])
def test_checkpoint_writer_helpers_outlive_a_stop_signal(tmp_path, mode):
    """A scheduler signals every process of a job (SLURM's SIGTERM at a time limit): megatron-core's results-queue
    Manager dies of it, and the save the signal asks for then fails (test_trainer's
    test_a_schedulers_sigterm_to_every_process_saves_and_exits_0); the patched helpers ignore it (they end with the
    trainer instead). The unpatched case must still lose its queue: when it does not, megatron-core fixed it and
    the signal part of the patch can go."""
    proc, result = _queue_lines(tmp_path, HELPERS_SENT_A_STOP_SIGNAL, mode)
    if mode == "patched":
        assert result == ["QUEUE before after"], proc.stdout[-2000:]
    else:
        assert len(result) == 1 and result != ["QUEUE before after"], \
            "megatron-core's results queue now outlives a SIGTERM: the helpers need not ignore stop signals"


HELPER_SIGNALLED_WHILE_STARTING = """
import os, signal, sys, threading, time
from litespark_megatron.platform import helper_processes as platform
from megatron.core.dist_checkpointing.strategies import filesystem_async


def children():
    found = []
    for task in os.listdir("/proc/self/task"):
        try:
            found += open(f"/proc/self/task/{task}/children").read().split()
        except OSError:
            pass
    return found


if __name__ == "__main__":  # the Manager is spawned: it imports this file again
    platform.helper_processes_die_with_the_trainer()
    if sys.argv[1] == "unpatched":
        platform._helpers_born_ignoring_stop_signals = platform.contextlib.nullcontext
    received = []
    signal.signal(signal.SIGTERM, lambda *_: received.append(1))  # the trainer's handler (megatron's)
    stop, hits = threading.Event(), []

    def scheduler():  # SIGTERM to every process of the job, again and again, while the save starts its helper
        while not stop.is_set():
            for child in children():
                try:
                    os.kill(int(child), signal.SIGTERM)
                    hits.append(child)
                except ProcessLookupError:
                    pass
            time.sleep(0.001)

    threading.Thread(target=scheduler, daemon=True).start()
    while not received:  # the trainer itself gets it first, and then starts the save
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
    try:
        queue = filesystem_async.get_write_results_queue()
        queue.put("saved")
        print("QUEUE", queue.get(), "signalled", len(hits) > 0)
    except Exception as e:
        print("QUEUE", type(e).__name__)
    stop.set()
"""


@pytest.mark.parametrize("mode", ["patched", "unpatched"])
def test_a_helper_signalled_while_it_starts_survives(tmp_path, mode):
    """The save a scheduler's SIGTERM asks for starts the results queue's Manager while that SIGTERM is still being
    sent to every process of the job: the helper, a fresh interpreter for a second or more before it can ignore
    the signal, was killed at birth and the save failed on that rank (seen on a loaded CPU). Helpers are now born
    ignoring the stop signals (`_helpers_born_ignoring_stop_signals`); without that (`unpatched`) the same script
    loses the helper, which shows that the test reaches the window."""
    proc, result = _queue_lines(tmp_path, HELPER_SIGNALLED_WHILE_STARTING, mode)
    if mode == "patched":
        assert result == ["QUEUE saved signalled True"], proc.stdout[-2000:] + proc.stderr[-2000:]
    else:
        assert result == ["QUEUE EOFError"], proc.stdout[-2000:] + proc.stderr[-2000:]


HELPER_ORPHANED_BEFORE_IT_STARTED = """
import ctypes, multiprocessing, os, subprocess, sys, threading, time

from litespark_megatron.platform import helper_processes

if __name__ == "__mp_main__":  # the spawned helper importing this file (spawn gives it the trainer's argv)
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(4)  # a slow start (a loaded machine): its trainer dies meanwhile


def helper():  # what megatron-core's checkpoint helpers run first under the patch, then their loop
    helper_processes.die_with_parent()
    time.sleep(120)


if __name__ == "__main__":
    if sys.argv[1] == "reaper":  # a container's init or a job's subreaper: where a dead trainer's orphans go
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        subprocess.run([sys.executable, __file__, "trainer", sys.argv[2]])
        time.sleep(0.5)  # the pid written whole
        pid = int(open(sys.argv[2]).read())
        deadline = time.time() + 60  # its start (4 s, more on a loaded machine), then die_with_parent
        while not (done := os.waitpid(pid, os.WNOHANG)[0]) and time.time() < deadline:
            time.sleep(0.2)
        print("HELPER", "ended" if done else "running")
        if not done:
            os.kill(pid, 9)
    else:
        def killed():  # once the helper runs this file's first lines: it is still starting
            while not os.path.exists(sys.argv[2]):
                time.sleep(0.05)
            os.kill(os.getpid(), 9)

        threading.Thread(target=killed).start()
        with helper_processes._helpers_born_ignoring_stop_signals():  # how the patch spawns them
            multiprocessing.get_context("spawn").Process(target=helper).start()
        time.sleep(60)
"""


def test_a_helper_whose_trainer_died_before_it_started_ends(tmp_path):
    """The trainer killed while a helper it spawned (as the patch spawns megatron-core's) is still importing: when
    die_with_parent runs in the helper, its parent is whoever adopts orphans (a subreaper here, as a container's
    init or a job step's can be; PID 1 only where nothing else is), not the trainer. It must see that its trainer is
    gone and end, not tie its life to the adopter (seen on a loaded 16-core machine: two helpers outlived their
    killed trainer)."""
    script = tmp_path / "reaper.py"
    script.write_text(HELPER_ORPHANED_BEFORE_IT_STARTED)
    proc = run([sys.executable, str(script), "reaper", str(tmp_path / "helper")], env=child_env(), timeout=120)
    assert proc.stdout.split()[-2:] == ["HELPER", "ended"], proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("mode", ["patched", "megatron-core"])
def test_checkpoint_writer_helpers_end_with_a_killed_trainer(tmp_path, mode):
    """megatron-core's checkpoint helper processes (the results queue's Manager, the persistent async-save worker)
    block forever once the trainer is killed; with `helper_processes_die_with_the_trainer` the kernel ends them.
    The unpatched case must still leave them running: when it does not, megatron-core fixed it and the patch can
    go."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "trainer.py"
    script.write_text(HELPERS_OF_A_KILLED_TRAINER)
    listed = tmp_path / "children"
    # No pipes: helpers left running would hold them open.
    proc = subprocess.run([sys.executable, str(script), mode, str(listed)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=120, env=child_env(), start_new_session=True)
    children = [int(pid) for pid in listed.read_text().split()]
    assert proc.returncode == -9 and len(children) >= 2, (proc.returncode, children)
    alive = children
    # Patched: a helper ends once its die_with_parent ran, after its interpreter's imports, which a loaded machine
    # stretches past 10 s (15 test workers on 16 cores: two helpers were still starting); the kernel's signal is
    # immediate after that, reaping is not.
    deadline = time.time() + (60 if mode == "patched" else 3)
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in alive if running(pid)]
    for pid in alive:
        os.kill(pid, 9)
    if mode == "patched":
        assert alive == [], "helpers outlived the killed trainer"
    else:
        assert alive, "megatron-core's helpers now end with a killed trainer: helper_processes_die_with_the_trainer " \
                      "can go"


def _as_a_user_runs_it():
    """The children's environment without the PYTHONWARNINGS=ignore every other test's children get."""
    env = child_env()
    del env["PYTHONWARNINGS"]
    return env


def test_help_starts_with_its_usage_line():
    """megatron-core warns, module by module as it is imported, that Transformer Engine and Apex are absent and
    which fallback it takes: those warnings came before --help's usage line (and before a run's first line). The
    first line is the usage now, and nothing is written to stderr."""
    import sys

    # Twice: Python's compiler warns (SyntaxWarning) about megatron-core's sources when it first byte-compiles them,
    # which pip does at install time; a package unpacked without byte-compiling (--no-compile) shows it once here.
    run([sys.executable, "-m", "litespark_megatron", "--help"], env=_as_a_user_runs_it())
    proc = run([sys.executable, "-m", "litespark_megatron", "--help"], env=_as_a_user_runs_it())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: litespark-train "), proc.stdout[:500]
    assert proc.stderr == "", proc.stderr[:3000]


def test_only_the_library_noise_is_dropped():
    """The filters are the messages of the TE/Apex fallbacks (and megatron's unused MimoModelConfig), nothing wider:
    another warning, even about TE or Apex, is still shown."""
    code = ("import warnings, litespark_megatron\n"
            "warnings.warn('Transformer Engine and Apex are not installed. Falling back to Torch optimizers.')\n"
            "warnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
            "warnings.warn('Only transformer-engine>=1.7.0 supports MoE experts, but your version is 0.0.0. Use local "
            "linear implementation instead.')\n"
            "warnings.warn('MimoModelConfig is experimental and still under active development.')\n"
            "warnings.warn('Only transformer-engine>=1.7.0 supports MoE experts, but your version is 1.6.0.')\n"
            "warnings.warn('Transformer Engine failed to load its library')\n")
    import sys

    proc = run([sys.executable, "-c", code], env=_as_a_user_runs_it())
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = [line for line in proc.stderr.splitlines() if "UserWarning" in line]
    assert [line.split("UserWarning: ")[1] for line in shown] == [
        "Only transformer-engine>=1.7.0 supports MoE experts, but your version is 1.6.0.",
        "Transformer Engine failed to load its library"], proc.stderr


def test_the_compilers_warnings_about_megatrons_sources_are_dropped_and_no_others(tmp_path):
    """A megatron-core installed without byte-compiling (uv's default, pip --no-compile) has Python's compiler warn
    about invalid escapes in its docstrings at the first run (seen on a GPU machine's install): dropped for megatron's
    files only."""
    import sys

    code = ("import litespark_megatron\n"
            f"compile('x = \"\\\\-\"', {str(tmp_path / 'megatron' / 'core' / 'allocator.py')!r}, 'exec')\n"
            f"compile('x = \"\\\\-\"', {str(tmp_path / 'mine' / 'model.py')!r}, 'exec')\n")
    proc = run([sys.executable, "-c", code], env=_as_a_user_runs_it())
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = [line for line in proc.stderr.splitlines() if "SyntaxWarning" in line]
    assert len(shown) == 1 and "mine" in shown[0] and "megatron" not in shown[0], proc.stderr


def test_the_suites_cpu_pass_hides_transformer_engine(tmp_path, py):
    """The CPU pass runs as on a machine without a GPU (conftest.py): a Transformer Engine that is installed does not
    import in its children, nor in the test process; outside the pass it imports."""
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("")
    code = "import transformer_engine; print('imported')"
    path = os.environ["PYTHONPATH"] + os.pathsep + str(tmp_path)
    hidden = py("-c", code, PYTHONPATH=path)
    assert hidden.returncode != 0 and "ModuleNotFoundError: import of transformer_engine halted" in hidden.stderr, \
        hidden.stderr[-2000:]
    found = py("-c", "import importlib.util; print(importlib.util.find_spec('transformer_engine'))", PYTHONPATH=path)
    assert found.stdout.strip() == "None"  # as where it is not installed (HF peft asks so)
    assert py("-c", code, PYTHONPATH=path, LITESPARK_TEST_NO_TE="0").stdout.strip() == "imported"
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        import transformer_engine.pytorch  # noqa: F401
