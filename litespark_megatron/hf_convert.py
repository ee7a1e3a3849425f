"""Hugging Face Llama checkpoints in and out: `litespark-convert import HF_DIR CKPT`, `litespark-convert export CKPT
HF_DIR` and `litespark-convert export-adapter CKPT ADAPTER_DIR`.

import  reads config.json (the model's shape comes from it, not from a preset) and the safetensors shards, and
        writes a Megatron-LM *release* checkpoint with megatron.training's own save_checkpoint (torch_dist format).
        Megatron-LM loads a release checkpoint as it loads every converted one: iteration 0, a fresh optimizer,
        scheduler and data position, in any TP/PP/VP/CP/EP layout (dist_checkpointing reshards at load time).
        Beside it, `model.yaml` holds the model's Megatron-LM flags for `litespark-train --config`, and
        `tokenizer/` the HF tokenizer when the directory has one.
export  reads any Megatron-LM torch_dist checkpoint of a Llama-shaped GPT (the Litespark and stock specs save the
        same keys), whatever layout it was saved in, one layer at a time, and writes config.json,
        generation_config.json, model.safetensors (sharded, with its index) and the tokenizer files. Norms a run
        kept zero-centered (--apply-layernorm-1p: weight = gamma - 1) are written as HF's gamma. A --peft lora|dora
        run exports with --merge-adapters (its adapters merged into the weights); `export-adapter` writes them as
        HF peft's adapter files instead (the adapters' part, at the end of this module).

The two weight layouts that differ (megatron-core's, in every layout; HF's LlamaForCausalLM):
    linear_qkv.weight = for each KV group g: [the query heads of g; k_g; v_g]   <- q_proj, k_proj, v_proj
    linear_fc1.weight = [gate; up]                                             <- gate_proj, up_proj
RoPE needs no permutation (HF's Llama rotates halves, as megatron-core's default RoPE does), and Llama-3 RoPE
scaling is megatron-core's --use-rope-scaling (its low/high frequency factors and original context are Llama 3's:
other values are refused). The vocabulary is stored unpadded; the rows Megatron-LM pads it with for TP are masked
out of the logits (model.py) and dropped on export. Rows a model has beyond its tokenizer's tokens are its own:
model.yaml gives its size (--padded-vocab-size), so none of them is padding.

Memory: import writes each converted tensor into its own file-backed buffer beside the output (the page cache holds
it, not the process), so the process holds about one tensor at a time; export holds one layer and one output shard
(--max-shard-size).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .errors import UserError

PROG = "litespark-convert"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HF_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# megatron-core's llama3 RoPE scaling hard-codes these (RotaryEmbedding._apply_scaling): Llama 3.1, 3.2 and 3.3.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "chat_template.jinja")


class ConversionError(UserError):
    """Input the converter cannot take: one line, exit code 2, nothing written."""


# --------------------------------------------------------------------------------------------- names and layouts
# Megatron checkpoint keys. The layers are stacked on a leading axis (dist_checkpointing's `decoder.layers.…`
# tensors are [num_layers, …]); each maps to the HF names of layer i, in the order they are fused.
LAYER_KEYS = {
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
    "decoder.layers.self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                        "self_attn.v_proj.weight"),
    "decoder.layers.self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",),
    "decoder.layers.mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "decoder.layers.mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
GLOBAL_KEYS = {EMBEDDING: "model.embed_tokens.weight", "decoder.final_layernorm.weight": "model.norm.weight",
               OUTPUT: "lm_head.weight"}


@dataclass(frozen=True)
class Shape:
    """What the weight layouts depend on."""
    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    tied: bool

    def hf_names(self) -> Dict[str, Tuple[int, ...]]:
        """Every tensor of the HF model and its shape."""
        h, d = self.hidden, self.head_dim
        per_layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (self.heads * d, h),
                     "self_attn.k_proj.weight": (self.groups * d, h), "self_attn.v_proj.weight": (self.groups * d, h),
                     "self_attn.o_proj.weight": (h, self.heads * d), "post_attention_layernorm.weight": (h,),
                     "mlp.gate_proj.weight": (self.ffn, h), "mlp.up_proj.weight": (self.ffn, h),
                     "mlp.down_proj.weight": (h, self.ffn)}
        names = {"model.embed_tokens.weight": (self.vocab, h), "model.norm.weight": (h,)}
        if not self.tied:
            names["lm_head.weight"] = (self.vocab, h)
        for i in range(self.layers):
            names.update({f"model.layers.{i}.{n}": s for n, s in per_layer.items()})
        return names

    def fuse(self, key: str, parts: List[torch.Tensor]) -> torch.Tensor:
        """HF tensors (LAYER_KEYS/GLOBAL_KEYS order) -> the megatron tensor of `key`."""
        if key.endswith("linear_qkv.weight"):
            q, k, v = (t.reshape(self.groups, -1, self.hidden) for t in parts)
            return torch.cat([q, k, v], dim=1).reshape(-1, self.hidden)
        if key.endswith("linear_fc1.weight"):
            return torch.cat(parts, dim=0)
        return parts[0]

    def split(self, key: str, tensor: torch.Tensor) -> List[torch.Tensor]:
        """The inverse of fuse."""
        if key.endswith("linear_qkv.weight"):
            per_group = tensor.reshape(self.groups, -1, self.hidden)
            q_rows = self.heads // self.groups * self.head_dim
            q, k, v = per_group.split([q_rows, self.head_dim, self.head_dim], dim=1)
            return [t.reshape(-1, self.hidden) for t in (q, k, v)]
        if key.endswith("linear_fc1.weight"):
            return list(tensor.chunk(2, dim=0))
        return [tensor]


def hf_parts(key: str, layer: Optional[int]) -> Tuple[str, ...]:
    if layer is None:
        return (GLOBAL_KEYS[key],)
    return tuple(f"model.layers.{layer}.{name}" for name in LAYER_KEYS[key])


# --------------------------------------------------------------------------------------------- HF config.json
def _json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    except ValueError as e:
        raise ConversionError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: {what} is not a JSON object")
    return data


def read_config(hf_dir: str) -> dict:
    """config.json of a Llama-shaped HF model, with RoPE normalized to `rope_theta` + `rope_scaling` (transformers
    5 writes both into `rope_parameters`). Anything the Litespark layer does not compute is refused, naming the
    field."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir}: no such directory")
    if not os.path.isfile(path):
        raise ConversionError(f"{hf_dir} is not a Hugging Face model directory: it has no config.json")
    config = _json(path, "the model's config")
    model_type = config.get("model_type")
    if model_type != "llama":
        raise ConversionError(f"{path}: model_type is {model_type!r}; only Llama-architecture models "
                              "(model_type 'llama': Llama 2, 3, 3.1, 3.2) convert")
    refusals = (("attention_bias", False, "attention with biases"), ("mlp_bias", False, "an MLP with biases"),
                ("hidden_act", "silu", "another activation than SwiGLU's silu"),
                ("sliding_window", None, "sliding-window attention"),
                ("qk_norm", False, "query/key norms"))
    for field, llama, what in refusals:
        if config.get(field, llama) not in (llama,):
            raise ConversionError(f"{path}: {field} = {config[field]!r} ({what}); the Litespark layer computes "
                                  f"Llama's ({field} = {llama!r})")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(config.get(field), int) or config[field] <= 0:
            raise ConversionError(f"{path}: {field} is missing or not a positive integer")
    rope = dict(config.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        scaling = None
    else:
        if kind != "llama3":
            raise ConversionError(f"{path}: rope_scaling type {kind!r}; only Llama 3's ('llama3') is supported")
        for field, value in LLAMA3_ROPE.items():
            if float(scaling.get(field, value)) != value:
                raise ConversionError(f"{path}: rope_scaling.{field} = {scaling[field]}; megatron-core's llama3 "
                                      f"RoPE scaling computes {field} = {value:g} (Llama 3.1-3.3's)")
        if not isinstance(scaling.get("factor"), (int, float)):
            raise ConversionError(f"{path}: rope_scaling has no factor")
        scaling = {"rope_type": "llama3", "factor": float(scaling["factor"]), **LLAMA3_ROPE}
    if float(theta) != int(theta):
        raise ConversionError(f"{path}: rope_theta = {theta}; Megatron-LM's --rotary-base takes an integer")
    config["rope_theta"], config["rope_scaling"] = float(theta), scaling
    config.pop("rope_parameters", None)
    return config


def shape_of(config: dict) -> Shape:
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if heads % groups:
        raise ConversionError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{groups}")
    return Shape(config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"], heads, groups,
                 head_dim, config["vocab_size"], bool(config.get("tie_word_embeddings", False)))


def model_flags(config: dict) -> Dict[str, object]:
    """The Megatron-LM flags (without --) of this model: what `model.yaml` holds."""
    from .presets import LLAMA

    shape = shape_of(config)
    flags: Dict[str, object] = {**LLAMA, "norm-epsilon": float(config.get("rms_norm_eps", 1e-6)),
                                "num-layers": shape.layers, "hidden-size": shape.hidden, "ffn-hidden-size": shape.ffn,
                                "num-attention-heads": shape.heads, "kv-channels": shape.head_dim,
                                "max-position-embeddings": int(config.get("max_position_embeddings", 4096)),
                                "rotary-base": int(config["rope_theta"]), "vocab-size": shape.vocab,
                                "untie-embeddings-and-output-weights": not shape.tied}
    if shape.groups != shape.heads:
        flags.update({"group-query-attention": True, "num-query-groups": shape.groups})
    if config["rope_scaling"]:
        flags.update({"use-rope-scaling": True, "rope-scaling-factor": config["rope_scaling"]["factor"]})
    return flags


# --------------------------------------------------------------------------------------------- HF weights
class HfWeights:
    """The tensors of a HF directory: model.safetensors, or the shards its model.safetensors.index.json lists.
    Tensors are read one at a time."""

    def __init__(self, hf_dir: str) -> None:
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.isfile(index):
            weight_map = _json(index, "the shard index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index}: no weight_map")
            self.files = {name: os.path.join(hf_dir, f) for name, f in weight_map.items()}
        elif os.path.isfile(single):
            self.files = None
        else:
            found = glob.glob(os.path.join(hf_dir, "*.safetensors"))
            other = glob.glob(os.path.join(hf_dir, "*.bin")) + glob.glob(os.path.join(hf_dir, "*.pt"))
            if found:
                raise ConversionError(f"{hf_dir}: {len(found)} safetensors shard(s) but no "
                                      "model.safetensors.index.json naming what each holds")
            hint = " (PyTorch .bin weights: load and save_pretrained them with transformers to get safetensors)" \
                if other else ""
            raise ConversionError(f"{hf_dir}: no model.safetensors{hint}")
        self._open: Dict[str, object] = {}
        if self.files is None:
            self.files = {name: single for name in self._handle(single).keys()}
        missing = sorted({f for f in self.files.values() if not os.path.isfile(f)})
        if missing:
            raise ConversionError(f"{hf_dir}: shard {os.path.basename(missing[0])} is listed in "
                                  f"model.safetensors.index.json but missing ({len(missing)} missing in all)")

    def _handle(self, path: str):
        from safetensors import safe_open

        if path not in self._open:
            try:
                self._open[path] = safe_open(path, framework="pt")
            except Exception as e:  # safetensors raises its own SafetensorError for a damaged header
                raise ConversionError(f"{path}: not a readable safetensors file ({e})") from None
        return self._open[path]

    def check(self, expected: Dict[str, Tuple[int, ...]], where: str) -> None:
        """Every tensor config.json implies is here with its shape; nothing else is."""
        missing = [n for n in expected if n not in self.files]
        if missing:
            raise ConversionError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing in all) although "
                                  "config.json implies it")
        # a tied model may still carry its (identical) lm_head; rotary inv_freq buffers are recomputed
        extra = [n for n in self.files if n not in expected and not n.endswith("rotary_emb.inv_freq") and
                 not (n == "lm_head.weight" and "lm_head.weight" not in expected)]
        if extra:
            raise ConversionError(f"{where}: tensor {extra[0]} is not part of a Llama model as config.json describes "
                                  f"it ({len(extra)} such tensors)")
        for name, shape in expected.items():
            actual = tuple(self._handle(self.files[name]).get_slice(name).get_shape())
            if actual != shape:
                raise ConversionError(f"{where}: {name} has shape {list(actual)} but config.json implies "
                                      f"{list(shape)}")

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.files[name]).get_tensor(name)

    def dtype(self) -> Optional[torch.dtype]:
        """The stored dtype of the embedding (from the file's header), None if not bf16/fp16/fp32."""
        name = "model.embed_tokens.weight"
        stored = self._handle(self.files[name]).get_slice(name).get_dtype()
        return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(stored)


