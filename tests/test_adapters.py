"""LoRA's forward path (layers/adapters.py `_plus_low_rank`: one A GEMM, the B's as one block matrix in the fused
row order, scaling and sum in the GEMM's epilogue) computes its definition, `out + B A x * scale` with one B GEMM per
projection interleaved into the fused layout, in fp64: output and every gradient, for the fused QKV (query groups
interleaved), [gate; up] and the single-projection row targets. The layouts under TP are the trainer tests'
(test_peft.py)."""
import types

import pytest
import torch

from litespark_megatron.layers.adapters import AdaptedLinear, AdapterSettings, projections


class _Base(torch.nn.Module):
    """What AdaptedLinear wraps: a linear returning (output, bias)."""

    def __init__(self, rows, cols):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, cols, dtype=torch.float64), requires_grad=False)

    def forward(self, x):
        return x @ self.weight.t(), None


class _OneRank:
    def size(self):
        return 1


def _config(**kw):
    shape = dict(num_attention_heads=6, kv_channels=4, num_query_groups=3, hidden_size=20, ffn_hidden_size=14,
                 sequence_parallel=False, params_dtype=torch.float64)
    shape.update(kw)
    return types.SimpleNamespace(**shape)


@pytest.mark.parametrize("target", ["linear_qkv", "linear_fc1", "linear_proj", "linear_fc2"])
@pytest.mark.parametrize("rank", [1, 3])
def test_the_lora_path_computes_its_definition_with_every_gradient(target, rank):
    torch.manual_seed(0)
    config = _config()
    what = projections(target, config)
    out_rows = sum(what.rows) * what.groups
    base = _Base(out_rows, what.in_features)
    module = AdaptedLinear(base, what, AdapterSettings("lora", rank, alpha=5.0), config, _OneRank())
    with torch.no_grad():
        for p in module.adapter.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(5, 2, what.in_features, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 2, out_rows, dtype=torch.float64)
    params = [x] + list(module.adapter.parameters())

    got, _ = module(x)
    got_grads = torch.autograd.grad(got, params, dy)
    want = base(x)[0] + module._low_rank(x) * module.settings.scale
    want_grads = torch.autograd.grad(want, params, dy)

    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-12)


def test_the_block_matrix_puts_each_projections_b_in_its_fused_rows():
    """The fused QKV of 3 query groups: per group [q (2 heads); k; v] rows, each reading its own r columns."""
    config = _config()
    what = projections("linear_qkv", config)
    module = AdaptedLinear(_Base(sum(what.rows) * what.groups, what.in_features), what,
                           AdapterSettings("lora", 2, alpha=2.0), config, _OneRank())
    with torch.no_grad():
        for i, b in enumerate(module.adapter.ordered("lora_B")):
            b.fill_(i + 1)
    fused = module._fused_b()
    per_group = (8, 4, 4)  # q: 6 heads / 3 groups x 4, k: 4, v: 4
    expected_rows = [p for _ in range(3) for p, n in enumerate(per_group) for _ in range(n)]
    for row, projection in zip(fused, expected_rows):
        want = torch.zeros(6, dtype=torch.float64)
        want[2 * projection:2 * projection + 2] = projection + 1
        assert torch.equal(row, want)
