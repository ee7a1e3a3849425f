"""The scaling estimate (litespark_megatron/apps/scaling_estimate.py, tools/scaling_estimate.py).

Hand-computed collective times, bubble fractions, TP volumes and group placements; the DP2 check of
docs/metrics.md recomputed (so the document cannot drift from the code); the command line's errors and sweeps.
"""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_tool, run_error, run_json

from conftest import preset
from litespark_megatron.metrics.flops import ModelShape, param_count, training_flops_per_step
from litespark_megatron.metrics.peaks import detect_peak
from litespark_megatron.apps.scaling_estimate import (
    Interconnect,
    Layout,
    Measurement,
    ScalingError,
    all_gather_s,
    all_reduce_s,
    estimate,
    group_placement,
    optimizer_bytes,
    pipeline_bubble_fraction,
    reduce_scatter_s,
)

ROOT = Path(__file__).resolve().parent.parent
H200 = detect_peak("H200", "bf16")
# A plain interconnect for hand arithmetic: 100 GB/s NVLink, 10 GB/s per NIC, no protocol loss, no latency.
PLAIN = Interconnect(nvlink_gbps=100, ib_gbps_per_gpu=10, bus_efficiency=1.0, nvlink_latency_us=0,
                     ib_latency_us=0, gpus_per_node=8)


