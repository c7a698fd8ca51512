"""GPT-2 in Flax NNX, with the attention function chosen per layer and per head group.

The architecture is nanoGPT's, as Qiu & Yao (arXiv 2510.04212) train it: pre-LayerNorm (eps 1e-5, no
bias), learned position embeddings, tied token embedding / LM head, no biases anywhere, exact-GELU
MLP 4x, no dropout; init N(0, 0.02) for every Linear and Embedding, N(0, 0.02/sqrt(2*n_layer)) for
the two residual projections (``attn.wo`` and ``mlp.proj``).

Mixed precision follows nanoGPT under bf16 autocast: parameters are FP32 ("master" weights); every
matmul runs in ``GPTConfig.dtype`` (default bfloat16) with bf16 outputs; LayerNorm and GELU compute in
FP32; the residual stream stays FP32 (embeddings are FP32 and branch outputs are added to it, as
autocast does); the tied LM head multiplies bf16 operands with FP32 accumulation and FP32 output, so
logits and the cross-entropy are FP32 (nanoGPT's head outputs bf16 logits, and so gets a bf16
gradient of them; ``logits_dtype="bfloat16"`` does the same: the model returns bf16 logits, and
``cross_entropy`` computes in FP32 from them).

Q, K and V are separate ``nnx.Linear`` layers per block (``attn.wq``, ``attn.wk``, ``attn.wv``), each
with kernel shape ``[n_embd, n_embd]`` (input, output). Head ``h`` of W_Q is
``kernel[:, h*head_dim:(h+1)*head_dim]``; ``per_head_weights`` returns them as ``[n_head, n_embd,
head_dim]``.

Layer indices are 0-based everywhere in this project's configs: the paper's "layer 2" is index 1,
and the paper's 1-based heads "1, 7, 8, 9, 11, 12" are 0-based heads (0, 6, 7, 8, 10, 11).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

ATTENTION_KINDS = ("standard", "flash", "cudnn", "xla")  # built in; register_attention adds more
DTYPES = ("float32", "bfloat16", "float16", "float64")  # the names suggested for a bad dtype


def choice_error(field: str, value: Any, choices: Sequence[str]) -> ValueError:
    """ValueError for a name outside ``choices``, with the closest one as a suggestion."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"{field}: unknown value {value!r}{hint} (known: {', '.join(choices)})")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Which attention computes a group of heads, with jax_flash's options for kind="flash".

    kind: "standard" (softmax in FP32, P.V in the compute dtype: the paper's non-flash baseline),
      "flash" (``jax_flash.attention``), "cudnn" / "xla" (``jax.nn.dot_product_attention`` with that
      implementation). Any name registered with ``register_attention`` is accepted too.
    The remaining fields are passed to ``jax_flash.attention`` and ignored by the other kinds.
    """

    kind: str = "standard"
    policy: str = "fa2"
    stable: bool = False
    beta: float = 2.0
    delta: str = "o"
    impl: str = "auto"
    block_q: int | None = None
    block_k: int | None = None


# (layer, spec) or (layer, heads, spec); heads: an int, a tuple of ints, a range or a slice.
Override = tuple


def _normalize_heads(heads: Any, n_head: int) -> tuple[int, ...]:
    if isinstance(heads, int):
        heads = (heads,)
    elif isinstance(heads, slice):
        heads = tuple(range(n_head))[heads]
    out = tuple(int(h) for h in heads)
    for h in out:
        if not 0 <= h < n_head:
            raise ValueError(f"head index {h} out of range for n_head={n_head}")
    if not out:
        raise ValueError("empty head group in an attention override")
    return out


def _as_spec(spec: Any) -> AttentionSpec:
    if isinstance(spec, AttentionSpec):
        return spec
    if isinstance(spec, dict):  # from JSON / the CLI
        return AttentionSpec(**spec)
    if isinstance(spec, str):
        return AttentionSpec(kind=spec)
    raise TypeError(f"not an AttentionSpec: {spec!r}")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dtype: str = "bfloat16"  # compute dtype of matmuls / activations
    param_dtype: str = "float32"  # master weights
    # "float32": logits leave the head's matmul in FP32; "bfloat16": rounded to bf16 first, as nanoGPT's
    # lm_head output is under bf16 autocast (the loss is FP32 either way).
    logits_dtype: str = "float32"
    # the dtype the logits' gradient is rounded to before the head's two backward GEMMs: "float32"
    # keeps autodiff's (FP32 GEMMs, TF32 on a GPU at default precision); "bfloat16" runs them in bf16
    # as nanoGPT's do, with the forward — logits and loss — unchanged
    head_grad_dtype: str = "float32"
    # the backward recomputes the MLP's GELU from its bf16 input instead of reading saved FP32
    # intermediates: the same elementwise operations on the same values, so every gradient is
    # bit-identical (tests/test_model.py, on the device the tests run on); less memory traffic
    recompute_gelu: bool = False
    # the GELU keeps only its bf16 input for the backward, whose own pass recomputes the FP32
    # intermediates and applies the cotangent (a custom VJP around autodiff's own operations, so
    # bit-identical; only the input passes an optimization barrier, not the recomputation's result)
    gelu_from_input: bool = False
    # how the exact GELU's normal CDF is computed, in FP32: "erfc" is jax.nn.gelu's x·erfc(−x/√2)/2;
    # "erf" is x·(1 + erf(x/√2))/2, the form PyTorch's exact GELU computes. The same function;
    # XLA's erf is one rational polynomial where its erfc takes an exp and two divisions, so "erf"
    # is cheaper, and it loses relative accuracy in the far negative tail (its absolute error there
    # is a few |x|·2⁻²⁴). Last bits differ, so it is a named option. "pallas": the erf form's
    # arithmetic in two Pallas kernels (models/gelu_kernels.py), the backward from the bf16 input,
    # its φ by the GPU's fast exp2 (recompute_gelu and gelu_from_input change nothing under it)
    gelu: str = "erfc"
    # "xla": flax's two-pass LayerNorm, compiled by XLA; "pallas": the same arithmetic in one Pallas
    # kernel per pass (models/layernorm.py), each residual addition in the kernels of the LayerNorm
    # after it; its FP32 sums in another order: last bits differ
    layernorm: str = "xla"
    # the loss: "xla", the ops of jax.nn.logsumexp (bit-identical to autodiff's of the logits upcast
    # to FP32); "pallas", a Pallas kernel that reads the logits once for the loss and, under
    # differentiation, again for the gradient (models/loss_kernels.py): the sum of exponentials
    # in another order, last bits differ
    cross_entropy: str = "xla"
    # Q, K and V from one GEMM on the three kernels side by side (the parameters stay three), and
    # under "flash" attention read in place from that product (jax_flash.attention_qkvpacked), whose
    # backward writes their gradients into one array for the input-gradient GEMM, one product
    # over 3·n_embd summed in FP32 where three bf16 products were added: last bits differ
    packed_qkv: bool = False
    init_std: float = 0.02
    attention: AttentionSpec = AttentionSpec()
    # Later entries win. Layers 0-based. Example: flash only in the paper's layer 2 is
    #   attention=AttentionSpec("standard"), attention_overrides=((1, AttentionSpec("flash")),)
    # and FP32 flash for heads 0,6,7,8,10,11 of that layer is
    #   ((1, AttentionSpec("flash")), (1, (0, 6, 7, 8, 10, 11), AttentionSpec("flash", policy="fp32"))).
    attention_overrides: tuple[Override, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"{name} must be an integer > 0, got {v!r}")
        for name in ("dtype", "param_dtype", "logits_dtype", "head_grad_dtype"):
            try:
                ok = jnp.issubdtype(jnp.dtype(getattr(self, name)), jnp.floating)
            except TypeError:
                ok = False
            if not ok:
                raise choice_error(name, getattr(self, name), DTYPES)
        for name in ("recompute_gelu", "gelu_from_input", "packed_qkv"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.recompute_gelu and self.gelu_from_input:
            raise ValueError("recompute_gelu and gelu_from_input are two ways to the same values: "
                             "set one")
        if self.gelu not in GELUS:
            raise choice_error("gelu", self.gelu, GELUS)
        if self.layernorm not in LAYERNORMS:
            raise choice_error("layernorm", self.layernorm, LAYERNORMS)
        if self.cross_entropy not in CROSS_ENTROPIES:
            raise choice_error("cross_entropy", self.cross_entropy, CROSS_ENTROPIES)
        if not (isinstance(self.init_std, (int, float)) and math.isfinite(self.init_std)
                and self.init_std > 0):
            raise ValueError(f"init_std must be a finite number > 0, got {self.init_std!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        object.__setattr__(self, "attention", _as_spec(self.attention))
        norm = []
        for ov in self.attention_overrides:
            ov = tuple(ov)
            if len(ov) == 2:
                layer, heads, spec = ov[0], tuple(range(self.n_head)), ov[1]
            elif len(ov) == 3:
                layer, heads, spec = ov
                heads = _normalize_heads(heads, self.n_head)
            else:
                raise ValueError(
                    f"attention override must be (layer, spec) or (layer, heads, spec): {ov!r}"
                )
            if not 0 <= int(layer) < self.n_layer:
                raise ValueError(
                    f"override layer {layer} out of range for n_layer={self.n_layer} (0-based)"
                )
            norm.append((int(layer), heads, _as_spec(spec)))
        object.__setattr__(self, "attention_overrides", tuple(norm))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def head_specs(self, layer: int) -> tuple[AttentionSpec, ...]:
        """The spec of every head of ``layer`` after applying the overrides in order."""
        specs = [self.attention] * self.n_head
        for ov_layer, heads, spec in self.attention_overrides:
            if ov_layer == layer:
                for h in heads:
                    specs[h] = spec
        return tuple(specs)

    def head_groups(self, layer: int) -> tuple[tuple[int, int, AttentionSpec], ...]:
        """Contiguous runs (start, stop, spec) of heads sharing a spec, in head order."""
        groups: list[tuple[int, int, AttentionSpec]] = []
        for h, spec in enumerate(self.head_specs(layer)):
            if groups and groups[-1][2] == spec:
                groups[-1] = (groups[-1][0], h + 1, spec)
            else:
                groups.append((h, h + 1, spec))
        return tuple(groups)

    def num_params(self, non_embedding: bool = True) -> int:
        d, L = self.n_embd, self.n_layer
        n = L * (12 * d * d + 2 * d) + d + self.vocab_size * d + self.block_size * d
        if non_embedding:
            n -= self.block_size * d
        return n


# ----------------------------------------------------------------------------- attention functions
# Each takes q, k, v [batch, seq, heads, head_dim] in the compute dtype and the spec, and returns the
# causal attention output in the same shape and dtype.


def standard_attention(q, k, v, spec: AttentionSpec | None = None):
    """Softmax attention as nanoGPT's non-flash path under autocast: S with FP32 accumulation,
    softmax in FP32, P cast to the compute dtype, P.V in the compute dtype with FP32 accumulation."""
    del spec
    dtype = q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    t = q.shape[1]
    mask = jnp.tril(jnp.ones((t, k.shape[1]), dtype=bool))
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=jnp.float32)
    return o.astype(dtype)


def _dpa(implementation):
    def fn(q, k, v, spec=None):
        del spec
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    fn.__name__ = f"dot_product_attention_{implementation}"
    return fn


def _flash_kwargs(spec: AttentionSpec) -> dict:
    return dict(causal=True, stable=spec.stable, beta=spec.beta, policy=spec.policy,
                delta=spec.delta, impl=spec.impl, block_q=spec.block_q, block_k=spec.block_k)


def flash_attention(q, k, v, spec: AttentionSpec):
    import jax_flash  # lazy: models/ must import even where jax_flash is incomplete

    return jax_flash.attention(q, k, v, **_flash_kwargs(spec))


def flash_attention_qkvpacked(qkv, spec: AttentionSpec):
    """``flash_attention`` of a packed ``[batch, seq, 3, heads, head_dim]`` Q/K/V."""
    import jax_flash

    return jax_flash.attention_qkvpacked(qkv, **_flash_kwargs(spec))


ATTENTION_FNS: dict[str, Callable] = {
    "standard": standard_attention,
    "flash": flash_attention,
    "cudnn": _dpa("cudnn"),
    "xla": _dpa("xla"),
}


def register_attention(kind: str, fn: Callable) -> None:
    """Make ``AttentionSpec(kind=kind)`` call ``fn(q, k, v, spec)`` (experiments, tests)."""
    ATTENTION_FNS[kind] = fn


def check_attention_spec(spec: AttentionSpec) -> AttentionSpec:
    """Raise ValueError ("field: ...") unless every field of ``spec`` names something that exists:
    a registered kind, and jax_flash's policies, deltas and impls (also for kinds that ignore them,
    where a misspelling is still a mistake). Returns spec."""
    from jax_flash.api import DELTAS, IMPLS  # lazy, like flash_attention
    from jax_flash.policy import POLICIES

    if spec.kind not in ATTENTION_FNS:
        raise choice_error("kind", spec.kind, tuple(ATTENTION_FNS))
    for field, choices in (("policy", POLICIES), ("delta", DELTAS), ("impl", IMPLS)):
        if getattr(spec, field) not in choices:
            raise choice_error(field, getattr(spec, field), choices)
    if not (isinstance(spec.beta, (int, float)) and math.isfinite(spec.beta) and spec.beta > 1):
        raise ValueError(f"beta must be a finite number > 1, got {spec.beta!r}")
    for field in ("block_q", "block_k"):
        b = getattr(spec, field)
        if b is not None and not (isinstance(b, int) and not isinstance(b, bool) and b > 0):
            raise ValueError(f"{field} must be none or an integer > 0, got {b!r}")
    return spec


def attend(q, k, v, spec: AttentionSpec):
    try:
        fn = ATTENTION_FNS[spec.kind]
    except KeyError:
        raise ValueError(
            f"unknown attention kind {spec.kind!r}; known: {sorted(ATTENTION_FNS)}"
        ) from None
    return fn(q, k, v, spec)


# ----------------------------------------------------------------------------- modules


def _dt(name: str):
    return jnp.dtype(name)


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: GPTConfig, layer: int, *, rngs: nnx.Rngs):
        d, dt, pdt = cfg.n_embd, _dt(cfg.dtype), _dt(cfg.param_dtype)
        init = nnx.initializers.normal(cfg.init_std)
        res_init = nnx.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.n_layer))
        mk = lambda kinit: nnx.Linear(
            d, d, use_bias=False, dtype=dt, param_dtype=pdt, kernel_init=kinit, rngs=rngs
        )
        self.wq, self.wk, self.wv = mk(init), mk(init), mk(init)
        self.wo = mk(res_init)
        self.n_head = cfg.n_head
        self.groups = cfg.head_groups(layer)  # static: part of the graphdef
        self.packed = cfg.packed_qkv

    def __call__(self, x, capture: dict | None = None):
        b, t, d = x.shape
        shape = (b, t, self.n_head, d // self.n_head)
        if self.packed:
            dt = self.wq.dtype
            w = jnp.concatenate([m.kernel[...] for m in (self.wq, self.wk, self.wv)], 1)
            qkv = jnp.dot(x.astype(dt), w.astype(dt)).reshape(b, t, 3, *shape[2:])
            spec = self.groups[0][2] if len(self.groups) == 1 else None
            if capture is None and spec is not None and spec.kind == "flash":
                return self.wo(flash_attention_qkvpacked(qkv, spec).reshape(b, t, d))
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q = self.wq(x).reshape(shape)
            k = self.wk(x).reshape(shape)
            v = self.wv(x).reshape(shape)
        if capture is not None:
            capture.update(q=q, k=k, v=v)
        outs = [
            attend(q[:, :, h0:h1], k[:, :, h0:h1], v[:, :, h0:h1], spec)
            for h0, h1, spec in self.groups
        ]
        o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
        return self.wo(o.reshape(b, t, d))


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d, dt, pdt = cfg.n_embd, _dt(cfg.dtype), _dt(cfg.param_dtype)
        self.fc = nnx.Linear(
            d,
            4 * d,
            use_bias=False,
            dtype=dt,
            param_dtype=pdt,
            kernel_init=nnx.initializers.normal(cfg.init_std),
            rngs=rngs,
        )
        self.proj = nnx.Linear(
            4 * d,
            d,
            use_bias=False,
            dtype=dt,
            param_dtype=pdt,
            kernel_init=nnx.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.n_layer)),
            rngs=rngs,
        )
        # plain flags on the module (its graph stays comparable across instances); the function
        # is picked where it runs
        self.recompute, self.from_input = cfg.recompute_gelu, cfg.gelu_from_input
        self.form = cfg.gelu

    def __call__(self, x):
        gelu = functools.partial(_gelu, form=self.form)
        if self.form == "pallas":
            pass  # its kernels' backward already starts from the input alone
        elif self.recompute:
            gelu = jax.checkpoint(gelu)
        elif self.from_input:
            gelu = functools.partial(gelu_from_input, form=self.form)
        return self.proj(gelu(self.fc(x)))


GELUS = ("erfc", "erf", "pallas")
_SQRT_HALF = 0.7071067811865476


def _gelu(h, form="erfc"):
    """Exact GELU in FP32, returned in ``h``'s dtype; ``form`` as ``GPTConfig.gelu``."""
    if form == "pallas":
        from models.gelu_kernels import gelu

        return gelu(h)
    x = h.astype(jnp.float32)
    if form == "erfc":
        y = jax.nn.gelu(x, approximate=False)
    elif form == "erf":
        y = x * ((1 + jax.lax.erf(x * jnp.float32(_SQRT_HALF))) / 2)
    else:
        raise choice_error("gelu", form, GELUS)
    return y.astype(h.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gelu_from_input(h, form="erfc"):
    """``_gelu`` whose backward keeps only ``h``: it runs autodiff's own VJP of ``_gelu`` at ``h``,
    so the gradient is the same operations on the same values as without it."""
    return _gelu(h, form)


def _gelu_fwd(h, form):
    return _gelu(h, form), h


def _gelu_bwd(form, h, g):
    # without the barrier XLA merges this recomputation with the forward's and keeps its FP32
    # intermediates until the backward
    h = jax.lax.optimization_barrier(h)
    return jax.vjp(functools.partial(_gelu, form=form), h)[1](g)


gelu_from_input.defvjp(_gelu_fwd, _gelu_bwd)


LAYERNORMS = ("xla", "pallas")
CROSS_ENTROPIES = ("xla", "pallas")


def _normed(ln, x, dtype, kind: str):
    """``ln`` (an ``nnx.LayerNorm`` without bias, FP32) of ``x``, returned in ``dtype``: flax's
    module, or with ``kind == "pallas"`` the Pallas kernels on the module's scale."""
    if kind == "pallas":
        from models.layernorm import layer_norm

        return layer_norm(x, ln.scale[...], ln.epsilon, jnp.dtype(dtype))
    return ln(x).astype(dtype)


def _layer_norm(d, pdt, rngs):
    # Two-pass variance, as torch.nn.LayerNorm: the one-pass E[x²] − E[x]² loses digits when a
    # token's features share a large offset (1.5e-3 error at offset 100; docs/REPRODUCTION.md).
    return nnx.LayerNorm(
        d, epsilon=1e-5, use_bias=False, dtype=jnp.float32, param_dtype=pdt, use_fast_variance=False,
        rngs=rngs,
    )


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, layer: int, *, rngs: nnx.Rngs):
        pdt = _dt(cfg.param_dtype)
        self.ln_1 = _layer_norm(cfg.n_embd, pdt, rngs)
        self.attn = CausalSelfAttention(cfg, layer, rngs=rngs)
        self.ln_2 = _layer_norm(cfg.n_embd, pdt, rngs)
        self.mlp = MLP(cfg, rngs=rngs)
        self.dtype = _dt(cfg.dtype)
        self.layernorm = cfg.layernorm

    def __call__(self, x, capture: dict | None = None):
        h = _normed(self.ln_1, x, self.dtype, self.layernorm)
        if capture is not None:
            capture["x"] = h  # the attention input, for dW_Q = x^T dQ analyses
        x = x + self.attn(h, capture)
        x = x + self.mlp(_normed(self.ln_2, x, self.dtype, self.layernorm))
        if capture is not None:
            capture["resid"] = x  # block output (residual stream), for train/probes.py
        return x

    def fused(self, x, h, ln_next, capture: dict | None = None):
        """The block under ``layernorm="pallas"``: ``h`` is ``ln_1(x)``, computed by the caller;
        each residual addition runs with the LayerNorm after it (``models.layernorm.add_layer_norm``:
        the values of the two apart, up to an FMA in the input gradient). Returns the block's output
        and ``ln_next`` of it."""
        from models.layernorm import add_layer_norm

        if capture is not None:
            capture["x"] = h
        x, h = add_layer_norm(x, self.attn(h, capture), self.ln_2.scale[...], self.ln_2.epsilon,
                              self.dtype)
        x, h = add_layer_norm(x, self.mlp(h), ln_next.scale[...], ln_next.epsilon, self.dtype)
        if capture is not None:
            capture["resid"] = x
        return x, h


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        pdt = _dt(cfg.param_dtype)
        init = nnx.initializers.normal(cfg.init_std)
        self.config = cfg
        self.wte = nnx.Embed(
            cfg.vocab_size, cfg.n_embd, param_dtype=pdt, dtype=pdt, embedding_init=init, rngs=rngs
        )
        self.wpe = nnx.Embed(
            cfg.block_size, cfg.n_embd, param_dtype=pdt, dtype=pdt, embedding_init=init, rngs=rngs
        )
        self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.n_layer)])
        self.ln_f = _layer_norm(cfg.n_embd, pdt, rngs)

    def __call__(self, idx, *, return_intermediates: bool = False):
        """idx: int [batch, seq] -> logits [batch, seq, vocab] in ``logits_dtype`` (FP32 by default).

        With return_intermediates=True also returns a list (one dict per layer) with the attention
        input ``x`` and ``q``, ``k``, ``v`` ([batch, seq, heads, head_dim], compute dtype).
        """
        cfg = self.config
        t = idx.shape[1]
        if t > cfg.block_size:
            raise ValueError(f"sequence length {t} > block_size {cfg.block_size}")
        x = self.wte(idx) + self.wpe(jnp.arange(t))[None]
        captures = [] if return_intermediates else None
        dt = _dt(cfg.dtype)
        # under "pallas" each residual addition runs with the LayerNorm after it: h is ln_1(x)
        fused = cfg.layernorm == "pallas"
        h = _normed(self.blocks[0].ln_1, x, dt, "pallas") if fused else None
        nexts = [b.ln_1 for b in self.blocks[1:]] + [self.ln_f]
        for block, ln_next in zip(self.blocks, nexts):
            cap = {} if return_intermediates else None
            if fused:
                x, h = block.fused(x, h, ln_next, cap)
            else:
                x = block(x, cap)
            if return_intermediates:
                captures.append(cap)
        # the head takes x normalised in the compute dtype
        x = h if fused else _normed(self.ln_f, x, dt, cfg.layernorm)
        # the head's output dtype: FP32, or bf16 as autocast makes it — then the gradient of the
        # logits is bf16 too and the head's backward GEMMs run in bf16, as nanoGPT's do
        out_dt = _dt(cfg.logits_dtype)
        grad_dt = _dt(cfg.head_grad_dtype)
        x, w = x.astype(dt), self.wte.embedding[...].astype(dt)
        if grad_dt == jnp.float32:
            logits = _head_logits(x, w, out_dt)
        else:
            logits = _head_rounded_grad(x, w, out_dt, grad_dt)
        return (logits, captures) if return_intermediates else logits


