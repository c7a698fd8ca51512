"""models/gpt2.py: shapes, tied head, init statistics, attention variants and per-layer/per-head choice."""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import gelu_kernels, gpt2
from models.gpt2 import GPT, AttentionSpec, GPTConfig, cross_entropy, per_head_weights
from helpers import assert_gelu_erf_within_bound, fp32_cross_entropy_of_upcast, jaxpr_eqns


def small_cfg(**kw):
    base = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    base.update(kw)
    return GPTConfig(**base)


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def tokens(shape=(2, 32), vocab=256, seed=1):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


# ----------------------------------------------------------------------------- structure


def test_output_shapes_and_dtypes():
    cfg = small_cfg()
    model = GPT(cfg, rngs=nnx.Rngs(0))
    idx = tokens((3, 17))
    logits, caps = nnx.jit(lambda m, idx: m(idx, return_intermediates=True))(model, idx)
    assert logits.shape == (3, 17, 256) and logits.dtype == jnp.float32
    assert len(caps) == cfg.n_layer
    for cap in caps:
        assert cap["x"].shape == (3, 17, 64) and cap["x"].dtype == jnp.bfloat16
        for name in "qkv":
            assert cap[name].shape == (3, 17, 4, 16) and cap[name].dtype == jnp.bfloat16
    for leaf in jax.tree.leaves(params_of(model)):
        assert leaf.dtype == jnp.float32  # FP32 master weights
    with pytest.raises(ValueError, match="block_size"):
        model(tokens((1, 33)))


def test_parameters_tied_head_and_no_biases():
    cfg = small_cfg(vocab_size=250)  # no other dimension is 250
    model = GPT(cfg, rngs=nnx.Rngs(0))
    p = params_of(model)
    paths = {
        "/".join(str(k) for k in path)
        for path, _ in jax.tree_util.tree_leaves_with_path(
            p, is_leaf=lambda x: isinstance(x, jax.Array)
        )
    }
    names = {path.split("/")[-1].strip("[]'") for path in paths}
    assert not any("bias" in n for n in names), names
    assert gpt2.count_params(p) == cfg.num_params(non_embedding=False)
    # exactly one vocab-sized matrix: the embedding is the head
    assert sum(1 for x in jax.tree.leaves(p) if cfg.vocab_size in x.shape) == 1
    # zeroing embedding row v zeroes logit v everywhere (the head multiplies by wte.embedding)
    idx = tokens((2, 16), seed=3) % 100 + 100  # inputs never use token 7
    model.wte.embedding[...] = model.wte.embedding[...].at[7].set(0.0)
    logits = nnx.jit(lambda m, idx: m(idx))(model, idx)
    assert jnp.all(logits[..., 7] == 0.0)
    assert jnp.all(logits[..., 8] != 0.0)


def test_init_statistics():
    cfg = GPTConfig(vocab_size=4096, block_size=256, n_layer=6, n_head=4, n_embd=256)
    p = params_of(GPT(cfg, rngs=nnx.Rngs(0)))
    res_std = 0.02 / math.sqrt(2 * cfg.n_layer)

    def check(x, std):
        x = np.asarray(x)
        assert abs(x.std() / std - 1) < 0.03, (x.std(), std)  # >= 65k samples: std error ~0.3 %
        assert abs(x.mean()) < 3 * std / math.sqrt(x.size) + 1e-9

    check(p["wte"]["embedding"], 0.02)
    check(p["wpe"]["embedding"], 0.02)
    for blk in p["blocks"].values():
        for name in ("wq", "wk", "wv"):
            check(blk["attn"][name]["kernel"], 0.02)
        check(blk["mlp"]["fc"]["kernel"], 0.02)
        check(blk["attn"]["wo"]["kernel"], res_std)
        check(blk["mlp"]["proj"]["kernel"], res_std)
        np.testing.assert_array_equal(blk["ln_1"]["scale"], 1.0)
    np.testing.assert_array_equal(p["ln_f"]["scale"], 1.0)


