"""Architecture knobs through litespark-train: MoE (megatron-core MoELayer, expert parallel), MLA (megatron-core
MLASelfAttention with the Litespark core attention), NSA (the Litespark native sparse attention), NoPE. The same losses in every layout as on one process
(layout-invariant init of experts, router and MLA projections; tolerances as test_parallel_parity.py), and one
clear error for each combination that cannot run."""
import hashlib
import json

import pytest
import torch

from conftest import WORKER_DIR, made_once, ok, parity_run, records, train

BASE = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "1e-2", "--train-iters", "3", "--eval-iters", "0", "--eval-interval",
        "100", "--seed", "1234"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
# Query compression and the latent norms on, so that every MLA module is exercised.
MLA = ["--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "64", "--qk-head-dim", "32",
       "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32", "--qk-layernorm"]
# 4 blocks of 8 in a 32-token sequence: the later queries select 4 of them and see 8 in their window.
NSA = ["--attention-variant", "nsa", "--nsa-block-size", "8", "--nsa-selected-blocks", "4", "--nsa-window", "8"]

LAYOUTS = {
    # megatron-core's default dispatcher (allgather) runs in the TP2 and CP2 layouts below.
    "moe-ep2-alltoall-shared-expert": (2, MOE + ["--moe-shared-expert-intermediate-size", "64"],
                                       ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                        "alltoall"]),
    # The MoE auxiliary loss's gradient under SP (the router sees 1/TP of the sequence) and the distributed
    # optimizer over expert and dense parameters.
    "moe-tp2-sp-ep2-distopt": (4, MOE, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                        "--expert-model-parallel-size", "2", "--use-distributed-optimizer"]),
    "moe-cp2-ep2": (2, MOE, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    # Dense and MoE layers mixed, each virtual stage holding the layers the uneven layout gives it (none: the last).
    "moe-freq-pp2-layout-vpp2": (2, MOE + ["--moe-layer-freq", "[1,1,0,1]"],
                                 ["--pipeline-model-parallel-size", "2",
                                  "--pipeline-model-parallel-layout", "Ett|t|t|L"]),
    "mla-dp2": (2, MLA, []),
    "mla-pp2": (2, MLA, ["--pipeline-model-parallel-size", "2"]),
    "mla-cp2": (2, MLA, ["--context-parallel-size", "2"]),
    # The branch gates are a second column-parallel linear: split by heads with the queries, sequence gathered.
    "nsa-tp2-sp": (2, NSA, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(arch):
        key = tuple(arch)
        if key not in cache:
            name = "architecture-" + hashlib.sha1(repr(key).encode()).hexdigest()[:12]
            cache[key] = made_once(tmp_path_factory, name, lambda run_dir: parity_run(run_dir, 1, BASE + list(arch)))
        return cache[key]
    return get


# MLA under CP attends each query chunk to the gathered keys in two softmax pieces merged by log-sum-exp, on
# the CPU's unfused kernel (q/k and v head dims differ): its rounding differs more from one process than the
# other layouts' (measured 1.6e-5 at step 3 with lr 1e-2, the others 5e-7). A wrong gradient shows as 1e-3.
LOSS_TOLERANCE = {"mla-cp2": 5e-5}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, references, tmp_path):
    nproc, arch, flags = LAYOUTS[layout]
    reference = references(arch)
    got = parity_run(tmp_path, nproc, BASE + arch + flags)
    tolerance = LOSS_TOLERANCE.get(layout, 1e-5)
    for step, (a, b) in enumerate(zip(got["losses"], reference["losses"])):
        assert abs(a - b) <= tolerance, f"{layout} step {step}: loss {a} != single-process {b}"
    for step, (a, b) in enumerate(zip(got["grad_norms"], reference["grad_norms"])):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"{layout} step {step}: grad norm {a} != {b}"


def test_architectures_change_the_model(references):
    """The flags reach the model: MoE, MLA, NSA and the dense model start from different losses."""
    dense, moe, mla, nsa = references([]), references(MOE), references(MLA), references(NSA)
    assert len({round(x["losses"][0], 6) for x in (dense, moe, mla, nsa)}) == 4, (dense, moe, mla, nsa)
    for r in (moe, mla, nsa):
        assert all(l == l and l < 10 for l in r["losses"])


@pytest.mark.parametrize("arch", [MOE + ["--moe-shared-expert-intermediate-size", "64"],
                                  ["--position-embedding-type", "none"]], ids=["moe", "nope"])
def test_litespark_equals_stock_local(references, tmp_path, arch):
    """MoE and NoPE through the Litespark spec compute what megatron-core's stock local layer computes (same
    weights by the layout-invariant init)."""
    litespark = references(arch)
    stock = parity_run(tmp_path, 1, BASE + arch + ["--spec", "stock-local"])
    for step, (a, b) in enumerate(zip(stock["losses"], litespark["losses"])):
        assert abs(a - b) <= 1e-5, f"step {step}: stock {a} != litespark {b}"


@pytest.mark.parametrize("freq, moe_layers", [("2", [0, 2]), ("([0]+[1])*2", [1, 3]), ("[1,1,0,1]", [0, 1, 3])],
                         ids=["every-2nd", "pattern", "list"])
def test_litespark_follows_moe_layer_freq(py, freq, moe_layers):
    """--moe-layer-freq (an int, or Megatron-LM's list pattern) makes the same layers MoE with the Litespark spec
    as with stock's (the rest dense): the same layers, parameters and state-dict keys, the same logits from the
    same weights."""
    proc = py(WORKER_DIR / "spec_worker.py", "litespark", "stock-local", *MOE, "--moe-layer-freq", freq,
              "--transformer-impl", "local", "--no-persist-layer-norm")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["moe_layers_b"] == moe_layers, r  # stock, megatron-core's reading of the flag
    assert r["moe_layers_a"] == r["moe_layers_b"], r
    assert r["numel_a"] == r["numel_b"] and r["same_keys"], r
    assert r["logit_max_abs_diff"] <= 1e-5 * max(1.0, r["logit_max_abs"]) and r["grad_max_rel_diff"] <= 1e-4, r


@pytest.mark.parametrize("layout", [None, "Et|tt|tL", "Ett|t|t|L"], ids=["even", "layout", "layout-vpp2"])
def test_litespark_stages_build_stocks_layers(layout, monkeypatch):
    """Each pipeline stage (and virtual stage) builds the layers stock's block spec builds there, MoE or dense as
    --moe-layer-freq says, with or without --pipeline-model-parallel-layout."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from litespark_megatron.specs import litespark_layer_spec

    stages = 3 if layout == "Et|tt|tL" else 2
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                               moe_ffn_hidden_size=64, moe_layer_freq=[0, 1, 1, 0],
                               pipeline_model_parallel_size=stages, pipeline_dtype=torch.float32,
                               pipeline_model_parallel_layout=layout, transformer_impl="local",
                               use_cpu_initialization=True)
    # The stage as megatron-core's parallel state reports it to both specs, without process groups.
    monkeypatch.setattr(parallel_state, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
                        config.virtual_pipeline_model_parallel_size)

    def kinds(block):
        return ["moe" if getattr(s.submodules.mlp, "func", None) is MoELayer else "dense" for s in block.layer_specs]

    built = []
    for vp_stage in range(config.virtual_pipeline_model_parallel_size or 1):
        for pp_rank in range(stages):
            monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", pp_rank)
            vp = vp_stage if config.virtual_pipeline_model_parallel_size else None
            want = kinds(get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp))
            got = kinds(litespark_layer_spec(config, vp_stage=vp))
            assert got == want, (vp_stage, pp_rank)
            built += got
    assert built == ["dense", "moe", "moe", "dense"]


@pytest.mark.parametrize("freq", [[], ["--moe-layer-freq", "2"]], ids=["all-moe", "every-2nd"])
def test_trainer_counts_the_parameters_it_builds(tmp_path, freq):
    """The run record's parameter count (the FLOP counter's shape) equals the parameters megatron.training built,
    which it prints per model-parallel rank."""
    metrics = tmp_path / "m.jsonl"
    proc = ok(train(1, *BASE, *MOE, *freq, "--metrics-file", metrics))
    start = records(metrics, "run")[0]
    built = int(next(line for line in proc.stdout.splitlines() if "number of parameters on (tensor" in line)
                .rsplit(":", 1)[1])
    assert start["params"] == built and start["flops_per_step_full"] > 0


def test_spec_module_trees():
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from litespark_megatron.layers import LitesparkCoreAttention, LitesparkMLP, LitesparkRMSNorm
    from litespark_megatron.specs import get_litespark_layer_spec

    mla = get_litespark_layer_spec("local", multi_latent_attention=True, q_lora_rank=48, qk_layernorm=True)
    attn = mla.submodules.self_attention.submodules
    assert mla.submodules.self_attention.module is MLASelfAttention
    assert attn.core_attention is LitesparkCoreAttention
    assert attn.q_layernorm is LitesparkRMSNorm and attn.kv_layernorm is LitesparkRMSNorm
    assert attn.linear_q_down_proj is ColumnParallelLinear and attn.linear_kv_down_proj is ColumnParallelLinear
    assert mla.submodules.input_layernorm is LitesparkRMSNorm and mla.submodules.mlp.module is LitesparkMLP
    assert mla.submodules.sharded_state_dict_keys_map == {
        "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
        "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    # Without --qk-layernorm MLA has no latent norms (megatron-core's own MLA specs), nothing to map.
    plain = get_litespark_layer_spec("local", multi_latent_attention=True).submodules
    assert plain.self_attention.submodules.q_layernorm is IdentityOp
    assert plain.self_attention.submodules.kv_layernorm is IdentityOp
    assert plain.sharded_state_dict_keys_map == {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}

    moe = get_litespark_layer_spec("local", num_experts=4).submodules
    # megatron-core 0.19 writes MoE specs as builders (functools.partial), not ModuleSpecs.
    experts = moe.mlp.keywords["submodules"].experts
    assert moe.mlp.func is MoELayer and experts.func is SequentialMLP
    assert experts.keywords["submodules"].linear_fc1 is ColumnParallelLinear
    assert moe.pre_mlp_layernorm is LitesparkRMSNorm  # not fused: the router sits between norm and experts
    assert moe.sharded_state_dict_keys_map == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}


def test_expert_names_are_global():
    """Layout-invariant init draws each expert from its global name, whichever EP rank and expert module hold it."""
    from litespark_megatron.layout_invariant import expert_global_name

    assert expert_global_name("decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight", 1, 2) == \
        "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight"
    # TEGroupedMLP keeps expert i's weight as linear_fc<k>.weight<i>: the same name as SequentialMLP's.
    assert expert_global_name("decoder.layers.3.mlp.experts.linear_fc2.weight0", 1, 2) == \
        "decoder.layers.3.mlp.experts.local_experts.2.linear_fc2.weight"
    assert expert_global_name("decoder.layers.3.mlp.router.weight", 1, 2) == "decoder.layers.3.mlp.router.weight"
    assert expert_global_name("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", 1, 2) == \
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight"


def test_core_attention_with_mla_head_dims():
    """LitesparkCoreAttention with q/k head dim != v head dim and MLA's softmax scale equals explicit attention."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from litespark_megatron.layers import LitesparkCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, attention_dropout=0.0,
                            use_cpu_initialization=True)
    core = LitesparkCoreAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, softmax_scale=0.2,
                                  k_channels=24, v_channels=16)
    g = torch.Generator().manual_seed(0)
    s, b, h = 7, 2, 4
    q, k, v = (torch.randn(s, b, h, d, generator=g) for d in (24, 24, 16))
    got = core(q, k, v)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * 0.2
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, h * 16)
    assert got.shape == (s, b, h * 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("flags, nproc, message", [
    (["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"], 2,
     "--num-query-groups (KV heads) 1 is not divisible by --tensor-model-parallel-size 2: every TP rank holds whole "
     "KV heads"),
    (["--tensor-model-parallel-size", "2", "--padded-vocab-size", "385"], 2, "--padded-vocab-size 385 is not "
     "divisible by --tensor-model-parallel-size 2: every TP rank holds an equal slice of the output layer; give a "
     "multiple of 2, or a TP that divides 385"),
    (["--no-pad-vocab-size"], 1, "--no-pad-vocab-size needs --padded-vocab-size N, the model's vocabulary rows, "
     "which Megatron-LM then builds unpadded (without N it has no vocabulary size for the model): give N, or drop "
     "the flag"),
    (MLA + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "--multi-latent-attention with --tensor-model-parallel-size > 1 needs --transformer-impl transformer_engine"),
    (["--multi-latent-attention", "--qk-layernorm"], 1, "on --transformer-impl local needs --q-lora-rank"),
    (["--multi-latent-attention", "--qk-pos-emb-head-dim", "15"], 1, "--qk-pos-emb-head-dim 15 must be even"),
    (MOE + ["--moe-router-topk", "5"], 1, "--moe-router-topk must be between 1 and --num-experts (4), got 5"),
    (MOE + ["--moe-router-topk", "1"], 1, "Please use --moe-router-pre-softmax when topk is 1"),
    (MOE + ["--moe-grouped-gemm"], 1, "--moe-grouped-gemm needs Transformer Engine (TEGroupedMLP)"),
    (MOE + ["--moe-layer-freq", "[1,0]"], 1, "--moe-layer-freq [1, 0]: give N >= 1 (every N-th layer MoE) or a list "
     "of 0/1, one per layer (4)"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4,
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (["--expert-model-parallel-size", "2"], 2, "num_experts must be non None to use expert model parallelism"),
    (MOE + ["--expert-model-parallel-size", "4"], 2,
     "world size 2 is not divisible by expert-TP x EP x PP = 1 x 4 x 1"),
    (MOE + ["--tensor-model-parallel-size", "2"], 2,
     "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel"),
    (MOE + ["--moe-ffn-hidden-size", "33", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "--moe-ffn-hidden-size 33 is not divisible by the expert tensor-parallel size 2"),
    (MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall"],
     2, "which gloo (the CPU backend) cannot do"),
    (NSA + ["--nsa-block-size", "5"], 1, "--nsa-block-size 5 does not divide --seq-length 32: NSA compresses whole "
     "blocks"),
    (NSA + ["--context-parallel-size", "2"], 2, "--attention-variant nsa has no context parallelism"),
    (NSA + ["--nsa-selected-blocks", "3"], 1, "--nsa-selected-blocks 3: give a power of 2 >= 4"),
    (NSA + ["--nsa-window", "0"], 1, "--nsa-window 0: give a positive number"),
    (NSA + MLA, 1, "--attention-variant nsa and --multi-latent-attention are two attentions: choose one"),
    (NSA + ["--spec", "stock-local"], 1, "--attention-variant nsa is a Litespark layer: it needs --spec litespark, "
     "not stock-local"),
])
def test_combinations_that_cannot_run_are_refused(flags, nproc, message, tmp_path):
    """Refused before any process group (WORLD_SIZE set as torchrun would), one line on stderr, exit 2."""
    from conftest import child_env, free_port

    proc = train(1, *BASE, *flags, "--save", tmp_path / "s", "--save-interval", "10",
                 env=child_env(WORLD_SIZE=nproc, MASTER_PORT=free_port()))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("litespark-train: error: ") and message in last, last
    assert "Traceback" not in proc.stderr and not (tmp_path / "s").exists()
