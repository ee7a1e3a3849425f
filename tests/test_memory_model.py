"""The memory model (litespark_megatron/apps/memory_model.py): hand-counted small cases, litespark-train's flags read
as the trainer reads them, the tiny model's saved tensors measured on the CPU, and every measured GPU row of
docs/benchmarks (docs/benchmarks/measured-peaks.json)."""
import dataclasses
import json

import pytest

from conftest import WORKER_DIR, forked
from litespark_megatron.apps import calibration, memory_model as mm
from litespark_megatron.apps.memory_model import MemorySetup, estimate, in_flight, layer_bytes
from litespark_megatron.errors import UserError
from litespark_megatron.metrics.flops import ModelShape

# 2 layers, hidden 8, FFN 16, 2 heads of 4 over 1 KV group, vocabulary 32, 4 tokens: every part countable by hand.
# Parameters per layer: QKV 8 x 4 x (2 + 2) = 128, output projection 8 x 8 = 64, MLP 3 x 8 x 16 = 384 (576 linear),
# norms 2 x 8 = 16 -> 592; model: 2 x 592 + embedding 256 + output layer 256 + final norm 8 = 1704 (1152 linear).
SMALL = ModelShape(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=1,
                   vocab_size=32, seq_length=4, kv_channels=4)


def part(setup, name, stage=0):
    return getattr(estimate(setup).stages[stage], name)


def test_one_gpu_by_hand():
    s = MemorySetup(shape=SMALL)  # bf16 parameters, fp32 gradients, fp32 main parameters and Adam moments
    assert part(s, "weights") == 1704 * 2 and part(s, "gradients") == 1704 * 4
    assert part(s, "optimizer") == 1704 * 12 and part(s, "fp8_copies") == 0
    # per token and layer: norms 2 x (8 x 2 + 8 x 2) = 64; q, k, v, o (8 + 4 + 4 + 8) x 2 = 48; SwiGLU input
    # 2 x 16 x 2 = 64; down projection input 16 x 2 = 32 -> 208 bytes, x 4 tokens x 2 layers
    assert part(s, "activations") == 208 * 4 * 2
    # the unfused loss: the bf16 logits and their fp32 copy, 6 bytes x 4 x 32; the final norm's input and output
    assert part(s, "loss") == 6 * 4 * 32 + 2 * 8 * 2 * 4
    assert estimate(s).allocated_gib == pytest.approx((3408 + 6816 + 20448 + 1664 + 896) / 2**30 + mm.OVERHEAD_GIB)
    assert part(dataclasses.replace(s, micro_batch_size=3), "activations") == 3 * 208 * 4 * 2


def test_precisions_and_optimizers_by_hand():
    s = MemorySetup(shape=SMALL)
    fp8 = dataclasses.replace(s, fp8=True)
    assert part(fp8, "fp8_copies") == 1152 * 2  # an FP8 weight and its transpose per linear parameter
    # FP8 keeps the norms' outputs (GEMM inputs) as 1-byte copies, adds the output projection's FP8 input and saves
    # the down projection's input in FP8: 64 - 16 + 48 + 8 + 64 + 16 = 184 bytes per token and layer
    assert part(fp8, "activations") == 184 * 4 * 2
    gather = dataclasses.replace(fp8, fp8_param_gather=True)  # FP8 weights: 1 byte, and only the transpose cached
    assert part(gather, "weights") == (1704 - 1152) * 2 + 1152 and part(gather, "fp8_copies") == 1152
    assert part(dataclasses.replace(s, fp8_attention=True), "activations") == (208 - 24) * 4 * 2
    # the precision-aware optimizer: bf16 main gradients, 16-bit main-parameter remainders, bf16 moments, sharded
    pao = dataclasses.replace(s, grad_bytes=2, main_param_bytes=2, exp_avg_bytes=2, exp_avg_sq_bytes=2,
                              distributed_optimizer=True, dp=4)
    assert part(pao, "gradients") == 1704 * 2 and part(pao, "optimizer") == 1704 * 6 / 4
    assert part(dataclasses.replace(s, distributed_optimizer=True, dp=2, cp=2), "optimizer") == 1704 * 12 / 4
    fp32 = dataclasses.replace(s, param_bytes=4, main_param_bytes=0)  # the CPU's fp32: no separate main copy
    assert part(fp32, "weights") == 1704 * 4 and part(fp32, "optimizer") == 1704 * 8
    assert part(fp32, "activations") == 2 * 208 * 4 * 2 and part(fp32, "loss") == 4 * 4 * 32 + 2 * 8 * 4 * 4


def test_losses_by_hand():
    s = MemorySetup(shape=SMALL)
    norm = 2 * 8 * 2 * 4
    for implementation, per_logit in (("unfused", 6), ("native", 10), ("te", 4), ("litespark", 2),
                                      ("litespark-fp8", 2)):
        assert part(dataclasses.replace(s, cross_entropy=implementation), "loss") == per_logit * 4 * 32 + norm
    assert part(dataclasses.replace(s, cross_entropy="native", chunked_output_loss=2), "loss") == 10 * 2 * 32 + norm
    with pytest.raises(UserError, match="cross-entropy"):
        dataclasses.replace(s, cross_entropy="fused")