def test_initial_loss_is_log_vocab():
    cfg = small_cfg(vocab_size=50304)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    idx = tokens((4, 32), vocab=50304)
    loss = nnx.jit(lambda m, idx: cross_entropy(m(idx), jnp.roll(idx, -1, axis=1)))(model, idx)
    assert abs(float(loss) - math.log(50304)) < 0.05


def test_per_head_weights_slices_kernel():
    cfg = small_cfg()
    p = params_of(GPT(cfg, rngs=nnx.Rngs(0)))
    w = per_head_weights(p, 1, cfg.n_head, "wq")
    kernel = p["blocks"][1]["attn"]["wq"]["kernel"]
    assert w.shape == (4, 64, 16)
    np.testing.assert_array_equal(w[2], kernel[:, 32:48])


# ----------------------------------------------------------------------------- attention functions


def test_standard_attention_matches_float64_reference():
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 24, 3, 8)) for i in range(3))
    with jax.default_matmul_precision("highest"):  # FP32 dots are TF32 by default on GPU
        out = np.asarray(gpt2.standard_attention(q, k, v), np.float64)
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", qn, kn) / math.sqrt(8)
    s = np.where(np.tril(np.ones((24, 24), bool)), s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    ref = np.einsum("bhqk,bkhd->bqhd", pr, vn)
    np.testing.assert_allclose(out, ref, atol=2e-6)
    assert out[:, 0].std() > 0  # the first query sees only key 0: out[:, 0] == v[:, 0]
    np.testing.assert_allclose(out[:, 0], vn[:, 0], atol=1e-6)


def _logits_for(kind_or_spec, dtype, **kw):
    spec = kind_or_spec if isinstance(kind_or_spec, AttentionSpec) else AttentionSpec(kind_or_spec)
    # init_std 0.1 sharpens the attention so the variants are not trivially uniform
    cfg = small_cfg(dtype=dtype, attention=spec, init_std=0.1, block_size=64, **kw)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    with jax.default_matmul_precision("highest" if dtype == "float32" else None):
        # one compiled forward: op by op, each of its many shapes compiled a program of its own
        return np.asarray(nnx.jit(lambda m, idx: m(idx))(model, tokens((2, 64))))


def _flash_available():
    jf = pytest.importorskip("jax_flash", reason="jax_flash not importable")
    if not hasattr(jf, "attention"):
        pytest.skip("jax_flash.attention missing")


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_attention_variants_agree_in_model(dtype):
    ref = _logits_for("standard", dtype)
    scale = np.abs(ref).max()
    # The xla path of jax.nn.dot_product_attention does the same arithmetic as "standard" (FP32
    # scores and softmax, P rounded to the compute dtype): equal up to fused-op ordering.
    np.testing.assert_allclose(_logits_for("xla", dtype), ref, atol=1e-6 * scale)
    _flash_available()
    flash = _logits_for(AttentionSpec("flash", policy="fa2"), dtype)
    diff = np.abs(flash - ref)
    if dtype == "float32":
        # same math in FP32, different summation order: a few FP32 ulps of the logit scale
        assert diff.max() <= 1e-5 * scale, diff.max()
    else:
        # bf16: flash rounds P̄ = exp(S - m) (unnormalised) to bf16 and divides by l in FP32, standard
        # rounds the normalised P; each attention output can differ by ~1 bf16 ulp (2^-8 relative),
        # which the bf16 projections after it carry to the logits. Allow 4 ulps of the logit scale
        # at the max and 1 ulp on average; a wrong mask or scale gives O(scale) differences.
        assert diff.max() <= 4 * 2.0**-8 * scale, (diff.max(), scale)
        assert diff.mean() <= 2.0**-8 * scale, (diff.mean(), scale)
        wrong = _logits_for(
            AttentionSpec("flash", policy="fa2"), "float32", n_head=2
        )  # sanity: differs
        assert np.abs(wrong - ref).max() > 10 * diff.max()


def test_flash_gradients_match_standard_fp32():
    _flash_available()
    cfg = small_cfg(dtype="float32", init_std=0.1)
    idx = tokens((2, 32))
    grads = {}
    for kind in ("standard", "flash"):
        model = GPT(dataclass_replace(cfg, attention=AttentionSpec(kind)), rngs=nnx.Rngs(0))
        graphdef, p = nnx.split(model)
        p = nnx.to_pure_dict(p)
        f = lambda p: cross_entropy(nnx.merge(graphdef, p)(idx), jnp.roll(idx, -1, 1))
        with jax.default_matmul_precision("highest"):
            grads[kind] = jax.jit(jax.grad(f))(p)
    for a, b in zip(jax.tree.leaves(grads["standard"]), jax.tree.leaves(grads["flash"])):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(a).max()) + 1e-9)


