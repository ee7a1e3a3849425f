"""The Litespark layer computes the same function as megatron-core's stock Llama layer."""
import dataclasses
import itertools
import json
import os
import warnings

import pytest
import torch

from conftest import TESTS, WORKER_DIR


def _compare(py, spec_a, spec_b, *flags):
    proc = py(WORKER_DIR / "spec_worker.py", spec_a, spec_b, *flags)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_litespark_local_equals_stock_local(py):
    # Without Apex megatron-core's local layer norms with torch, which has no persistent kernel (on a CPU
    # litespark-train adds the flag itself).
    r = _compare(py, "litespark", "stock-local", "--transformer-impl", "local", "--no-persist-layer-norm")
    assert r["same_keys"], "state-dict keys differ: checkpoints would not be interchangeable"
    assert r["params_compared"] == r["params_a"] == r["params_b"]
    assert r["logit_max_abs_diff"] <= 1e-5 * max(1.0, r["logit_max_abs"])
    assert r["grad_max_rel_diff"] <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the te backend needs a CUDA GPU and Transformer Engine")
@pytest.mark.parametrize("litespark", ["litespark", "litespark --core-attention te"], ids=["sdpa", "te-attention"])
def test_litespark_te_equals_stock_te(py, litespark):
    pytest.importorskip("transformer_engine.pytorch", reason="Transformer Engine is not installed")
    r = _compare(py, litespark, "stock-te", "--transformer-impl", "transformer_engine", "--bf16")
    assert r["same_keys"]
    assert r["logit_max_abs_diff"] <= 2e-2 * max(1.0, r["logit_max_abs"])  # bf16 tolerance
    assert r["grad_max_rel_diff"] <= 5e-2


def test_spec_module_tree():
    """The spec is data: a TransformerLayer whose attention and MLP are the Litespark classes."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from litespark_megatron.layers import LitesparkCoreAttention, LitesparkMLP, LitesparkRMSNorm, LitesparkSelfAttention
    from litespark_megatron.specs import LOCAL_TO_TE_KEYS, get_litespark_layer_spec

    spec = get_litespark_layer_spec(backend="local")
    assert spec.module is TransformerLayer
    sub = spec.submodules
    assert sub.self_attention.module is LitesparkSelfAttention
    assert sub.self_attention.submodules.core_attention is LitesparkCoreAttention
    assert sub.mlp.module is LitesparkMLP
    assert sub.input_layernorm is LitesparkRMSNorm and sub.pre_mlp_layernorm is LitesparkRMSNorm
    assert sub.sharded_state_dict_keys_map == LOCAL_TO_TE_KEYS


def test_te_backend_attention_is_sdpa_or_tes():
    """The te backend runs torch SDPA core attention by default (independent of which attention backends TE can
    load), context parallelism included, and TE's DotProductAttention with core_attention="te" (GQA and MLA); the
    local backend and NSA refuse "te". (megatron-core defines its TE classes even where TE is absent, so the spec
    is data here too.)"""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    from litespark_megatron.arguments import ConfigError
    from litespark_megatron.layers import LitesparkCoreAttention
    from litespark_megatron.layers.nsa import NSASettings
    from litespark_megatron.specs import get_litespark_layer_spec

    def core(backend="te", **kw):
        return get_litespark_layer_spec(backend=backend, **kw).submodules.self_attention.submodules.core_attention

    assert core() is LitesparkCoreAttention
    assert core(multi_latent_attention=True) is LitesparkCoreAttention
    assert core(core_attention="te") is TEDotProductAttention
    assert core(multi_latent_attention=True, core_attention="te") is TEDotProductAttention
    with pytest.raises(ConfigError, match=r"^the Litespark core attention 'te' \(Transformer Engine's "
                                          r"DotProductAttention\) needs the te backend"):
        core("local", core_attention="te")
    with pytest.raises(ConfigError, match="native sparse attention is its own core attention"):
        core(core_attention="te", nsa=NSASettings(8, 4, 8))
    with pytest.raises(ConfigError, match="unknown Litespark core attention 'flash'; choose 'sdpa' or 'te'"):
        core(core_attention="flash")


def test_unknown_backend_and_spec_are_refused():
    from litespark_megatron.arguments import ConfigError, resolve_quietly
    from litespark_megatron.specs import get_litespark_layer_spec

    with pytest.raises(ConfigError, match="unknown Litespark backend 'cuda'"):
        get_litespark_layer_spec(backend="cuda")
    with pytest.raises(ConfigError, match="--spec gpt2: name one of litespark, stock, stock-te, stock-local, or give "
                                          "a module and a function"):
        resolve_quietly(["--model", "tiny", "--spec", "gpt2"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused cross-entropy kernels run on CUDA only")
def test_fused_cross_entropy_equals_unfused(py):
    """--cross-entropy-loss-fusion (both implementations) computes megatron-core's cross-entropy: same per-token
    losses and gradients as the unfused loss, on the same weights, within bf16 rounding."""
    pytest.importorskip("transformer_engine.pytorch", reason="the te implementation needs Transformer Engine")
    proc = py(WORKER_DIR / "loss_fusion_worker.py", "--model", "tiny", "--bf16", "--transformer-impl",
              "transformer_engine")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 5.0 < r["loss_mean"] < 9.0, r  # a fresh model on a 1024 vocabulary: ~ln(1024) = 6.9
    for impl in ("native", "te"):
        assert r[impl]["loss_max_abs_diff"] <= 2e-2, r
        assert r[impl]["grad_max_rel_diff"] <= 2e-2, r


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["rope-gqa", "nope-gqa", "nope-mha"])
def test_litespark_attention_does_not_keep_the_qkv_buffer_for_the_backward(saved_tensors, model):
    """Key and value (and under MHA the query) come out of the QKV projection as views of one buffer. The Litespark
    layer hands the attention copies where they are views, so that what it saves for the backward does not keep the
    whole buffer (with RoPE: the pre-RoPE query and key, 2 (h + hk) d bytes per token and layer) alive.
    Transformer Engine's attention copies its inputs the same way; on an H200 the SDPA path held 3.5 GiB more
    than TE's at llama-3b micro-batch 4, 32 MiB per layer and sequence: the pre-RoPE query and key exactly."""
    r = saved_tensors[model]
    assert r["layers"] == 4 and r["qkv_outputs_kept"] == 0, r


