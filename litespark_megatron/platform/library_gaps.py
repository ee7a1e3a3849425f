"""The library gaps every machine hits, closed: megatron-core 0.19.2 (and megatron.training) as installed from its wheel,
without Apex, fails or does something else than asked in these places. Each function says the megatron function it
serves and the failure it fixes; tests/test_platform.py reproduces each failure without it. Idempotent.

- `helpers`: megatron.training's initialize compiles the dataset helpers with `make` in the installed package,
  but the wheel ships them compiled and no Makefile, so rank 0 exits 1 before training. The shipped helpers are
  imported instead (a clear error if they are missing).
- `distopt`: resuming megatron-core's distributed optimizer fails with fp32 parameters (its loader copies into
  views of the model's parameters with autograd on: `load_optimizer_shards_without_autograd`) and, without
  Apex and TE, on torch's Adam (an assert before the first step, then a wrong step count:
  `resume_distributed_optimizer_on_torch_adam`).
- `wgrad`: megatron-core's own linears (the output layer; every linear of the local backends) fuse weight-gradient
  accumulation only with Apex's `fused_weight_gradient_mlp_cuda`; without Apex, Transformer Engine's GEMM provides
  the same two functions (`provide_wgrad_accumulation_kernel`).
- `rope`: megatron.training builds the model config without --rope-scaling-factor, so Llama 3's RoPE scaling ran
  with factor 8 whatever the flag said (`pass_rope_scaling_factor`).
- `help`: a help text of megatron-core's parser has a bare '%', and --help raised (`escape_bare_percent_in_help`).
- `docstrings`: megatron.training builds its parser's config groups from each config dataclass's source, read and
  parsed again every time a parser is built: ~0.3 s of CPU a parse (`read_config_docstrings_once`).
(One more, `children`, has its own module: helper_processes.py.)
"""
from __future__ import annotations

import functools
import re
from typing import Optional

import torch

from .detection import te_importable


def use_shipped_dataset_helpers() -> None:
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


def resume_distributed_optimizer_on_torch_adam() -> None:
    """Without Apex and TE, megatron-core's DistributedOptimizer wraps torch's Adam, whose step count is a 0-dim
    tensor per parameter (Apex's and TE's keep it per param group). Resuming it fails three ways in 0.19.2:
    - state_dict() takes 'step' from that per-parameter state and asserts it holds one value; load_checkpoint
      asks for it before the first step, when the state is empty (bare `assert len(steps) == 1`): it is 0 there.
      A rank whose optimizer holds no parameter at all (a pipeline stage with nothing to train, --peft) never has
      a state, and every save failed on the same assert: its step is 0 too (tests/test_peft.py, freeze).
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
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for p in params or ["no parameter"]:  # torch's state_dict keeps a key that is no parameter as it is
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


def load_optimizer_shards_without_autograd() -> None:
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



def read_config_docstrings_once() -> None:
    """megatron.training's ArgumentGroupFactory reads the help texts of a config dataclass's fields from the class's
    source (inspect.getsource and ast.parse of the class and each of its bases) every time it builds an argument
    group, and megatron.training builds a parser's groups anew at every parse_args: ~0.3 s of CPU a parse, paid
    two or three times by every run and once per flag set by the tools that resolve many (the memory model's
    calibration over 142 measured rows spent 33 of its 38 s there). A class's source does not change while the
    process runs: each class is read once (the same texts, a copy per call). Idempotent."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    original = ArgumentGroupFactory._get_field_docstrings
    if getattr(original, "_litespark", False):
        return
    read = {}

    @functools.wraps(original)
    def _get_field_docstrings(self, src_cfg_class):
        if src_cfg_class not in read:
            read[src_cfg_class] = original(self, src_cfg_class)
        return dict(read[src_cfg_class])

    _get_field_docstrings._litespark = True
    ArgumentGroupFactory._get_field_docstrings = _get_field_docstrings


def escape_bare_percent_in_help(parser) -> None:
    """megatron-core 0.19.2's help of --moe-paged-stash-buffer-size-factor-cuda has a bare '%' ("10%)"), which
    argparse reads as a format directive: --help raised ValueError. Escape bare percent signs in help texts."""
    for action in parser._actions:
        if action.help and "%" in action.help:
            action.help = re.sub(r"%(\([a-z_]+\)[a-z]|%)?", lambda m: m.group(0) if m.group(1) else "%%",
                                 action.help)
