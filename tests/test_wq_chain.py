"""experiments/wq_chain.py: the split of the W_Q-gradient error into its δ part and the rest, checked
in float64 with planted errors, and its single-row backward against jax_flash.attention's gradient."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf
from experiments import bias_map as bm
from experiments import wq_chain as wc

BF16 = jnp.bfloat16


def problems(rng, n=32, kv_len=64, gap=6.0):
    q, k, v, _ = bm.bias_rows(rng, n, kv_len=kv_len, ties=2, top=(6.0, 10.0), gap=gap)
    q, k, v = (np.asarray(jnp.asarray(x, BF16), np.float32) for x in (q, k, v))
    return q, k, v, bm.make_do(rng, v)


def test_delta_error_enters_as_minus_eps_times_mean_score(rng):
    """A planted δ error ε gives q·ΔdQ = −ε·S̄ exactly and nothing in "the rest"; a planted error in P
    that δ does not see lands in "the rest" only."""
    q, k, v, do = problems(rng)
    dq, delta, s_bar = wc.exact_backward(q, k, v, do)
    s, p, _ = bm.exact(q, k, v)
    k64, v64 = np.asarray(k, np.float64), np.asarray(v, np.float64)
    dp = np.einsum("nd,ntd->nt", do, v64)
    eps = rng.normal(0, 1e-2, len(q))
    dq_eps = np.einsum("nt,ntd->nd", p * (dp - (delta + eps)[:, None]), k64) / math.sqrt(q.shape[-1])
    parts = wc.decompose(q, dq_eps, delta + eps, dq, delta, s_bar)
    np.testing.assert_allclose(parts["delta"], -eps * s_bar, rtol=1e-8)  # (δ + ε) − δ loses bits
    np.testing.assert_allclose(parts["total"], parts["delta"], rtol=1e-9, atol=1e-12)
    assert np.max(np.abs(parts["rest"])) < 1e-9 * np.max(np.abs(parts["total"]))
    # a recomputed P that is not the softmax (rows scaled by 1 + η), δ untouched
    eta = rng.normal(0, 1e-2, len(q))[:, None]
    dq_p = np.einsum("nt,ntd->nd", (1 + eta) * p * (dp - delta[:, None]), k64) / math.sqrt(q.shape[-1])
    parts = wc.decompose(q, dq_p, delta, dq, delta, s_bar)
    assert np.all(parts["delta"] == 0)
    np.testing.assert_allclose(parts["rest"], parts["total"], rtol=0, atol=0)
    # and q·dQ_hp is the row's Σ dS·S
    ds = p * (dp - delta[:, None])
    np.testing.assert_allclose(parts["own"], np.sum(ds * s, axis=1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arm", [pytest.param("fa2", marks=pytest.mark.slow), "fa2-stable-dpp", "paper-stable"])
def test_backward_runner_is_jax_flash_gradient(rng, record_bound, monkeypatch, arm):
    """The single-row loop computes jax_flash.attention's dQ (and the kernel's δ agrees with its O)."""
    from experiments import arms

    # one arm beyond the registry's: both fixes at once
    monkeypatch.setitem(arms.ARMS, "fa2-stable-dpp", arms.ARMS["fa2-stable"] + ("attention.delta=dpp",))
    kw = arms.attention_kwargs(arm)
    policy, stable, delta = kw["policy"], kw.get("stable", False), kw.get("delta", "o")
    q, k, v, do = problems(rng, n=16, kv_len=128)
    cfg = wc.arm_config(arm, kv_len=128)
    dq_run, _ = wc.backward_runner(cfg)(*(jnp.asarray(x, BF16) for x in (q, k, v, do)))
    f = lambda q_: jf.attention(q_, jnp.asarray(k, BF16)[:, :, None], jnp.asarray(v, BF16)[:, :, None],
                                causal=False, policy=policy, stable=stable, delta=delta, impl="jnp")
    _, vjp = jax.vjp(f, jnp.asarray(q, BF16)[:, None, None])
    (dq_api,) = vjp(jnp.asarray(do, BF16)[:, None, None])
    dq_api = np.asarray(dq_api, np.float64)[:, 0, 0]
    # the same arithmetic up to XLA:CPU's FP32 summation order for 1- vs 16-row blocks (see
    # test_bias_map.test_kernel_runner_is_jax_flash_attention): nearly all rows bitwise equal. A row
    # where that order flips one BF16 rounding (of O or ℓ, or of a P recomputed from L) moves δ or
    # an entry of dS by a BF16 ulp of one term, and dP − δ cancels: a row whose dQ had cancelled to
    # 0.5 % of its absolute terms can move by most of itself. A flipped rounding moves P_t by at
    # most eps_bf16·P_t, δ by at most eps_bf16·Σ|dO||O| (an element of O, or ℓ's rounding moving the
    # row's O): each row's change is bounded by eps_bf16 times its absolute terms,
    # Σ_t P_t (|dP_t| + Σ|dO||O|) |K_t| / √d in float64.
    dq_run = np.asarray(dq_run, np.float64)
    _, p, _ = bm.exact(q, k, v)
    dp = np.einsum("nd,ntd->nt", np.asarray(do, np.float64), np.asarray(v, np.float64))
    o = np.einsum("nt,ntd->nd", p, np.asarray(v, np.float64))
    abs_delta = np.sum(np.abs(np.asarray(do, np.float64)) * np.abs(o), axis=1)
    terms = np.einsum("nt,ntd->nd", p * (np.abs(dp) + abs_delta[:, None]), np.abs(np.asarray(k, np.float64)))
    bound = float(jnp.finfo(BF16).eps) * np.linalg.norm(terms, axis=1) / math.sqrt(q.shape[-1])
    row_err = np.linalg.norm(dq_run - dq_api, axis=1)
    record_bound(row_err, bound, "dQ row")


@pytest.mark.slow  # experiment tooling, 5–15 s: JAX_FLASH_SLOW=1 (make test-all)
def test_run_separates_delta_fixes_from_the_baseline(rng, monkeypatch):
    """Two arms, one cell: the baseline's tied rows carry a W_Q-gradient error through δ (t ≫ 2 with
    tiny remainders), δ = dpp's δ part is ~0 (orders of magnitude smaller), and the CSV/markdown rows
    come out complete."""
    monkeypatch.setattr(wc, "ARMS", ("fa2", "fa2-dpp"))
    monkeypatch.setattr(wc, "CASES", [(13.0, (6.0, 10.0), "V's sign")])
    res = wc.run(rows=256, seed=int(rng.integers(1 << 31)), progress=False)
    base, dpp = res
    assert base["delta_tie_t"] > 4 and abs(base["rest_tie_t"]) < 4
    assert abs(dpp["delta_tie_mean"]) < 1e-2 * abs(base["delta_tie_mean"])
    md = wc.markdown(res)
    assert md.count("\n") == 4 and "nan" not in md


def test_every_arm_is_a_registry_arm():
    """The experiment's arms are names of experiments/arms.py, each with a numerics config (a table
    of another form once shadowed them, and the command failed on its first cell)."""
    from experiments import arms

    assert wc.ARMS and all(a in arms.ARMS for a in wc.ARMS)
    for a in wc.ARMS:
        assert wc.arm_config(a, kv_len=128).policy.name.startswith(a.split("-")[0])