# --------------------------------------------------------------------------------------------- one process
@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A gloo world of one (what dist_checkpointing and megatron's save need), destroyed afterwards."""
    from .platform import prepare_libraries

    prepare_libraries()
    started = not torch.distributed.is_initialized()
    if started:
        torch.distributed.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
    try:
        yield
    finally:
        if started:
            torch.distributed.destroy_process_group()


class FileBackedTensors:
    """Tensors in shared file mappings, one file each: the page cache holds them (and writes them back under memory
    pressure), so converting a model larger than host memory stays possible. One file per tensor because the
    checkpoint writer copies a tensor that is a view into a larger storage. The files are deleted on close."""

    def __init__(self, directory: str, dtype: torch.dtype) -> None:
        self.directory, self.dtype = directory, dtype
        os.makedirs(directory)
        self._count = 0

    def new(self, shape) -> torch.Tensor:
        self._count += 1
        path = os.path.join(self.directory, f"{self._count}.bin")
        return torch.from_file(path, shared=True, size=math.prod(shape), dtype=self.dtype).view(shape)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=quiet, file=sys.stderr)


def check_output_target(path: str) -> None:
    """The output must be new or an empty directory, in an existing one."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConversionError(f"{path} exists and is not an empty directory: give a new output directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConversionError(f"{parent}: no such directory for the output")


def start_output(path: str) -> str:
    """The temporary directory the output is built in (renamed to `path` by commit_output): a failure leaves nothing."""
    tmp = os.path.abspath(path).rstrip(os.sep) + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def commit_output(tmp: str, path: str) -> None:
    if os.path.isdir(path):
        os.rmdir(path)  # empty (checked)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------- import
def _import_args(flags: Dict[str, object], save: str, dtype: torch.dtype):
    """megatron.training's args for a model of these flags at TP = PP = 1, set as its global args."""
    from megatron.training.global_vars import set_global_variables

    from .arguments import as_flags, megatron_validate, resolve_quietly

    argv = as_flags({**flags, "spec": "litespark", "transformer-impl": "local", "tokenizer-type": "NullTokenizer",
                     # unpadded: the rows a run pads the vocabulary with depend on its TP (and are masked)
                     "make-vocab-size-divisible-by": 1,
                     "seq-length": min(int(flags["max-position-embeddings"]), 4096), "micro-batch-size": 1,
                     "ckpt-format": "torch_dist", "save": save, "save-interval": 1, "no-save-optim": True,
                     "no-save-rng": True, "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16,
                     "mock-data": True, "skip-train": True, "use-cpu-initialization": True}, "import")
    args = resolve_quietly(argv)
    args.world_size = 1
    with contextlib.redirect_stdout(io.StringIO()):  # Megatron-LM's printout of its arguments
        megatron_validate(args)
        set_global_variables(args, build_tokenizer=True)
    return args


