"""apps/profile.py: kernel names (as seen on an H200 with TE 2.20 / torch 2.11) land in the right category; the
summary's per-step arithmetic; the Markdown rendering. The profiler run itself is covered by the benchmark's CPU
end-to-end test (--profile-steps)."""
import pytest

from litespark_megatron.apps.profile import OTHER, category_ms, kernel_category, render, summarize

KERNELS = {
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1_kernel0_0":
        "attention",
    "void transformer_engine::scaled_masked_softmax_warp_forward<__nv_bfloat16, __nv_bfloat16, float, 12>(": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>": "attention",
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "gemm",
    "void multi_tensor_apply_kernel<TensorListMetadata<4, false>, transformer_engine::multi_tensor_adam::AdamFunctor":
        "optimizer",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "void transformer_engine::normalization::rmsnorm_fwd_general_kernel<transformer_engine::normalization::K":
        "norm",
    "void transformer_engine::fused_rope_forward_kernel<__nv_bfloat16>(__nv_bfloat16 const*, int const*)": "rope",
    "void transformer_engine::detail::cast_transpose_kernel<8, __nv_bfloat16, __nv_fp8_e4m3>": "fp8 cast/transpose",
    "te_parallel_cross_entropy_kernel": "cross-entropy/softmax",
    "Memset (Device)": "copy/fill",
    "Memcpy HtoD (Pageable -> Device)": "copy/fill",
    # at::native's "gpu_kernel_impl_nocast" is a plain elementwise kernel, not a cast; triton's "fused_cat_mul_silu"
    # an elementwise fusion, not a copy.
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float":
        OTHER,
    "triton_poi_fused_cat_mul_silu_silu_backward_split_0": OTHER,
    "void transformer_engine::dgated_act_kernel<16, true, float, transformer_engine::Empty>": OTHER,
    # Litespark's own Triton kernels, by their function names
    "rms_norm_backward": "norm",
    "cross_entropy_gradient_in_place": "cross-entropy/softmax",
}


def test_every_litespark_kernel_is_filed_under_what_it_computes():
    """A Triton kernel shows in a profile under its function's name: one named `forward` or `backward` was filed as
    elementwise work (the RMSNorm kernels' 18.6 ms/step once hid there)."""
    import ast

    from conftest import ROOT

    jitted = {}
    for path in sorted((ROOT / "litespark_megatron" / "kernels").glob("*_triton.py")):
        for node in ast.parse(path.read_text()).body:
            # (a private @triton.jit function is a device function: inlined into the kernels that call it)
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list) \
                    and not node.name.startswith("_"):
                jitted[node.name] = kernel_category(node.name)
    assert len(jitted) >= 4, jitted
    assert OTHER not in jitted.values(), jitted


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_category(name):
    assert kernel_category(name) == KERNELS[name]


def test_summary_arithmetic_and_rendering():
    kernels = {"nvjet_gemm_a": 6000.0, "nvjet_gemm_b": 2000.0, "cudnn_generated_fort_native_sdpa_x": 1000.0,
               "multi_tensor_apply_kernel<adam>": 1000.0}
    calls = {"nvjet_gemm_a": 4, "nvjet_gemm_b": 2, "cudnn_generated_fort_native_sdpa_x": 2,
             "multi_tensor_apply_kernel<adam>": 2}
    s = summarize(kernels, calls, steps=2, wall_s=0.0125, device="cuda", top=3)
    assert s["kernel_ms_per_step"] == pytest.approx(5.0) and s["wall_ms_per_step"] == pytest.approx(6.25)
    assert s["busy_fraction"] == pytest.approx(0.8)
    assert category_ms(s) == pytest.approx({"gemm": 4.0, "attention": 0.5, "optimizer": 0.5})
    assert [c["category"] for c in s["categories"]][0] == "gemm"
    assert sum(c["share"] for c in s["categories"]) == pytest.approx(1.0)
    assert [k["name"] for k in s["top_kernels"]] == ["nvjet_gemm_a", "nvjet_gemm_b",
                                                     "cudnn_generated_fort_native_sdpa_x"]
    assert s["top_kernels"][0]["calls_per_step"] == 2 and s["top_kernels"][0]["share"] == pytest.approx(0.6)
    md = render(s, "demo")
    assert md.startswith("### demo") and "GPU busy 80% of the wall time" in md
    assert "| gemm | 4.0 | 80.0% |" in md and "| `nvjet_gemm_a` | gemm | 3.00 | 2 | 60.0% |" in md


def test_trace_summary_gpu_kernels_and_steps(tmp_path):
    """A Chrome trace as torch.profiler exports it (what megatron.training's --use-pytorch-profiler writes): GPU
    kernel/memcpy events by name, steps and wall time from the ProfilerStep ranges. A GPU trace holds each step
    twice, as the CPU range and as its projection on the GPU's timeline: a step is counted once."""
    import gzip
    import json

    from litespark_megatron.apps.profile import summarize_trace

    events = [{"ph": "X", "name": "ProfilerStep#4", "cat": "user_annotation", "ts": 0, "dur": 10000},
              {"ph": "X", "name": "ProfilerStep#5", "cat": "user_annotation", "ts": 10000, "dur": 10000},
              {"ph": "X", "name": "ProfilerStep#4", "cat": "gpu_user_annotation", "ts": 5, "dur": 7000},
              {"ph": "X", "name": "ProfilerStep#5", "cat": "gpu_user_annotation", "ts": 10005, "dur": 7000},
              {"ph": "X", "name": "nvjet_gemm_a", "cat": "kernel", "ts": 5, "dur": 6000},
              {"ph": "X", "name": "nvjet_gemm_a", "cat": "kernel", "ts": 10005, "dur": 6000},
              {"ph": "X", "name": "Memcpy HtoD", "cat": "gpu_memcpy", "ts": 1, "dur": 1000},
              {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 0, "dur": 99999}]
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize_trace(str(path))
    assert (s["device"], s["steps"]) == ("cuda", 2)
    assert s["wall_ms_per_step"] == pytest.approx(10.0) and s["kernel_ms_per_step"] == pytest.approx(6.5)
    assert category_ms(s) == pytest.approx({"gemm": 6.0, "copy/fill": 0.5})


