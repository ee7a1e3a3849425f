"""Litespark's FP8 output layer (kernels/fp8_logits.py): the reference computes the cross-entropy of the logits of
FP8-quantized inputs, and gradients of the FP8-quantized loss gradient; the Triton kernels write the reference's
bytes in both layouts (Triton's interpreter on gloo ranks: tests/workers/fp8_logits_worker.py; compiled on a GPU);
TP2 computes what one process computes; megatron-core's gradient-accumulation fusion is honoured; the flag trains
close to the BF16 output layer, says so in the run's record, and is refused where it cannot run."""
import pytest
import torch

from conftest import WORKER_DIR, child_env, made_once, torchrun
from litespark_megatron.kernels import fp8_logits as fl
from litespark_megatron.kernels.cross_entropy import vocab_parallel_cross_entropy_reference


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    import json

    def build(_):
        proc = torchrun(2, WORKER_DIR / "fp8_logits_worker.py", env=child_env(TRITON_INTERPRET=1))
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    return made_once(tmp_path_factory, "fp8-logits-worker", build)


def test_triton_kernels_write_the_references_bytes_in_both_layouts(worker):
    """The cast and the loss-gradient kernels, odd shapes, fp32 and bf16 in, targets in and out of the shard, padded
    columns, masked tokens, the gradient written over the logits in launches of doubling row ranges: every byte the
    reference's (integer conversion, exact under the interpreter; the fp32 exponentials may differ in their last
    bit: one FP8 step, once in 10^4 at most)."""
    assert worker["kernel_elements"] > 50_000, worker
    assert worker["kernel_mismatched"] <= worker["kernel_elements"] * 1e-4 and worker["kernel_max_step"] <= 1, worker
    assert worker["layouts_agree"], worker
    assert worker["over_logits"], worker  # the gradient takes no memory beyond the logits'


def test_the_triton_path_computes_the_references_loss_and_gradients(worker):
    """The whole function on TP2's shards: the Triton kernels (the GEMMs the reference's, on a CPU) against the
    reference."""
    assert worker["triton_vs_reference_loss"] <= 1e-6, worker
    assert worker["triton_vs_reference_grad_h"] <= 1e-6 and worker["triton_vs_reference_grad_w"] <= 1e-6, worker


def test_tp2_computes_what_one_process_computes(worker):
    """The weight's scale is the whole weight's (its amax all-reduced over the TP group), so both layouts quantize
    alike: the loss and dW to fp32 rounding; dh is summed from the ranks' bf16 partial products, as megatron-core's
    output layer sums it (bf16's 2^-8)."""
    assert worker["tp2_vs_tp1_loss"] <= 1e-6 and worker["tp2_vs_tp1_grad_w"] <= 1e-6, worker
    assert worker["tp2_vs_tp1_grad_h"] <= 2 ** -7, worker


def test_padded_columns_are_no_tokens(worker):
    """Columns from padded_from on are -inf logits (megatron's padded vocabulary, model.mask_padded_vocab): the
    loss of the unpadded vocabulary, no gradient into the padded rows of the weight."""
    assert worker["padded_loss"] <= 1e-6 and worker["padded_grad_w_zero"] == 0.0, worker


def _case(tokens=33, hidden=32, vocab=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(tokens, hidden, generator=g) * 2).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=g) * 0.1).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    grad_loss = torch.rand(tokens, generator=g) / tokens
    return h, w, target, grad_loss


def _dequantized(x, dtype):
    scale = fl.amax_scale(x, dtype)
    return fl.quantize_reference(x, scale, dtype)[0].float() / scale


