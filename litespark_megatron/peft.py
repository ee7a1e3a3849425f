"""Parameter-efficient fine-tuning: `--peft lora|dora|freeze` on a base model (`--peft-base CKPT`).

What a run does, in megatron.training's model construction (a pre-wrap hook: after the model is built and
initialized, before megatron.training moves, wraps it for data parallelism and builds the optimizer):

    1. the base's tensors are loaded from --peft-base (a Megatron-LM torch_dist checkpoint: a `litespark-convert
       import` or a pretraining run; any layout, dist_checkpointing reshards it);
    2. lora/dora: the target linears of every layer get an adapter (layers/adapters.py), its A drawn from the run's
       seed and the parameter's global name (the same adapters in every TP/PP layout), B = 0 (and DoRA's
       magnitude the base's row norms), so the adapted model starts as the base bit for bit;
    3. everything but the adapters (lora/dora) or the last --trainable-layers K layers (freeze: LLaMA-Factory's
       freeze_trainable_layers; embedding, final norm and output layer frozen) stops requiring gradients.

megatron.training then allocates gradients and optimizer state (the distributed optimizer's shards included) for
the trainable parameters only, and its checkpoints, resume, async saves and --keep-last-checkpoints work as for
pretraining: a checkpoint holds the base's tensors under their own keys and the adapters beside them, or, with
--save-adapters-only (lora/dora), the adapters and their optimizer state alone (platform/checkpoint_contents.py).
`--load` keeps megatron.training's meaning, this run's own checkpoints; --peft-base is read again at every start (a
whole checkpoint's base tensors then replace it, the same tensors). megatron.training's own --freeze-all-layers freezes
every parameter (and turns the distributed optimizer off): what it is for, forward-only use, is not this.

LoRA-plus (--lora-plus-ratio F): B's learning rate (and DoRA's magnitudes', as HF peft's create_loraplus_optimizer
groups the 1-D parameters with B) is F times the run's, through the whole schedule: megatron-core's per-parameter
optimizer overrides (max_lr, min_lr), added to those megatron.training builds (platform/optimizer_overrides.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .errors import ConfigError
from .layers.adapters import TARGETS, AdapterSettings
from .spec_choice import SpecChoice

DEFAULT_RANK = 8  # HF peft's and LLaMA-Factory's default rank; the default alpha is twice the rank (LLaMA-Factory)


@dataclass(frozen=True)
class PeftSettings:
    method: str
    base: str
    adapter: Optional[AdapterSettings]  # lora/dora
    targets: Tuple[str, ...]
    trainable_layers: Optional[int]  # freeze
    lora_plus_ratio: Optional[float]


def settings(args) -> Optional[PeftSettings]:
    """The run's PEFT settings, None without --peft."""
    method = getattr(args, "peft", None)
    if method is None:
        return None
    adapter = None
    if method in ("lora", "dora"):
        rank = args.lora_rank or DEFAULT_RANK
        alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * rank
        adapter = AdapterSettings(method, rank, float(alpha), float(args.lora_dropout or 0.0),
                                  args.lora_scaling == "rs")
    return PeftSettings(method, args.peft_base, adapter, tuple(args.lora_targets or TARGETS),
                        args.trainable_layers, args.lora_plus_ratio)