def _meta_model(args):
    """The GPTModel of these args with parameters on the meta device: keys and layouts, no memory."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    from .model import model_config_from_args

    parallel_state.initialize_model_parallel()
    config = model_config_from_args(args)
    config.transformer.perform_initialization = False
    with torch.device("meta"):
        return GPTModelBuilder(config).build_model(ProcessGroupCollection.use_mpu_process_groups())


def _checkpoint_keys(model) -> Dict[str, Tuple[str, Optional[int]]]:
    """parameter name -> (checkpoint key, global layer index or None), as megatron-core's sharded_state_dict keys
    them (its GLU fc1 is a ShardedTensorFactory: key and data, no offsets; the layer comes from the name)."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    keys = {}
    for sharded in model.sharded_state_dict().values():
        name = by_id.get(id(getattr(sharded, "data", None)))
        if name is None:
            continue
        layer = None
        if name.startswith("decoder.layers."):
            layer = model.decoder.layers[int(name.split(".")[2])].layer_number - 1
        keys[name] = (sharded.key, layer)
    return keys


def _replace_parameter(model, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._parameters[leaf]
    new = torch.nn.Parameter(tensor, requires_grad=False)
    new.__dict__.update(old.__dict__)  # tensor-parallel attributes
    module._parameters[leaf] = new


def import_hf(hf_dir: str, out: str, dtype: Optional[str] = None, tokenizer: Optional[str] = None,
              quiet: bool = False) -> Dict[str, object]:
    """HF Llama directory -> Megatron-LM release checkpoint in `out` (+ model.yaml, tokenizer/). Returns the model
    flags."""
    check_output_target(out)
    config = read_config(hf_dir)
    shape = shape_of(config)
    weights = HfWeights(hf_dir)
    weights.check(shape.hf_names(), hf_dir)
    flags = model_flags(config)
    tokenizer_dir = tokenizer or (hf_dir if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")) else None)
    tokenizer_vocab = None if tokenizer_dir is None else _check_tokenizer(tokenizer_dir, shape.vocab)
    torch_dtype = DTYPES[dtype] if dtype else weights.dtype()
    if torch_dtype is None:
        raise ConversionError(f"{hf_dir}: weights stored in another dtype than bf16, fp16 or fp32; give --dtype")
    tmp = start_output(out)
    try:
        with single_process_group():
            from megatron.training.checkpointing import save_checkpoint

            args = _import_args(flags, tmp, torch_dtype)
            model = _meta_model(args)
            keys = _checkpoint_keys(model)
            params = dict(model.named_parameters())
            unknown = sorted(set(params) - set(keys))
            if unknown:
                raise RuntimeError(f"no checkpoint key for parameter {unknown[0]}")
            buffer = FileBackedTensors(os.path.join(tmp, ".import-buffer"), torch_dtype)
            try:
                with _progress(len(params), "import", quiet) as bar:
                    for name, param in params.items():
                        key, layer = keys[name]
                        fused = shape.fuse(key, [weights.get(n) for n in hf_parts(key, layer)])
                        target = buffer.new(tuple(param.shape))
                        target.copy_(fused)
                        _replace_parameter(model, name, target)
                        bar.update()
                # megatron-core saves a GLU fc1 as its two halves [gate; up], views of the parameter, which the
                # checkpoint writer copies into process memory (about half of a Llama's layer weights). Saved
                # whole, fc1 is written from its file as is; a checkpoint stores chunks of a tensor, and a GLU
                # model reads its halves from them in any layout (tests/test_hf_convert.py loads it in TP2 x PP2).
                model.config.gated_linear_unit = False
                with contextlib.redirect_stdout(sys.stderr if not quiet else io.StringIO()):
                    save_checkpoint(0, [model], None, None, 0, release=True)
            finally:
                buffer.close()
        _write_model_yaml(os.path.join(tmp, "model.yaml"), flags, tokenizer_dir and os.path.join(out, "tokenizer"),
                          tokenizer_vocab)
        if tokenizer_dir is not None:
            _copy_tokenizer(tokenizer_dir, os.path.join(tmp, "tokenizer"))
        commit_output(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return flags


def _check_tokenizer(tokenizer_dir: str, vocab: int) -> int:
    """The tokenizer's vocabulary, refused if it outgrows the model's."""
    from .data import DataError, load_tokenizer

    try:
        tok = load_tokenizer("HuggingFaceTokenizer", tokenizer_dir)
    except DataError as e:
        raise ConversionError(f"tokenizer: {e}") from None
    if tok.vocab_size > vocab:
        raise ConversionError(f"{tokenizer_dir}: the tokenizer has {tok.vocab_size} tokens but the model's embedding "
                              f"{vocab} rows (config.json vocab_size): they are not one model's")
    return tok.vocab_size


def _copy_tokenizer(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


def _write_model_yaml(path: str, flags: Dict[str, object], tokenizer_dir: Optional[str],
                      tokenizer_vocab: Optional[int]) -> None:
    import yaml

    data = dict(flags)
    if tokenizer_dir:
        rows = data.pop("vocab-size")  # a HF tokenizer's run takes its size from the tokenizer (padded for TP)
        if tokenizer_vocab < rows:
            # Rows without tokens are the model's all the same: its exact size, none of them padding (model.own_vocab)
            data.update({"padded-vocab-size": rows, "no-pad-vocab-size": True})
        data.update({"tokenizer-type": "HuggingFaceTokenizer", "tokenizer-model": os.path.abspath(tokenizer_dir)})
    else:
        data["tokenizer-type"] = "NullTokenizer"
    header = ("# The model's Megatron-LM flags, from its config.json (litespark-convert import).\n"
              "# litespark-train --config model.yaml --load <this directory> ...\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write(header + yaml.safe_dump(data, sort_keys=False))


# --------------------------------------------------------------------------------------------- export
def checkpoint_dir(path: str) -> str:
    """The checkpoint directory a --load/--save directory's tracker names, or `path` itself if it is one."""
    from .checkpoint_dir import latest_checkpoint_dir

    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    found = latest_checkpoint_dir(path)
    if found is None:
        raise ConversionError(f"{path}: not a Megatron-LM checkpoint (no latest_checkpointed_iteration.txt, and not "
                              "an iter_* directory)")
    if not os.path.isfile(os.path.join(found, "metadata.json")):
        raise ConversionError(f"{found}: not a torch_dist checkpoint (no metadata.json); export reads Megatron-LM's "
                              "default --ckpt-format torch_dist")
    return found


def _checkpoint_shape(args, metadata, vocab: int) -> Shape:
    """The checkpoint's model, refused if it is not a Llama or lacks one of its tensors."""
    shape = model_shape(args, vocab)
    for key in [EMBEDDING, "decoder.final_layernorm.weight", *LAYER_KEYS] + ([] if shape.tied else [OUTPUT]):
        if key not in metadata:
            raise ConversionError(f"the checkpoint has no tensor {key}")
    return shape


def model_shape(args, vocab: int) -> Shape:
    """The model of a checkpoint's arguments, refused if it is not a Llama."""
    llama = args.swiglu and args.normalization == "RMSNorm" and not args.add_bias_linear and \
        not getattr(args, "add_qkv_bias", False) and args.position_embedding_type == "rope" and \
        args.rotary_percent == 1.0 and not args.rotary_interleaved and not args.num_experts and \
        not args.multi_latent_attention and not args.qk_layernorm
    if not llama:
        raise ConversionError("the checkpoint's model is not a Llama (RMSNorm, SwiGLU, no biases, full RoPE, dense, "
                              "no MLA or QK norms), which is what a HF LlamaForCausalLM holds")
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    return Shape(args.num_layers, args.hidden_size, args.ffn_hidden_size, heads, groups,
                 args.kv_channels or args.hidden_size // heads, vocab, not args.untie_embeddings_and_output_weights)


def run_tokenizer_dir(args, directory: str) -> Optional[str]:
    """The HF tokenizer a run trained with: its --tokenizer-model under HuggingFaceTokenizer; the embedded corpus's
    own (that run reads token ids with a NullTokenizer and names the corpus's tokenizer as --tokenizer-model); else
    the tokenizer/ beside an untouched import. None when the run had no HF tokenizer."""
    model = getattr(args, "tokenizer_model", None)
    own = args.tokenizer_type == "HuggingFaceTokenizer" or getattr(args, "embedded_corpus", None)
    if own and model and os.path.isfile(os.path.join(model, "tokenizer.json")):
        return model
    return _imported_tokenizer(directory)


def _imported_tokenizer(directory: str) -> Optional[str]:
    """The tokenizer/ an import writes beside its release checkpoint (the import's own arguments name none: it
    saves with NullTokenizer), None if there is none."""
    found = os.path.join(os.path.dirname(os.path.abspath(directory)), "tokenizer")
    return found if os.path.isfile(os.path.join(found, "tokenizer.json")) else None


def _true_vocab(args, rows: int, vocab: Optional[int]) -> int:
    """The vocabulary without Megatron-LM's TP padding: --vocab-size given to export, else the model's own
    vocabulary with the run's tokenizer as megatron.training builds it (the size whose padded rows the trainer
    masked, model.own_vocab)."""
    from .model import own_vocab

    if vocab is None:
        vocab = own_vocab(args, None)  # the model's size, where the run gave it
    if vocab is None:
        from .data import megatron_tokenizer

        try:
            vocab = megatron_tokenizer(args)[0].vocab_size
        except Exception as e:  # a tokenizer path that is gone, a library that is missing: megatron raises anything
            raise ConversionError(f"cannot build the run's tokenizer ({args.tokenizer_type} {args.tokenizer_model}: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}) to tell the vocabulary "
                                  "without padding: give --vocab-size") from None
    if vocab > rows:
        raise ConversionError(f"--vocab-size {vocab} is larger than the checkpoint's embedding ({rows} rows)")
    return vocab


def hf_config(args, shape: Shape, vocab: int, dtype: torch.dtype, tokenizer=None):
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": float(args.rotary_base)}
    if args.use_rope_scaling:
        rope = {**rope, "rope_type": "llama3", "factor": float(args.rope_scaling_factor), **LLAMA3_ROPE}
    special = {"bos_token_id": None, "eos_token_id": None}  # unknown without the run's tokenizer
    if tokenizer is not None:
        tok, directory = tokenizer
        from .data import special_token_name

        bos = None
        path = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(path):
            bos = tok.vocab.get(special_token_name(_json(path, "the tokenizer's config").get("bos_token")))
        special = {"bos_token_id": bos, "eos_token_id": tok.eod}
    return LlamaConfig(vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.groups, head_dim=shape.head_dim,
                       max_position_embeddings=args.max_position_embeddings, rms_norm_eps=args.layernorm_epsilon,
                       tie_word_embeddings=shape.tied, rope_parameters=rope, dtype=dtype,
                       architectures=["LlamaForCausalLM"], **special)


class ShardWriter:
    """model-0000k-of-0000N.safetensors of at most `max_bytes` each (one tensor larger than that gets its own),
    and model.safetensors.index.json; a single shard is model.safetensors."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: List[List[str]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, os.path.join(self.directory, f"shard-{len(self.shards)}.tmp"),
                  metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.pending:
            self._flush()
        n = len(self.shards)
        if n == 1:
            os.replace(os.path.join(self.directory, "shard-0.tmp"), os.path.join(self.directory, "model.safetensors"))
            return
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.directory, f"shard-{i}.tmp"), os.path.join(self.directory, final))
            weight_map.update({name: final for name in names})
        with open(os.path.join(self.directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)


def _parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = str(text).strip().upper()
    for unit, factor in sorted(units.items(), key=lambda u: -len(u[0])):
        if t.endswith(unit):
            try:
                return int(float(t[:-len(unit)]) * factor)
            except ValueError:
                break
    if t.isdigit():
        return int(t)
    raise ConversionError(f"--max-shard-size {text}: give a size such as 5GB or 500MB")


def checkpoint_arguments(directory: str):
    """The Megatron-LM arguments a torch_dist checkpoint was saved with (in a process group)."""
    from megatron.core import dist_checkpointing

    args = dist_checkpointing.load_common_state_dict(directory).get("args")
    if args is None or isinstance(args, dict):
        raise ConversionError(f"{directory}: the checkpoint has no Megatron-LM arguments (a checkpoint of "
                              "litespark-megatron's old trainer: load it with --finetune and save it once)")
    return args


class CheckpointTensors:
    """The tensors of a torch_dist checkpoint, whole or one layer of the stacked [num_layers, ...] ones (in a
    process group); those it lacks from `base`'s, where given (a --save-adapters-only run's base)."""

    def __init__(self, directory: str, base: Optional["CheckpointTensors"] = None) -> None:
        from megatron.core import dist_checkpointing

        self.directory, self.base = directory, base
        self.own = dist_checkpointing.load_tensors_metadata(directory)
        self.metadata = {**(base.metadata if base else {}), **self.own}

    def __contains__(self, key: str) -> bool:
        return key in self.metadata

    def get(self, key: str, layer: Optional[int] = None) -> torch.Tensor:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        if key not in self.own and self.base is not None:
            return self.base.get(key, layer)
        meta = self.metadata[key]
        if layer is None:
            request = ShardedTensor.from_rank_offsets(key, torch.empty(meta.global_shape, dtype=meta.dtype),
                                                      replica_id=0)
        else:
            # layer i of the stacked [num_layers, ...] tensor: one slice of its first axis
            request = ShardedTensor.from_rank_offsets(key, torch.empty((1, *meta.global_shape[1:]), dtype=meta.dtype),
                                                      (0, layer, meta.global_shape[0]), replica_id=0)
        tensor = dist_checkpointing.load({key: request}, self.directory, validate_access_integrity=False)[key]
        return tensor if layer is None else tensor[0]


def export_hf(ckpt: str, out: str, dtype: Optional[str] = None, vocab: Optional[int] = None,
              tokenizer: Optional[str] = None, max_shard_size: str = "5GB", quiet: bool = False,
              merge_adapters: bool = False, peft_base: Optional[str] = None) -> None:
    """Megatron-LM torch_dist checkpoint (any layout, any Llama spec) -> HF directory `out`. A --peft lora|dora
    run's checkpoint exports with merge_adapters: W + s B A (DoRA: scaled to its magnitudes), a plain HF Llama; a
    --save-adapters-only run's base is read from its --peft-base (or `peft_base`)."""
    check_output_target(out)
    max_bytes = _parse_size(max_shard_size)
    directory = checkpoint_dir(ckpt)
    with single_process_group():

        args = checkpoint_arguments(directory)
        adapters = adapters_of(args, directory, merge_adapters)
        tensors = CheckpointTensors(directory, base_of(args, directory, peft_base))
        metadata = tensors.metadata
        if EMBEDDING not in metadata:
            raise ConversionError(f"the checkpoint has no tensor {EMBEDDING}")
        shape = _checkpoint_shape(args, metadata, _true_vocab(args, metadata[EMBEDDING].global_shape[0], vocab))
        tokenizer_dir = tokenizer or run_tokenizer_dir(args, directory)
        tok = None
        if tokenizer_dir is not None:
            from .data import load_tokenizer

            tok = load_tokenizer("HuggingFaceTokenizer", tokenizer_dir)
        target_dtype = DTYPES[dtype] if dtype else metadata[EMBEDDING].dtype
        # --apply-layernorm-1p: megatron-core's layernorm_zero_centered_gamma (older Megatron-LM kept the flag's name)
        zero_centered = bool(getattr(args, "layernorm_zero_centered_gamma", False) or
                             getattr(args, "apply_layernorm_1p", False))

        def load(key: str, layer: Optional[int]) -> torch.Tensor:
            tensor = tensors.get(key, layer)
            if zero_centered and "norm" in key:
                tensor = tensor + 1  # stored as gamma - 1; HF's RMSNorm weight is gamma
            if adapters is not None and layer is not None:
                tensor = adapters.merged(key, layer, tensor, tensors, shape)
            return tensor

        keys = [(EMBEDDING, None)] + [(k, i) for i in range(shape.layers) for k in LAYER_KEYS] + \
            [("decoder.final_layernorm.weight", None)] + ([] if shape.tied else [(OUTPUT, None)])
        tmp = start_output(out)
        try:
            writer = ShardWriter(tmp, max_bytes)
            with _progress(len(keys), "export", quiet) as bar:
                for key, layer in keys:
                    tensor = load(key, layer)
                    if key in (EMBEDDING, OUTPUT):
                        tensor = tensor[:shape.vocab]  # Megatron-LM's TP padding dropped
                    for name, part in zip(hf_parts(key, layer), shape.split(key, tensor)):
                        writer.add(name, part.to(target_dtype))
                    bar.update()
            writer.finish()
            config = hf_config(args, shape, shape.vocab, target_dtype, tok and (tok, tokenizer_dir))
            config.save_pretrained(tmp)
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            if tokenizer_dir is not None:
                _copy_tokenizer(tokenizer_dir, tmp)
            commit_output(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# --------------------------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Hugging Face Llama checkpoints in and out of Megatron-LM's "
                                                       "torch_dist format.")
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF Llama directory -> Megatron-LM release checkpoint (+ model.yaml)")
    imp.add_argument("hf_dir", help="a HF model directory: config.json and model.safetensors (or shards + index)")
    imp.add_argument("out", help="the checkpoint directory to create (for --load / --pretrained-checkpoint)")
    imp.add_argument("--dtype", choices=list(DTYPES), help="stored dtype (default: the safetensors' own)")
    imp.add_argument("--tokenizer", help="HF tokenizer directory (default: HF_DIR when it holds tokenizer.json)")
    exp = sub.add_parser("export", help="Megatron-LM torch_dist checkpoint -> HF directory")
    exp.add_argument("ckpt", help="a --save directory (its latest checkpoint) or one iter_*/release directory")
    exp.add_argument("out", help="the HF directory to create")
    exp.add_argument("--dtype", choices=list(DTYPES), help="stored dtype (default: the checkpoint's)")
    exp.add_argument("--vocab-size", type=int, help="the vocabulary without TP padding (default: the run's "
                                                    "tokenizer)")
    exp.add_argument("--tokenizer", help="HF tokenizer directory to ship with the model (default: the run's "
                                         "--tokenizer-model when it is one, else an import's tokenizer/ beside "
                                         "the checkpoint)")
    exp.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    exp.add_argument("--merge-adapters", action="store_true",
                     help="a --peft lora|dora run: its adapters merged into the weights (W + s B A; DoRA scaled to "
                          "its magnitudes), a plain HF Llama")
    exp.add_argument("--peft-base", help="a --save-adapters-only run's base checkpoint (default: the run's "
                                         "--peft-base)")
    ada = sub.add_parser("export-adapter", help="a --peft lora|dora checkpoint's adapters -> HF peft adapter "
                                                "directory (adapter_config.json, adapter_model.safetensors)")
    ada.add_argument("ckpt", help="a --save directory (its latest checkpoint) or one iter_* directory")
    ada.add_argument("out", help="the adapter directory to create")
    ada.add_argument("--dtype", choices=list(DTYPES), help="stored dtype (default: the checkpoint's)")
    ada.add_argument("--base-model", help="adapter_config.json's base_model_name_or_path: the HF export of the "
                                          "run's --peft-base, which peft loads the adapter onto")
    for sp in (imp, exp, ada):
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    from .platform import quiet_library_noise

    opts = parser().parse_args(argv)
    quiet_library_noise()
    try:
        if opts.command == "import":
            flags = import_hf(opts.hf_dir, opts.out, opts.dtype, opts.tokenizer, opts.quiet)
            print(f"{PROG}: wrote {opts.out} ({flags['num-layers']} layers, hidden {flags['hidden-size']}, vocabulary "
                  f"{flags['vocab-size']}); train from it with: litespark-train --config "
                  f"{os.path.join(opts.out, 'model.yaml')} --load {opts.out} ...")
        elif opts.command == "export":
            export_hf(opts.ckpt, opts.out, opts.dtype, opts.vocab_size, opts.tokenizer, opts.max_shard_size,
                      opts.quiet, opts.merge_adapters, opts.peft_base)
            print(f"{PROG}: wrote {opts.out}")
        else:

            export_adapter(opts.ckpt, opts.out, opts.dtype, opts.base_model)
            print(f"{PROG}: wrote {opts.out}; load it with peft.PeftModel.from_pretrained(<the base's HF model>, "
                  f"{opts.out!r})")
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0




# ------------------------------------------------------------------ a --peft run's adapters out (HF peft)
# A --peft lora|dora run's adapters out to Hugging Face: as HF peft's adapter files (`litespark-convert
# export-adapter CKPT DIR`: adapter_config.json and adapter_model.safetensors, for peft.PeftModel.from_pretrained on
# the base's HF export), or merged into the weights of a plain HF Llama (`litespark-convert export CKPT DIR
# --merge-adapters`).
# 
# The checkpoint stores each adapter in HF peft's own terms (layers/adapters.py): per layer and HF projection
# (q/k/v/o_proj, gate/up/down_proj) its lora_A [r, in], lora_B [out, r] and, for DoRA, its magnitude [out], so the
# adapter files are a renaming; `use_rslora` and `use_dora` say what the run trained. Merging computes, in fp32 and
# then the output's dtype, what peft's merge_and_unload computes:
# 
#     LoRA  W' = W + s B A                    DoRA  W' = m / ||W + s B A||_row * (W + s B A)
# 
# with B A of the fused QKV and [gate; up] interleaved into megatron-core's fused layout before the export splits it. A
# --save-adapters-only run's checkpoint holds the adapters alone: the merge reads the base from its --peft-base.

HF_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _target(key: str) -> str:
    """decoder.layers.self_attention.linear_qkv.weight -> linear_qkv"""
    return key.rsplit(".", 2)[-2]


class Adapters:
    """A checkpoint's adapters, read one layer and linear at a time."""

    def __init__(self, args) -> None:
        from .peft import settings

        self.peft = settings(args)
        self.dora = self.peft.method == "dora"
        self._whole = {}  # adapter key -> its tensor of every layer (adapters are small: read once each)

    def projections(self, target: str, shape: Shape):
        from .layers.adapters import projections

        return projections(target, SimpleNamespace(num_attention_heads=shape.heads, kv_channels=shape.head_dim,
                                                   num_query_groups=shape.groups, hidden_size=shape.hidden,
                                                   ffn_hidden_size=shape.ffn))

    def read(self, tensors: CheckpointTensors, target: str, shape: Shape,
             layer: int) -> List[Tuple[str, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """(HF projection, A, B, magnitude or None) of `target` in `layer`, in the fused order."""
        prefix = f"decoder.layers.{'mlp' if 'fc' in target else 'self_attention'}.{target}.adapter."

        def get(key):
            if key not in self._whole:
                self._whole[key] = tensors.get(key)
            return self._whole[key][layer]

        found = []
        for name in self.projections(target, shape).names:
            a, b = get(f"{prefix}lora_A.{name}"), get(f"{prefix}lora_B.{name}")
            found.append((name, a, b, get(f"{prefix}magnitude.{name}") if self.dora else None))
        return found

    def merged(self, key: str, layer: int, weight: torch.Tensor, tensors: CheckpointTensors,
               shape: Shape) -> torch.Tensor:
        """The weight of megatron-core's layer tensor `key` with its adapter merged (fp32), or as it is."""
        target = _target(key)
        if not key.endswith(".weight") or target not in self.peft.targets:
            return weight
        from .layers.adapters import interleave

        what = self.projections(target, shape)
        parts = self.read(tensors, target, shape, layer)
        scale = self.peft.adapter.scale
        merged = weight.float() + interleave([b.float() @ a.float() for _, a, b, _ in parts], what.groups, 0) * scale
        if self.dora:
            magnitude = interleave([m.float() for *_, m in parts], what.groups, 0)
            merged = (magnitude / torch.linalg.vector_norm(merged, dim=1)).unsqueeze(1) * merged
        return merged


def adapters_of(args, directory: str, merge: bool) -> Optional[Adapters]:
    """The adapters export merges: those of a --peft lora|dora checkpoint with --merge-adapters; a checkpoint with
    adapters does not export without merging them (its base alone is not what it trained)."""
    method = getattr(args, "peft", None)
    if method in ("lora", "dora"):
        if not merge:
            raise ConversionError(f"{directory} holds a --peft {method} run, its adapters beside the base: add "
                                  "--merge-adapters (a plain HF Llama with them merged), or export them for HF peft "
                                  "with litespark-convert export-adapter")
        return Adapters(args)
    if merge:
        raise ConversionError(f"--merge-adapters: {directory} holds no adapters (no --peft lora|dora run): drop the "
                              "flag")
    return None


def base_of(args, directory: str, peft_base: Optional[str]) -> Optional[CheckpointTensors]:
    """The base tensors of a --save-adapters-only run's checkpoint (which holds its adapters alone): its --peft-base,
    or `peft_base`; None for a checkpoint that holds its model whole."""
    if not getattr(args, "save_adapters_only", False):
        return None
    from .checkpoint_dir import latest_checkpoint_dir

    where = peft_base or args.peft_base
    found = latest_checkpoint_dir(where) if where and os.path.isdir(where) else None
    if found is None:
        raise ConversionError(f"{directory} holds the adapters alone (--save-adapters-only), and its base {where} "
                              "holds no checkpoint: give the base with --peft-base")
    return CheckpointTensors(found)


def adapter_config(peft, base_model: Optional[str]) -> dict:
    """HF peft's LoraConfig of these adapters, as peft's save_pretrained writes its main fields."""
    from .layers.adapters import projections

    adapter = peft.adapter
    alpha = int(adapter.alpha) if float(adapter.alpha).is_integer() else adapter.alpha
    names = sorted({n for target in peft.targets for n in projections(target, _ANY_SHAPE).names})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": adapter.rank, "lora_alpha": alpha, "lora_dropout": adapter.dropout, "target_modules": names,
            "use_rslora": adapter.rslora, "use_dora": peft.method == "dora", "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


# projections' names do not depend on the sizes
_ANY_SHAPE = SimpleNamespace(num_attention_heads=1, kv_channels=1, num_query_groups=1, hidden_size=1,
                             ffn_hidden_size=1)


def export_adapter(ckpt: str, out: str, dtype: Optional[str] = None, base_model: Optional[str] = None) -> None:
    """A --peft lora|dora checkpoint's adapters -> HF peft's adapter directory `out`."""
    from safetensors.torch import save_file

    check_output_target(out)
    directory = checkpoint_dir(ckpt)
    with single_process_group():
        args = checkpoint_arguments(directory)
        method = getattr(args, "peft", None)
        if method not in ("lora", "dora"):
            what = f"a --peft {method} run: its trained layers are the model's, export" if method else \
                "a model without adapters (no --peft lora|dora run): export"
            raise ConversionError(f"{directory} holds {what} it with litespark-convert export")
        tensors = CheckpointTensors(directory)
        shape = model_shape(args, vocab=0)  # (the adapters do not depend on the vocabulary)
        adapters = Adapters(args)
        weights = {}
        for layer in range(shape.layers):
            for target in adapters.peft.targets:
                for name, a, b, m in adapters.read(tensors, target, shape, layer):
                    where = f"base_model.model.model.layers.{layer}.{HF_MODULES[name]}.{name}"
                    weights[f"{where}.lora_A.weight"], weights[f"{where}.lora_B.weight"] = a, b
                    if m is not None:
                        weights[f"{where}.lora_magnitude_vector"] = m
    if dtype:
        weights = {k: v.to(DTYPES[dtype]) for k, v in weights.items()}
    tmp = start_output(out)
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(tmp, ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(adapter_config(adapters.peft, base_model), f, indent=2)
        commit_output(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


if __name__ == "__main__":
    sys.exit(main())