def test_trace_summary_cpu_operators_count_self_time(tmp_path):
    """On a CPU trace (no kernels) an operator's self time is its duration minus the operators it calls."""
    import json

    from litespark_megatron.apps.profile import summarize_trace

    events = [{"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "ts": 0, "dur": 1000},
              {"ph": "X", "name": "aten::linear", "cat": "cpu_op", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
              {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 10, "dur": 60, "pid": 1, "tid": 1},
              {"ph": "X", "name": "aten::add", "cat": "cpu_op", "ts": 80, "dur": 10, "pid": 1, "tid": 1},
              {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 200, "dur": 40, "pid": 1, "tid": 2}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = summarize_trace(str(path))
    assert s["device"] == "cpu" and s["steps"] == 1
    by_name = {k["name"]: k["ms_per_step"] for k in s["top_kernels"]}
    assert by_name == pytest.approx({"aten::mm": 0.1, "aten::linear": 0.03, "aten::add": 0.01})


def test_gpu_idle_is_the_step_not_covered_by_gpu_work_and_each_gap_is_charged_to_its_launcher(tmp_path):
    """Idle = the step's wall time no GPU event covers (overlapping streams counted once); a gap longer than GAP_US
    is charged to the innermost host operator around the launch (by correlation id) of the work that ends it, with
    the kernel finished before it; shorter gaps count as idle but are not listed. The rendering lists them."""
    import json

    from litespark_megatron.apps.profile import render, summarize_trace

    def kernel(name, ts, dur, corr, stream=7):
        return {"ph": "X", "name": name, "cat": "kernel", "ts": ts, "dur": dur, "tid": stream,
                "args": {"correlation": corr}}

    def launch(ts, corr):
        return {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": ts, "dur": 2, "pid": 1, "tid": 1,
                "args": {"correlation": corr}}

    def runtime(name, ts, dur):
        return {"ph": "X", "name": name, "cat": "cuda_runtime", "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": {}}

    def op(name, ts, dur):
        return {"ph": "X", "name": name, "cat": "cpu_op", "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    events = [{"ph": "X", "name": "ProfilerStep#3", "cat": "user_annotation", "ts": 0, "dur": 1000, "pid": 1,
               "tid": 1},
              # GPU: busy 0-300 (two streams overlapping), a 5 us gap (launch latency), 305-400, a 200 us gap
              # ended by work launched inside aten::mm inside aten::linear, 600-700, a 100 us gap ended by work
              # launched inside aten::add, 800-900, then 100 us idle to the step's end.
              kernel("gemm_a", 0, 200, 1), kernel("gemm_b", 100, 200, 2, stream=8), kernel("k_c", 305, 95, 3),
              kernel("k_c2", 305, 95, 7, stream=8),  # the same range on another stream (a tie to sort)
              kernel("k_d", 600, 100, 4), kernel("k_e", 800, 100, 5),
              # outside the step: ignored
              kernel("k_f", 1200, 50, 6),
              launch(10, 1), launch(20, 2), launch(30, 3), op("aten::linear", 500, 60), op("aten::mm", 510, 40),
              launch(520, 4), op("aten::add", 700, 20), launch(705, 5),
              # the host inside runtime calls: a synchronization across the 400-600 gap's start (130 us of it), a
              # cudaMalloc inside the 700-800 gap (40 us), one outside every gap, one inside the 5 us gap (not
              # listed: that gap is launch latency); launches are not waits
              runtime("cudaStreamSynchronize", 380, 150), runtime("cudaMalloc", 720, 40),
              runtime("cudaMalloc", 100, 50), runtime("cudaFree", 301, 3)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = summarize_trace(str(path))
    idle = s["idle"]
    assert idle["ms_per_step"] == pytest.approx((5 + 200 + 100 + 100) / 1e3)
    assert [(g["host_op"], g["after_kernel"]) for g in idle["gaps"]] == [("aten::mm", "k_c"), ("aten::add", "k_d")]
    assert [g["ms_per_step"] for g in idle["gaps"]] == pytest.approx([0.2, 0.1])
    assert idle["gaps"][0]["count_per_step"] == 1
    md = render(s, "gaps")
    assert "GPU idle 0.4 ms/step" in md and "| `aten::mm` | `k_c` | 0.20 | 1 |" in md
    assert idle["host_calls"] == [{"call": "cudaStreamSynchronize", "ms_per_step": pytest.approx(0.13)},
                                  {"call": "cudaMalloc", "ms_per_step": pytest.approx(0.04)}]
    assert "host spent 0.2 ms/step inside CUDA runtime calls" in md and "| `cudaStreamSynchronize` | 0.13 |" in md