# --------------------------------------------------------------------------------------------- checks
def check(args) -> None:
    """The PEFT flags against each other and the run (arguments.check calls it); one line each."""
    method = args.peft
    lora_flags = [flag for flag, value in (("--lora-rank", args.lora_rank), ("--lora-alpha", args.lora_alpha),
                                           ("--lora-dropout", args.lora_dropout),
                                           ("--lora-targets", args.lora_targets),
                                           ("--lora-scaling", args.lora_scaling),
                                           ("--lora-plus-ratio", args.lora_plus_ratio)) if value is not None]
    if method not in ("lora", "dora") and lora_flags:
        raise ConfigError(f"{lora_flags[0]} sets the adapters of --peft lora or dora; "
                          f"{'this run has no --peft' if method is None else f'--peft {method} has none'}: add "
                          "--peft lora (or dora), or drop the flag")
    if args.save_adapters_only and method not in ("lora", "dora"):
        raise ConfigError("--save-adapters-only saves the adapters of --peft lora or dora alone: add one, or drop "
                          "the flag")
    if args.save_adapters_only and args.ckpt_format != "torch_dist":
        raise ConfigError(f"--save-adapters-only with --ckpt-format {args.ckpt_format}: it leaves the base out of "
                          "torch_dist checkpoints (Megatron-LM's default format) only; use torch_dist")
    if args.trainable_layers is not None and method != "freeze":
        raise ConfigError("--trainable-layers K trains the last K layers of --peft freeze: add --peft freeze, or "
                          "drop it")
    if method is None:
        if args.peft_base is not None:
            raise ConfigError("--peft-base is the base model of --peft lora|dora|freeze: add --peft, or load a "
                              "checkpoint to train all of it with --load (or --pretrained-checkpoint)")
        return
    if args.peft_base is None:
        raise ConfigError(f"--peft {method} fine-tunes a base model: give --peft-base CKPT (a litespark-convert "
                          "import, or a pretraining run's --save directory)")
    from .checkpoint_dir import latest_checkpoint_dir

    if latest_checkpoint_dir(args.peft_base) is None:
        raise ConfigError(f"--peft-base {args.peft_base}: no checkpoint there (no latest_checkpointed_iteration.txt)")
    same = [flag for flag, path in (("--load", args.load), ("--save", args.save), ("--pretrained-checkpoint",
                                                                                   args.pretrained_checkpoint))
            if path and os.path.abspath(path) == os.path.abspath(args.peft_base)]
    if same:
        raise ConfigError(f"{same[0]} is --peft-base's directory: the base stays as it is; {same[0]} is this run's "
                          "own checkpoints, give it another directory")
    if args.pretrained_checkpoint:
        raise ConfigError("--pretrained-checkpoint with --peft: the base model is --peft-base (megatron.training "
                          "would load the base into the adapted model); drop --pretrained-checkpoint")
    if args.freeze_all_layers:
        raise ConfigError("--freeze-all-layers freezes every parameter (Megatron-LM's forward-only use): --peft "
                          "chooses what trains; drop it")
    for flag, on in (("--init-model-with-meta-device", args.init_model_with_meta_device),
                     ("--use-torch-fsdp2", args.use_torch_fsdp2), ("--use-megatron-fsdp", args.use_megatron_fsdp),
                     ("--mtp-num-layers", bool(args.mtp_num_layers))):
        if on:
            raise ConfigError(f"--peft with {flag}: not supported (the base is loaded into the built model before "
                              "it is wrapped, and only the decoder's layers are adapted or frozen); drop one")
    if method == "freeze":
        k = args.trainable_layers
        if k is None:
            raise ConfigError(f"--peft freeze trains the last layers of the model: give --trainable-layers K (1 to "
                              f"{args.num_layers})")
        if not 1 <= k <= args.num_layers:
            raise ConfigError(f"--trainable-layers {k}: give 1 to {args.num_layers} (the model's layers)")
        if args.save and k < args.num_layers and not args.use_distributed_optimizer:
            # megatron-core's plain optimizer saves its state per parameter, stacked over the layers like the
            # weights: with some layers frozen the stack has holes, which its checkpoint validation refuses at the
            # first save, after the training it would have kept.
            raise ConfigError(f"--peft freeze --trainable-layers {k} with --save: megatron-core's plain optimizer "
                              "cannot save the state of some layers of a stack; add --use-distributed-optimizer (one "
                              "GPU or process is enough)")
        return
    _check_adapters(args)


