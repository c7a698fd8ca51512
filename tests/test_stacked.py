"""optim.stack_params (train/stacked.py): the parameters and Adam moments as one array per shape.
What is computed must not change: steps of the micro model, stacked and not, are bitwise equal
(parameters, both moments, loss, gradient norm), with the clip off, idle and cutting; a stacked
run checkpoints and resumes bitwise; GPT-2 small's step takes about 20 arrays, not 300."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train import config as C
from train import gpt2 as T
from train import stacked
from train.checkpoint import CheckpointStore

from helpers import Tokens, micro_cfg


def _tree(rng):
    return {"a": {"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
                  "s": jnp.asarray(rng.standard_normal(4), jnp.float32)},
            "b": [jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
                  jnp.asarray(rng.standard_normal(4), jnp.float32),
                  jnp.asarray(rng.standard_normal((2, 2)), jnp.bfloat16)]}


def test_stack_groups_by_shape_and_dtype_and_views_the_tree_back():
    tree = _tree(np.random.default_rng(0))
    s = stacked.stack(tree)
    assert {k: v.shape for k, v in s.stacks.items()} == {
        "float32_3x4": (2, 3, 4), "float32_4": (2, 4), "bfloat16_2x2": (1, 2, 2)}
    assert len(jax.tree.leaves(s)) == 3
    chex.assert_trees_all_equal(stacked.view(s), tree)
    assert stacked.view(tree) is tree  # a tree is its own view
    doubled = jax.tree.map(lambda x: 2 * x, s)  # optax's tree maps keep the layout
    assert isinstance(doubled, stacked.Stacked) and doubled.layout == s.layout
    chex.assert_trees_all_equal(stacked.view(doubled), jax.tree.map(lambda x: 2 * x, tree))


def test_gradient_through_the_view_is_stacked_like_the_values():
    tree = _tree(np.random.default_rng(1))
    weights = jax.tree.map(lambda x: jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape) + 1,
                           tree)

    def loss(t):
        return sum(jnp.sum(a.astype(jnp.float32) * w) for a, w in
                   zip(jax.tree.leaves(t), jax.tree.leaves(weights)))

    g = jax.grad(lambda s: loss(stacked.view(s)))(stacked.stack(tree))
    assert isinstance(g, stacked.Stacked)
    expect = jax.tree.map(lambda w, x: w.astype(x.dtype), weights, tree)
    chex.assert_trees_all_equal(stacked.view(g), expect)


@pytest.mark.parametrize("max_norm", [1e3, 1e-2], ids=["idle", "cutting"])
def test_clip_is_optaxs_on_the_tree(max_norm):
    tree = _tree(np.random.default_rng(2))
    tree = jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    want, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
    got, _ = stacked.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
    chex.assert_trees_all_equal(got, want)
    got_s, _ = stacked.clip_by_global_norm(max_norm).update(stacked.stack(tree),
                                                          optax.EmptyState())
    chex.assert_trees_all_equal(stacked.view(got_s), want)


# XLA's GPU scatter (the token embedding's gradient) adds repeated rows with atomics, in no fixed
# order from one execution to the next; its deterministic ops sort them first
DETERMINISTIC = {"xla_gpu_deterministic_ops": True}


def _setup(*overrides, deterministic=False):
    cfg = micro_cfg("/unused", *overrides)
    graphdef, params = T.split_model(T.make_model(cfg))
    tx, schedule = T.make_optimizer(cfg)
    step = jax.jit(functools.partial(T.train_step, graphdef=graphdef, tx=tx, schedule=schedule),
                   compiler_options=DETERMINISTIC if deterministic else None)
    return cfg, T.init_state(cfg, params, tx), step


def _batches(cfg, n, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        x = rng.integers(0, cfg.model.vocab_size, (2, 4, 33))  # 2 micro-batches a step
        yield jnp.asarray(x[..., :-1], jnp.int32), jnp.asarray(x[..., 1:], jnp.int32)


def _as_tree(state):
    """A state with its stacks viewed as the tree (Adam's moments included)."""
    return jax.tree.map(stacked.view, state, is_leaf=lambda x: isinstance(x, stacked.Stacked))


def _as_stacked(state):
    """A tree state with its parameters and everything shaped like them (the moments) stacked."""
    like = jax.tree.structure(state["params"])
    is_params = lambda x: isinstance(x, dict) and jax.tree.structure(x) == like
    return jax.tree.map(lambda x: stacked.stack(x) if is_params(x) else x, state, is_leaf=is_params)


# weight decay on, lr 1e-2: every path of AdamW's update runs; the clip at 1e-3 cuts every step
ARGS = ("optim.warmup_steps=0", "optim.lr=1e-2", "optim.weight_decay=0.1")
CLIPS = pytest.mark.parametrize("clip,cuts", [(100.0, False), (1e-3, True), (0.0, False)],
                                ids=["clip-idle", "clip-cutting", "no-clip"])


@CLIPS
def test_first_step_is_the_tree_steps_bits(clip, cuts, deterministic=False):
    """From fresh (zero) moments no update has a second product to contract: bitwise."""
    cfg, tree0, tree_step = _setup(*ARGS, f"optim.clip={clip}", deterministic=deterministic)
    _, stack0, stack_step = _setup(*ARGS, f"optim.clip={clip}", "optim.stack_params=true",
                                   deterministic=deterministic)
    assert isinstance(stack0["params"], stacked.Stacked)
    assert len(jax.tree.leaves(stack0)) < len(jax.tree.leaves(tree0)) / 2
    chex.assert_trees_all_equal(_as_tree(stack0), tree0)
    batch = next(_batches(cfg, 1))
    tree1, tm = tree_step(tree0, batch)
    stack1, sm = stack_step(stack0, batch)
    chex.assert_trees_all_equal(_as_tree(stack1), tree1)
    chex.assert_trees_all_equal(sm, tm)
    if clip:
        assert (float(tm["grad_norm"]) > clip) == cuts


def _adam(opt_state):
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    (adam,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
    return adam


def _moment_bound(new, prev, decay):
    """|Δ| of β·m + (1 − β)·x computed with either product fused into an FMA, or neither: each
    result is within half an ulp of itself and of each rounded product from the exact value, and
    |(1 − β)·x| ≤ |new| + |β·m|."""
    new, scaled = np.abs(new), np.abs(decay * prev.astype(np.float64))
    return np.spacing(new) + np.spacing(scaled.astype(np.float32)) + np.spacing(
        (new + scaled).astype(np.float32))


@CLIPS
def test_a_later_step_within_one_contraction_of_the_tree_step(clip, cuts, deterministic=False):
    """From the same state after two tree steps: loss and gradient norm bitwise (same parameters,
    the norm over the same leaves); each moment within ``_moment_bound``; each parameter within
    that difference carried through Adam's update, plus the roundings its own FMAs may move."""
    cfg, state, tree_step = _setup(*ARGS, f"optim.clip={clip}", deterministic=deterministic)
    _, _, stack_step = _setup(*ARGS, f"optim.clip={clip}", "optim.stack_params=true",
                              deterministic=deterministic)
    batches = list(_batches(cfg, 3, seed=1))
    for b in batches[:2]:
        state, _ = tree_step(state, b)
    prev = jax.tree.map(np.asarray, state)
    stack_next, sm = stack_step(_as_stacked(jax.tree.map(jnp.copy, state)), batches[2])
    tree_next, tm = tree_step(state, batches[2])
    chex.assert_trees_all_equal(sm, tm)
    a, b = jax.tree.map(np.asarray, tree_next), jax.tree.map(np.asarray, _as_tree(stack_next))
    o = cfg.optim
    adam_a, adam_b, adam_p = (_adam(x["opt_state"]) for x in (a, b, prev))
    t = int(adam_a.count)
    c1, c2 = 1 - o.b1 ** t, 1 - o.b2 ** t
    lr, wd = float(tm["lr"]), o.weight_decay
    paths = jax.tree_util.tree_flatten_with_path(a["params"])[0]
    leaves = lambda tree: jax.tree.leaves(tree)
    for (path, p_new), p_b, p, mu, mu_b, mu_p, nu, nu_b, nu_p in zip(
            paths, leaves(b["params"]), leaves(prev["params"]), leaves(adam_a.mu),
            leaves(adam_b.mu), leaves(adam_p.mu), leaves(adam_a.nu), leaves(adam_b.nu),
            leaves(adam_p.nu)):
        where = jax.tree_util.keystr(path)
        bm, bn = _moment_bound(mu, mu_p, o.b1), _moment_bound(nu, nu_p, o.b2)
        assert np.all(np.abs(mu_b.astype(np.float64) - mu) <= bm), where
        assert np.all(np.abs(nu_b.astype(np.float64) - nu) <= bn), where
        mu_hat, nu_hat = mu / c1, nu.astype(np.float64) / c2
        q = np.sqrt(nu_hat) + o.eps
        dq = np.minimum(np.sqrt(bn / c2), bn / c2 / (2 * np.sqrt(np.maximum(nu_hat, 1e-300))))
        dq = dq + np.spacing(q.astype(np.float32))
        u = mu_hat / q
        du = (bm / c1) / q + np.abs(mu_hat) * dq / (q * np.maximum(q - dq, o.eps)) + 2 * np.spacing(
            np.abs(u).astype(np.float32))
        y = u + wd * p
        dy = du + np.spacing(np.abs(y).astype(np.float32)) + np.spacing(
            np.abs(wd * p).astype(np.float32))
        bound = lr * dy + 2 * np.spacing(np.abs(p_new)) + 2 * np.spacing(
            np.abs(lr * y).astype(np.float32))
        assert np.all(np.abs(p_b.astype(np.float64) - p_new) <= bound), where


def test_stacked_run_checkpoints_and_resumes_bitwise(tmp_path):
    base = micro_cfg(tmp_path / "full", "optim.stack_params=true", "max_steps=4")
    T.train(base, tokens=Tokens())
    part = dataclasses.replace(base, run_dir=str(tmp_path / "part"), checkpoint_every=2)
    T.train(part, tokens=Tokens(), stop_after=2)
    T.train(dataclasses.replace(part, resume="true"), tokens=Tokens())
    full, resumed = T.read_metrics(base.run_dir), T.read_metrics(part.run_dir)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    store = CheckpointStore(tmp_path / "part", keep=3)
    assert store.steps() == [2, 4]
    store.close()


def test_stack_params_needs_adamw():
    with pytest.raises(ValueError, match="stack_params needs name=adamw"):
        C.OptimConfig(name="muon", stack_params=True)
    with pytest.raises(ValueError, match="stack_params must be true or false"):
        C.OptimConfig(stack_params="yes")


def test_gpt2_small_state_is_about_20_arrays():
    """Counted on shapes alone (``jax.eval_shape``: nothing allocated)."""
    def count(*overrides):
        cfg = C.apply_overrides(C.get_preset("small-gpu"), list(overrides))

        def state():
            graphdef, params = T.split_model(T.make_model(cfg))
            return T.init_state(cfg, params, T.make_optimizer(cfg)[0])

        return len(jax.tree.leaves(jax.eval_shape(state)))

    assert count() == 301
    assert count("optim.stack_params=true") == 22
