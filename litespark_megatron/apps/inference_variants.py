"""The precisions the inference benchmark compares, and how each turns a loaded HF Llama into that precision: 16-bit
dtypes, torchao's weight-only int4 (round-to-nearest, HQQ or AWQ-calibrated scales), Litespark's own int4 layer
(round-to-nearest, its Triton kernel for decode), torchao float8 and bitsandbytes NF4. What the weights then occupy
is measured from the tensors that hold them.

torchao's int4 lives in two tensors of one format (asymmetric int4, a bf16 scale and zero per group of 128 input
columns, the "tinygemm" layout): on a CUDA GPU `Int4WeightOnlyConfig` with the tile_packed_to_4d packing (aten's
`_weight_int4pack_mm`; its default plain packing needs the separate mslk kernels), on a CPU the prototype
`PrototypeInt4WeightOnlyConfig` (aten's `_weight_int4pack_mm_for_cpu`). A result names the one that ran.

Only the linear layers of the transformer blocks are quantized (torchao's default filter, `nn.Linear`), and the
output layer only with `quantize_lm_head`: the embedding is a gather and stays 16-bit, as in EfficientLLM's AWQ
checkpoints. A layer whose input width is not a multiple of the group stays 16-bit (torchao skips it); the result
counts them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ..errors import UserError

GROUP_SIZE = 128


@dataclass(frozen=True)
class InferenceVariant:
    name: str
    what: str
    dtype: str  # the activations' and unquantized weights' dtype: "bf16" or "fp16"
    weight_bits: int  # nominal bits per quantized weight (16: nothing is quantized)
    needs_cuda: bool = False
    needs_calibration: bool = False


VARIANTS: Dict[str, InferenceVariant] = {v.name: v for v in (
    InferenceVariant("bf16", "bfloat16 weights and activations", "bf16", 16),
    InferenceVariant("fp16", "float16 weights and activations", "fp16", 16),
    InferenceVariant("int4", "torchao int4 weight-only, group 128, round-to-nearest scales (tinygemm), bf16 "
                             "activations", "bf16", 4),
    InferenceVariant("int4-hqq", "torchao int4 weight-only, group 128, HQQ-optimized scales and zeros, bf16 "
                                 "activations", "bf16", 4),
    InferenceVariant("int4-awq", "torchao AWQ (activation-aware per-channel scales, calibrated on held-out text) "
                                 "over int4 weight-only group 128", "bf16", 4, needs_calibration=True),
    InferenceVariant("int4-litespark", "Litespark int4 weight-only, group 128, round-to-nearest scales and zeros, "
                                       "its Triton kernel for decode (kernels/int4_linear.py), bf16 activations",
                     "bf16", 4),
    InferenceVariant("fp8", "torchao float8 (e4m3) weights and dynamic per-row activations", "bf16", 8,
                     needs_cuda=True),
    InferenceVariant("nf4", "bitsandbytes NF4 weight-only (block 64), bf16 compute", "bf16", 4),
)}
DEFAULT_VARIANTS = ("bf16", "fp16", "int4")


def parse_variant_names(text: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise UserError(f"unknown variant{'s' if len(unknown) > 1 else ''} {', '.join(repr(n) for n in unknown)}; "
                        f"choose from: {', '.join(VARIANTS)} (or 'all')")
    if not names:
        raise UserError("--variants is empty; name at least one of: " + ", ".join(VARIANTS))
    if len(set(names)) != len(names):
        raise UserError(f"--variants names a variant twice: {text}")
    return names


def cannot_run_reason(name: str, cuda_capability: Optional[tuple]) -> Optional[str]:
    """Why variant `name` cannot run on this machine (None: it can). `cuda_capability`: the GPU's (major, minor),
    None without a CUDA GPU. Decided before any process starts, from what is importable and the GPU."""
    import importlib.util

    variant = VARIANTS[name]
    if variant.weight_bits < 16 and variant.name not in ("nf4", "int4-litespark") and \
            importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'litespark-megatron[inference]')"
    if name == "fp8":
        if cuda_capability is None:
            return "float8 matmuls need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); none here"
        if tuple(cuda_capability) < (8, 9):
            return (f"float8 matmuls need compute capability 8.9 or newer; this GPU is "
                    f"{cuda_capability[0]}.{cuda_capability[1]}")
    if name == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install bitsandbytes)"
    return None


# --------------------------------------------------------------------------------------------- quantization
def _int4_config(cuda: bool, algorithm: str):
    """(torchao config, its name as the result records it) of int4 weight-only, group 128, on this device."""
    if cuda:
        from torchao.quantization import Int4WeightOnlyConfig

        return (Int4WeightOnlyConfig(group_size=GROUP_SIZE, int4_packing_format="tile_packed_to_4d",
                                     int4_choose_qparams_algorithm=algorithm),
                f"torchao Int4WeightOnlyConfig(group_size={GROUP_SIZE}, int4_packing_format=tile_packed_to_4d, "
                f"int4_choose_qparams_algorithm={algorithm})")
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    return (PrototypeInt4WeightOnlyConfig(group_size=GROUP_SIZE, int4_choose_qparams_algorithm=algorithm),
            f"torchao PrototypeInt4WeightOnlyConfig(group_size={GROUP_SIZE}, "
            f"int4_choose_qparams_algorithm={algorithm}) (the CPU layout of int4 weight-only)")


def _layer_filter(quantize_lm_head: bool) -> Callable:
    import torch

    def wanted(module, fqn: str) -> bool:
        return isinstance(module, torch.nn.Linear) and (quantize_lm_head or fqn != "lm_head")
    return wanted


def quantize(model, name: str, cuda: bool, calibrate: Optional[Callable] = None,
             quantize_lm_head: bool = False) -> dict:
    """Turn the loaded 16-bit `model` into variant `name` in place (bf16, fp16 and nf4 are what loading made them:
    nothing to do). `calibrate(model)` runs the calibration text through the model (AWQ's observers record the
    activations). Returns what was done: the method's name, the linear layers quantized and those left 16-bit."""
    variant = VARIANTS[name]
    linears = [fqn for fqn, m in model.named_modules() if _layer_filter(True)(m, fqn)]
    if variant.weight_bits == 16:
        return dict(method=f"transformers, {variant.dtype} weights", quantized_layers=0,
                    layers_left_16bit=len(linears))
    if name == "nf4":
        return dict(method="bitsandbytes BitsAndBytesConfig(load_in_4bit, nf4, bf16 compute), applied at loading",
                    quantized_layers=sum(type(m).__name__ == "Linear4bit" for m in model.modules()),
                    layers_left_16bit=sum(type(m).__name__ == "Linear" for m in model.modules()))
    wanted = _layer_filter(quantize_lm_head)
    if name == "int4-litespark":
        return _int4_litespark(model, wanted, len(linears), cuda)
    from torchao.quantization import quantize_

    if name in ("int4", "int4-hqq"):
        config, method = _int4_config(cuda, "hqq" if name == "int4-hqq" else "tinygemm")
        quantize_(model, config, filter_fn=wanted)
    elif name == "int4-awq":
        if calibrate is None:
            raise ValueError("int4-awq needs the calibration text")
        from torchao.prototype.awq import AWQConfig

        base, base_name = _int4_config(cuda, "tinygemm")
        quantize_(model, AWQConfig(base, step="prepare"), filter_fn=wanted)
        calibrate(model)
        quantize_(model, AWQConfig(base, step="convert"), filter_fn=wanted)
        method = f"torchao AWQConfig(base_config={base_name}), calibrated"
    elif name == "fp8":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=wanted)
        method = "torchao Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())"
    else:
        raise ValueError(f"no quantization for variant {name}")
    quantized = [fqn for fqn, m in model.named_modules() if fqn in linears and is_quantized(m.weight)]
    return dict(method=method, quantized_layers=len(quantized), layers_left_16bit=len(linears) - len(quantized))