def preset_shape(name, **over) -> ModelShape:
    p = preset(name)
    fields = dict(num_layers=p.num_layers, hidden_size=p.hidden_size, ffn_hidden_size=p.ffn_hidden_size,
                  num_attention_heads=p.num_attention_heads, num_query_groups=p.num_query_groups,
                  vocab_size=-(-p.vocab_size // 128) * 128, seq_length=p.seq_length,
                  untie_embeddings_and_output_weights=p.untie_embeddings_and_output_weights)
    fields.update(over)
    return ModelShape(**fields)


@pytest.fixture(scope="module")
def tool():
    return load_tool("scaling_estimate")


# ---------------------------------------------------------------------------------------------------------
# collectives, bubble, placement: by hand
# ---------------------------------------------------------------------------------------------------------
def test_all_reduce_time_by_hand():
    ic = dataclasses.replace(PLAIN, nvlink_latency_us=5.0, ib_latency_us=20.0)
    tp4 = group_placement("tp", 4, 1, 8, ic)
    # 1 GB over 4 ranks at 100 GB/s: 2 x 3/4 x 1e9 / 1e11 = 15 ms, plus 2 x 3 = 6 NVLink steps of 5 us.
    assert all_reduce_s(1e9, tp4, ic) == pytest.approx(15e-3 + 6 * 5e-6)
    assert reduce_scatter_s(1e9, tp4, ic) == pytest.approx(7.5e-3 + 3 * 5e-6)
    assert all_gather_s(1e9, tp4, ic) == reduce_scatter_s(1e9, tp4, ic)
    # 16 ranks over 2 nodes, 8 on each: min(100, 8 x 10) = 80 GB/s; 30 steps, 2 of them between nodes.
    tp16 = group_placement("tp", 16, 1, 16, ic)
    assert tp16.bytes_per_s == pytest.approx(80e9)
    assert all_reduce_s(1e9, tp16, ic) == pytest.approx(2 * 15 / 16 * 1e9 / 80e9 + 28 * 5e-6 + 2 * 20e-6)
    assert all_reduce_s(1e9, group_placement("x", 1, 1, 8, ic), ic) == 0.0


def test_dp2_all_reduce_of_llama_1b_gradients():
    # 1,498,482,688 fp32 gradients = 5,993,930,752 bytes; 2 ranks: 2(1)/2 x bytes / (450 x 0.8 GB/s) + 2 x 3.4 us.
    ic = Interconnect(gpus_per_node=2)
    dp = group_placement("dp", 2, 1, 2, ic)
    assert dp.bytes_per_s == pytest.approx(360e9)
    assert all_reduce_s(1_498_482_688 * 4, dp, ic) == pytest.approx(5_993_930_752 / 360e9 + 6.8e-6)
    assert 5_993_930_752 / 360e9 == pytest.approx(16.650e-3, abs=1e-6)


def test_pipeline_bubble_fraction():
    assert pipeline_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pipeline_bubble_fraction(4, 8, virtual=2) == pytest.approx(3 / 19)
    assert pipeline_bubble_fraction(1, 8) == 0.0


@pytest.mark.parametrize("name, size, stride, world, nodes, k, bw", [
    ("TP8 on 8-GPU nodes", 8, 1, 64, 1, 8, 100e9),
    ("TP16 on 8-GPU nodes", 16, 1, 64, 2, 8, 80e9),        # min(100, 8 NICs x 10)
    ("DP under TP8 (stride 8)", 8, 8, 64, 8, 1, 10e9),     # one GPU per node: one NIC
    ("DP under TP2 on 2 nodes", 8, 2, 16, 2, 4, 40e9),     # ranks 0,2,..,14: 4 per node
    ("TP4 x PP2 pipeline group", 2, 4, 8, 1, 2, 100e9),    # stages 4 ranks apart, same node
    ("PP under TP8 x DP2", 2, 16, 32, 2, 1, 10e9),
])
def test_group_placement(name, size, stride, world, nodes, k, bw):
    g = group_placement("g", size, stride, world, PLAIN)
    assert (g.nodes_spanned, g.gpus_per_node_in_group, g.bytes_per_s) == (nodes, k, pytest.approx(bw)), name
    assert g.where == ("intra-node" if nodes == 1 else f"inter-node ({nodes} nodes)")


def test_tp_volume_tiny_shape():
    # tiny: 4 layers, h=128, s=128. TP2, micro-batch 2, 8 GPUs (DP4), global batch 16 -> 2 micro-batches.
    # Message b s h x 2 bytes = 2 x 128 x 128 x 2 = 65,536 B; 2 ranks at 100 GB/s: 1 x 65,536 / 1e11 s.
    # Per micro-batch 4 x 4 layers + embedding + output layer = 18 all-reduces, plus 3 loss all-reduces of
    # b s x 4 = 1,024 B.
    shape = preset_shape("tiny")
    meas = Measurement(tokens_per_sec_per_gpu=1e5, seq_length=128, micro_batch_size=2, global_batch_size=16)
    per_mb = 18 * 65_536 / 1e11 + 3 * 1_024 / 1e11
    for sp in (False, True):  # sequence parallelism: reduce-scatter + all-gather, the same volume and time
        est = estimate(shape, Layout(tensor_model_parallel_size=2, sequence_parallel=sp), nodes=1,
                       global_batch_size=16, micro_batch_size=2, measured=meas, peak=H200, interconnect=PLAIN,
                       hbm_tbps=4.8)
        assert est.num_microbatches == 2 and est.data_parallel_size == 4
        assert est.breakdown["tp_comm"] == pytest.approx(2 * per_mb)
    full = estimate(shape, Layout(tensor_model_parallel_size=2, recompute_granularity="full"), nodes=1,
                    global_batch_size=16, micro_batch_size=2, measured=meas, peak=H200, interconnect=PLAIN,
                    hbm_tbps=4.8)
    # full recomputation repeats the 2 forward all-reduces of every layer: 6 x 4 + 2 = 26
    assert full.breakdown["tp_comm"] == pytest.approx(2 * (26 * 65_536 / 1e11 + 3 * 1_024 / 1e11))


def test_context_parallel_terms():
    # llama-1b (16 layers, 8 KV heads of 64) CP2 on 2 GPUs, micro-batch 1 of 4096: per layer an all-gather of the
    # whole sequence's K and V (4096 x 2 x 8 x 64 x 2 bytes = 8 MiB) and a reduce-scatter of their gradients,
    # each 1/2 x 8 MiB / 100 GB/s.
    shape = preset_shape("llama-1b")
    meas = Measurement(tokens_per_sec_per_gpu=28_021, seq_length=4096, micro_batch_size=1, global_batch_size=8)
    ic = dataclasses.replace(PLAIN, gpus_per_node=2)
    kv = 4096 * 2 * 8 * 64 * 2
    for recompute, gathers in ((None, 1), ("full", 2)):
        est = estimate(shape, Layout(context_parallel_size=2, recompute_granularity=recompute), nodes=1,
                       global_batch_size=8, micro_batch_size=1, measured=meas, peak=H200, interconnect=ic,
                       hbm_tbps=4.8)
        assert est.num_microbatches == 8 and est.groups["cp"].where == "intra-node"
        assert est.breakdown["cp_exposed"] == pytest.approx(8 * 16 * (gathers + 1) * kv / 2 / 1e11)


def test_context_parallel_ring_terms():
    """TE's ring (cp_comm_type p2p): CP - 1 steps per layer, each step's transfer of one rank's K and V (backward:
    and their gradients) exposed only beyond the attention of one block."""
    shape = preset_shape("llama-1b")
    meas = Measurement(tokens_per_sec_per_gpu=28_021, seq_length=4096, micro_batch_size=1, global_batch_size=8)
    kv = 4096 * 2 * 8 * 64 * 2  # the whole sequence's K and V of one layer, bytes

    def ring(ic, cp=2):
        return estimate(shape, Layout(context_parallel_size=cp, cp_comm_type="p2p"), nodes=1, global_batch_size=8,
                        micro_batch_size=1, measured=meas, peak=H200, interconnect=ic, hbm_tbps=4.8)

    fast = ring(dataclasses.replace(PLAIN, gpus_per_node=2))
    assert fast.breakdown["cp_exposed"] == 0  # 4 MiB in 42 us, far below a block's attention
    slow_link = dataclasses.replace(PLAIN, gpus_per_node=2, nvlink_gbps=0.01)
    slow = ring(slow_link)
    # the attention of one block, forward: the layer's attention-core share of the micro-batch time, / 3, / CP blocks
    from litespark_megatron.metrics.flops import layer_forward_per_sequence
    layer = layer_forward_per_sequence(shape, 0, "half")
    total = 16 * layer.total + 2 * 4096 * 2048 * shape.vocab_size
    block = slow.details["microbatch_compute_one_gpu_s"] / 2 * layer.attention_core / total / 3 / 2
    per_layer = (kv / 2 / 1e7 - block) + (2 * kv / 2 / 1e7 - 2 * block)
    assert slow.breakdown["cp_exposed"] == pytest.approx(8 * 16 * per_layer)
    assert any("ring attention" in a for a in slow.assumptions)
    with pytest.raises(ScalingError, match="cp_comm_type"):
        Layout(cp_comm_type="a2a")


def test_context_parallel_attention_overhead():
    """A CP rank's micro-batch costs CP_ATTENTION_OVERHEAD more than 1/CP of one GPU's (its split attention), on top
    of the K/V exchange and only under CP; the step is the sum of the breakdown."""
    from litespark_megatron.apps.scaling_estimate import CP_ATTENTION_OVERHEAD

    shape = preset_shape("llama-1b")
    meas = Measurement(tokens_per_sec_per_gpu=28_021, seq_length=4096, micro_batch_size=1, global_batch_size=8)
    ic = dataclasses.replace(PLAIN, gpus_per_node=2)

    def run(**layout):
        return estimate(shape, Layout(**layout), nodes=1, global_batch_size=8, micro_batch_size=1, measured=meas,
                        peak=H200, interconnect=ic, hbm_tbps=4.8)

    for comm in ("p2p", "all_gather"):
        cp = run(context_parallel_size=2, cp_comm_type=comm)
        assert cp.breakdown["cp_attention"] == pytest.approx(CP_ATTENTION_OVERHEAD * cp.breakdown["compute"])
        assert cp.step_time_s == pytest.approx(sum(cp.breakdown.values()))
        assert any("longer than 1/CP of one GPU's" in a for a in cp.assumptions)
    dp = run()
    assert dp.breakdown["cp_attention"] == 0 and not any("longer than 1/CP" in a for a in dp.assumptions)



    """A micro-batch takes at least the host's launch time of its stage's layers; below it nothing changes."""
    shape = preset_shape("llama-1b")
    meas = Measurement(tokens_per_sec_per_gpu=28_021, seq_length=4096, micro_batch_size=1, global_batch_size=8)
    ic = dataclasses.replace(PLAIN, gpus_per_node=2)

    def tp2(host):
        return estimate(shape, Layout(tensor_model_parallel_size=2, sequence_parallel=True), nodes=1,
                        global_batch_size=8, micro_batch_size=1, measured=meas, peak=H200, interconnect=ic,
                        hbm_tbps=4.8, host_s_per_layer=host)

    free, slow = tp2(0.0), tp2(0.010)
    gpu = (free.breakdown["compute"] + free.breakdown["tp_comm"]) / 8  # per micro-batch
    assert free.breakdown["host_wait"] == 0 and gpu < 16 * 0.010
    assert slow.breakdown["host_wait"] == pytest.approx(8 * (16 * 0.010 - gpu))
    assert slow.step_time_s == pytest.approx(free.step_time_s + slow.breakdown["host_wait"])
    assert tp2(gpu / 16 / 2).step_time_s == pytest.approx(free.step_time_s)
    with pytest.raises(ScalingError, match="host_s_per_layer"):
        tp2(-1.0)


def test_pipeline_terms():
    # llama-1b PP2 x 2 virtual stages (4 layers each) on 2 GPUs, global batch 8 of 1: m = 8.
    shape = preset_shape("llama-1b")
    meas = Measurement(tokens_per_sec_per_gpu=28_021, seq_length=4096, micro_batch_size=1, global_batch_size=8)
    ic = dataclasses.replace(PLAIN, gpus_per_node=2)
    est = estimate(shape, Layout(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=4), nodes=1,
                   global_batch_size=8, micro_batch_size=1, measured=meas, peak=H200, interconnect=ic, hbm_tbps=4.8)
    b = est.breakdown
    assert (est.num_microbatches, est.virtual_pipeline_size) == (8, 2)
    per_mb = b["compute"] / 8  # no TP or CP: the micro-batch time of the busiest stage is its compute
    assert b["pp_bubble"] == pytest.approx((2 - 1) / 2 * per_mb)
    # p2p: 4096 x 2048 x 2 bytes at 100 GB/s, (m v + pp - 1) x 2 = 34 of them
    assert b["pp_p2p"] == pytest.approx(34 * 4096 * 2048 * 2 / 1e11)
    # the last stage holds the 128,256 x 2048 output layer: it is the busiest
    assert est.details["critical_stage"] == 1.0 and est.details["stage_compute_imbalance"] > 1.0
    with pytest.raises(ScalingError, match="multiple of PP"):
        estimate(shape, Layout(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=4), nodes=1,
                 global_batch_size=3, micro_batch_size=1, measured=meas, peak=H200, interconnect=ic, hbm_tbps=4.8)


def test_optimizer_bytes():
    # fp32 gradients: zero 4 + norm 4 + Adam 28 + copy 6 = 42 B; DP > 1 adds the 1/DP scaling (8 B).
    assert optimizer_bytes(1e9, 1, False, 4) == pytest.approx(42e9)
    assert optimizer_bytes(1e9, 2, False, 4) == pytest.approx(50e9)
    # distributed optimizer over 4: zero 4 + scaling 8 + (4 + 28 + 6) / 4
    assert optimizer_bytes(1e9, 4, True, 4) == pytest.approx(12e9 + 38e9 / 4)
    # bf16 gradients: zero 2, scaling 4, and the copy to fp32 main gradients (6)
    assert optimizer_bytes(1e9, 2, False, 2) == pytest.approx(6e9 + 44e9)


# ---------------------------------------------------------------------------------------------------------
# the single-GPU measurement and the DP2 check of docs/metrics.md
# ---------------------------------------------------------------------------------------------------------
LLAMA_1B = preset_shape("llama-1b")
MEASURED_1GPU = Measurement(tokens_per_sec_per_gpu=28_021, seq_length=4096, micro_batch_size=1, global_batch_size=8)
MEASURED_DP2_TPS = 26_601


def dp2(**measured):
    meas = dataclasses.replace(MEASURED_1GPU, **measured)
    return estimate(LLAMA_1B, Layout(), nodes=1, global_batch_size=8, micro_batch_size=1, measured=meas,
                    peak=H200, interconnect=Interconnect(gpus_per_node=2))


def test_one_gpu_reproduces_the_measurement():
    assert param_count(LLAMA_1B).total == 1_498_482_688
    one = estimate(LLAMA_1B, Layout(), nodes=1, global_batch_size=8, micro_batch_size=1, measured=MEASURED_1GPU,
                   peak=H200, interconnect=Interconnect(gpus_per_node=1))
    assert one.tokens_per_sec_per_gpu == pytest.approx(28_021)
    assert one.scaling_efficiency == pytest.approx(1.0)
    # 28,021 x 9,025,093,632 FLOPs per token (full) = 252.9 TFLOP/s = 25.56% of 989.4
    assert one.model_tflops_per_gpu == pytest.approx(252.892, abs=1e-3)
    assert one.mfu == pytest.approx(0.25560, abs=1e-5)
    assert one.breakdown["optimizer"] == pytest.approx(42 * 1_498_482_688 / 4.8e12)


def test_dp2_prediction_matches_the_document():
    est = dp2()
    b = est.breakdown
    t1 = 8 * 4096 / 28_021
    t_opt1 = 42 * 1_498_482_688 / 4.8e12
    t_mb1 = (t1 - t_opt1) / 8
    assert b["compute"] == pytest.approx(4 * t_mb1)
    assert b["dp_grad_exposed"] == pytest.approx(5_993_930_752 / 360e9 + 6.8e-6)
    assert b["optimizer"] == pytest.approx(50 * 1_498_482_688 / 4.8e12)
    assert est.step_time_s == pytest.approx(4 * t_mb1 + b["dp_grad_exposed"] + b["optimizer"])
    error = est.tokens_per_sec_per_gpu / MEASURED_DP2_TPS - 1
    assert est.tokens_per_sec_per_gpu == pytest.approx(26_840.8, abs=0.1)
    assert est.scaling_efficiency == pytest.approx(0.9579, abs=1e-4)
    assert error == pytest.approx(0.0090, abs=1e-4)

    doc = " ".join((ROOT / "docs" / "metrics.md").read_text().split())
    section = doc[doc.index("### Check against a measured DP2 run"):]
    measured_eff = MEASURED_DP2_TPS / 28_021
    for text in (
        f"T₁ = 8 × 4096 / 28,021 = {1e3 * t1:.2f} ms",
        f"at 4.8 TB/s = {1e3 * t_opt1:.2f} ms",
        f"t_mb₁ = ({1e3 * t1:.2f} − {1e3 * t_opt1:.2f}) / 8 = {1e3 * t_mb1:.2f} ms",
        f"compute `4 × {1e3 * t_mb1:.2f} = {1e3 * b['compute']:.2f} ms`",
        f"2 × 3.4 µs = {1e3 * b['dp_grad_exposed']:.2f} ms`",
        f"15.61 ms`; step {1e3 * est.step_time_s:.2f} ms",
        f"prediction: {est.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU = {est.scaling_efficiency:.3f} of linear; "
        f"measured 26,601 = {measured_eff:.3f}: the prediction is {100 * error:.1f}% too high",
        f"step {1e3 * est.step_time_s:.1f} ms predicted against {8 * 4096 / 2 / MEASURED_DP2_TPS * 1e3:.1f} ms "
        f"measured",
    ):
        assert text in section, text
    assert f"{1e3 * b['optimizer']:.2f} ms" == "15.61 ms"


def test_dp2_with_measured_components_matches_the_document():
    est = dp2(optimizer_step_s=16.87e-3)
    doc = " ".join((ROOT / "docs" / "metrics.md").read_text().split())
    error = est.tokens_per_sec_per_gpu / MEASURED_DP2_TPS - 1
    assert f"`--optimizer-step-ms 16.87`) the prediction is {est.scaling_efficiency:.3f} (+{100 * error:.1f}%)" in doc
    both = estimate(LLAMA_1B, Layout(), nodes=1, global_batch_size=8, micro_batch_size=1,
                    measured=dataclasses.replace(MEASURED_1GPU, optimizer_step_s=16.87e-3), peak=H200,
                    interconnect=Interconnect(gpus_per_node=2, bus_efficiency=0.763))
    error = both.tokens_per_sec_per_gpu / MEASURED_DP2_TPS - 1
    assert f"(`--bus-efficiency 0.763`) gives {both.scaling_efficiency:.3f} (+{100 * error:.1f}%)" in doc
    assert est.breakdown["optimizer"] == pytest.approx(16.87e-3 * 50 / 42)


def test_measurement_at_another_shape():
    # A measurement at seq 2048 / micro-batch 2 carries to seq 4096 / micro-batch 1 by executed (half) FLOPs.
    meas = Measurement(tokens_per_sec_per_gpu=30_000, seq_length=2048, micro_batch_size=2, global_batch_size=16)
    est = estimate(LLAMA_1B, Layout(), nodes=1, global_batch_size=8, micro_batch_size=1, measured=meas, peak=H200,
                   interconnect=Interconnect(gpus_per_node=1))
    short = dataclasses.replace(LLAMA_1B, seq_length=2048)
    t1 = 16 * 2048 / 30_000
    t_mb1 = (t1 - 42 * 1_498_482_688 / 4.8e12) / 8
    ratio = (training_flops_per_step(LLAMA_1B, 1, causal="half").model_flops
             / training_flops_per_step(short, 2, causal="half").model_flops)
    assert est.breakdown["compute"] == pytest.approx(8 * t_mb1 * ratio)
    assert any("same achieved FLOP rate" in a for a in est.assumptions)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(layout=Layout(tensor_model_parallel_size=3)), "not divisible by TP x PP x CP"),
    (dict(layout=Layout(tensor_model_parallel_size=8), shape=preset_shape("llama-30b")), "52 attention heads"),
    (dict(layout=Layout(pipeline_model_parallel_size=3), nodes=3), "16 layers are not divisible by PP 3"),
    (dict(layout=Layout(context_parallel_size=2), shape=preset_shape("llama-1b", seq_length=4094)), "2 x CP"),
    (dict(global_batch_size=12), "not divisible by micro-batch x DP"),
    (dict(nodes=0), "nodes must be a positive integer"),
])
def test_estimate_errors(kwargs, needle):
    args = dict(shape=LLAMA_1B, layout=Layout(), nodes=1, global_batch_size=8, micro_batch_size=1,
                measured=MEASURED_1GPU, peak=H200, interconnect=Interconnect(), hbm_tbps=4.8)
    args.update(kwargs)
    shape, layout = args.pop("shape"), args.pop("layout")
    with pytest.raises(ScalingError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        estimate(shape, layout, **args)


def test_value_errors():
    with pytest.raises(ScalingError, match="bus_efficiency"):
        Interconnect(bus_efficiency=1.2)
    with pytest.raises(ScalingError, match="nvlink_gbps"):
        Interconnect(nvlink_gbps=0)
    with pytest.raises(ScalingError, match="tokens_per_sec_per_gpu"):
        Measurement(tokens_per_sec_per_gpu=-1, seq_length=4096, micro_batch_size=1, global_batch_size=8)
    with pytest.raises(ScalingError, match="optimizer step"):
        dp2(tokens_per_sec_per_gpu=1e9)  # a step shorter than the modelled optimizer step


def test_import_does_not_load_torch():
    code = ("import sys, litespark_megatron.apps.scaling_estimate; "
            "assert 'torch' not in sys.modules and 'megatron' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# ---------------------------------------------------------------------------------------------------------
# tools/scaling_estimate.py
# ---------------------------------------------------------------------------------------------------------
DP2_ARGV = ["--model", "llama-1b", "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--gpu", "H200", "--measured-tokens-per-sec-per-gpu", "28021", "--nodes", "1", "--gpus-per-node", "2"]


def test_cli_dp2(tool, capsys):
    out = run_json(tool, DP2_ARGV, capsys)
    (e,) = out["estimates"]
    assert e["tokens_per_sec_per_gpu"] == pytest.approx(dp2().tokens_per_sec_per_gpu)
    assert e["groups"]["dp"]["where"] == "intra-node" and e["groups"]["dp"]["bus_gbps"] == pytest.approx(360)
    assert out["hbm_tbps"] == 4.8
    assert tool.main(DP2_ARGV) == 0
    text = capsys.readouterr().out
    for needle in ("26,840.8 per GPU", "scaling efficiency 0.958", "DP gradient reduction, exposed",
                   "16.66 ms", "optimizer step", "15.61 ms", "MFU 24.48%", "assumptions:"):
        assert needle in text, needle


def test_cli_measured_mfu_equals_tokens(tool, capsys):
    # --measured-mfu u in the full convention = u x 989.4e12 / 9,025,093,632 tokens/s
    mfu = 28_021 * 9_025_093_632 / 989.4e12
    argv = [a for a in DP2_ARGV if a not in ("--measured-tokens-per-sec-per-gpu", "28021")]
    out = run_json(tool, argv + ["--measured-mfu", f"{mfu:.12f}"], capsys)
    assert out["measured"]["tokens_per_sec_per_gpu"] == pytest.approx(28_021)
    assert out["estimates"][0]["tokens_per_sec_per_gpu"] == pytest.approx(dp2().tokens_per_sec_per_gpu)


def test_cli_sweep_llama_3b(tool, capsys):
    argv = ["--model", "llama-3b", "--micro-batch-size", "1", "--global-batch-size", "1024", "--gpu", "H100",
            "--measured-mfu", "0.45", "--sweep-nodes", "1,8,64"]
    out = run_json(tool, argv, capsys)
    rows = out["estimates"]
    assert [(r["nodes"], r["world_size"], r["data_parallel_size"], r["num_microbatches"]) for r in rows] == [
        (1, 8, 8, 128), (8, 64, 64, 16), (64, 512, 512, 2)]
    per_gpu = [r["tokens_per_sec_per_gpu"] for r in rows]
    assert per_gpu[0] > per_gpu[1] > per_gpu[2]
    # DP8 in one node: all-reduce of 3,606,752,256 fp32 gradients, 2 x 7/8 x bytes / 360 GB/s + 14 x 3.4 us
    assert rows[0]["breakdown"]["dp_grad_exposed"] == pytest.approx(
        2 * 7 / 8 * 3_606_752_256 * 4 / 360e9 + 14 * 3.4e-6)
    # 64 nodes: 8 GPUs of the group per node, min(360, 8 x 40) = 320 GB/s; 1022 steps, 126 between nodes
    assert rows[2]["groups"]["dp"]["bus_gbps"] == pytest.approx(320)
    assert rows[2]["breakdown"]["dp_grad_exposed"] == pytest.approx(
        2 * 511 / 512 * 3_606_752_256 * 4 / 320e9 + (1022 - 126) * 3.4e-6 + 126 * 9.6e-6)
    assert tool.main(argv) == 0
    text = capsys.readouterr().out
    table = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [t[:4] for t in table] == [["1", "8", "8", "128"], ["8", "64", "64", "16"], ["64", "512", "512", "2"]]
    assert [t[6] for t in table] == [f"{x:,.1f}" for x in per_gpu]


def test_cli_sweep_llama_30b(tool, capsys):
    argv = ["--model", "llama-30b", "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
            "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce", "--micro-batch-size", "1",
            "--global-batch-size", "512", "--gpu", "H100", "--measured-mfu", "0.40", "--sweep-nodes", "1,8,64"]
    out = run_json(tool, argv, capsys)
    rows = out["estimates"]
    assert [(r["data_parallel_size"], r["num_microbatches"]) for r in rows] == [(1, 512), (8, 64), (64, 8)]
    for r in rows:
        assert r["groups"]["tp"]["where"] == "intra-node"
        b = r["breakdown"]
        assert b["pp_bubble"] == pytest.approx((b["compute"] + b["tp_comm"]) / r["num_microbatches"])
        assert r["step_time_s"] == pytest.approx(sum(b.values()))
    # one replica (TP4 x PP2) per node: the pipeline stays in the node; with DP the stages are 4 x DP ranks apart
    assert rows[0]["groups"]["pp"]["where"] == "intra-node"
    assert rows[1]["groups"]["pp"]["where"] == "inter-node (2 nodes)"
    assert rows[1]["groups"]["dp"]["gpus_per_node_in_group"] == 2  # stride 4 on 8-GPU nodes
    assert rows[0]["scaling_efficiency"] > rows[1]["scaling_efficiency"] > rows[2]["scaling_efficiency"]
    assert tool.main(argv) == 0
    text = capsys.readouterr().out
    assert "TP 4, PP 2, CP 1, DP 1; sequence parallel, use distributed optimizer, overlap grad reduce" in text
    assert len([line for line in text.splitlines() if line.strip()[:1].isdigit()]) == 3


@pytest.mark.parametrize("extra, needle", [
    (["--tensor-model-parallel-size", "3"], "not divisible by TP x PP x CP"),
    (["--tensor-model-parallel-size", "8", "--gpus-per-node", "8", "--model", "llama-30b"],
     "52 attention heads are not divisible by TP 8"),
    (["--nodes", "0"], "positive integer"),
    (["--nvlink-gbps", "-450"], "positive number"),
    (["--bus-efficiency", "1.5"], "(0, 1]"),
    (["--ib-latency-us", "-1"], ">= 0"),
    (["--gpu", "Tesla V100"], "--peak-tflops"),
    (["--gpu", "A100", "--peak-tflops", "312"], "--hbm-tbps"),
    (["--sweep-nodes", "1,x"], "comma-separated"),
    (["--sweep-nodes", "1,2"], "both"),
    (["--global-batch-size", "7"], "micro-batch x DP"),
    (["--measured-mfu", "0.3"], "not allowed"),
    (["--overlap-param-gather"], "--use-distributed-optimizer"),
    (["--measured-micro-batch-size", "3"], "not a multiple of its micro-batch"),
    (["--model", "llama-7"], "unknown --model"),
    (["--num-experts", "8"], "mixture-of-experts"),
])
def test_cli_errors(tool, capsys, extra, needle):
    # later flags win, so each case overrides the valid DP2 command line
    assert needle in run_error(tool, DP2_ARGV + extra, capsys)


def test_cli_errors_without_measurement_or_batch(tool, capsys):
    assert "--measured-tokens-per-sec-per-gpu" in run_error(tool, ["--model", "llama-1b", "--gpu", "H200",
                                                                   "--global-batch-size", "8"], capsys)
    assert "--global-batch-size" in run_error(tool, ["--model", "llama-1b", "--gpu", "H200",
                                                     "--measured-mfu", "0.3"], capsys)


def test_cli_sweep_error_names_the_node_count(tool, capsys):
    line = run_error(tool, ["--model", "llama-1b", "--micro-batch-size", "1", "--global-batch-size", "16",
                            "--gpu", "H200", "--measured-tokens-per-sec-per-gpu", "28021", "--sweep-nodes", "1,4"],
                     capsys)
    assert "at 4 nodes (32 GPUs)" in line and "micro-batch x DP" in line


def test_cli_runs_as_a_script():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "scaling_estimate.py"), *DP2_ARGV],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "scaling efficiency 0.958" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "scaling_estimate.py"), *DP2_ARGV, "--nodes", "-1"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