def _check_adapters(args) -> None:
    spec = SpecChoice.of(args)
    if not spec.is_litespark:
        raise ConfigError(f"--peft {args.peft}: the adapters live in the Litespark layer; --spec "
                          f"{spec.value} builds another: use --spec litespark (the same checkpoint keys)")
    for flag, on in (("--num-experts", bool(args.num_experts)),
                     ("--multi-latent-attention", args.multi_latent_attention),
                     ("--attention-variant nsa", args.attention_variant == "nsa")):
        if on:
            raise ConfigError(f"--peft {args.peft} with {flag}: adapters are written for the dense Llama layer's "
                              "four linears; use --peft freeze, or the dense layer")
    for flag, on in (("--fp8-param-gather", args.fp8_param_gather), ("--tp-comm-overlap", args.tp_comm_overlap),
                     ("--cuda-graph-impl", args.cuda_graph_impl not in ("none", None))):
        if on:
            raise ConfigError(f"--peft {args.peft} with {flag}: not supported with adapters (FP8 base weights, TE's "
                              "fused communication and captured graphs assume the base linears alone); drop it")
    if args.lora_rank is not None and args.lora_rank < 1:
        raise ConfigError(f"--lora-rank {args.lora_rank}: give a rank >= 1")
    if args.lora_alpha is not None and not args.lora_alpha > 0:
        raise ConfigError(f"--lora-alpha {args.lora_alpha:g}: give alpha > 0")
    if args.lora_dropout is not None and not 0 <= args.lora_dropout < 1:
        raise ConfigError(f"--lora-dropout {args.lora_dropout:g}: give a probability in [0, 1)")
    if args.lora_plus_ratio is not None and not args.lora_plus_ratio > 0:
        raise ConfigError(f"--lora-plus-ratio {args.lora_plus_ratio:g}: give B's learning rate over A's, > 0 (LoRA-"
                          "plus uses 2 to 16)")
    unknown = [t for t in args.lora_targets or () if t not in TARGETS]
    if unknown:
        raise ConfigError(f"--lora-targets {unknown[0]}: not a linear of the Litespark layer; choose from "
                          f"{', '.join(TARGETS)}")


def check_checkpoint(args, saved, where: str) -> None:
    """A checkpoint a run loads against its PEFT flags: --load resumes the adapters it holds (the same method, rank
    and targets), and a model whose checkpoint holds adapters is not loaded as if it had none."""
    theirs = getattr(saved, "peft", None)
    adapters_there = theirs in ("lora", "dora")
    if where.startswith("--peft-base"):
        if adapters_there:
            raise ConfigError(f"{where} holds a --peft {theirs} run's adapters, not a base model: merge them first "
                              "(litespark-convert export --merge-adapters, then import) or resume that run with "
                              "--load")
        return
    mine = args.peft if args.peft in ("lora", "dora") else None
    if getattr(saved, "save_adapters_only", False) and not args.save_adapters_only:
        raise ConfigError(f"{where} holds the adapters alone (a --save-adapters-only run): resume it with "
                          "--save-adapters-only and its --peft flags, the base from --peft-base")
    if adapters_there and mine is None:
        raise ConfigError(f"{where} holds a --peft {theirs} run (its adapters beside the base): resume it with the "
                          "same --peft flags and --peft-base, or merge it (litespark-convert export "
                          "--merge-adapters) to train a plain model")
    if mine and adapters_there:
        run, there = settings(args), settings(saved)
        shape = lambda s: (s.method, s.adapter.rank, tuple(sorted(s.targets)))  # noqa: E731
        if shape(run) != shape(there):
            raise ConfigError(f"{where} holds adapters of --peft {theirs}, rank {there.adapter.rank}, targets "
                              f"{','.join(there.targets)}; this run builds --peft {mine}, rank {run.adapter.rank}, "
                              f"targets {','.join(run.targets)}: give the checkpoint's flags")


# --------------------------------------------------------------------------------------------- the model
def attach(model_config, args) -> None:
    """Add the PEFT construction to megatron.training's model (a pre-wrap hook, after the initialization's) and
    LoRA-plus's learning rate to its optimizer."""
    peft = settings(args)
    if peft is None:
        return
    model_config.pre_wrap_hooks.append(lambda chunks: apply(chunks, peft, args))
    if peft.lora_plus_ratio is not None:
        from .platform import add_optimizer_overrides

        add_optimizer_overrides(lambda config: lora_plus_overrides(config, peft.lora_plus_ratio))
    if args.save_adapters_only:
        from .platform import save_trainable_only

        save_trainable_only()


def lora_plus_overrides(config, ratio: float) -> dict:
    """megatron-core optimizer overrides giving B (and DoRA's magnitudes) `ratio` times the learning rate."""
    from megatron.core.optimizer import ParamKey

    key = ParamKey(name=("*.adapter.lora_B.*", "*.adapter.magnitude.*"))
    return {key: {"max_lr": config.lr * ratio, "min_lr": config.min_lr * ratio}}