def test_layouts_by_hand():
    s = MemorySetup(shape=SMALL)
    tp = dataclasses.replace(s, tp=2)  # the norms' tensors stay whole without sequence parallelism
    assert layer_bytes(tp) == (4 * (64 + 144 / 2), 4 * 8 * 2)
    assert layer_bytes(dataclasses.replace(tp, sequence_parallel=True)) == (4 * 208 / 2, 4 * 8 * 2 / 2)
    # TP splits a layer's linear weights, the embedding and the output layer; norms stay whole
    assert part(tp, "weights") == (1152 / 2 + 2 * 16 + 256 / 2 + 256 / 2 + 8) * 2
    assert layer_bytes(dataclasses.replace(s, cp=2)) == (2 * 208, 2 * 16)
    # Litespark's all-gather attention under CP2: the other rank's K and V (2 x 4 x 2 bytes) and a second output
    assert layer_bytes(dataclasses.replace(s, cp=2, all_gather_cp=True)) == (2 * (208 + 16 + 16), 2 * 16)
    pp = dataclasses.replace(s, pp=2, num_microbatches=8)
    first, last = estimate(pp).stages
    assert (first.in_flight, last.in_flight) == (2, 1)
    assert first.activations == 2 * 208 * 4 and first.loss == 0 and last.activations == 208 * 4 and last.loss > 0
    assert first.weights == (592 + 256) * 2 and last.weights == (592 + 256 + 8) * 2
    assert [in_flight(r, 4, 1, 2) for r in range(4)] == [2, 2, 2, 1]  # never more than the micro-batches
    assert [in_flight(r, 2, 2, 8) for r in range(2)] == [5, 3]  # interleaved: 2 (pp - r - 1) + (v - 1) pp + 1


def test_recomputation_by_hand():
    shape = dataclasses.replace(SMALL, num_layers=4)
    s = MemorySetup(shape=shape, recompute="full")
    # each layer keeps its input (4 tokens x 8 x 2 bytes); one layer is recomputed at a time
    assert part(s, "activations") == 4 * 64 + 208 * 4
    grouped = dataclasses.replace(s, recompute_num_layers=2)  # 2 groups of 2: their inputs, and 2 layers at a time
    assert part(grouped, "activations") == 2 * 64 + 2 * 208 * 4
    block = dataclasses.replace(s, recompute_method="block", recompute_num_layers=1)  # the first layer only
    assert part(block, "activations") == 64 + 3 * 208 * 4 + 208 * 4
    assert part(dataclasses.replace(s, recompute="selective"), "activations") == 4 * 208 * 4


def test_cuda_graph_pools():
    s = MemorySetup(shape=SMALL, cuda_graphs=True)
    peak = estimate(s).peak
    assert peak.graph_pools == mm.GRAPH_POOL_SHARE["bf16"] * peak.activations
    assert peak.required == peak.allocated + peak.graph_pools
    fp8 = estimate(dataclasses.replace(s, fp8=True)).peak
    assert fp8.graph_pools == mm.GRAPH_POOL_SHARE["fp8"] * fp8.activations


@pytest.fixture(scope="module")
def resolved():
    from litespark_megatron.platform import Platform
    from litespark_megatron.apps.layouts import resolve

    h100 = Platform("cuda", "nccl", True, True, "H100")
    return lambda flags, world=1: mm.setup_from_args(resolve(["--model", "llama-3b", "--mock-data", *flags.split()],
                                                             h100, world), world)


def test_setup_from_litespark_train_flags(resolved):
    s = resolved("--bf16 --micro-batch-size 2 --global-batch-size 16 --tensor-model-parallel-size 2 "
                 "--sequence-parallel --use-distributed-optimizer --fp8-format hybrid --use-precision-aware-optimizer "
                 "--main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --cross-entropy-loss-fusion "
                 "--cuda-graph-impl transformer_engine", world=4)
    assert (s.tp, s.dp, s.num_microbatches, s.sequence_parallel, s.distributed_optimizer) == (2, 2, 4, True, True)
    assert (s.param_bytes, s.grad_bytes, s.main_param_bytes, s.exp_avg_bytes, s.exp_avg_sq_bytes) == (2, 2, 2, 2, 2)
    assert s.fp8 and s.cross_entropy == "native" and s.cuda_graphs
    assert s.shape.vocab_size == 128_256  # a multiple of 128 x TP already
    # the output layer's rows as megatron.training pads the tokenizer's vocabulary: to a multiple of 128 x TP
    assert resolved("--bf16 --micro-batch-size 1 --vocab-size 1100 --tensor-model-parallel-size 2",
                    world=2).shape.vocab_size == 1280
    plain = resolved("--bf16 --micro-batch-size 1 --global-batch-size 8")
    assert (plain.grad_bytes, plain.main_param_bytes, plain.cross_entropy) == (4, 4, "unfused")
    assert not plain.cuda_graphs
    assert resolved("--bf16 --micro-batch-size 1 --litespark-cross-entropy").cross_entropy == "litespark"
    cp = "--bf16 --micro-batch-size 1 --context-parallel-size 2"
    assert not resolved(cp, world=2).all_gather_cp  # te backend under CP: TE's ring attention (--core-attention auto)
    assert resolved(cp + " --core-attention sdpa", world=2).all_gather_cp
    assert resolved("--micro-batch-size 1").param_bytes == 4  # no --bf16: fp32 parameters
    assert resolved("--fp16 --micro-batch-size 1").grad_bytes == 2  # fp16 gradients unless accumulated in fp32
    assert resolved("--fp16 --micro-batch-size 1 --accumulate-allreduce-grads-in-fp32").grad_bytes == 4
    with pytest.raises(UserError, match="--num-experts is not modelled"):
        resolved("--bf16 --micro-batch-size 1 --num-experts 4 --moe-router-topk 1")


