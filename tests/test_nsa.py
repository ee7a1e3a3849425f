"""Native sparse attention (layers/nsa.py): the plain-torch reference against a loop written from the definition,
causality, gradients into every branch and gate, and (on a GPU with fla-core) the fused kernels against the
reference."""
import math

import pytest
import torch

from litespark_megatron.layers.nsa import NSASettings, fla_available, nsa_reference

SETTINGS = NSASettings(block_size=4, selected_blocks=4, window=6)


def naive_loop_nsa(q, k, v, gates, settings, scale):
    """One query, one head at a time, from the definition in layers/nsa.py's docstring."""
    b, t, hq, d = q.shape
    hk, bs = k.size(2), settings.block_size
    group, nb = hq // hk, t // bs
    out = torch.zeros_like(q)

    def attend(query, keys, values):
        weights = torch.softmax(torch.stack([query @ key for key in keys]) * scale, dim=0)
        return sum(w * value for w, value in zip(weights, values))

    for i in range(b):
        for kh in range(hk):
            k_cmp = [k[i, c * bs:(c + 1) * bs, kh].mean(0) for c in range(nb)]
            v_cmp = [v[i, c * bs:(c + 1) * bs, kh].mean(0) for c in range(nb)]
            heads = range(kh * group, (kh + 1) * group)
            for pos in range(t):
                visible = [c for c in range(nb) if (c + 1) * bs - 1 <= pos]
                o_cmp = {h: attend(q[i, pos, h], [k_cmp[c] for c in visible], [v_cmp[c] for c in visible])
                         if visible else torch.zeros(d, dtype=q.dtype) for h in heads}
                score = {c: 0.0 for c in range(nb)}
                for h in heads:
                    if visible:
                        probs = torch.softmax(torch.stack([q[i, pos, h] @ k_cmp[c] for c in visible]) * scale, 0)
                        for c, p in zip(visible, probs):
                            score[c] += float(p) / group
                own = pos // bs
                forced = {0, own} | ({own - 1} if own > 0 else set())
                allowed = sorted(set(visible) | forced, key=lambda c: (-(1.0 if c in forced else score[c]), c))
                chosen = allowed[:settings.selected_blocks]
                selected = [j for c in sorted(chosen) for j in range(c * bs, (c + 1) * bs) if j <= pos]
                window = list(range(max(0, pos - settings.window + 1), pos + 1))
                for h in heads:
                    o_slc = attend(q[i, pos, h], [k[i, j, kh] for j in selected], [v[i, j, kh] for j in selected])
                    o_swa = attend(q[i, pos, h], [k[i, j, kh] for j in window], [v[i, j, kh] for j in window])
                    g = gates[i, pos, h]
                    out[i, pos, h] = g[0] * o_cmp[h] + g[1] * o_slc + g[2] * o_swa
    return out


def inputs(b=2, t=24, hq=4, hk=2, d=8, dtype=torch.float64, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, t, h, d, generator=gen, dtype=dtype).to(device) for h in (hq, hk, hk))
    gates = torch.rand(b, t, hq, 3, generator=gen, dtype=dtype).to(device)
    return q, k, v, gates


@pytest.mark.parametrize("hq, hk", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
def test_reference_equals_the_loop_from_the_definition(hq, hk):
    q, k, v, gates = inputs(hq=hq, hk=hk)
    scale = 1 / math.sqrt(q.size(-1))
    expected = naive_loop_nsa(q, k, v, gates, SETTINGS, scale)
    got = nsa_reference(q, k, v, gates, SETTINGS, scale)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)  # float64: only the summation order differs


def test_the_selection_reads_the_blocks_that_matter_and_no_others():
    """The last query (position 31, block 7 of 8) selects 4 blocks: the forced first, previous and own blocks, and
    the one whose keys match its heads best (block 3, made so here). With the compressed and window branches off, a
    token of another block (9, block 2) changes nothing; one of block 3 does."""
    q, k, v, gates = inputs(b=1, t=32, hq=2, hk=1)
    k[0, 12:16, 0] = 3 * (q[0, 31, 0] + q[0, 31, 1])
    gates[..., 0] = 0.0
    gates[..., 2] = 0.0
    scale = 1 / math.sqrt(q.size(-1))
    base = nsa_reference(q, k, v, gates, SETTINGS, scale)[0, 31]
    for token, read in ((9, False), (13, True), (2, True), (25, True), (30, True)):
        v2 = v.clone()
        v2[0, token] += 100.0
        changed = nsa_reference(q, k, v2, gates, SETTINGS, scale)[0, 31]
        assert torch.equal(changed, base) != read, token