# ---- every option combination builds the recorded layer ----------------------------------------------------------
# tests/fixtures/litespark_layer_specs.json holds, for each combination of the grid below, the layer's submodules
# (classes, params, the checkpoint keys map) or the ConfigError it was refused with, as the layer spec built them when
# the fixture was recorded. After a change to the spec made on purpose, record it again:
#     LITESPARK_RECORD_SPECS=1 python -m pytest tests/test_specs.py -k recorded_layer
# and read the fixture's diff: each changed line is a combination that now builds another layer.
SPEC_FIXTURE = TESTS / "fixtures" / "litespark_layer_specs.json"
SPEC_GRID = dict(backend=("local", "te"), norm=("default", "litespark"), rope=("default", "litespark"),
                 adapters=(False, True), core_attention=("sdpa", "te"),
                 attention=("dense", "mla", "mla-qk", "mla-qk-qlora", "nsa"), mlp=("dense", "moe", "moe-grouped"))


def _grid_options(attention: str, mlp: str) -> dict:
    from litespark_megatron.layers.nsa import NSASettings

    return {**{"dense": {}, "mla": dict(multi_latent_attention=True),
               "mla-qk": dict(multi_latent_attention=True, qk_layernorm=True),
               "mla-qk-qlora": dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=48),
               "nsa": dict(nsa=NSASettings(8, 4, 8))}[attention],
            **{"dense": {}, "moe": dict(num_experts=4),
               "moe-grouped": dict(num_experts=4, moe_grouped_gemm=True)}[mlp]}


def describe_spec(value) -> str:
    """A spec as one line of text: modules by class name, their params and the submodules set, recursively."""
    import enum
    import functools
    import types
    from unittest import mock

    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer.spec_utils import ModuleSpec

    def named(items):
        return ",".join(f"{k}={describe_spec(v)}" for k, v in items)

    if isinstance(value, mock.Mock):  # without Transformer Engine, megatron-core's TE classes are mocks
        return next(name for name, there in vars(transformer_engine).items() if there is value)
    if isinstance(value, ModuleSpec):
        return describe_spec(value.module) + (f"{{{named(sorted(value.params.items()))}}}" if value.params else "") \
            + (f"({describe_spec(value.submodules)})" if value.submodules is not None else "")
    if isinstance(value, functools.partial):
        return f"partial:{describe_spec(value.func)}({named(sorted(value.keywords.items()))})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # the fields the spec sets
        return named((f.name, getattr(value, f.name)) for f in dataclasses.fields(value)
                     if f.default is dataclasses.MISSING or getattr(value, f.name) is not f.default)
    if isinstance(value, dict):
        return f"{{{named(sorted(value.items()))}}}"
    if isinstance(value, (type, types.FunctionType)):
        return value.__qualname__
    if isinstance(value, enum.Enum):
        return value.name
    return repr(value)