def dataclass_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


# ----------------------------------------------------------------------------- per-layer / per-head choice


def test_head_specs_resolution_and_paper_examples():
    std, flash = AttentionSpec("standard"), AttentionSpec("flash")
    fp32 = AttentionSpec("flash", policy="fp32")
    # the paper's "flash only in layer 2" (1-based) == layer index 1
    cfg = GPTConfig(attention=std, attention_overrides=((1, flash),))
    assert cfg.head_specs(0) == (std,) * 12 and cfg.head_specs(1) == (flash,) * 12
    # FP32 flash for the paper's heads 1,7,8,9,11,12 of layer 2 (0-based heads 0,6,7,8,10,11)
    cfg = GPTConfig(attention=flash, attention_overrides=((1, (0, 6, 7, 8, 10, 11), fp32),))
    specs = cfg.head_specs(1)
    assert [h for h, s in enumerate(specs) if s == fp32] == [0, 6, 7, 8, 10, 11]
    assert [(a, b) for a, b, _ in cfg.head_groups(1)] == [(0, 1), (1, 6), (6, 9), (9, 10), (10, 12)]
    assert cfg.head_groups(0) == ((0, 12, flash),)
    # later overrides win; slices, ranges and single ints are accepted; configs stay hashable
    cfg = GPTConfig(
        attention_overrides=((3, slice(0, 6), flash), (3, 2, std), (4, range(6, 12), "xla"))
    )
    assert cfg.head_specs(3)[:6] == (flash, flash, std, flash, flash, flash)
    assert cfg.head_specs(4)[6:] == (AttentionSpec("xla"),) * 6
    hash(cfg)
    with pytest.raises(ValueError, match="layer"):
        GPTConfig(attention_overrides=((12, flash),))
    with pytest.raises(ValueError, match="head"):
        GPTConfig(attention_overrides=((0, (12,), flash),))


@pytest.fixture
def spy_kinds(monkeypatch):
    """Register attention kinds that record the head count of each call."""
    calls = []

    def make(name, fn):
        def spy(q, k, v, spec):
            calls.append((name, q.shape[2]))
            return fn(q, k, v, spec)

        monkeypatch.setitem(gpt2.ATTENTION_FNS, name, spy)

    make("spy_std", gpt2.standard_attention)
    make("spy_other", gpt2.standard_attention)
    make("spy_zero", lambda q, k, v, spec: jnp.zeros_like(q))
    return calls


def test_overrides_choose_the_function_per_layer_and_head_group(spy_kinds):
    calls = spy_kinds
    cfg = small_cfg(
        n_layer=3,
        attention=AttentionSpec("spy_std"),
        attention_overrides=(
            (1, AttentionSpec("spy_other")),
            (2, (0, 2, 3), AttentionSpec("spy_other")),
        ),
    )
    model = GPT(cfg, rngs=nnx.Rngs(0))
    idx = tokens()
    out = model(idx)  # eager: one call per head group per forward
    assert calls == [
        ("spy_std", 4),  # layer 0
        ("spy_other", 4),  # layer 1
        ("spy_other", 1),
        ("spy_std", 1),
        ("spy_other", 2),
    ]  # layer 2
    # the same function under another name, split into groups, gives the same logits bitwise:
    # groups are concatenated back in head order
    base = GPT(small_cfg(n_layer=3, attention=AttentionSpec("spy_std")), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(base(idx)))
    # a deliberately different function on one head group changes the output
    zero = GPT(
        small_cfg(
            n_layer=3,
            attention=AttentionSpec("spy_std"),
            attention_overrides=((2, (3,), AttentionSpec("spy_zero")),),
        ),
        rngs=nnx.Rngs(0),
    )
    assert np.abs(np.asarray(zero(idx)) - np.asarray(out)).max() > 1e-4


