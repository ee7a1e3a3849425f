"""Litespark's cross-entropy (kernels/cross_entropy.py): the plain-torch reference is megatron-core's
vocab_parallel_cross_entropy; the Triton kernels equal the reference (through Triton's interpreter on the CPU, on
gloo ranks holding 1, 2 or 3 shards of the vocabulary: tests/workers/cross_entropy_worker.py; compiled on a GPU); and
--litespark-cross-entropy trains the model megatron-core's loss trains."""
import json

import pytest
import torch

from conftest import WORKER_DIR, child_env, made_once, ok, records, torchrun, train
from test_arguments import TINY, check
from litespark_megatron.arguments import ConfigError
import litespark_megatron.kernels
from litespark_megatron.kernels import cross_entropy as ce, triton_available


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """The worker's largest differences and its single-rank findings (Triton's interpreter reads TRITON_INTERPRET
    when Triton is first imported: a fresh process)."""
    def build(_):
        proc = torchrun(3, WORKER_DIR / "cross_entropy_worker.py", env=child_env(TRITON_INTERPRET=1))
        # Every rank's first error: the rank that failed first leaves the others waiting in a collective, and their
        # errors (connection closed) fill the end of the output.
        first = [line for line in proc.stderr.splitlines() if line.startswith("[rank0]") or "Error" in line]
        assert proc.returncode == 0, "\n".join(first[:60])[-6000:] + "\n...\n" + proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    return made_once(tmp_path_factory, "cross-entropy-interpreted", build)


def test_reference_is_the_cross_entropy_of_the_whole_vocabulary(interpreted):
    """The reference's TP shards, combined, give torch's cross_entropy of the whole row (fp64)."""
    assert interpreted["exact_fp64"] <= 1e-12, interpreted


def test_reference_equals_megatron_cores_vocab_parallel_cross_entropy(interpreted):
    """Loss and gradient as megatron-core's unfused vocab-parallel cross-entropy computes them, fp32 and bf16
    logits, TP 1 to 3, padded (-inf) columns, a shard of nothing but padding (gradients relative to the loss's)."""
    for dtype, grad_tolerance in (("fp32", 1e-6), ("bf16", 2 ** -8)):
        assert interpreted[f"megatron_{dtype}_loss"] <= 1e-6, interpreted
        assert interpreted[f"megatron_{dtype}_grad"] <= grad_tolerance, interpreted


def test_triton_kernels_equal_the_reference(interpreted):
    """The Triton path against the reference on the same logits in fp64: rows of 37 and 129 columns in one block
    and in blocks of 16, targets at every shard's first and last id, TP 1 to 3, padded columns. The bf16 gradient
    is stored in bf16; Triton's interpreter truncates to bf16 where a GPU rounds to nearest: 2^-7 of the loss's
    gradient."""
    for dtype in ("fp32", "bf16"):
        assert interpreted[f"triton_{dtype}_loss"] <= 1e-5, interpreted
    assert interpreted["triton_fp32_grad"] <= 2e-6, interpreted
    assert interpreted["triton_bf16_grad"] <= 2 ** -7, interpreted


def test_triton_backward_writes_the_gradient_over_the_logits(interpreted):
    """The gradient is the logits' own memory; a second backward (which would read the gradient as logits) is
    refused by autograd's version check; a forward without gradients leaves the logits as they were."""
    assert interpreted["grad_is_the_logits_memory"] is True
    assert interpreted["second_backward"] == "refused"
    assert interpreted["no_grad_logits_unchanged"] is True


def test_triton_path_copies_non_contiguous_logits_and_runs_under_checkpointing(interpreted):
    """A non-contiguous view computes the same and is left alone (its contiguous copy takes the gradient); under
    activation checkpointing (--chunked-output-loss) the recomputed forward gives the same gradient."""
    assert interpreted["non_contiguous_input_unchanged"] is True
    for key in ("non_contiguous_loss", "non_contiguous_grad", "checkpoint_loss", "checkpoint_grad"):
        assert interpreted[key] <= 1e-5, (key, interpreted)


def test_the_cpu_runs_the_reference():
    logits, target = torch.randn(3, 2, 11), torch.randint(0, 11, (3, 2))
    assert ce.cross_entropy_path("cpu") == "litespark (reference)"
    assert torch.equal(ce.cross_entropy(logits, target), ce.vocab_parallel_cross_entropy_reference(logits, target))
    assert ce.cross_entropy_path("cuda") == ("litespark" if triton_available() else "litespark (reference)")


@pytest.mark.parametrize("fn", [ce.cross_entropy, ce.vocab_parallel_cross_entropy_reference,
                                ce.vocab_parallel_cross_entropy_triton])
def test_label_smoothing_and_a_mismatched_target_are_refused(fn):
    logits, target = torch.randn(3, 2, 11), torch.randint(0, 11, (3, 2))
    with pytest.raises(ValueError) as e:
        fn(logits, target, None, 0.1)
    assert str(e.value) == ("label smoothing 0.1: Litespark's cross-entropy computes the plain loss; use "
                            "megatron-core's vocab_parallel_cross_entropy for a smoothed one")
    with pytest.raises(ValueError) as e:
        fn(logits, target.t())
    assert str(e.value) == ("cross-entropy: target of shape (2, 3) for logits of shape (3, 2, 11); the target has "
                            "the logits' shape without the vocabulary")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