def describe_layer(backend: str, **options) -> str:
    """get_litespark_layer_spec's layer, or its refusal, as one line. An MoE layer's MLP is megatron-core's MoE spec
    of the backend (the experts Transformer Engine runs depend on its version), and named as that when it is."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    from litespark_megatron.errors import ConfigError
    from litespark_megatron.specs import get_litespark_layer_spec

    try:
        layer = get_litespark_layer_spec(backend, **options).submodules
    except ConfigError as e:
        return f"ConfigError: {e}"
    if options.get("num_experts"):
        if backend == "te":
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider as stock
        else:
            stock = LocalSpecProvider
        moe = get_moe_module_spec_for_backend(stock(), num_experts=options["num_experts"],
                                              moe_grouped_gemm=options.get("moe_grouped_gemm", False))
        if describe_spec(layer.mlp) == describe_spec(moe):
            grouped = ", grouped GEMM" if options.get("moe_grouped_gemm") else ""
            layer = dataclasses.replace(layer, mlp=f"megatron-core's MoE spec ({backend}{grouped})")
    return describe_spec(layer)


def test_every_option_combination_builds_the_recorded_layer():
    """The option grid: backend x norm x RoPE x adapters x core attention x attention (GQA, MLA with and without
    latent norms and query compression, NSA) x MLP (dense, MoE with and without grouped GEMM), refusals included.
    Each combination builds the layer the fixture recorded (its modules, their params, its checkpoint keys map)."""
    built = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's MoE spec warns about the missing Transformer Engine
        for combo in itertools.product(*SPEC_GRID.values()):
            c = dict(zip(SPEC_GRID, combo))
            built[" ".join(map(str, combo))] = describe_layer(
                c["backend"], norm=c["norm"], rope=c["rope"], adapters=c["adapters"],
                core_attention=c["core_attention"], **_grid_options(c["attention"], c["mlp"]))
    if os.environ.get("LITESPARK_RECORD_SPECS") == "1":
        SPEC_FIXTURE.write_text(json.dumps(built, indent=0) + "\n")
    recorded = json.loads(SPEC_FIXTURE.read_text())
    assert list(recorded) == list(built), "the grid changed: record the fixture again"
    for combo, layer in built.items():
        assert layer == recorded[combo], f"{combo} ({' '.join(SPEC_GRID)}) builds another layer"


@pytest.mark.parametrize("backend", ["local", "te"])
def test_the_block_ends_in_the_providers_norm(backend):
    """The block's final norm is the backend's norm, as every norm of its layers: Litespark's RMSNorm (local) or
    TENorm (te), Litespark's kernel with norm "litespark". The providers are megatron-core's, extended."""
    from types import SimpleNamespace
    from unittest import mock

    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.backends import LocalSpecProvider

    from litespark_megatron.layers import LitesparkRMSNorm
    from litespark_megatron.spec_providers import litespark_spec_provider
    from litespark_megatron.specs import litespark_layer_spec

    assert isinstance(litespark_spec_provider(backend), TESpecProvider if backend == "te" else LocalSpecProvider)
    config = SimpleNamespace(transformer_impl="transformer_engine" if backend == "te" else "local",
                             multi_latent_attention=False, moe_grouped_gemm=False, qk_layernorm=False,
                             num_moe_experts=None, moe_layer_freq=1, num_layers=2, pipeline_model_parallel_layout=None)
    with mock.patch("megatron.core.transformer.transformer_block.get_num_layers_to_build", return_value=2), \
            mock.patch("megatron.core.transformer.transformer_layer.get_transformer_layer_offset", return_value=0), \
            mock.patch("megatron.core.models.gpt.experimental_attention_variant_module_specs.get_moe_layer_pattern",
                       return_value=[0, 0]):
        assert litespark_layer_spec(config).layer_norm is (TENorm if backend == "te" else LitesparkRMSNorm)
        kernel = litespark_layer_spec(config, norm="litespark").layer_norm
    assert kernel.module is LitesparkRMSNorm and kernel.params == {"kernel": "litespark"}