def test_unknown_attention_kind_raises():
    model = GPT(small_cfg(attention=AttentionSpec("nope")), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown attention kind"):
        model(tokens())


@functools.cache
def _one_layer_baseline():
    """A one-layer GPT-2 of 32, its tokens and loss function, and the default model's loss and every
    gradient: compiled once for both head options compared against it."""
    cfg = small_cfg(vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=32)
    idx = jnp.arange(16, dtype=jnp.int32)[None] % 128
    loss = lambda m: gpt2.cross_entropy(m(idx), idx)
    return cfg, idx, loss, nnx.jit(nnx.value_and_grad(loss))(GPT(cfg, rngs=nnx.Rngs(0)))


def test_bf16_logits_option_rounds_like_autocast():
    """model.logits_dtype="bfloat16" gives exactly the FP32 logits rounded to bf16 (nanoGPT's lm_head
    output under autocast); the default keeps FP32."""
    import dataclasses

    cfg, idx, loss, (_, g32) = _one_layer_baseline()
    logits = nnx.jit(lambda m: m(idx))
    f32 = logits(GPT(cfg, rngs=nnx.Rngs(0)))
    b16 = logits(GPT(dataclasses.replace(cfg, logits_dtype="bfloat16"), rngs=nnx.Rngs(0)))
    assert f32.dtype == jnp.float32 and b16.dtype == jnp.bfloat16
    chex.assert_trees_all_equal(b16, f32.astype(jnp.bfloat16))
    assert np.any(np.asarray(b16, np.float32) != np.asarray(f32))
    # backward: the head's GEMMs take the logits' gradient in bf16 (autocast's), so under the
    # option the head's weight gradient is that of the bf16-rounded logit gradient
    m16 = GPT(dataclasses.replace(cfg, logits_dtype="bfloat16"), rngs=nnx.Rngs(0))
    _, g16 = nnx.jit(nnx.value_and_grad(loss))(m16)
    assert g16.wte.embedding[...].dtype == jnp.float32
    assert np.any(np.asarray(g16.wte.embedding[...]) != np.asarray(g32.wte.embedding[...]))


def test_cross_entropy_of_bf16_logits_is_autodiffs_and_keeps_no_fp32_copy():
    """cross_entropy of bf16 logits (the model's under ``logits_dtype="bfloat16"``): loss and
    gradient bit-identical to autodiff's of the upcast logits, eager and compiled; for its backward
    it keeps the bf16 logits and two FP32 numbers a row, where autodiff keeps an FP32 array of the
    logits' shape; its forward reduces over the logits twice (row max, sum of exponentials), the
    target's logit gathered."""
    k1, k2 = jax.random.split(jax.random.key(3))
    logits = (4.0 * jax.random.normal(k1, (3, 40, 1000))).astype(jnp.bfloat16)
    targets = jax.random.randint(k2, (3, 40), 0, 1000)
    for wrap in (lambda f: f, jax.jit):
        got = wrap(jax.value_and_grad(cross_entropy))(logits, targets)
        want = wrap(jax.value_and_grad(fp32_cross_entropy_of_upcast))(logits, targets)
        chex.assert_trees_all_equal(got, want)
        chex.assert_trees_all_equal_dtypes(got[1], logits)

    def kept(f):
        vjp = jax.vjp(lambda x: f(x, targets), logits)[1]
        return [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "dtype")]

    assert (logits.shape, jnp.float32) in kept(fp32_cross_entropy_of_upcast)
    assert sorted(kept(cross_entropy), key=str) == sorted(
        [(logits.shape, jnp.bfloat16), ((3, 40, 1), jnp.float32), ((3, 40, 1), jnp.float32),
         (targets.shape, jnp.int32)], key=str)

    def vocab_reductions(jaxpr):
        return [e.primitive.name for e in jaxpr_eqns(jaxpr) if e.primitive.name.startswith(
            "reduce_") and e.invars[0].aval.shape == logits.shape]

    for f in (cross_entropy, jax.value_and_grad(cross_entropy)):
        assert vocab_reductions(jax.make_jaxpr(f)(logits, targets).jaxpr) == ["reduce_max",
                                                                              "reduce_sum"]


