"""Architecture knobs: MoE (megatron-core MoELayer, expert parallel), MLA (megatron-core MLASelfAttention), NoPE.

The same losses in every layout as on one process (layout-invariant init of experts, router and MLA projections),
the same function as megatron-core's stock layer where one exists, the trainer end to end, and one clear error for
each combination that cannot run."""
import json
import sys

import pytest
import torch

from conftest import TESTS, child_env, free_port, parity_losses, run

# fp32, 4 layers, global batch 8 in micro-batches of 2 (as test_parallel_parity.py).
BASE = ["--model", "tiny", "--seq-length", "32", "--vocab-size", "128", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "1e-2", "--seed", "1234"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
# Query compression on, so that every MLA module (q down/up projections, both latent norms) is exercised.
MLA = ["--multi-latent-attention", "--q-lora-rank", "48"]

LAYOUTS = {
    "moe-dp2": (2, MOE, []),
    "moe-ep2-alltoall": (2, MOE, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]),
    "moe-ep2-allgather-shared-expert": (2, MOE + ["--moe-shared-expert-intermediate-size", "64"],
                                        ["--expert-model-parallel-size", "2"]),
    "moe-tp2-sp-ep2-distopt": (4, MOE, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                        "--expert-model-parallel-size", "2", "--use-distributed-optimizer"]),
    "mla-dp2": (2, MLA, []),
    "mla-tp2-sp": (2, MLA, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "mla-pp2": (2, MLA, ["--pipeline-model-parallel-size", "2"]),
    "mla-cp2": (2, MLA, ["--context-parallel-size", "2"]),
    "moe-cp2-ep2": (2, MOE, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(arch):
        key = tuple(arch)
        if key not in cache:
            cache[key] = parity_losses(tmp_path_factory.mktemp("ref"), 1, BASE + list(arch))
        return cache[key]
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, references, tmp_path):
    nproc, arch, flags = LAYOUTS[layout]
    reference = references(arch)
    got = parity_losses(tmp_path, nproc, BASE + arch + flags)
    for step, (a, b) in enumerate(zip(got["losses"], reference["losses"])):
        assert abs(a - b) <= 1e-5, f"{layout} step {step}: loss {a} != single-process {b}"
    for step, (a, b) in enumerate(zip(got["grad_norms"], reference["grad_norms"])):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"{layout} step {step}: grad norm {a} != {b}"


def test_architectures_change_the_model(references):
    """The flags reach the model: MoE, MLA and the dense model start from different losses."""
    dense, moe, mla = references([]), references(MOE), references(MLA)
    assert len({round(x["losses"][0], 6) for x in (dense, moe, mla)}) == 3, (dense, moe, mla)
    for r in (moe, mla):
        assert all(l == l and l < 10 for l in r["losses"])


def _compare_specs(py, *flags):
    proc = py(TESTS / "spec_worker.py", "litespark", "stock-local", "--transformer-impl", "local", *flags,
              MASTER_PORT=free_port())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flags", [MOE + ["--moe-shared-expert-intermediate-size", "64"],
                                   ["--position-embedding-type", "none"]], ids=["moe", "nope"])
def test_litespark_equals_stock_local(py, flags):
    """MoE and NoPE through the Litespark spec compute what megatron-core's stock local layer computes."""
    r = _compare_specs(py, *flags)
    assert r["same_keys"] and r["params_compared"] == r["params_a"] == r["params_b"]
    assert r["logit_max_abs_diff"] <= 1e-5 * max(1.0, r["logit_max_abs"])
    assert r["grad_max_rel_diff"] <= 1e-4


TRAIN = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "128", "--global-batch-size", "4",
         "--micro-batch-size", "2", "--train-iters", "2", "--log-interval", "1", "--eval-iters", "1"]


@pytest.mark.parametrize("flags", [MLA, MOE + ["--moe-token-dispatcher-type", "alltoall"],
                                   ["--position-embedding-type", "none"]], ids=["mla", "moe", "nope"])
