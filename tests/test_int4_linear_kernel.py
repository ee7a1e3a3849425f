"""Litespark's int4 linear layer (kernels/int4_linear.py): the weights' round trip is within half a step of their
group, the nibbles sit where the format says; the Triton kernel computes the reference over odd shapes, row counts
past one tile and uneven slices of the input columns (Triton's interpreter on the CPU in fp16 and fp32, whose bf16
dot is broken; compiled on a GPU in bf16); the layer and its operator work on any device."""

import pytest
import torch

from conftest import run_interpreted
from litespark_megatron.kernels import int4_linear as L


def test_weights_come_back_within_half_a_step_of_their_group():
    torch.manual_seed(0)
    w = torch.randn(24, 512) * 0.05
    w[3, 128:256] = 0.25  # a group of equal weights: exact
    packed, scale, zero = L.quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 256) and scale.shape == zero.shape == (24, 4)
    back = L.dequantize_int4(packed, scale, zero)
    step = scale.repeat_interleave(128, dim=1)
    assert ((back - w).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[3, 128:256], w[3, 128:256])
    wb = w.bfloat16()  # bf16 scales and zeros: within half a step plus their own rounding
    back = L.dequantize_int4(*L.quantize_int4(wb))
    assert ((back - wb.float()).abs() <= step * 0.51 + 2 ** -8 * wb.float().abs().amax()).all()


def test_the_low_nibble_is_the_even_column():
    w = torch.zeros(1, 128)
    w[0, 1::2] = 15.0  # min 0, max 15: scale 1, zero 0, q = the weight
    w[0, 4] = 3.0
    packed, scale, zero = L.quantize_int4(w)
    assert scale.tolist() == [[1.0]] and zero.tolist() == [[0.0]]
    assert packed[0, 0].item() == 0xF0 and packed[0, 2].item() == 0xF3


def test_input_columns_that_are_not_whole_groups_are_refused():
    with pytest.raises(ValueError) as e:
        L.quantize_int4(torch.randn(4, 200))
    assert str(e.value) == "int4: 200 input columns are not whole groups of 128"


INTERPRETED = """
import json, torch
from litespark_megatron.kernels import int4_linear as L
from litespark_megatron.kernels.int4_linear_triton import int4_matmul

torch.manual_seed(0)
worst = {}
for M, N, K, group, splits in ((1, 40, 256, 128, 0), (3, 96, 384, 128, 2), (17, 33, 128, 32, 3), (5, 64, 512, 64, 1)):
    w = torch.randn(N, K) * 0.05
    for dtype in (torch.float16, torch.float32):
        p, s, z = L.quantize_int4(w.to(dtype), group)
        x = torch.randn(M, K).to(dtype)
        got = int4_matmul(x, p, s, z, splits)
        want = L.int4_linear_reference(x, p, s, z)
        assert got.dtype == dtype and got.shape == want.shape
        err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
        worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
print(json.dumps(worst))
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(tmp_path_factory, "int4-linear-interpreted", INTERPRETED)


def test_triton_kernel_computes_the_reference(interpreted):
    """One row, a few, 17 (two tiles), output columns not a multiple of the block, one to three slices of the input
    columns: fp32 to its summation order; fp16 to one rounding of the output."""
    assert interpreted["torch.float32"] <= 1e-5, interpreted
    assert interpreted["torch.float16"] <= 2 ** -10, interpreted


def test_the_layer_is_the_reference_and_holds_four_bits_a_weight():
    torch.manual_seed(1)
    linear = torch.nn.Linear(256, 48, bias=True).to(torch.bfloat16)
    layer = L.Int4Linear.from_linear(linear)
    x = torch.randn(2, 5, 256).to(torch.bfloat16)
    y = layer(x)
    want = L.int4_linear_reference(x.reshape(-1, 256), layer.packed, layer.scale, layer.zero, linear.bias)
    assert y.shape == (2, 5, 48) and torch.equal(y.reshape(-1, 48), want)
    assert sum(p.numel() * p.element_size() for p in layer.parameters()) == 48 * 128 + 2 * 48 * 2 * 2 + 48 * 2
    assert torch.equal(layer.dequantized().float(), L.dequantize_int4(layer.packed, layer.scale, layer.zero).bfloat16()
                       .float())
    assert L.int4_path("cpu") == "litespark (reference)"
    assert "int4, group=128" in repr(layer)


def test_the_operator_is_whole_to_torch():
    """The custom operator's schema, its fake (the shape torch.compile traces) and its eager result agree."""
    p, s, z = L.quantize_int4(torch.randn(16, 128).to(torch.bfloat16))
    torch.library.opcheck(L.int4_linear, (torch.randn(3, 128).to(torch.bfloat16), p, s, z))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
@pytest.mark.parametrize("rows", [1, 8, 32, 100])
def test_compiled_kernel_computes_the_reference_in_bf16(rows):
    """llama-1b's fc1 (2048 -> 16384) in bf16: one row to 32 through the kernel, 100 (a prefill) through torch's GEMM
    of the dequantized weight; within one rounding of the output."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(16384, 2048, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    p, s, z = L.quantize_int4(w)
    x = torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16)
    got = L.int4_linear(x, p, s, z)
    want = x.double() @ L.dequantize_int4(p, s, z).to(torch.bfloat16).double().t()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 16384)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() <= 2 ** -7
    assert L.int4_path("cuda") == "litespark"


def test_the_inference_variant_replaces_the_blocks_linears_and_computes_its_own_dequantized_weights():
    """`int4-litespark` on a tiny HF Llama: every linear of the blocks becomes an Int4Linear (the output layer stays
    16-bit), the model's logits are those of a 16-bit model holding the dequantized weights, and its parameters hold
    four bits a quantized weight plus a bf16 scale and zero per group of 128. It needs no torchao."""
    transformers = pytest.importorskip("transformers")
    from litespark_megatron.apps.inference_variants import cannot_run_reason, dequantized_weight, quantize, weight_bytes

    config = transformers.LlamaConfig(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    plain = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    plain.load_state_dict(model.state_dict())
    before = weight_bytes(model)
    done = quantize(model, "int4-litespark", cuda=False)
    assert done == dict(method="litespark Int4Linear(group=128, round-to-nearest), litespark (reference)",
                        quantized_layers=14, layers_left_16bit=1)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, L.Int4Linear)}
    assert len(layers) == 14 and isinstance(model.lm_head, torch.nn.Linear)
    with torch.no_grad():
        for name, layer in layers.items():
            plain.get_submodule(name).weight.copy_(dequantized_weight(layer))
        tokens = torch.randint(0, 384, (2, 9))
        assert torch.equal(model(tokens).logits, plain(tokens).logits)
    quantized = sum(l.in_features * l.out_features for l in layers.values())
    assert before - weight_bytes(model) == quantized * 2 - (quantized // 2 + quantized // 128 * 2 * 2)
    assert cannot_run_reason("int4-litespark", None) is None