def test_head_grad_option_rounds_only_the_logits_gradient(rng):
    """model.head_grad_dtype="bfloat16": logits and loss bit-identical to the default; the head's
    input and weight gradients are exactly the two GEMMs of the bf16-rounded logit gradient (FP32
    accumulation), where the default's differ from them."""
    import dataclasses

    bf16 = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((2, 16, 32)), bf16)
    w = jnp.asarray(rng.standard_normal((128, 32)), bf16)
    c = jnp.asarray(rng.standard_normal((2, 16, 128)), jnp.float32)
    out, vjp = jax.vjp(lambda x, w: gpt2._head_rounded_grad(x, w, jnp.float32, bf16), x, w)
    ref, ref_vjp = jax.vjp(lambda x, w: gpt2._head_logits(x, w, jnp.float32), x, w)
    chex.assert_trees_all_equal(out, ref)
    cb = c.astype(bf16)
    want = (jnp.einsum("btv,vd->btd", cb, w, preferred_element_type=jnp.float32).astype(bf16),
            jnp.einsum("btv,btd->vd", cb, x, preferred_element_type=jnp.float32).astype(bf16))
    got = vjp(c)
    chex.assert_trees_all_equal(got, want)
    chex.assert_trees_all_equal_dtypes(got, (x, w))
    default = ref_vjp(c)
    assert any(np.any(np.asarray(a, np.float32) != np.asarray(b, np.float32))
               for a, b in zip(default, want))

    # in the model: the same loss, other gradients
    cfg, idx, loss, (l32, g32) = _one_layer_baseline()
    opt = dataclasses.replace(cfg, head_grad_dtype="bfloat16")
    l16, g16 = nnx.jit(nnx.value_and_grad(loss))(GPT(opt, rngs=nnx.Rngs(0)))
    chex.assert_trees_all_equal(l16, l32)
    assert g16.wte.embedding[...].dtype == jnp.float32
    assert np.any(np.asarray(g16.wte.embedding[...]) != np.asarray(g32.wte.embedding[...]))


@functools.cache
def _two_layer_baseline():
    """A small GPT-2 (2 layers of 32), its loss function, and the default model's loss and every
    gradient: compiled once for every option compared against it."""
    cfg = small_cfg(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)
    idx = (jnp.arange(32, dtype=jnp.int32).reshape(2, 16) * 37) % 128

    def loss(m):
        return gpt2.cross_entropy(m(idx[:, :-1]), idx[:, 1:])

    return cfg, loss, nnx.jit(nnx.value_and_grad(loss))(GPT(cfg, rngs=nnx.Rngs(0)))


def _gelu_option_is_bit_identical(**option):
    """A small GPT-2 with and without a GELU option: asserts the loss and every gradient equal bit
    for bit; returns (config, config with the option, loss function)."""
    import dataclasses

    cfg, loss, want = _two_layer_baseline()
    opt = dataclasses.replace(cfg, **option)
    got = nnx.jit(nnx.value_and_grad(loss))(GPT(opt, rngs=nnx.Rngs(0)))
    chex.assert_trees_all_equal(got, want)
    return cfg, opt, loss