def test_the_reference_is_the_cross_entropy_of_fp8_quantized_logits_and_its_gradient():
    """Loss: the cross-entropy of (q(h) q(W)^T) in bf16, q the FP8 e4m3 quantization at the tensor's own amax.
    Gradients: dlogits = (softmax - onehot) * dloss quantized to e5m2 at the scale max |dloss| gives; dh = q(dlogits)
    q(W), dW = q(dlogits)^T q(h). All within FP8's error of the unquantized function's autograd in fp64."""
    h, w, target, grad_loss = _case()
    hv, wv = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fl.fp8_logits_loss(hv, wv, target)
    gh, gw = torch.autograd.grad(loss, (hv, wv), grad_loss)
    qh, qw = _dequantized(h, fl.FORWARD), _dequantized(w, fl.FORWARD)
    logits = (qh @ qw.t()).to(torch.bfloat16)
    assert torch.equal(loss, vocab_parallel_cross_entropy_reference(logits, target))
    d = torch.softmax(logits.float(), dim=-1) - torch.nn.functional.one_hot(target, 48).float()
    d = d * grad_loss[:, None]
    d_scale = fl.current_scale(grad_loss.abs().amax(), fl.BACKWARD)
    qd = fl.quantize_reference(d, d_scale, fl.BACKWARD)[0].float() / d_scale
    assert torch.allclose(gh.float(), (qd @ qw).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-6)
    assert torch.allclose(gw, (qd.t() @ qh).to(torch.bfloat16), rtol=0, atol=0)
    # against the unquantized function in fp64: FP8's rounding (e4m3: 2^-4 per value, e5m2: 2^-3), averaged
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    exact = torch.nn.functional.cross_entropy(h64 @ w64.t(), target, reduction="none")
    eh, ew = torch.autograd.grad(exact, (h64, w64), grad_loss.double())
    assert (loss.double() - exact).abs().max() <= 0.05 * exact.abs().max()
    for got, want in ((gh, eh), (gw, ew)):
        assert (got.double() - want).norm() <= 0.15 * want.norm(), (got.double() - want).norm() / want.norm()


def test_the_gradient_rounded_stochastically_keeps_its_mean_where_rounding_to_nearest_drifts():
    """A softmax row of about one size (an untrained model's: every probability near 1 / vocabulary), scaled as the
    gradient is: rounded to nearest, every value moves the same way (here 2% down, the whole row's sum with it);
    rounded stochastically, each value goes to one of its two FP8 neighbours and their mean over seeds is the value
    (the spread of 64 seeds' mean: a step / 16). Normal and subnormal FP8 values both."""
    torch.manual_seed(0)
    scale = torch.tensor([1.0])
    for size in (0.447, 2.0 ** -15 * 1.3):  # e5m2: between 0.4375 and 0.5; between subnormals 2^-16 and 2^-15
        x = size * (1 + 0.01 * torch.rand(8, 512))
        nearest = fl.quantize_reference(x, scale, fl.BACKWARD)[0].double()
        assert abs(nearest.sum() / x.double().sum() - 1) > 0.015
        # the two neighbours' bytes: rounded down (no random bits), and the next FP8 value up
        low = fl.quantize_reference(x, scale, fl.BACKWARD, torch.zeros(x.shape, dtype=torch.int64))[0].view(torch.uint8)
        high = low + 1
        mean = torch.zeros_like(nearest)
        for seed in range(64):
            random = fl.random_bits_reference(torch.arange(8), torch.arange(512), seed)
            q = fl.quantize_reference(x, scale, fl.BACKWARD, random)[0]
            assert ((q.view(torch.uint8) == low) | (q.view(torch.uint8) == high)).all()
            mean += q.double() / 64
        assert abs(mean.sum() / x.double().sum() - 1) < 2e-3, mean.sum() / x.double().sum()