def test_triton_on_cuda_equals_the_reference_and_keeps_only_the_logits():
    """4096 tokens x 32,000 bf16 logits: the compiled kernels give the reference's loss and, rounded to bf16 once,
    its gradient. Beyond the logits the Triton path allocates a few floats per row (its gradient is the logits'
    memory); the reference, like megatron-core, an fp32 copy of the logits and more."""
    s, b, v = 2048, 2, 32000
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(s, b, v, device="cuda", generator=g) * 3).to(torch.bfloat16)
    target = torch.randint(0, v, (s, b), device="cuda", generator=g)
    grad_loss = torch.rand(s, b, device="cuda", generator=g)
    assert ce.cross_entropy_path("cuda") == "litespark"

    def run(fn):
        x = logits.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = fn(x, target)
        (grad,) = torch.autograd.grad(loss, x, grad_loss)
        torch.cuda.synchronize()
        return loss.detach(), grad, torch.cuda.max_memory_allocated() - before, grad.data_ptr() == x.data_ptr()

    ref_loss, ref_grad, ref_peak, _ = run(ce.vocab_parallel_cross_entropy_reference)
    loss, grad, peak, in_place = run(ce.cross_entropy)
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=0)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=2 ** -8, rtol=0)
    size = logits.numel() * logits.element_size()
    assert in_place
    assert peak <= 0.02 * size, (peak, size)
    assert ref_peak >= 2 * size, (ref_peak, size)


# --------------------------------------------------------------------------------------------- the flag
MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "1e-2", "--train-iters", "3", "--eval-iters", "0", "--eval-interval",
        "100", "--seed", "1234", "--log-interval", "1"]


def _run(tmp_path, name, nproc, *flags):
    metrics = tmp_path / f"{name}.jsonl"
    proc = ok(train(nproc, *MOCK, *flags, "--metrics-file", metrics))
    return proc, records(metrics)


def test_the_flag_trains_as_megatron_cores_loss(tmp_path):
    """--litespark-cross-entropy (on the CPU: the reference, through megatron-core's output_processor) gives the
    losses of megatron-core's own loss to fp32 noise; under TP2 with --chunked-output-loss the chunks' losses
    go through it and the shards' statistics through gloo, to the parity tests' 1e-5. The run says what ran."""
    _, off = _run(tmp_path, "off", 1)
    proc, on = _run(tmp_path, "on", 1, "--litespark-cross-entropy")
    _, tp2 = _run(tmp_path, "tp2", 2, "--litespark-cross-entropy", "--tensor-model-parallel-size", "2",
                  "--chunked-output-loss", "2")
    reference = [r["loss"] for r in off if r["kind"] == "train"]
    assert len(reference) == 3
    for got, tolerance in ((on, 1e-6), (tp2, 1e-5)):
        losses = [r["loss"] for r in got if r["kind"] == "train"]
        assert len(losses) == 3 and all(abs(a - b) <= tolerance * abs(b) for a, b in zip(losses, reference)), \
            (losses, reference)
    health = [r for r in on if r["kind"] == "health"]
    assert health[0]["fusions"]["cross_entropy"] == "litespark (reference)", health
    assert [r for r in off if r["kind"] == "health"][0]["fusions"]["cross_entropy"] == "off"
    assert "fused: cross-entropy litespark (reference), " in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--cross-entropy-loss-fusion"],
     "--litespark-cross-entropy with --cross-entropy-loss-fusion: two cross-entropy kernels; drop one"),
    (["--mtp-num-layers", "1"],
     "--litespark-cross-entropy with --mtp-num-layers: multi-token prediction computes its losses with megatron-core's "
     "cross-entropy; drop one"),
])
def test_the_flag_is_refused_beside_another_loss(flags, message):
    with pytest.raises(ConfigError) as e:
        check(TINY + ["--litespark-cross-entropy"] + flags)
    assert str(e.value) == message


def test_the_health_record_names_the_loss_that_ran():
    from types import SimpleNamespace

    from litespark_megatron import backend_probe

    assert backend_probe.requested_fusions(SimpleNamespace(litespark_cross_entropy=True))["cross_entropy"] is True
    with backend_probe.BackendProbe([]) as probe:
        pass
    config = SimpleNamespace(cross_entropy_loss_fusion=False, apply_rope_fusion=False, rotary_interleaved=False)
    assert probe.report(config=config, device_type="cpu").fusions["cross_entropy"] == "off"
    report = probe.report(config=config, device_type="cuda", cross_entropy="litespark",
                          requested=dict(cross_entropy=True))
    assert report.fusions["cross_entropy"] == "litespark"
    assert "cross-entropy fusion asked for but off" not in report.degraded


def test_a_gpu_without_triton_is_refused(monkeypatch):
    """A CPU runs the reference; a GPU asked for the kernel must run it, so a GPU without Triton is one line."""
    from test_arguments import GPU_TE

    monkeypatch.setattr(litespark_megatron.kernels, "triton_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        check(TINY + ["--litespark-cross-entropy", "--transformer-impl", "transformer_engine", "--bf16"], GPU_TE)
    assert str(e.value) == ("--litespark-cross-entropy on a GPU runs Triton kernels, and Triton does not import here: "
                            "install torch's CUDA build with its triton, or drop the flag")
    check(TINY + ["--litespark-cross-entropy"])  # the CPU: the reference, Triton or not