def test_gelu_from_input_changes_no_bit_and_saves_only_the_input():
    """model.gelu_from_input: the loss and every gradient are bit-identical to autodiff's, and what
    the forward keeps for each GELU's backward is its bf16 input alone (autodiff keeps three FP32
    arrays of the MLP's width)."""
    import dataclasses

    cfg, _, _ = _gelu_option_is_bit_identical(gelu_from_input=True)

    h = jnp.linspace(-4.0, 4.0, 24, dtype=jnp.bfloat16).reshape(2, 12)
    kept = jax.vjp(gpt2.gelu_from_input, h)[1]
    leaves = [x for x in jax.tree_util.tree_leaves(kept) if hasattr(x, "dtype")]
    assert [(x.shape, x.dtype) for x in leaves] == [(h.shape, jnp.bfloat16)]
    auto = [x for x in jax.tree_util.tree_leaves(jax.vjp(gpt2._gelu, h)[1]) if hasattr(x, "shape")
            and x.shape == h.shape]
    assert len(auto) == 3 and all(x.dtype == jnp.float32 for x in auto)
    with pytest.raises(ValueError, match="set one"):
        dataclasses.replace(cfg, gelu_from_input=True, recompute_gelu=True)
    # the backward's erfc is computed from the input behind an optimization barrier, so the compiler
    # cannot take the forward's (and keep it in FP32 until the backward) instead of recomputing it
    grad = jax.make_jaxpr(jax.grad(lambda h: gpt2.gelu_from_input(h).astype(jnp.float32).sum()))(h)
    eqns = grad.jaxpr.eqns
    barrier = [i for i, e in enumerate(eqns) if e.primitive.name == "optimization_barrier"]
    erfc = [i for i, e in enumerate(eqns) if e.primitive.name == "erfc"]
    assert len(barrier) == 1 and len(erfc) == 2 and erfc[0] < barrier[0] < erfc[1]
    behind = set(eqns[barrier[0]].outvars)
    for e in eqns[barrier[0] + 1:erfc[1] + 1]:
        if behind & {v for v in e.invars if type(v).__name__ == "Var"}:
            behind |= set(e.outvars)
    assert behind & {v for v in eqns[erfc[1]].invars if type(v).__name__ == "Var"}


def test_recompute_gelu_changes_no_bit():
    """model.recompute_gelu: the backward recomputes each layer's GELU from its input (a remat per
    layer in the program) and the loss and every gradient are bit-identical. (Recomputing the
    LayerNorms instead is not: their reductions, compiled into other fusions, round differently.)"""
    cfg, opt, loss = _gelu_option_is_bit_identical(recompute_gelu=True)

    # the name this JAX gives jax.checkpoint's primitive in a differentiated program
    probe = jax.make_jaxpr(jax.grad(jax.checkpoint(jnp.sin)))(1.0)
    remat = next(e.primitive.name for e in probe.jaxpr.eqns if "jaxpr" in e.params)

    def remats(c):
        graph, params = nnx.split(GPT(c, rngs=nnx.Rngs(0)))
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss(nnx.merge(graph, p))))(params)
        return str(jaxpr).count(f"{remat}[")

    assert remats(cfg) == 0
    assert remats(opt) == cfg.n_layer


def test_gelu_erf_form_is_the_exact_gelu_within_its_bound():
    """model.gelu="erf": value and derivative on every bf16 input in [-8, 8] within the bound of
    ``helpers.assert_gelu_erf_within_bound``; the two forms differ in last bits only; the option
    reaches the model and ``gelu_from_input`` keeps it."""
    import dataclasses

    h, y, _ = assert_gelu_erf_within_bound()
    # the two forms agree but for last bits: bitwise on most of the grid
    y_erfc = np.asarray(gpt2._gelu(h, "erfc"), np.float32)
    assert 0.5 < np.mean(np.asarray(y, np.float32) == y_erfc) < 1
    # the option reaches the model, and gelu_from_input keeps the form
    graph, params = nnx.split(gpt2.MLP(small_cfg(gelu="erf"), rngs=nnx.Rngs(0)))
    mlp = jax.make_jaxpr(lambda p, x: nnx.merge(graph, p)(x))
    text = str(mlp(params, h[:64].reshape(1, 1, 64)))
    assert " erf " in text.replace("erf[", "erf ") and "erfc" not in text
    g = jnp.asarray(np.linspace(-2, 2, h.size), jnp.bfloat16)
    grads = [jax.jit(lambda h, g, f=f: jax.vjp(f, h)[1](g))(h, g) for f in (
        lambda v: gpt2.gelu_from_input(v, "erf"), lambda v: gpt2._gelu(v, "erf"))]
    chex.assert_trees_all_equal(*grads)
    with pytest.raises(ValueError, match="gelu"):
        dataclasses.replace(small_cfg(), gelu="tanh")


