"""``lax.reduce`` with a combine of its own (several operands) in Pallas's Triton lowering.

Pallas lowers ``jnp.max`` / ``jnp.sum`` / ``argmax`` to Triton's ``tt.reduce``, whose combine region
can be any function of operand pairs; a general ``lax.reduce`` it does not lower. ``tile.row_top2``
needs one (a row's two largest scores in one reduction), so this module adds the rule: the combine is
the reduce's own jaxpr, lowered inside ``tt.reduce``'s region by Pallas's machinery, and the init
values are combined with the result afterwards (Triton's reduce has no init), which is
``lax.reduce``'s meaning for any init. One reduced axis, as in every Pallas Triton reduction.

The rule uses Pallas internals (``jax._src.pallas.triton.lowering``), checked on jax 0.10.2 and 0.11.2;
``register`` leaves a JAX without them, or with a rule of its own, alone.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax


def _rule(lowering, ctx, *args, computation, jaxpr, dimensions):
    from jax._src import core as jax_core

    del computation  # the jaxpr is the same function, already traced
    if len(dimensions) != 1:
        raise NotImplementedError(f"lax.reduce over {len(dimensions)} axes in a Pallas Triton kernel")
    n = len(args) // 2
    operands, inits = args[:n], args[n:]
    closed_consts = getattr(jaxpr, "consts", ())
    open_jaxpr = getattr(jaxpr, "jaxpr", jaxpr)

    def combine(left, right):
        return tuple(jax_core.eval_jaxpr(open_jaxpr, closed_consts, *left, *right))

    sub = dataclasses.replace(ctx, avals_in=list(ctx.avals_in[:n]))
    reduced = lowering._reduction_lowering(combine, sub, tuple(operands), axes=tuple(dimensions))
    # combine(init, result), lowered from its own jaxpr over the reduced vectors
    init_avals, out_avals = ctx.avals_in[n:], ctx.avals_out

    def with_init(*xs):
        inits_b = tuple(lax.broadcast(x, a.shape) for x, a in zip(xs[:n], out_avals))
        return combine(inits_b, tuple(xs[n:]))

    spec = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*init_avals, *out_avals)]
    closed = jax.make_jaxpr(with_init)(*spec)
    if closed.consts:
        raise NotImplementedError("lax.reduce whose init combine captures constants")
    inits = [lowering._ensure_ir_value(x, a) for x, a in zip(inits, init_avals)]
    return lowering.lower_jaxpr_to_triton_ir(ctx.context, closed.jaxpr, None, *inits, *reduced)


def register() -> bool:
    """Add the rule to Pallas's Triton lowering (idempotent). False where this JAX lacks the internals
    it needs (then a kernel using ``lax.reduce`` fails to lower, as it would without this module)."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False
    rules = getattr(lowering, "triton_lowering_rules", None)
    if rules is None or not hasattr(lowering, "_reduction_lowering"):
        return False
    if lax.reduce_p not in rules:
        rules[lax.reduce_p] = lambda ctx, *args, **params: _rule(lowering, ctx, *args, **params)
    return True