def test_trainer_runs_and_counts_parameters(tmp_path, flags):
    """litespark-train end to end; the model it builds has exactly the parameters the FLOP counter's shape has."""
    from litespark_megatron import config
    from litespark_megatron.metrics.flops import ModelShape, param_count

    metrics = tmp_path / "m.jsonl"
    proc = run([sys.executable, "-m", "litespark_megatron", *TRAIN, *flags, "--metrics-file", metrics],
               env=child_env(MASTER_PORT=free_port()))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    start = next(r for r in records if r["kind"] == "run")
    expected = param_count(ModelShape.from_args(config.resolve(TRAIN + flags), padded_vocab=128))
    assert start["params"] == expected.total
    assert start["flops_per_step_full"] > 0
    val = next(r for r in records if r["kind"] == "val")
    assert 1 < val["ppl"] < 1000


def test_spec_module_trees():
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from litespark_megatron.layers import LitesparkCoreAttention, LitesparkMLP, LitesparkRMSNorm
    from litespark_megatron.specs import get_litespark_layer_spec

    mla = get_litespark_layer_spec("local", multi_latent_attention=True).submodules
    assert mla.self_attention.module is MLASelfAttention
    attn = mla.self_attention.submodules
    assert attn.core_attention is LitesparkCoreAttention
    assert attn.q_layernorm is LitesparkRMSNorm and attn.kv_layernorm is LitesparkRMSNorm
    assert attn.linear_q_down_proj is Linear and attn.linear_kv_down_proj is Linear  # replicated across TP
    assert attn.linear_q_up_proj is ColumnParallelLinear and attn.linear_kv_up_proj is ColumnParallelLinear
    assert mla.input_layernorm is LitesparkRMSNorm and mla.mlp.module is LitesparkMLP
    assert mla.sharded_state_dict_keys_map == {
        "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
        "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}

    moe = get_litespark_layer_spec("local", num_experts=4).submodules
    assert moe.mlp.module is MoELayer and moe.mlp.submodules.experts.module is SequentialMLP
    experts = moe.mlp.submodules.experts.submodules
    assert experts.linear_fc1 is ColumnParallelLinear
    assert moe.pre_mlp_layernorm is LitesparkRMSNorm  # not fused: the router sits between norm and experts
    assert moe.sharded_state_dict_keys_map == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}


def test_expert_names_are_global():
    """Layout-invariant init draws each expert from its global name, whichever EP rank and expert module hold it."""
    from litespark_megatron.model import expert_global_name

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


def test_mla_without_te_needs_the_patch(py):
    """megatron-core 0.16.1 without TE: its MLA module believes TE is there (TELinear is a MagicMock, not a class)
    and fails building; platform.patch_mla_without_te corrects exactly that, once."""
    proc = py("-c", "from megatron.core.transformer import multi_latent_attention as m\n"
                    "from litespark_megatron import platform\n"
                    "print(m.HAVE_TE, isinstance(m.TELinear, type), platform.patch_mla_without_te(), m.HAVE_TE,"
                    " platform.patch_mla_without_te())")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False", "True", "False", "False"], proc.stdout


# --------------------------------------------------------------------------------------------- validation
def check(argv, world=1, cuda=False, te=False):
    from litespark_megatron.config import resolve, validate

    validate(resolve(argv), world, cuda=cuda, te=te, fp8_capable=cuda)