def test_gelu_pallas_kernels_are_the_exact_gelu_within_its_bound():
    """model.gelu="pallas": the erf form's arithmetic in Pallas kernels, value and derivative on
    every bf16 input in [-8, 8] within the erf form's bound (the grid is not a whole number of
    blocks: the padded path); XLA's erf form differs from it in last bits only; in the model the
    kernels run, once each way (gelu_from_input and recompute_gelu change nothing under it)."""
    h, y, vjp = assert_gelu_erf_within_bound("pallas")
    assert h.size % (gelu_kernels.FWD_ROWS * gelu_kernels.COLS)
    y_erf = np.asarray(gpt2._gelu(h, "erf"), np.float32)
    assert 0.5 < np.mean(np.asarray(y, np.float32) == y_erf) <= 1
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 64)), jnp.bfloat16)
    dy = jnp.asarray(np.random.default_rng(1).standard_normal((2, 32, 64)), jnp.bfloat16)
    runs = []
    for kw in ({}, {"gelu_from_input": True}, {"recompute_gelu": True}):
        graph, params = nnx.split(gpt2.MLP(small_cfg(gelu="pallas", **kw), rngs=nnx.Rngs(0)))
        f = lambda p, x, graph=graph: nnx.merge(graph, p)(x)
        step = jax.make_jaxpr(lambda p, x: jax.vjp(f, p, x)[1](dy))(params, x).jaxpr
        calls = [str(e.params.get("name", e.params.get("name_and_src_info"))).split()[0]
                 for e in jaxpr_eqns(step) if e.primitive.name == "pallas_call"]
        assert sorted(calls) == ["model_gelu_bwd", "model_gelu_fwd"]
        y, vjp = jax.vjp(jax.jit(f), params, x)
        runs.append((y, vjp(dy)))
    chex.assert_trees_all_equal(runs[0], runs[1])
    chex.assert_trees_all_equal(runs[0], runs[2])


def test_layer_norm_keeps_digits_when_features_share_a_large_offset(rng):
    # torch.nn.LayerNorm's two-pass variance; the one-pass E[x²] − E[x]² is off by ~1e-3 at offset 100
    d = 768
    ln = gpt2._layer_norm(d, jnp.float32, nnx.Rngs(0))
    # tolerances: a few FP32 ulps of the mean's sum (one-pass: 1e-3 at 100, 0.1 at 1000)
    for offset, tol in ((0.0, 1e-5), (100.0, 5e-5), (1000.0, 1e-3)):
        x = (rng.standard_normal((256, d)) + offset).astype(np.float32)
        x64 = x.astype(np.float64)
        want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
        got = np.asarray(ln(jnp.asarray(x)), np.float64)
        assert np.abs(got - want).max() < tol, offset


def test_pallas_layernorm_option_agrees_to_fp32_noise():
    """model.layernorm="pallas" (models/layernorm.py, interpreted here) in a float32 model: the loss
    and every gradient agree with flax's LayerNorm to FP32 noise. Each of the 5 LayerNorms is within
    4·d·u of its outputs' size forward and 8·d·u backward (tests/test_layernorm.py); allowing a
    conditioning factor of 10 through the layers, forward and backward: rtol 10·10·8·d·u."""
    import dataclasses

    cfg = small_cfg(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32, dtype="float32")
    idx = (jnp.arange(32, dtype=jnp.int32).reshape(2, 16) * 37) % 128

    def loss(m):
        return gpt2.cross_entropy(m(idx[:, :-1]), idx[:, 1:])

    value_and_grad = nnx.jit(nnx.value_and_grad(loss))
    want = value_and_grad(GPT(cfg, rngs=nnx.Rngs(0)))
    got = value_and_grad(GPT(dataclasses.replace(cfg, layernorm="pallas"), rngs=nnx.Rngs(0)))
    rtol = 10 * 10 * 8 * cfg.n_embd * 2.0 ** -24
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want[1]))
    chex.assert_trees_all_close(got, want, rtol=rtol, atol=rtol * scale)
    assert got[0] != want[0] or any(bool(jnp.any(a != b)) for a, b in
                                    zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]))), \
        "the option did not reach the model"
    with pytest.raises(ValueError, match="layernorm"):
        dataclasses.replace(cfg, layernorm="fused")