def _int4_litespark(model, wanted: Callable, linears: int, cuda: bool) -> dict:
    """Each wanted nn.Linear replaced by Litespark's Int4Linear (a layer whose input width is not whole groups stays
    16-bit)."""
    from ..kernels.int4_linear import GROUP, Int4Linear, int4_path

    chosen = [(fqn, m) for fqn, m in model.named_modules() if wanted(m, fqn) and m.in_features % GROUP == 0]
    for fqn, linear in chosen:
        parent, _, attr = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, Int4Linear.from_linear(linear))
    return dict(method=f"litespark Int4Linear(group={GROUP}, round-to-nearest), {int4_path('cuda' if cuda else 'cpu')}",
                quantized_layers=len(chosen), layers_left_16bit=linears - len(chosen))


def is_quantized(weight) -> bool:
    """A torchao tensor subclass (its data are not one plain tensor)."""
    import torch

    return type(weight) not in (torch.Tensor, torch.nn.Parameter) and hasattr(weight, "__tensor_flatten__")


# --------------------------------------------------------------------------------------------- bytes
def tensor_bytes(t) -> int:
    """Bytes a tensor holds: a torchao subclass, those of its inner tensors (packed data, scales, zeros, AWQ's
    activation scale); a bitsandbytes 4-bit parameter, its packed data and its quantization state's tensors."""
    import torch

    if is_quantized(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names if getattr(t, n, None) is not None)
    total = t.numel() * t.element_size()
    state = getattr(t, "quant_state", None)  # bitsandbytes Params4bit
    if state is not None:
        for value in vars(state).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif hasattr(value, "absmax"):  # nested (double-quantized) state
                total += sum(v.numel() * v.element_size() for v in vars(value).values() if isinstance(v, torch.Tensor))
    return total


def weight_bytes(model) -> int:
    """Bytes of the model's parameters as stored, quantization scales and zeros included; a tensor shared by two
    modules (tied embeddings) once."""
    return sum(tensor_bytes(p) for p in model.parameters())


# --------------------------------------------------------------------------------------------- dequantization
def dequantized_weight(linear):
    """The weight a quantized linear layer multiplies by, as a plain tensor [out, in]: the layer applied to the
    identity (so what the kernel computes, whatever the packing), less its bias. AWQ's activation pre-scale is part
    of it. (Litespark's Int4Linear says it itself.)"""
    import torch

    if hasattr(linear, "dequantized"):
        return linear.dequantized()

    eye = torch.eye(linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device)
    out = torch.nn.functional.linear(eye, linear.weight)
    return out.t().contiguous()


def int4_group_scales(weight):
    """The scale of every group of an int4 tinygemm-layout weight, [out, in / group]: torchao keeps scales and
    zeros as one tensor [in / group, out, 2] (scale first)."""
    packed = weight.scale_and_zero
    if packed.ndim != 3 or packed.shape[-1] != 2:
        raise ValueError(f"not a tinygemm scale_and_zero tensor: shape {tuple(packed.shape)}")
    return packed[..., 0].t().contiguous()