@pytest.mark.parametrize("argv, world, message", [
    (["--num-query-groups", "1", "--tensor-model-parallel-size", "2"], 2,
     "--num-query-groups (KV heads) 1 is not divisible by --tensor-model-parallel-size 2: megatron-core's attention "
     "gives every TP rank whole KV heads (MQA has one KV head)"),
    (MLA + ["--tensor-model-parallel-size", "2"], 2, "with --tensor-model-parallel-size > 1 needs --sequence-parallel"),
    (MLA + ["--tensor-model-parallel-size", "8", "--sequence-parallel"], 8,
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"),
    (MLA + ["--num-query-groups", "2"], 1, "--num-query-groups 2 has no meaning with --multi-latent-attention"),
    (MLA + ["--position-embedding-type", "none"], 1, "cannot be combined with --multi-latent-attention"),
    (MLA + ["--qk-pos-emb-head-dim", "15"], 1, "--qk-pos-emb-head-dim 15 must be even"),
    (MLA + ["--spec", "stock-local"], 1, "--spec stock-local cannot build MLA"),
    (["--kv-lora-rank", "64"], 1, "--kv-lora-rank needs --multi-latent-attention"),
    (["--moe-router-topk", "2"], 1, "--moe-router-topk needs --num-experts"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, "--num-experts 6 is not divisible by "
     "--expert-model-parallel-size 4"),
    (MOE + ["--expert-model-parallel-size", "4"], 2, "world size 2 is not divisible by TP x EP x PP = 1 x 4 x 1"),
    (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 needs an MoE model"),
    (MOE + ["--moe-router-topk", "5"], 1, "--moe-router-topk must be between 1 and --num-experts (4), got 5"),
    (MOE + ["--moe-router-topk", "1"], 1, "--moe-router-topk 1 needs --moe-router-pre-softmax"),
    (MOE + ["--tensor-model-parallel-size", "2"], 2, "MoE with --tensor-model-parallel-size > 1 needs "
     "--sequence-parallel"),
    (MOE + ["--moe-grouped-gemm"], 1, "--moe-grouped-gemm needs Transformer Engine"),
    (MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall"],
     2, "which gloo (the CPU backend) cannot do"),
    (MOE + ["--moe-ffn-hidden-size", "33", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "--moe-ffn-hidden-size 33 must be >= 1 and divisible by TP 2"),
])
def test_combinations_that_cannot_run_are_refused(argv, world, message):
    from litespark_megatron.config import ConfigError

    with pytest.raises(ConfigError) as e:
        check(argv, world)
    assert message in str(e.value)


def test_architecture_defaults_are_resolved():
    from litespark_megatron.config import resolve

    mla = resolve(MLA[:1])
    # Head dim 128 / 4 = 32: DeepSeek-V2 proportions, no query compression.
    assert (mla.qk_head_dim, mla.v_head_dim, mla.qk_pos_emb_head_dim, mla.kv_lora_rank, mla.q_lora_rank) == \
        (32, 32, 16, 128, None)
    assert mla.num_query_groups == mla.num_attention_heads
    moe = resolve(["--num-experts", "8"])
    assert (moe.moe_router_topk, moe.moe_ffn_hidden_size, moe.moe_token_dispatcher_type, moe.moe_aux_loss_coeff) == \
        (2, moe.ffn_hidden_size, "allgather", 0.0)
    check(MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"], 4)
    check(MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type",
                 "alltoall"], 2, cuda=True, te=True)  # NCCL gathers uneven token counts
    check(MOE + ["--moe-grouped-gemm", "--bf16"], 1, cuda=True, te=True)


def test_moe_checkpoint_refuses_another_expert_layout(tmp_path):
    """Optimizer state saved at EP2 cannot be loaded at EP1 (megatron-core fails deep inside): one clear error."""
    flags = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "128", "--global-batch-size",
             "4", "--micro-batch-size", "2", "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0", *MOE]
    ckpt = tmp_path / "ckpt"
    proc = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", 2, "--master-addr", "127.0.0.1",
                "--master-port", free_port(), "-m", "litespark_megatron", *flags, "--expert-model-parallel-size", "2",
                "--save", ckpt])
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = run([sys.executable, "-m", "litespark_megatron", *flags, "--train-iters", "3", "--load", ckpt],
               env=child_env(MASTER_PORT=free_port()))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"litespark-train: error: --load {ckpt}: its optimizer state was saved at --expert-model-parallel-size 2 and "
        f"cannot be resharded to 1; resume with EP 2 (model weights alone reshard: a --no-save-optim checkpoint "
        f"loads at any EP)")