def test_packed_qkv_option_reads_qkv_in_place_and_sums_the_input_gradient_once():
    """model.packed_qkv: Q, K, V from one product on the three kernels side by side, attended in
    place (``jax_flash.attention_qkvpacked``). On the CPU the output and the parameter gradients
    are bit-identical to the three projections' (XLA's CPU product sums each output column alike
    at either width); the input gradient is one product over 3·n_embd summed in FP32, where the
    default adds three bf16 products: they differ within the bound derived from both roundings
    (each bf16 rounding half an ulp, FP32 accumulation of K terms within K·u of Σ|terms|). The
    computation has no slice of the product; a layer whose attention records its inputs (the
    probes' capture) slices it."""
    from helpers import half_ulp

    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=64,
                    attention=AttentionSpec("flash", stable=True, impl="pallas"))
    x = jax.random.normal(jax.random.key(0), (1, 32, 64), jnp.float32)
    g = jax.random.normal(jax.random.key(1), (1, 32, 64), jnp.bfloat16)

    def run(packed, capture=None):
        c = dataclasses.replace(cfg, packed_qkv=packed)
        gd, st = nnx.split(gpt2.CausalSelfAttention(c, 0, rngs=nnx.Rngs(0)))
        f = lambda st, x: nnx.merge(gd, st)(x, capture)
        return jax.vjp(f, st, x)

    (o, vjp), (o_d, vjp_d) = run(True), run(False)
    (dst, dx), (dst_d, dx_d) = vjp(g), vjp_d(g)
    chex.assert_trees_all_equal((o, dst), (o_d, dst_d))
    # the bound: dx_p = bf16(Σ over 3d terms), dx_d = Σ_i bf16(Σ over d terms) in FP32
    m = gpt2.CausalSelfAttention(cfg, 0, rngs=nnx.Rngs(0))
    w = np.concatenate([np.asarray(l.kernel[...].astype(jnp.bfloat16), np.float64)
                        for l in (m.wq, m.wk, m.wv)], 1)
    xb = x.astype(jnp.bfloat16)
    qkv = jnp.dot(xb, jnp.asarray(w, jnp.bfloat16)).reshape(1, 32, 3, 2, 32)
    do = jax.vjp(lambda o: m.wo(o.reshape(1, 32, 64)), jnp.zeros((1, 32, 2, 32), jnp.bfloat16))[1](g)
    dqkv = jax.vjp(lambda t: gpt2.flash_attention_qkvpacked(t, cfg.attention), qkv)[1](do[0])[0]
    a = np.abs(np.asarray(dqkv, np.float64).reshape(1, 32, 192))
    parts = [a[..., i * 64:(i + 1) * 64] @ np.abs(w[:, i * 64:(i + 1) * 64]).T for i in range(3)]
    total = sum(parts)
    u = 2.0 ** -24
    dx_p, dx_d = np.asarray(dx, np.float64), np.asarray(dx_d, np.float64)
    bound = (half_ulp(dx_p, jnp.bfloat16) + sum(half_ulp(p, jnp.bfloat16) for p in parts)
             + (192 + 64 + 2) * u * total)
    assert np.all(np.abs(dx_p - dx_d) <= bound), float(np.max(np.abs(dx_p - dx_d) / bound))
    assert np.any(dx_p != dx_d)

    def prims(f, *args):
        return {e.primitive.name for e in jaxpr_eqns(jax.make_jaxpr(f)(*args).jaxpr)}

    c = dataclasses.replace(cfg, packed_qkv=True)
    gd, st = nnx.split(gpt2.CausalSelfAttention(c, 0, rngs=nnx.Rngs(0)))
    step = lambda st, x, cap: jax.vjp(lambda s: nnx.merge(gd, s)(x, cap), st)[1](o)
    assert "slice" not in prims(lambda st, x: step(st, x, None), st, x)
    assert "slice" in prims(lambda st, x: step(st, x, {}), st, x)
