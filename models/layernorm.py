"""LayerNorm (no bias) as two Pallas kernels: ``GPTConfig.layernorm = "pallas"``.

XLA compiles the model's two-pass LayerNorm and its autodiff into several fusions, the backward's
reading the activations many times over (the step profile, docs/PERFORMANCE.md). Here a program
takes whole rows (``BLOCK_ROWS`` forward, ``BWD_BLOCK_ROWS`` backward), a few at a time in a loop
(``FWD_SUB_ROWS``, ``BWD_SUB_ROWS``): the forward reads each row once and writes the normalised row
in the output dtype with the row's mean and 1/σ; the backward reads x, dy and those two and writes
dx and a per-program partial of d(scale), summed afterwards, reading each input once
(``_grads``). The arithmetic is the two-pass
LayerNorm's (mean, then the mean of squared deviations, eps inside the square root) and its exact
gradient, in FP32; the sums run in another order than XLA's, so last bits differ from the default
``"xla"`` LayerNorm — an opt-in named option, not bit-neutral.

``add_layer_norm`` takes the residual addition before a LayerNorm into the same kernels: the
forward writes the sum and its normalised row from one read of both addends, the backward adds the
sum's own cotangent to the LayerNorm's input gradient and writes it with its cast to the branch's
dtype. The model runs every residual addition that way under ``"pallas"``.

Rows are loaded in chunks of ``chunk`` features (a power of two dividing the width: Triton's tensors
are powers of two), e.g. three of 256 for GPT-2's 768.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_flash.pallas.common import interpret_mode as _interpret

# Launch constants, chosen by lab.row_kernels on an H200. Rows a program, rows a step of its loop
# and warps set the layout the row sums are reduced in, so they are numerics, fixed here for every
# device; stages (how far Triton's pipeliner loads the loop's rows ahead) changes no value.
BLOCK_ROWS = 16  # the forward's rows per program
FWD_SUB_ROWS = 16  # the forward's rows per step (all of a program's: no loop)
NUM_WARPS = 8  # the forward's: 1.13× as fast as 4 at 32768 rows (lab.row_kernels)
FWD_NUM_STAGES = 1
BWD_BLOCK_ROWS = 16  # the backward's rows per program
BWD_SUB_ROWS = 4  # the backward's rows per step (faster than 2, 8 or two loops: lab.row_kernels)
BWD_NUM_WARPS = 2  # the backward's (faster than 4 or 8 there)
BWD_NUM_STAGES = 1
# The backward's second pass reads each step's rows again (from cache) instead of holding them in
# registers from the first: the same expressions, so no value changes
BWD_RELOAD = False


def triton_params(num_warps: int = NUM_WARPS, num_stages: int = 1):
    """Triton's (passing them selects the Triton backend over Mosaic GPU); none when interpreted."""
    if _interpret():
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def chunk_width(d: int, cap: int = 256) -> int:
    """The largest power of two ≤ ``cap`` that divides ``d``."""
    c = 1
    while c * 2 <= cap and d % (c * 2) == 0:
        c *= 2
    return c


def rows_per_program(n: int, most: int = BLOCK_ROWS) -> int:
    """The largest power of two ≤ ``most`` dividing ``n``: a program's rows of an ``[n, ·]`` array."""
    br = most
    while n % br:
        br //= 2
    return br