def _head_logits(x, w, out_dt):
    """The tied head: ``x`` [b, t, d] times ``w`` [vocab, d] in the compute dtype, logits in
    ``out_dt`` (FP32 accumulation either way)."""
    return jnp.einsum("btd,vd->btv", x, w, preferred_element_type=out_dt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _head_rounded_grad(x, w, out_dt, grad_dt):
    """``_head_logits`` whose backward rounds the logits' gradient to ``grad_dt`` before the two
    GEMMs (FP32 accumulation), the head's ``head_grad_dtype`` option."""
    return _head_logits(x, w, out_dt)


def _head_rounded_grad_fwd(x, w, out_dt, grad_dt):
    return _head_logits(x, w, out_dt), (x, w)


def _head_rounded_grad_bwd(out_dt, grad_dt, res, g):
    x, w = res
    # the gradient reaching the head's output dtype first, as autodiff's would
    g = g.astype(out_dt).astype(grad_dt)
    dx = jnp.einsum("btv,vd->btd", g, w.astype(grad_dt), preferred_element_type=jnp.float32)
    dw = jnp.einsum("btv,btd->vd", g, x.astype(grad_dt), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_head_rounded_grad.defvjp(_head_rounded_grad_fwd, _head_rounded_grad_bwd)


def cross_entropy(logits, targets, impl: str = "xla"):
    """Mean token cross-entropy in FP32, of FP32 or lower-precision logits; ``impl`` as
    ``GPTConfig.cross_entropy`` (what follows describes "xla").

    Lower-precision logits (``logits_dtype="bfloat16"``) are kept as they are for the backward, with
    each row's max and sum of exponentials; the backward recomputes the exponentials in the pass that
    writes the gradient, and takes the target's term there too (a select, not a scatter). Autodiff
    of the FP32 loss would store an FP32 copy of the logits and their FP32 exponentials, each 200 KB
    a token at GPT-2's vocabulary. Loss and gradient are the values autodiff gives the logits upcast
    (tests/test_model.py checks them bit for bit on the device the tests run on).
    """
    targets = targets.astype(jnp.int32)
    if impl == "pallas":
        from models.loss_kernels import cross_entropy as kernels

        return kernels(logits, targets)
    if impl != "xla":
        raise choice_error("cross_entropy", impl, CROSS_ENTROPIES)
    if logits.dtype != jnp.float32:
        return _cross_entropy_low_precision(logits, targets)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - tgt)


def _cross_entropy_rows(logits, targets):
    """The FP32 branch's operations (those of ``jax.nn.logsumexp``) on the logits upcast, with the
    two row statistics named for ``jax.checkpoint``."""
    x = logits.astype(jnp.float32)
    amax = jnp.max(x, axis=-1, keepdims=True)
    amax = jax.lax.stop_gradient(jnp.where(jnp.isfinite(amax), amax, jnp.zeros_like(amax)))
    amax = checkpoint_name(amax, "ce_row_max")
    sumexp = checkpoint_name(jnp.sum(jnp.exp(x - amax), axis=-1, keepdims=True), "ce_row_sumexp")
    lse = (jnp.log(jnp.abs(sumexp)) + amax)[..., 0]
    return jnp.mean(lse - _target_logit(x.shape[-1], x, targets))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _target_logit(vocab, x, targets):
    """``x[..., targets]`` (``vocab`` is x's last dimension): gathered in the forward, its gradient
    a select in the backward — the gradient autodiff gives the masked row sum Σ where(hit, x, 0),
    the same value. A gather's own gradient is a scatter into an FP32 array, written and read again,
    which XLA does not fuse with the pass that writes the logits' gradient; the masked sum's
    forward reads all the logits once more."""
    return jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]