def test_the_random_bits_are_the_elements_own_under_every_split():
    """The bits of an element depend on its row, its column in the whole vocabulary and the seed only: a TP shard
    (columns from its vocab_start) draws the whole tensor's bits for its columns; another seed draws others; each bit
    is one half of the time."""
    rows, columns, seed = torch.arange(5, 45), torch.arange(300), 11
    whole = fl.random_bits_reference(rows, columns, seed)
    assert torch.equal(fl.random_bits_reference(rows[3:9], columns[100:200], seed), whole[3:9, 100:200])
    assert (fl.random_bits_reference(rows, columns, 12) != whole).float().mean() > 0.99
    assert whole.min() >= 0 and whole.max() < 2 ** 32
    for bit in (0, 11, 21, 31):
        assert abs(((whole >> bit) & 1).double().mean().item() - 0.5) < 0.02


def test_main_grad_fusion_adds_dw_into_main_grad_as_megatron_cores_linear_does():
    """With gradient-accumulation fusion dW is added (in fp32) to the weight's main_grad, the parameter is marked
    grad_added_to_main_grad, and the gradient autograd gets is a dummy of the weight's shape (megatron-core's DDP
    hooks skip it); without the marker there is nothing to return."""
    h, w, target, grad_loss = _case()
    plain = torch.nn.Parameter(w.clone())
    loss = fl.fp8_logits_loss(h, plain, target)
    (want,) = torch.autograd.grad(loss, plain, grad_loss)
    fused = torch.nn.Parameter(w.clone())
    fused.main_grad = torch.ones(fused.shape, dtype=torch.float32)
    fused.grad_added_to_main_grad = False
    loss = fl.fp8_logits_loss(h, fused, target, main_grad_fusion=True)
    (dummy,) = torch.autograd.grad(loss, fused, grad_loss)
    assert fused.grad_added_to_main_grad is True and dummy.shape == fused.shape
    assert torch.allclose(fused.main_grad - 1, want.float(), rtol=2 ** -8, atol=1e-9)
    del fused.grad_added_to_main_grad
    loss = fl.fp8_logits_loss(h, fused, target, main_grad_fusion=True)
    assert torch.autograd.grad(loss, fused, grad_loss, allow_unused=True) == (None,)


def test_the_weight_gradient_in_vocabulary_slices_equals_the_whole_product(monkeypatch):
    """dW is computed in slices of the vocabulary (its fp32 product never whole): slices of 16 rows, the last one
    short, give what one product over the whole vocabulary gives, into main_grad and as the weight's gradient."""
    h, w, target, grad_loss = _case(vocab=40)

    def grads():
        plain, fused = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
        fused.main_grad, fused.grad_added_to_main_grad = torch.zeros(w.shape, dtype=torch.float32), False
        (g,) = torch.autograd.grad(fl.fp8_logits_loss(h, plain, target), plain, grad_loss)
        torch.autograd.grad(fl.fp8_logits_loss(h, fused, target, main_grad_fusion=True), fused, grad_loss)
        return g, fused.main_grad

    whole = grads()
    monkeypatch.setattr(fl, "DW_ROWS", 16)
    sliced = grads()
    # fp32 products of a row slice may round their last bit otherwise (the BLAS's blocking); bf16 gradients by one step
    assert torch.allclose(sliced[1], whole[1], rtol=1e-6, atol=0)
    assert torch.allclose(sliced[0].float(), whole[0].float(), rtol=2 ** -8, atol=0)


def test_the_gradient_goes_only_over_logits_whose_memory_holds_it():
    """Written over the logits' memory, the gradient needs them contiguous and of 2 bytes or more a value (both FP8
    layouts in their bytes): anything else is refused before a kernel runs."""
    args = (torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.ones(1), 0)
    with pytest.raises(ValueError, match=r"^FP8 output layer: the logits' gradient goes over contiguous logits of 2 "
                                         r"bytes or more, got torch.bfloat16 of strides \(1, 4\)$"):
        fl.gradient_fp8_over_logits(torch.zeros(8, 4, dtype=torch.bfloat16).t(), *args)
    with pytest.raises(ValueError, match=r"got torch.uint8 of strides \(8, 1\)$"):
        fl.gradient_fp8_over_logits(torch.zeros(4, 8, dtype=torch.uint8), *args)


