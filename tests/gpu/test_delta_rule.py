"""Gated delta rule: the reference against hand-computed updates and the rule's defining
property, and the Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from kvstore.gpu import delta_rule as ref
from kvstore.errors import InvalidArgument


def test_hand_computed_step():
    # S = I, k = e1, v = e2, q = [1, 1], alpha = beta = 1:
    # S' = I, S'k = e1, S = I + (e2 - e1) e1^T = [[0, 0], [1, 1]], o = S q = [0, 2]
    state = torch.eye(2)[None, None]
    o, s = ref.delta_rule_step(state, torch.tensor([[[1.0, 1.0]]]), torch.tensor([[[1.0, 0.0]]]),
                               torch.tensor([[[0.0, 1.0]]]), torch.ones(1, 1), torch.ones(1, 1))
    assert s[0, 0].tolist() == [[0.0, 0.0], [1.0, 1.0]] and o[0, 0].tolist() == [0.0, 2.0]


def test_hand_computed_gate_and_partial_write():
    # 1x1: S = 2, alpha = 0.5 -> S' = 1; k = 1, v = 3, beta = 0.5 -> S = 1 + 0.5 (3 - 1) = 2
    one = torch.ones(1, 1, 1)
    o, s = ref.delta_rule_step(torch.full((1, 1, 1, 1), 2.0), one, one, 3 * one,
                               torch.full((1, 1), 0.5), torch.full((1, 1), 0.5))
    assert s.item() == 2.0 and o.item() == 2.0


def test_full_write_stores_value_at_key():
    # with beta = 1 and a unit key the memory answers v exactly for that key
    gen = torch.Generator().manual_seed(6)
    state = torch.randn(2, 3, 5, 8, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(2, 3, 8, generator=gen), dim=-1)
    v = torch.randn(2, 3, 5, generator=gen)
    alpha = torch.rand(2, 3, generator=gen)
    _, s = ref.delta_rule_step(state, k, k, v, alpha, torch.ones(2, 3))
    torch.testing.assert_close(torch.einsum("bhvk,bhk->bhv", s, k), v, rtol=1e-5, atol=1e-5)


def test_per_key_gate_scales_state_columns():
    state = torch.ones(1, 1, 2, 3)
    zero = torch.zeros(1, 1, 3)
    gate = torch.tensor([[[1.0, 0.5, 0.0]]])
    _, s = ref.delta_rule_step(state, zero, zero, torch.zeros(1, 1, 2), gate, torch.ones(1, 1))
    assert s[0, 0].tolist() == [[1.0, 0.5, 0.0]] * 2


def inputs(b=2, t=5, h=3, dk=6, dv=5, per_key=False, device="cpu", seed=7):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    alpha = torch.rand(b, t, h, *((dk,) if per_key else ()), generator=gen) * 0.5 + 0.5
    beta = torch.rand(b, t, h, generator=gen)
    state = torch.randn(b, h, dv, dk, generator=gen)
    return [x.to(device) for x in (state, q, k, v, alpha, beta)]


def test_chunk_equals_repeated_steps_and_leaves_state_alone():
    state, q, k, v, alpha, beta = inputs()
    before = state.clone()
    o, s = ref.delta_rule_chunk(state, q, k, v, alpha, beta)
    step_state = state
    for t in range(q.shape[1]):
        o_t, step_state = ref.delta_rule_step(step_state, q[:, t], k[:, t], v[:, t], alpha[:, t], beta[:, t])
        torch.testing.assert_close(o[:, t], o_t)
    torch.testing.assert_close(s, step_state)
    assert torch.equal(state, before)


def test_shapes_are_checked():
    state, q, k, v, alpha, beta = inputs()
    with pytest.raises(InvalidArgument, match="v must be"):
        ref.delta_rule_chunk(state, q, k, v[..., :2], alpha, beta)
    with pytest.raises(InvalidArgument, match="fp32"):
        ref.delta_rule_chunk(state.double(), q, k, v, alpha, beta)
    with pytest.raises(InvalidArgument, match="alpha"):
        ref.delta_rule_chunk(state, q, k, v, alpha[..., None, None], beta)


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_triton_matches_reference(dev, per_key):
    from kvstore.gpu import delta_rule_triton as tri

    state, q, k, v, alpha, beta = inputs(per_key=per_key, device=dev)
    o_ref, s_ref = ref.delta_rule_chunk(state, q, k, v, alpha, beta)
    o_tri, s_tri = tri.delta_rule_chunk(state, q, k, v, alpha, beta)
    torch.testing.assert_close(o_tri, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_tri, s_ref, rtol=1e-5, atol=1e-5)
    o1, s1 = tri.delta_rule_step(state, q[:, 0], k[:, 0], v[:, 0], alpha[:, 0], beta[:, 0])
    o2, s2 = ref.delta_rule_step(state, q[:, 0], k[:, 0], v[:, 0], alpha[:, 0], beta[:, 0])
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_triton_at_real_shape_on_gpu(per_key):
    from kvstore.gpu import delta_rule_triton as tri

    args = inputs(b=4, t=64, h=16, dk=128, dv=128, per_key=per_key, device="cuda")
    o_ref, s_ref = ref.delta_rule_chunk(*args)
    o_tri, s_tri = tri.delta_rule_chunk(*args)
    torch.testing.assert_close(o_tri, o_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(s_tri, s_ref, rtol=1e-3, atol=1e-3)
