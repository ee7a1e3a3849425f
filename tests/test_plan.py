"""litespark-plan (litespark_megatron/apps/plan.py, layouts.py): the layouts it enumerates, refused or accepted by the
trainer's own checks; the plan's ranking, memory and commands; bad input as one line; --verify end to end on the CPU
with two ranks."""
import json
import sys

import pytest

from conftest import child_env, run
from litespark_megatron import arguments
from litespark_megatron.apps import layouts, plan
from litespark_megatron.errors import ConfigError

LLAMA_3B = ["--model", "llama-3b", "--bf16", "--seq-length", "4096", "--global-batch-size", "64"]


def planned(capsys, *argv):
    assert plan.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def refused(capsys, *argv) -> str:
    assert plan.main(list(argv)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err  # one line: no usage block, no traceback
    assert lines[0].startswith("litespark-plan: error: ")
    return lines[0][len("litespark-plan: error: "):]


def test_every_candidate_goes_through_the_trainers_checks(monkeypatch, capsys):
    """The plan calls arguments.check_run, litespark-train's own pre-flight, for every layout, and a rule added there
    applies to the plan unchanged: refusing TP2 in the trainer removes every TP2 layout from the plan."""
    calls, real = [], arguments.check_run

    def spy(args, plat, world):
        calls.append((args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size,
                      args.micro_batch_size))
        if args.tensor_model_parallel_size == 2:
            raise ConfigError("no TP2 today")
        return real(args, plat, world)

    monkeypatch.setattr(arguments, "check_run", spy)
    result = planned(capsys, "--gpu", "H200", "--gpus-per-node", "4", "--top", "10", *LLAMA_3B)
    assert result["checked"] == len(calls) - len(result["layouts"])  # every candidate, and each printed command again
    assert any(tp == 2 for tp, *_ in calls) and {(4, 1, 1, 1), (1, 2, 1, 2), (1, 1, 2, 1)} <= set(calls)
    assert result["refused"] == sum(tp == 2 for tp, *_ in calls)
    assert result["layouts"] and all(not layout["layout"].startswith("TP2") for layout in result["layouts"])


def test_the_trainers_refusals_are_the_plans(capsys):
    """Layouts the trainer refuses never reach the plan, with the trainer's reason: 28 layers do not split into 8
    pipeline stages (Megatron-LM's validate_args), 24 heads not over TP 16... and a layout flag no layout can honour
    is one line with that reason."""
    from litespark_megatron.platform import Platform

    h200 = Platform("cuda", "nccl", True, True, "H200")
    named = layouts.named_flags(LLAMA_3B)
    args = layouts.resolve([*LLAMA_3B, *layouts.placeholders(named)], h200, 8)
    reasons = {}
    for candidate in layouts.candidates(args, 8, 8, named):
        try:
            layouts.check(args, candidate, h200, 8)
        except ConfigError as e:
            reasons[(candidate.tp, candidate.pp, candidate.layers_per_virtual_stage)] = str(e)
    assert reasons[(1, 8, None)] == "--num-layers 28 is not divisible by --pipeline-model-parallel-size 8"
    assert not {(1, 2, None), (1, 4, None), (8, 1, None)} & set(reasons)  # 8 KV heads split over TP8 too
    line = refused(capsys, "--gpu", "H200", *LLAMA_3B, "--tensor-model-parallel-size", "3")
    assert line.startswith("no layout of 8 H200 GPUs passes litespark-train's checks with these flags: world size 8 "
                           "is not divisible by TP x PP x CP = 3 x"), line


def test_a_plan_ranks_layouts_that_fit_and_prints_their_commands(capsys):
    result = planned(capsys, "--gpu", "H100", "--gpus-per-node", "4", "--top", "3", *LLAMA_3B,
                     "--cross-entropy-loss-fusion")
    assert result["gpu"] == "H100" and result["fit"] >= 3 and result["do_not_fit"] > 0
    speeds = [layout["tokens_per_sec_per_gpu"] for layout in result["layouts"]]
    assert speeds == sorted(speeds, reverse=True) and "assumed MFU 50%" in result["rate"]
    for layout in result["layouts"]:
        assert layout["memory_gib"]["required"] <= result["usable_gib"]
        assert layout["command"].removeprefix("CUDA_DEVICE_MAX_CONNECTIONS=1 ").startswith(
            "torchrun --nnodes 1 --nproc-per-node 4 -m litespark_megatron --model llama-3b --bf16 --seq-length 4096 "
            "--global-batch-size 64 --cross-entropy-loss-fusion --")
        assert layout["flags"][:len(LLAMA_3B) + 1] == [*LLAMA_3B, "--cross-entropy-loss-fusion"]
    # llama-3b BF16 does not fit one 80 GB H100 with fp32 optimizer state: the best layouts shard it
    assert all("dist-opt" in layout["layout"] for layout in result["layouts"])
    # a layout flag the user gives fixes that dimension, and is not repeated in the command
    fixed = planned(capsys, "--gpu", "H100", "--gpus-per-node", "4", *LLAMA_3B, "--micro-batch-size", "2")
    assert {layout["layout"].split(" mb ")[1][:1] for layout in fixed["layouts"]} == {"2"}
    assert all(layout["flags"].count("--micro-batch-size") == 1 for layout in fixed["layouts"])
    # FP8's assumed MFU is the one measured on the GPU type: an H200 runs the Litespark defaults faster than an H100
    fp8 = {gpu: planned(capsys, "--gpu", gpu, "--gpus-per-node", "4", "--top", "1", *LLAMA_3B, "--fp8-format",
                        "hybrid")["rate"] for gpu in ("H100", "H200")}
    assert "assumed MFU 65% (causal-half, FP8; measured on H100s)" in fp8["H100"]
    assert "assumed MFU 75% (causal-half, FP8; measured on H200s)" in fp8["H200"]
    # a measured rate replaces the assumed MFU, and scales the prediction
    slow = planned(capsys, "--gpu", "H100", "--gpus-per-node", "4", "--top", "1", *LLAMA_3B,
                   "--cross-entropy-loss-fusion", "--measured-tokens-per-sec-per-gpu", "10000")
    assert slow["rate"].startswith("measured 10,000 tokens/s") and \
        slow["layouts"][0]["tokens_per_sec_per_gpu"] < result["layouts"][0]["tokens_per_sec_per_gpu"]


def test_tp_and_cp_commands_set_the_one_work_queue_and_refusals_say_why(capsys):
    """A TP or CP layout's command starts with CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM refuses TP and CP on an
    H100 or H200 without it; scripts/pretrain.sh sets it the same way), a DP one with torchrun; the refused layouts
    are counted by reason, the most frequent first, in the JSON and in the printout."""
    result = planned(capsys, "--gpu", "H100", "--gpus-per-node", "8", "--top", "40", *LLAMA_3B)
    split = [layout for layout in result["layouts"] if not layout["layout"].startswith("TP1 PP1 CP1")]
    assert split and len(split) < len(result["layouts"])
    for layout in result["layouts"]:
        tp_or_cp = not layout["layout"].startswith("TP1 ") or " CP1 " not in layout["layout"]
        assert layout["environment"] == ({"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp_or_cp else {}), layout["layout"]
        assert layout["command"].startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun " if tp_or_cp else "torchrun ")
    assert any(not layout["environment"] for layout in result["layouts"])
    assert sum(r["layouts"] for r in result["refusals"]) == result["refused"] > 0
    counts = [r["layouts"] for r in result["refusals"]]
    assert counts == sorted(counts, reverse=True)
    assert plan.main(["--gpu", "H100", "--gpus-per-node", "8", "--top", "1", *LLAMA_3B]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith("; refused:"))
    assert lines[at].startswith(f"{result['checked']} layouts: {result['refused']} refused (litespark-train's "
                                "checks, the estimate), ")
    shown = result["refusals"][:plan.REFUSALS_SHOWN]
    assert lines[at + 1:at + 1 + len(shown)] == [f"  {r['layouts']} x {r['reason']}" for r in shown]
    assert lines[at + 1 + len(shown)] == "the best:" and lines[at + 2 + len(shown)].startswith("1. ")


def test_a_plan_across_nodes(capsys):
    """64 H100s as 8 nodes of 8 (llama3-8b, FP8, 8k tokens, the published 8-GPU row's global batch): every layout
    spans the 64 ranks (DP x TP x PP x CP), TP stays inside a node, the commands launch 8 nodes, and the DP
    reductions over the network make no layout faster per GPU than the one GPU the plan starts from."""
    import re

    result = planned(capsys, "--gpu", "H100", "--nodes", "8", "--gpus-per-node", "8", "--top", "5",
                     "--model", "llama3-8b", "--bf16", "--fp8-format", "hybrid", "--seq-length", "8192",
                     "--global-batch-size", "128", "--micro-batch-size", "1")
    assert result["nodes"] == 8 and result["fit"] >= 5
    assert result["interconnect"] == "datasheet: 450 GB/s between GPUs of a node, 50 GB/s per GPU between nodes, " \
                                     "x 0.8 (NCCL)"
    one_gpu = float(re.search(r"([\d,]+) tokens/s on one GPU", result["rate"]).group(1).replace(",", ""))
    for layout in result["layouts"]:
        tp, pp, cp, dp = (int(re.search(rf"{dim}(\d+)", layout["layout"]).group(1)) for dim in ("TP", "PP", "CP", "DP"))
        assert tp * pp * cp * dp == 64 == layout["gpus"] and 8 % tp == 0, layout["layout"]
        command = layout["command"].removeprefix("CUDA_DEVICE_MAX_CONNECTIONS=1 ")
        assert command.startswith("torchrun --nnodes 8 --nproc-per-node 8 -m litespark_megatron ")
        assert 0 < layout["tokens_per_sec_per_gpu"] < one_gpu
        assert layout["memory_gib"]["required"] <= result["usable_gib"]


def test_measured_collective_bandwidth(tmp_path, capsys):
    report = tmp_path / "bw.json"
    report.write_text(json.dumps({"world_size": 4, "rows": [
        {"op": "all_reduce", "mib_per_rank": 1024, "bus_gbps": 300.0},
        {"op": "all_gather", "mib_per_rank": 1024, "bus_gbps": 280.0},
        {"op": "all_reduce", "mib_per_rank": 24, "bus_gbps": 200.0}]}))
    result = planned(capsys, "--gpu", "H100", "--gpus-per-node", "4", "--top", "1", "--comm-bandwidth", str(report),
                     *LLAMA_3B)
    assert result["interconnect"].startswith("measured 300 GB/s bus bandwidth inside a node (4 ranks")
    (tmp_path / "bad.json").write_text("{}")
    line = refused(capsys, "--gpu", "H100", "--comm-bandwidth", str(tmp_path / "bad.json"), *LLAMA_3B)
    assert line.startswith(f"--comm-bandwidth {tmp_path / 'bad.json'}: not a report of tools/comm_bandwidth.py")


def test_a_model_too_large_says_what_would_fit(capsys):
    """The line names what would hold the model: more GPUs (llama3-8b in BF16 does not fit one 80 GB H100: its fp32
    optimizer state alone is 8B x 12 bytes), FP8 with the precision-aware optimizer, recomputation where the user's
    flags ruled it out; and says so where nothing tried fits."""
    line = refused(capsys, "--gpu", "H100", "--gpus-per-node", "1", "--model", "llama3-8b", "--bf16",
                   "--global-batch-size", "8")
    assert line.startswith("no layout of 1 H100 GPU fits llama3-8b: the smallest, TP1 PP1 CP1 DP1 mb 1 recompute "
                           "full, needs "), line
    # 42.7 GiB: the plan runs Litespark's cross-entropy, its default on a GPU in BF16 (the logits' fp32 copy of
    # megatron-core's loss, 46.6 GiB, is gone)
    assert line.endswith("what would fit: 4 nodes of 1 (4 GPUs), e.g. TP1 PP4 CP1 DP1 mb 1 recompute full at 42.7 GiB")
    selective = refused(capsys, "--gpu", "H100", "--gpus-per-node", "1", "--model", "llama-3b", "--bf16",
                        "--global-batch-size", "8", "--recompute-granularity", "selective")
    assert ("; or FP8 with the precision-aware optimizer (--fp8-format hybrid --use-distributed-optimizer "
            "--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16), "
            "e.g. TP1 PP1 CP1 DP1 mb 1 dist-opt recompute selective at 49.3 GiB; ") in selective
    assert selective.endswith("; or full recomputation (drop --recompute-granularity: the plan then tries it)")
    huge = refused(capsys, "--gpu", "H100", "--gpus-per-node", "1", "--gpu-memory-gib", "2", *LLAMA_3B)
    assert huge.endswith("nothing tried fits either (up to 64 nodes, FP8 with the precision-aware optimizer); the "
                         "plan splits the 28 layers evenly only (pipeline sizes 1, 2, 4 on these GPU counts): deeper "
                         "pipelines (8, 16) need an uneven split (--decoder-first-pipeline-num-layers, "
                         "--decoder-last-pipeline-num-layers, --account-for-embedding-in-pipeline-split), which it "
                         "does not model")


def test_pipeline_sizes_that_split_the_layers_evenly_and_the_deeper_ones_that_would_not():
    """Llama 3.1 405B's 126 layers on 8-4,096 GPUs: PP 1 or 2 only (docs/planner-at-scale.md); 32 layers: any."""
    assert plan.pipeline_splits(126, [8 * 2 ** k for k in range(10)]) == ([1, 2], [4, 8, 16, 32, 64])
    assert plan.pipeline_splits(32, [8, 64]) == ([1, 2, 4, 8, 16, 32], [])
    assert plan.pipeline_splits(28, [6]) == ([1, 2], [3, 6])


@pytest.mark.parametrize("argv, start", [
    (["--gpu", "A40", *LLAMA_3B], "unknown --gpu 'A40': litespark-plan knows H100, H200, cpu"),
    (["--gpu", "H100", "--model", "llama-3b", "--bf16"], "--global-batch-size is not set"),
    (["--gpu", "H100", *LLAMA_3B, "--expert-model-parallel-size", "2"], "--expert-model-parallel-size: litespark-plan "
                                                                        "models even pipeline splits"),
    (["--gpu", "H100", *LLAMA_3B, "--num-experts", "8", "--moe-router-topk", "2"],
     "the memory model covers dense Llama layers; --num-experts is not modelled"),
    (["--gpu", "H100", *LLAMA_3B, "--model", "llama-9z"], "unknown --model 'llama-9z'; choose one of: tiny, llama-1b"),
    (["--gpu", "cpu", "--model", "tiny", "--global-batch-size", "4"], "--gpu cpu needs --gpu-memory-gib"),
    (["--gpu", "cpu", "--gpu-memory-gib", "4", "--model", "tiny", "--global-batch-size", "4"],
     "--gpu cpu has no measured MFU to start from: give --measured-tokens-per-sec-per-gpu"),
    (["--gpu", "H100", "--nodes", "2", "--verify", "1", *LLAMA_3B], "--verify trains the layouts on this machine"),
    # FP8 without --bf16 keeps FP32 parameters: on the four-H200 machine every verified layout fell back to SDPA's
    # math attention and ran out of memory where the model predicted 52-110 GiB
    (["--gpu", "H200", "--model", "llama-3b", "--fp8-format", "hybrid", "--global-batch-size", "8"],
     "these flags train in FP32 (no --bf16 or --fp16; FP8 runs keep --bf16 too): on a GPU the attention's fused "
     "kernels take 16-bit inputs only"),
])
def test_bad_input_is_one_line(capsys, argv, start):
    line = refused(capsys, *argv)
    assert line.startswith(start), line


def test_the_module_runs_and_refuses_in_one_line():
    proc = run([sys.executable, "-m", "litespark_megatron.apps.plan", "--gpu", "V100", *LLAMA_3B], env=child_env())
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "litespark-plan: error: unknown --gpu 'V100': litespark-plan knows H100, H200, cpu"


def test_verify_logs_past_the_cuda_graph_capture(tmp_path, capsys):
    """The sweep times the log intervals after the first: with CUDA graphs the verify's first interval holds their
    capture (step 4 by default), and too few steps for a second one are refused before anything is written."""
    from types import SimpleNamespace

    graphs = ["--model", "tiny", "--cuda-graph-impl", "transformer_engine"]
    assert arguments.cuda_graph_capture_step(arguments.resolve_quietly(graphs)) == 4
    assert arguments.cuda_graph_capture_step(arguments.resolve_quietly(graphs + ["--cuda-graph-warmup-steps",
                                                                                 "1"])) == 2
    assert arguments.cuda_graph_capture_step(arguments.resolve_quietly(["--model", "tiny"])) is None
    # Megatron-LM's deprecated spelling is graphs too
    assert arguments.cuda_graph_capture_step(arguments.resolve_quietly(["--model", "tiny",
                                                                        "--enable-cuda-graph"])) == 4
    # the plan records the capture step of the user's flags for --verify
    result = planned(capsys, "--gpu", "H200", "--gpus-per-node", "4", "--top", "1", *LLAMA_3B,
                     "--cuda-graph-impl", "transformer_engine")
    assert result["cuda_graph_capture_step"] == 4
    assert planned(capsys, "--gpu", "H200", "--gpus-per-node", "4", "--top", "1",
                   *LLAMA_3B)["cuda_graph_capture_step"] is None
    out = tmp_path / "verify"
    with pytest.raises(plan.UserError) as e:
        plan.verify({"layouts": [], "cuda_graph_capture_step": 4}, graphs,
                    SimpleNamespace(verify_steps=6, verify=1, out=str(out)))
    assert str(e.value) == ("--verify-steps 6 with CUDA graphs (captured in step 4): the sweep times the log intervals "
                            "after the first, which must hold the capture; give --verify-steps 8 or more")
    assert not out.exists()


@pytest.mark.integration  # its processes start inside the package
def test_verify_on_the_cpu_with_two_ranks(tmp_path, capsys):
    """The best layout of two CPU ranks, trained for a few steps by tools/layout_sweep.py: its measured tokens/s
    beside the predicted."""
    result = planned(capsys, "--gpu", "cpu", "--gpus-per-node", "2", "--gpu-memory-gib", "16",
                     "--measured-tokens-per-sec-per-gpu", "20000", "--top", "2", "--verify", "1", "--verify-steps", "3",
                     "--out", str(tmp_path), "--model", "tiny", "--seq-length", "64", "--global-batch-size", "4")
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    row, best = sweep["rows"][0], result["layouts"][0]
    # each of the verify's own flags once (not after a placeholder of the same flag)
    assert [sweep["shared_flags"].count(f) for f in ("--train-iters", "--eval-interval", "--lr")] == [1, 1, 1]
    assert row["rc"] == 0 and row["nproc"] == 2 and row["flags"] == " ".join(best["layout_flags"])
    verified = result["verified"]
    assert len(verified) == 1 and verified[0]["layout"] == best["layout"] and verified[0]["error"] is None
    assert verified[0]["measured_tokens_per_sec_per_gpu"] == row["tokens_per_sec_per_gpu"] > 0
    assert verified[0]["predicted_tokens_per_sec_per_gpu"] == best["tokens_per_sec_per_gpu"]
    text = plan.render(result)
    assert f"verify {best['layout']}: {row['tokens_per_sec_per_gpu']:,.0f} tokens/s per GPU measured, " in text
    assert "peak not measured (no GPU)" in text