def apply(chunks, peft: PeftSettings, args):
    """Base loaded, adapters attached (lora/dora), everything else frozen; see the module docstring."""
    load_base(chunks, peft.base, args.dist_ckpt_strictness)
    if peft.adapter is not None:
        for chunk in chunks:
            attach_adapters(chunk, peft.adapter, peft.targets, args.seed)
    for chunk in chunks:
        freeze(chunk, peft)
        if chunk.pre_process and chunk.config.recompute_granularity == "full":
            # megatron-core's full recompute (a reentrant checkpoint) gives its layers' outputs a gradient only if
            # their input has one; the frozen embedding's has none, and nothing after it would train.
            chunk.embedding.register_forward_hook(_output_requires_grad)
    return chunks


def _output_requires_grad(module, inputs, output):
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_()
    return output


def load_base(chunks, directory: str, strictness: str) -> None:
    """The tensors of the base checkpoint (its latest iteration, or its release) into the model chunks, in this
    run's layout."""
    from megatron.core import dist_checkpointing, parallel_state

    from .checkpoint_dir import latest_checkpoint_dir

    checkpoint = latest_checkpoint_dir(directory)
    metadata = dict(dist_checkpointing.load_content_metadata(checkpoint) or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    request = {f"model{i}": chunk.sharded_state_dict(metadata=metadata) for i, chunk in enumerate(chunks)}
    loaded = dist_checkpointing.load(request, checkpoint, strict=strictness)
    if isinstance(loaded, tuple):  # the strictness that also returns the keys it found missing or unexpected
        loaded = loaded[0]
    for i, chunk in enumerate(chunks):
        missing, _ = chunk.load_state_dict(loaded[f"model{i}"], strict=False)
        missing = [key for key in missing if not key.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"--peft-base {directory}: no tensor for {missing[0]}")


def attach_adapters(chunk, settings: AdapterSettings, targets, seed: int) -> None:
    """Wrap the target linears of this chunk's layers and initialize their adapters (see apply)."""
    from megatron.core import parallel_state

    from .layers.adapters import AdaptedLinear, projections

    config = chunk.config
    for layer in chunk.decoder.layers:
        for parent, target in ((layer.self_attention, "linear_qkv"), (layer.self_attention, "linear_proj"),
                               (layer.mlp, "linear_fc1"), (layer.mlp, "linear_fc2")):
            if target not in targets:
                continue
            base = getattr(parent, target)
            tp_group = getattr(base, "tp_group", None)
            if tp_group is None:
                tp_group = parallel_state.get_tensor_model_parallel_group()
            setattr(parent, target, AdaptedLinear(base, projections(target, config), settings, config, tp_group))
    init_adapters(chunk, seed)


@torch.no_grad()
def init_adapters(chunk, seed: int) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (HF peft's kaiming-uniform init of lora_A), drawn whole from the run's seed and
    the parameter's global name and split as this rank holds it; B = 0; DoRA's magnitude = the base's row norms, so
    that the adapted model computes the base exactly."""
    from megatron.core import parallel_state

    from .layers.adapters import AdaptedLinear, deinterleave
    from .layout_invariant import global_name, parameter_generator, shard

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    prefix = {id(module): name for name, module in chunk.named_modules()}
    for module in chunk.modules():
        if not isinstance(module, AdaptedLinear):
            continue
        for name, a in module.adapter.lora_A.items():
            gname = global_name(chunk, f"{prefix[id(module)]}.adapter.lora_A.{name}")
            split = getattr(a, "tensor_model_parallel", False)
            shape = (a.shape[0], a.shape[1] * (tp_size if split else 1))
            bound = 1.0 / shape[1] ** 0.5
            full = torch.empty(shape, dtype=torch.float32, device=a.device).uniform_(
                -bound, bound, generator=parameter_generator(seed, gname, a.device))
            a.copy_(shard(full, 1, 1, tp_rank, tp_size) if split else full)
        for b in module.adapter.lora_B.values():
            b.zero_()
        if module.adapter.magnitude is not None:
            norms = deinterleave(module.row_norm(), module.local_rows(), module.local_groups)
            for m, norm in zip(module.adapter.ordered("magnitude"), norms):
                m.copy_(norm)


def freeze(chunk, peft: PeftSettings) -> None:
    """requires_grad off for all but the adapters (lora/dora) or the last K layers (freeze)."""
    if peft.method == "freeze":
        first = chunk.config.num_layers - peft.trainable_layers
        chunk.requires_grad_(False)
        for layer in chunk.decoder.layers:
            if layer.layer_number - 1 >= first:
                layer.requires_grad_(True)
    else:
        for name, param in chunk.named_parameters():
            param.requires_grad_(".adapter." in name)