def test_every_measured_row_of_the_current_code():
    """Every measured peak of the code the model describes within 10% (the steady state after CUDA-graph capture,
    which the allocator counts without the graphed activations, included), every out-of-memory row predicted not to
    fit and every row that ran predicted to fit. (docs/planner.md lists the rows of earlier code too.)"""
    checks = [(row, calibration.memory_check(row)) for row in calibration.rows() if row["code"] == "current"]
    errors = [(row["doc"], row["flags"], round(c["error"], 3)) for row, c in checks if "error" in c]
    assert len(errors) >= 100
    assert all(abs(e) <= 0.10 for _, _, e in errors), [x for x in errors if abs(x[2]) > 0.10]
    assert sum(abs(e) for _, _, e in errors) / len(errors) < 0.02
    # Every fit check agrees but the Litespark FP8 rows at micro-batch 8 with CUDA graphs on an H200, which ran where
    # FP8's pool share says they do not fit (the share is fitted to an H100 row that did not: the model errs on the
    # side of not running out; docs/planner.md). Exactly these: a new miss, or one of these fixed, fails here.
    missed = sorted((row["doc"], row["flags"].split(" --cuda-graph-impl")[0].split("--litespark-swiglu")[-1].strip())
                    for row, c in checks if not c["agrees"])
    assert missed == [("2026-11-28-best-micro-batch-rope-fp8-grad-h200.md", ""),
                      ("2026-11-28-best-micro-batch-rope-fp8-grad-h200.md", "--litespark-fp8-output-layer"),
                      ("2026-11-28-best-micro-batch-rope-fp8-grad-h200.md", "--litespark-rope-fp8-grad")], missed
    assert sum(1 for row, _ in checks if row.get("oom")) >= 10


@pytest.fixture(scope="module")
def cpu_saved():
    """Bytes the tiny model saves for the backward on the CPU (fp32, the local backend), per setting."""
    base = "--model tiny --seq-length 64 --vocab-size 256 --spec litespark --transformer-impl local"
    settings = {
        "mb1": "--micro-batch-size 1 --global-batch-size 1", "mb2": "--micro-batch-size 2 --global-batch-size 2",
        "mb3": "--micro-batch-size 3 --global-batch-size 3",
        "vocab512": "--micro-batch-size 2 --global-batch-size 2 --vocab-size 512",
        "full1": "--micro-batch-size 2 --global-batch-size 2 --recompute-granularity full --recompute-method uniform "
                 "--recompute-num-layers 1",
        "full2": "--micro-batch-size 2 --global-batch-size 2 --recompute-granularity full --recompute-method uniform "
                 "--recompute-num-layers 2"}
    proc = forked(1, WORKER_DIR / "memory_worker.py", *(f"{base} {f}" for f in settings.values()))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(zip(settings, json.loads(proc.stdout.strip().splitlines()[-1])))


def test_cpu_measured_saved_tensors(cpu_saved, resolved):
    """What the CPU runs as the GPU does, measured: activations grow linearly with the micro-batch; full
    recomputation keeps each group's input, as many bytes as the model's checkpoints; the unfused loss keeps the fp32
    logits, 4 bytes per logit. (The CPU's reference SwiGLU and RMSNorm keep intermediates TE's fused kernels do not, so
    a whole layer is compared on the GPU rows only.)"""
    per_sequence = cpu_saved["mb2"] - cpu_saved["mb1"]
    assert per_sequence > 0 and cpu_saved["mb3"] - cpu_saved["mb2"] == per_sequence
    tiny = MemorySetup(shape=ModelShape(4, 128, 352, 4, 2, 256, 64), param_bytes=4, main_param_bytes=0,
                       micro_batch_size=2, recompute="full")
    _, checkpoint = layer_bytes(tiny)
    assert checkpoint == 2 * 64 * 128 * 4
    assert cpu_saved["full1"] - cpu_saved["full2"] == (4 - 2) * checkpoint  # 4 group inputs against 2
    wider = dataclasses.replace(tiny, shape=dataclasses.replace(tiny.shape, vocab_size=512))
    assert cpu_saved["vocab512"] - cpu_saved["mb2"] == part(wider, "loss") - part(tiny, "loss") == 2 * 64 * 256 * 4