def _target_logit_fwd(vocab, x, targets):
    return _target_logit(vocab, x, targets), targets


def _target_logit_bwd(vocab, targets, g):
    shape = (*targets.shape, vocab)
    hit = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1) == targets[..., None]
    return jnp.where(hit, g[..., None], jnp.zeros((), g.dtype)), None


_target_logit.defvjp(_target_logit_fwd, _target_logit_bwd)


_cross_entropy_low_precision = jax.checkpoint(
    _cross_entropy_rows,
    policy=jax.checkpoint_policies.save_only_these_names("ce_row_max", "ce_row_sumexp"))


def per_head_weights(params: dict, layer: int, n_head: int, which: str = "wq"):
    """[n_head, n_embd, head_dim] view of W_Q (or "wk", "wv") of ``layer`` from a pure param dict."""
    kernel = params["blocks"][layer]["attn"][which]["kernel"]
    d_in, d_out = kernel.shape
    return jnp.transpose(kernel.reshape(d_in, n_head, d_out // n_head), (1, 0, 2))


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


__all__: Sequence[str] = (
    "AttentionSpec",
    "GPTConfig",
    "GPT",
    "ATTENTION_FNS",
    "ATTENTION_KINDS",
    "check_attention_spec",
    "register_attention",
    "attend",
    "standard_attention",
    "flash_attention",
    "cross_entropy",
    "per_head_weights",
    "count_params",
)