def _chunks(ref, d, c, rows):
    return [ref[rows, pl.ds(i * c, c)] for i in range(d // c)]


def _fwd_kernel(x_ref, w_ref, y_ref, mean_ref, rstd_ref, *, d: int, c: int, eps: float,
                sub: int):
    def step(rows):
        xs = [x.astype(jnp.float32) for x in _chunks(x_ref, d, c, rows)]
        _normalize(xs, w_ref, y_ref, mean_ref, rstd_ref, rows, d=d, c=c, eps=eps)

    _row_steps(mean_ref.shape[0], sub, step)


def _add_fwd_kernel(x_ref, r_ref, w_ref, s_ref, y_ref, mean_ref, rstd_ref, *, d: int, c: int,
                    eps: float, sub: int):
    def step(rows):  # s = x + r as XLA adds them (r upcast first), written, normalised in place
        xs = [x.astype(jnp.float32) + r.astype(jnp.float32)
              for x, r in zip(_chunks(x_ref, d, c, rows), _chunks(r_ref, d, c, rows))]
        for i, x in enumerate(xs):
            s_ref[rows, pl.ds(i * c, c)] = x.astype(s_ref.dtype)
        _normalize(xs, w_ref, y_ref, mean_ref, rstd_ref, rows, d=d, c=c, eps=eps)

    _row_steps(mean_ref.shape[0], sub, step)


def _row_steps(br: int, sub: int, step):
    """``step(rows)`` over a program's ``br`` rows, ``sub`` at a time (both powers of two; a
    program of no more than ``sub`` rows is one step, without a loop)."""
    if sub >= br:
        step(pl.ds(0, br))
        return

    def body(r, carry):
        step(pl.ds(pl.multiple_of(r * sub, sub), sub))
        return carry

    lax.fori_loop(0, br // sub, body, 0)


def _normalize(xs, w_ref, y_ref, mean_ref, rstd_ref, rows, *, d: int, c: int, eps: float):
    mean = sum(jnp.sum(x, axis=1) for x in xs) / d
    cs = [x - mean[:, None] for x in xs]
    var = sum(jnp.sum(v * v, axis=1) for v in cs) / d
    rstd = lax.rsqrt(var + eps)
    for i, v in enumerate(cs):
        w = w_ref[pl.ds(i * c, c)].astype(jnp.float32)
        y_ref[rows, pl.ds(i * c, c)] = (v * rstd[:, None] * w[None, :]).astype(y_ref.dtype)
    mean_ref[rows] = mean
    rstd_ref[rows] = rstd


def _bwd_kernel(x_ref, w_ref, mean_ref, rstd_ref, dy_ref, dx_ref, dw_ref, *, d: int, c: int,
                sub: int, reload: bool):
    def store(rows, i, dx):
        dx_ref[rows, pl.ds(i * c, c)] = dx.astype(dx_ref.dtype)

    _grads(x_ref, w_ref, mean_ref, rstd_ref, dy_ref, dw_ref, d=d, c=c, store=store, sub=sub,
           reload=reload)


def _add_bwd_kernel(s_ref, w_ref, mean_ref, rstd_ref, dy_ref, gs_ref, ds_ref, dr_ref, dw_ref, *,
                    d: int, c: int, sub: int, reload: bool):
    def store(rows, i, dx):  # the sum's own cotangent added, as autodiff adds the two; r's is its cast
        cols = (rows, pl.ds(i * c, c))
        ds = dx + gs_ref[cols].astype(jnp.float32)
        ds_ref[cols] = ds.astype(ds_ref.dtype)
        dr_ref[cols] = ds.astype(dr_ref.dtype)

    _grads(s_ref, w_ref, mean_ref, rstd_ref, dy_ref, dw_ref, d=d, c=c, store=store, sub=sub,
           reload=reload)


def _grads(x_ref, w_ref, mean_ref, rstd_ref, dy_ref, dw_ref, *, d: int, c: int, store,
           sub: int, reload: bool = False):
    """The LayerNorm's input gradient (handed to ``store(rows, chunk, dx)``) and d(scale)'s partial:
    a loop over ``sub`` rows at a time that holds every chunk of them, so each input is read once
    (``reload``: read again for the input gradient, each chunk while it is needed, instead of
    held); d(scale)'s partial summed over those steps in registers."""
    n_chunks = d // c
    ws = [w_ref[pl.ds(i * c, c)].astype(jnp.float32)[None, :] for i in range(n_chunks)]

    def step(r, dws):
        rows = pl.ds(r * sub, sub)
        mean, rstd = mean_ref[rows], rstd_ref[rows]
        x_hat = lambda i: ((x_ref[rows, pl.ds(i * c, c)].astype(jnp.float32) - mean[:, None])
                           * rstd[:, None])
        d_y = lambda i: dy_ref[rows, pl.ds(i * c, c)].astype(jnp.float32)
        xh = [x_hat(i) for i in range(n_chunks)]
        dy = [d_y(i) for i in range(n_chunks)]
        g = [a * w for a, w in zip(dy, ws)]
        c1 = sum(jnp.sum(a * b, axis=1) for a, b in zip(g, xh)) / d  # mean(g·x̂)
        c2 = sum(jnp.sum(a, axis=1) for a in g) / d  # mean(g)
        summed = lambda: tuple(acc + jnp.sum(a * b, axis=0) for acc, a, b in zip(dws, dy, xh))
        # reload: the held chunks' last use comes before the stores, so they need not outlive it
        early = summed() if reload else None
        for i in range(n_chunks):
            xh_i, g_i = (x_hat(i), d_y(i) * ws[i]) if reload else (xh[i], g[i])
            store(rows, i, (g_i - c2[:, None] - xh_i * c1[:, None]) * rstd[:, None])
        return early if reload else summed()

    br = mean_ref.shape[0]
    sub = min(sub, br)  # both powers of two: a program of fewer rows is one step
    zero = tuple(jnp.zeros((c,), jnp.float32) for _ in range(n_chunks))
    dws = lax.fori_loop(0, br // sub, step, zero)
    for i, dw in enumerate(dws):
        dw_ref[0, pl.ds(i * c, c)] = dw


def row_call(kernel, n: int, d: int, ins, outs, name: str, *args, rows: int = BLOCK_ROWS,
             num_warps: int = NUM_WARPS, num_stages: int = 1):
    """``kernel`` over programs of up to ``rows`` whole rows of an ``[n, d]`` array. ``ins`` name
    each operand's block: "row" (the program's rows), "vec" (one number a row), "scale" (the whole
    scale); ``outs`` each output's block and dtype: "row", "vec" or "part" (one row of d a
    program)."""
    br = rows_per_program(n, rows)
    spec = {"row": pl.BlockSpec((br, d), lambda i: (i, 0)),
            "vec": pl.BlockSpec((br,), lambda i: (i,)),
            "scale": pl.BlockSpec((d,), lambda i: (0,)),
            "part": pl.BlockSpec((1, d), lambda i: (i, 0))}
    shape = {"row": (n, d), "vec": (n,), "part": (n // br, d)}
    return pl.pallas_call(
        kernel,
        grid=(n // br,),
        in_specs=[spec[k] for k in ins],
        out_specs=[spec[k] for k, _ in outs],
        out_shape=[jax.ShapeDtypeStruct(shape[k], dt) for k, dt in outs],
        interpret=_interpret(),
        compiler_params=triton_params(num_warps, num_stages),
        name=name,
    )(*args)


F32 = jnp.float32


FWD = dict(rows=BLOCK_ROWS, sub=FWD_SUB_ROWS, warps=NUM_WARPS, stages=FWD_NUM_STAGES)
BWD = dict(rows=BWD_BLOCK_ROWS, sub=BWD_SUB_ROWS, warps=BWD_NUM_WARPS, stages=BWD_NUM_STAGES,
           reload=BWD_RELOAD)


def _launch(kernel, defaults, given, n, d, *ins_outs_name_args, **static):
    """``row_call`` of ``kernel`` with the launch ``defaults`` (FWD or BWD) updated by ``given``
    (lab.row_kernels' variants)."""
    unknown = set(given) - set(defaults)
    if unknown:
        raise TypeError(f"unknown launch settings {sorted(unknown)}; known: {sorted(defaults)}")
    launch = {**defaults, **given}
    kernel_kw = {k: v for k, v in launch.items() if k not in ("rows", "warps", "stages")}
    kernel = functools.partial(kernel, d=d, c=chunk_width(d), **kernel_kw, **static)
    return row_call(kernel, n, d, *ins_outs_name_args, rows=launch["rows"],
                    num_warps=launch["warps"], num_stages=launch["stages"])


def _forward(x2, w, eps, out_dtype, **launch):
    n, d = x2.shape
    return _launch(_fwd_kernel, FWD, launch, n, d, ("row", "scale"),
                   (("row", out_dtype), ("vec", F32), ("vec", F32)), "model_layernorm_fwd", x2, w,
                   eps=eps)


def _backward(x2, w, mean, rstd, dy2, **launch):
    n, d = x2.shape
    dx, dw_parts = _launch(_bwd_kernel, BWD, launch, n, d, ("row", "scale", "vec", "vec", "row"),
                           (("row", x2.dtype), ("part", F32)), "model_layernorm_bwd",
                           x2, w, mean, rstd, dy2)
    return dx, jnp.sum(dw_parts, axis=0)


def _add_forward(x2, r2, w, eps, out_dtype, **launch):
    n, d = x2.shape
    return _launch(_add_fwd_kernel, FWD, launch, n, d, ("row", "row", "scale"),
                   (("row", x2.dtype), ("row", out_dtype), ("vec", F32), ("vec", F32)),
                   "model_add_layernorm_fwd", x2, r2, w, eps=eps)


def _add_backward(s2, w, mean, rstd, dy2, gs2, r_dtype, **launch):
    n, d = s2.shape
    ds, dr, dw_parts = _launch(_add_bwd_kernel, BWD, launch, n, d,
                               ("row", "scale", "vec", "vec", "row", "row"),
                               (("row", s2.dtype), ("row", r_dtype), ("part", F32)),
                               "model_add_layernorm_bwd", s2, w, mean, rstd, dy2, gs2)
    return ds, dr, jnp.sum(dw_parts, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def layer_norm(x, scale, eps: float = 1e-5, out_dtype=jnp.float32):
    """LayerNorm over the last axis of ``x`` with ``scale`` (no bias), in FP32, the result in
    ``out_dtype``. Differentiable in ``x`` and ``scale``."""
    return _fwd(x, scale, eps, out_dtype)[0]


def _fwd(x, scale, eps, out_dtype):
    d = x.shape[-1]
    y, mean, rstd = _forward(x.reshape(-1, d), scale, eps, jnp.dtype(out_dtype))
    return y.reshape(x.shape), (x, scale, mean, rstd)


def _bwd(eps, out_dtype, res, g):
    x, scale, mean, rstd = res
    d = x.shape[-1]
    dx, dw = _backward(x.reshape(-1, d), scale, mean, rstd, g.reshape(-1, d))
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(scale.dtype)


layer_norm.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def add_layer_norm(x, r, scale, eps: float = 1e-5, out_dtype=jnp.float32):
    """``(s, layer_norm(s, scale, eps, out_dtype))`` with ``s = x + r`` (``r`` upcast to ``x``'s
    dtype first, as XLA adds them): a residual addition and the next LayerNorm in one kernel each
    way. ``r`` is in ``out_dtype`` (a branch's output in the compute dtype); its gradient is the
    sum's, cast to it. The values of the two apart, except that the backward adds the sum's own
    cotangent to the LayerNorm's last product in the kernel, where a compiler may make the two one
    FMA (the bound in tests/helpers.py)."""
    return _add_fwd(x, r, scale, eps, out_dtype)[0]


def _add_fwd(x, r, scale, eps, out_dtype):
    if r.dtype != jnp.dtype(out_dtype):
        raise ValueError(f"add_layer_norm: r is {r.dtype}, expected out_dtype "
                         f"{jnp.dtype(out_dtype)}")
    d = x.shape[-1]
    s, y, mean, rstd = _add_forward(x.reshape(-1, d), r.reshape(-1, d), scale, eps,
                                    jnp.dtype(out_dtype))
    return (s.reshape(x.shape), y.reshape(x.shape)), (s, scale, mean, rstd)


def _add_bwd(eps, out_dtype, res, g):
    s, scale, mean, rstd = res
    gs, gy = g
    d = s.shape[-1]
    ds, dr, dw = _add_backward(s, scale, mean, rstd, gy.reshape(-1, d), gs.reshape(-1, d),
                               jnp.dtype(out_dtype))
    shape = gs.shape
    return ds.reshape(shape), dr.reshape(shape), dw.astype(scale.dtype)


add_layer_norm.defvjp(_add_fwd, _add_bwd)