def test_no_position_sees_the_future():
    """The gradient of every output at positions <= p with respect to queries, keys, values and gates at positions
    > p is exactly zero, for every p (every block boundary and inside blocks)."""
    q, k, v, gates = (x.requires_grad_() for x in inputs(t=16))
    out = nsa_reference(q, k, v, gates, SETTINGS, 1 / math.sqrt(q.size(-1)))
    for p in range(15):
        grads = torch.autograd.grad(out[:, : p + 1].sum(), (q, k, v, gates), retain_graph=True)
        for name, grad in zip("qkvg", grads):
            assert torch.count_nonzero(grad[:, p + 1:]) == 0, (p, name)
            if p > 0:  # (position 0 attends to itself alone: its output is v_0, whatever q_0 and k_0)
                assert torch.count_nonzero(grad[:, : p + 1]) > 0, (p, name)


@pytest.mark.parametrize("branch", [0, 1, 2], ids=["compressed", "selected", "window"])
def test_gradient_reaches_keys_values_and_the_gate_through_each_branch(branch):
    q, k, v, gates = inputs()
    only = torch.zeros_like(gates)
    only[..., branch] = gates[..., branch]
    q, k, v, only = (x.requires_grad_() for x in (q, k, v, only))
    out = nsa_reference(q, k, v, only, SETTINGS, 1 / math.sqrt(q.size(-1)))
    out.square().sum().backward()
    for name, x in zip("qkv", (q, k, v)):
        assert x.grad.abs().sum() > 0, name
    gate_grads = only.grad.abs().sum(dim=(0, 1, 2))
    assert gate_grads[branch] > 0  # and the other gates get the gradient of their (zero-weighted) branch:
    assert all(g > 0 for g in gate_grads), gate_grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core's NSA kernels run on CUDA only")
@pytest.mark.skipif(not fla_available(), reason="fla-core is not installed (pip install -e '.[nsa]')")
def test_fused_kernels_equal_the_reference_on_the_gpu():
    """bf16 on the GPU (fla-core's compressed and selected branches, FlexAttention's window) against the reference
    in float64 on the same inputs: forward and backward within 3x the error of the reference itself run in bf16 (the
    rounding floor, measured here), plus 1e-3 for the kernels' own accumulation order."""
    settings = NSASettings(block_size=64, selected_blocks=16, window=128)
    exact = [x.cuda().requires_grad_() for x in inputs(b=2, t=512, hq=16, hk=1, d=64)]
    scale = 1 / 8
    bf16 = [x.detach().bfloat16().requires_grad_() for x in exact]
    ref_bf16 = [x.detach().bfloat16().requires_grad_() for x in exact]
    want = nsa_reference(*exact, settings, scale)
    from litespark_megatron.layers.nsa import nsa_fused

    got = nsa_fused(*bf16, settings, scale)
    floor = nsa_reference(*ref_bf16, settings, scale)
    grad = torch.randn_like(want)
    for out, xs in ((want, exact), (got, bf16), (floor, ref_bf16)):
        out.backward(grad.to(out.dtype))
    for name, (w, g, f) in {"out": (want, got, floor), **{n: (a.grad, b.grad, c.grad) for n, a, b, c in
                                                         zip(("dq", "dk", "dv", "dgates"), exact, bf16,
                                                             ref_bf16)}}.items():
        err = (g.double() - w.detach()).abs().max().item()
        noise = (f.double() - w.detach()).abs().max().item()
        assert err <= 3 * noise + 1e-3, (name, err, noise)


def test_the_flop_count_counts_the_pairs_the_reference_attends():
    """metrics/flops.py's NSA pairs: per query, its visible compressed blocks, plus the keys whose values reach its
    output through the selected and the window branch (found here by the gradient of the reference)."""
    from litespark_megatron.metrics.flops import NSAShape

    q, k, v, gates = inputs(b=1, t=32, hq=2, hk=1)
    scale = 1 / math.sqrt(q.size(-1))
    pairs = sum((t + 1) // SETTINGS.block_size for t in range(32))  # compressed keys
    for branch in (1, 2):
        only = torch.zeros_like(gates)
        only[..., branch] = 1.0
        for t in range(32):
            vv = v.clone().requires_grad_()
            nsa_reference(q, k, vv, only, SETTINGS, scale)[0, t, 0].sum().backward()
            pairs += int((vv.grad[0, :, 0].abs().sum(-1) > 0).sum())
    shape = NSAShape(SETTINGS.block_size, SETTINGS.selected_blocks, SETTINGS.window)
    assert shape.attended_pairs(32) == pairs