def test_shapes_it_does_not_take_are_refused(monkeypatch):
    h, w, target, _ = _case()
    with pytest.raises(ValueError, match=r"^FP8 output layer: tokens \(33, 32\), weight \(48, 31\), target \(33,\); "
                                         r"it takes \[T, H\], \[V, H\] and \[T\]$"):
        fl.fp8_logits_loss(h, w[:, :31], target)
    monkeypatch.setattr(fl, "fp8_logits_path", lambda device: "litespark")
    with pytest.raises(ValueError, match=r"^FP8 output layer: the tokens must be multiples of 16 \(FP8 GEMMs\); got "
                                         r"tokens 33, hidden 32, vocabulary shard 48$"):
        fl.fp8_logits_loss(h, w, target)


# --------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels and FP8 GEMMs run on CUDA")
def test_compiled_kernels_and_fp8_gemms_equal_the_reference_on_the_gpu():
    """llama-3b's output layer on a quarter micro-batch (4,096 tokens, hidden 3,072, a vocabulary shard of 16,032):
    the compiled kernels' bytes as the reference's, and the function through them and torch's FP8 GEMM
    (cuBLASLt) against the reference's dequantized fp32 GEMMs: the same loss and gradients to the GEMMs' own
    rounding; against the BF16 output layer within FP8's error."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or more")
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, shard = 4096, 3072, 16032
    h = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(shard, hidden, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    target = torch.randint(0, shard, (tokens,), device="cuda", generator=g)
    grad_loss = torch.full((tokens,), 1.0 / tokens, device="cuda")
    scale = fl.amax_scale(h, fl.FORWARD)
    for got, want in zip(fl.quantize_triton(h, scale, fl.FORWARD), fl.quantize_reference(h, scale, fl.FORWARD)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    logits = (h.float() @ w.float().t()).to(torch.bfloat16)
    lse = torch.logsumexp(logits.float(), dim=-1)
    gscale = fl.current_scale(grad_loss.abs().amax(), fl.BACKWARD)
    for seed in (None, 7):  # rounded to nearest, stochastically
        want = fl.gradient_fp8_reference(logits, target, lse, grad_loss, gscale, 0, seed=seed)
        got = fl.gradient_fp8_over_logits(logits.clone(), target, lse, grad_loss, gscale, 0, seed=seed)
        for a, b in zip(got, want):
            a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert (a != b).float().mean().item() <= 1e-4 and ((a.int() - b.int()).abs() <= 1).all()

    def run(triton):
        hv, wv = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fl._FP8LogitsLoss.apply(hv, wv, target, None, None, False, triton, 7)
        return (loss, *torch.autograd.grad(loss, (hv, wv), grad_loss))

    fast, ref = run(True), run(False)
    for a, b in zip(fast, ref):
        assert (a.float() - b.float()).norm() <= 1e-2 * b.float().norm()
    hv, wv = h.clone().requires_grad_(), w.clone().requires_grad_()
    bf16 = torch.nn.functional.cross_entropy((hv @ wv.t()).float(), target, reduction="none")
    for a, b in zip(fast, (bf16, *torch.autograd.grad(bf16, (hv, wv), grad_loss))):
        assert (a.float() - b.float()).norm() <= 0.15 * b.float().norm()


# --------------------------------------------------------------------------------------------- the flag
# A vocabulary of 250 padded to 256: the padded columns' logits are -inf here too (model.mask_padded_vocab's rows).
MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "250", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "1e-2", "--train-iters", "3", "--eval-iters", "0", "--eval-interval",
        "100", "--seed", "1234", "--log-interval", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import ok, records, train

    def build(directory):
        out = {}
        for name, nproc, flags in (("off", 1, []), ("on", 1, ["--litespark-fp8-output-layer"]),
                                   ("tp2", 2, ["--litespark-fp8-output-layer", "--tensor-model-parallel-size", "2",
                                               "--sequence-parallel"])):
            metrics = directory / f"{name}.jsonl"
            proc = ok(train(nproc, *MOCK, *flags, "--metrics-file", metrics))
            out[name] = (proc.stdout, records(metrics))
        return out
    return made_once(tmp_path_factory, "fp8-logits-runs", build)


def _losses(records):
    return [r["loss"] for r in records if r["kind"] == "train"]


def test_the_flag_trains_as_the_bf16_output_layer_to_fp8s_error_and_tp2_sp_as_one_process(runs):
    """Three steps of tiny on the CPU (the reference path through megatron-core's output processor): the losses of
    the unquantized output layer to FP8's error; TP2 with sequence parallelism (the input all-gathered by
    megatron-core's mapping, the shards' statistics and the weight's amax through gloo, padded columns on rank 1)
    those of one process: the first step bit for bit. The run says what ran."""
    off, on, tp2 = (_losses(runs[k][1]) for k in ("off", "on", "tp2"))
    assert len(off) == len(on) == len(tp2) == 3
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(on, off)), (on, off)
    assert on != off  # the FP8 path ran
    # step 1 bit for bit; after it the two layouts' fp32 roundings (dh summed in another order) move a few values
    # across an FP8 rounding boundary: measured 1.4e-5 at step 2
    assert tp2[0] == on[0] and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(tp2, on)), (tp2, on)
    health = [r for r in runs["on"][1] if r["kind"] == "health"][0]
    assert health["fusions"]["output_layer"] == "litespark-fp8 (reference)", health
    assert health["fusions"]["cross_entropy"] == "litespark (reference)", health
    assert "output layer litespark-fp8 (reference)" in runs["on"][0]
    assert "output_layer" not in [r for r in runs["off"][1] if r["kind"] == "health"][0]["fusions"]


@pytest.mark.parametrize("flags, message", [
    (["--cross-entropy-loss-fusion"],
     "--litespark-fp8-output-layer with --cross-entropy-loss-fusion: it computes the loss itself; drop one"),
    (["--chunked-output-loss", "2"],
     "--litespark-fp8-output-layer with --chunked-output-loss: it keeps one micro-batch's bf16 logits and frees them "
     "in the backward; drop one"),
    (["--mtp-num-layers", "1"],
     "--litespark-fp8-output-layer with --mtp-num-layers: multi-token prediction computes its own logits; drop one"),
    (["--use-mup"], "--litespark-fp8-output-layer with --use-mup: MuP scales the logits before the loss; drop one"),
    (["--defer-embedding-wgrad-compute"],
     "--litespark-fp8-output-layer with --defer-embedding-wgrad-compute: it computes the weight's gradient in its own "
     "backward; drop one"),
])
def test_the_flag_is_refused_beside_what_owns_the_logits(flags, message):
    from test_arguments import TINY, check

    from litespark_megatron.arguments import ConfigError

    with pytest.raises(ConfigError) as e:
        check(TINY + ["--litespark-fp8-output-layer"] + flags)
    assert str(e.value) == message


def test_on_a_gpu_shapes_the_fp8_gemms_cannot_take_are_refused(monkeypatch):
    """FP8 GEMMs take multiples of 16 (tokens per micro-batch, the hidden size, the vocabulary per TP rank) and a
    GPU of compute capability 8.9 or more; a GPU without Triton is one line too (a CPU runs the reference)."""
    import litespark_megatron.kernels
    from test_arguments import GPU_TE, TINY, check

    from litespark_megatron.arguments import ConfigError

    base = TINY + ["--litespark-fp8-output-layer", "--transformer-impl", "transformer_engine", "--bf16"]
    with pytest.raises(ConfigError) as e:
        check(base + ["--seq-length", "40", "--micro-batch-size", "1"], GPU_TE)
    assert str(e.value) == ("--litespark-fp8-output-layer runs FP8 GEMMs, which take multiples of 16: tokens per "
                            "micro-batch (--seq-length / CP x --micro-batch-size) 40; drop the flag or change the "
                            "shape")
    with pytest.raises(ConfigError) as e:
        check(base + ["--make-vocab-size-divisible-by", "8", "--hidden-size", "100", "--num-attention-heads", "4"],
              GPU_TE)
    assert str(e.value) == ("--litespark-fp8-output-layer runs FP8 GEMMs, which take multiples of 16: --hidden-size "
                            "100, --make-vocab-size-divisible-by (the vocabulary per TP rank is a multiple of it) 8; "
                            "drop the flag or change the shape")
    check(base + ["--seq-length", "48", "--micro-batch-size", "1"], GPU_TE)
    from dataclasses import replace

    with pytest.raises(ConfigError) as e:
        check(base, replace(GPU_TE, fp8_capable=False, device_name="NVIDIA A100-SXM4-80GB"))
    assert str(e.value) == ("--litespark-fp8-output-layer runs FP8 GEMMs, which need compute capability 8.9 or more "
                            "(Ada, Hopper, Blackwell); this GPU (NVIDIA A100-SXM4-80GB) has none: drop the flag")
    monkeypatch.setattr(litespark_megatron.kernels, "triton_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        check(base, GPU_TE)
    assert str(e.value) == ("--litespark-fp8-output-layer on a GPU runs Triton kernels, and Triton does not import "
                            "here: install torch's CUDA build with its triton, or drop the flag")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 24 * 2 ** 30,
                    reason="the Triton kernels run on CUDA, here on a GPU of 24 GiB or more (the tensors take ~13 GiB)")
def test_the_column_major_layout_of_a_tensor_past_two_to_the_31_bytes_lands_where_it_belongs():
    """16,448 x 131,136 (a micro-batch's logits and then some): the column-major offsets of the last columns pass
    2^31, which 32-bit index arithmetic would wrap; the far corner of both layouts holds the reference's bytes, for
    the cast and for the loss's gradient written over the logits (with the rows about its last launch's start)."""
    rows, columns = 16384 + 64, 131072 + 64
    x = torch.empty(rows, columns, device="cuda", dtype=torch.bfloat16).normal_(generator=torch.Generator(
        device="cuda").manual_seed(0))
    scale = fl.amax_scale(x, fl.FORWARD)
    row, col = fl.quantize_triton(x, scale, fl.FORWARD)
    want, _ = fl.quantize_reference(x[-64:, -64:], scale, fl.FORWARD)
    assert torch.equal(row[-64:, -64:].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(col[-64:, -64:].view(torch.uint8), want.t().contiguous().view(torch.uint8))
    del row, col
    target = torch.randint(0, columns, (rows,), device="cuda")
    target[-64:] = columns - 1 - torch.arange(64, device="cuda")  # the far corner holds the targets' columns
    lse = torch.logsumexp(x.float(), dim=-1)
    grad = torch.full((rows,), 1.0 / rows, device="cuda")
    gscale = fl.current_scale(grad.abs().amax(), fl.BACKWARD)
    corners = [(slice(rows - 64, rows), slice(columns - 64, columns)), (slice(8192 - 32, 8192 + 32), slice(0, 64))]
    wants = [fl.gradient_fp8_reference(x[r, c], target[r], lse[r], grad[r], gscale, c.start)[0] for r, c in corners]
    row, col = fl.gradient_fp8_over_logits(x, target, lse, grad, gscale, 0)
    for (r, c), want in zip(corners, wants):
        a, b = row[r, c].view(torch.uint8), want.view(torch.uint8)
        # 4,096 values a corner: at most 4 one FP8 step apart (the exponentials' last bit, as above)
        assert (a != b).float().mean().item() <= 1e-3 and ((a.int() - b.int()).abs() <= 1).all()
        assert torch.equal(col[c, r].view(torch.uint8), a.t())
