"""Parameters held as one array per (shape, dtype): ``optim.stack_params``.

A jitted call pays the host for every array it takes and returns (parsing each argument, creating
each output) before and after the device's work; a step waited for cannot hide it. GPT-2 small's
state is 301 arrays — 99 parameters, their two Adam moments, counters — for which the host trace
of one H200 step shows 0.16 ms parsing and 0.15 ms creating outputs a call. Stacked, the same
numbers are 6 parameter arrays (every leaf of a shape stacked along a new first axis, in the
tree's order) and 22 in all.

The formulas are the same element by element: the model sees each leaf as a slice of its stack
(``view``); the step takes the gradient of those leaves, accumulates it over micro-batches as the
tree run does, and only then stacks it (an earlier stack changes which additions XLA fuses, and so
their order); the optimizer's update, elementwise, runs on the stacks; the one reduction, the
gradient's global norm, is taken over the leaves' views in the tree's order (``clip_by_global_norm``).
What can differ is where the compiler contracts a multiply and an add into one FMA: a moment
update β·m + (1 − β)·x compiled in another fusion may fuse the other product (measured on a CPU:
β₂·ν fused on the tree, (1 − β₂)·g² on the stacks). So the first step from fresh moments is
bitwise the tree's, loss and gradient norm of a step from the same state too, and each later
update of a moment can differ by about one rounding (``tests/test_stacked.py`` derives the
bounds): an option that changes last bits, off by default.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.tree_util import DictKey, register_pytree_with_keys


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which leaves of a tree share a stack: ``groups`` pairs a stack's name with the indices of its
    leaves in the tree's flattening order (its first axis follows that order)."""

    treedef: jax.tree_util.PyTreeDef
    groups: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, tree) -> Layout:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        groups: dict[str, list[int]] = {}
        for i, leaf in enumerate(leaves):
            shape = "x".join(map(str, leaf.shape)) or "scalar"
            groups.setdefault(f"{jnp.dtype(leaf.dtype).name}_{shape}", []).append(i)
        return cls(treedef, tuple((name, tuple(idx)) for name, idx in groups.items()))

    @functools.cached_property  # read on every flatten: each jitted call's arguments
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.groups)


class Stacked:
    """A tree's leaves as stacks (``Layout``), a pytree whose leaves are the stacks: optax, jit,
    donation and Orbax see ~6 arrays where the tree has ~100; ``view`` gives the tree back."""

    def __init__(self, stacks: dict, layout: Layout):
        self.stacks, self.layout = stacks, layout

    def __repr__(self):
        shapes = {k: getattr(v, "shape", v) for k, v in self.stacks.items()}
        return f"Stacked({shapes})"


def _flatten(s: Stacked):
    return [(DictKey(name), s.stacks[name]) for name in s.layout.names], s.layout


def _unflatten(layout: Layout, children) -> Stacked:
    return Stacked(dict(zip(layout.names, children)), layout)


register_pytree_with_keys(Stacked, _flatten, _unflatten)


def stack(tree, layout: Layout | None = None) -> Stacked:
    """``tree``'s leaves stacked by (shape, dtype) in the tree's order, or as ``layout`` says."""
    layout = layout or Layout.of(tree)
    leaves = layout.treedef.flatten_up_to(tree)
    return Stacked({name: jnp.stack([leaves[i] for i in idx]) for name, idx in layout.groups},
                   layout)


@jax.custom_vjp
def _split(x):
    return tuple(x[i] for i in range(x.shape[0]))


def _split_fwd(x):
    return _split(x), None


def _split_bwd(_, cotangents):
    # the leaves' gradients stacked as their values are: one concatenation, where autodiff's own
    # transpose of each slice would pad it to the stack's size and add the pads
    return (jnp.stack(cotangents),)


_split.defvjp(_split_fwd, _split_bwd)


def view(params):
    """The tree a ``Stacked`` holds (each leaf a slice of its stack; differentiable, the gradient
    stacked); anything else as it is."""
    if not isinstance(params, Stacked):
        return params
    layout = params.layout
    leaves = [None] * layout.treedef.num_leaves
    for name, idx in layout.groups:
        for i, leaf in zip(idx, _split(params.stacks[name])):
            leaves[i] = leaf
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm``'s arithmetic with the norm taken over ``view(updates)``: the
    leaves' sums of squares in the tree's order whether the updates are stacked or not, then each
    element kept where the norm is below ``max_norm`` and scaled by max_norm / norm elsewhere."""

    def update(updates, state, params=None):
        del params
        g_norm = optax.tree.norm(view(updates))
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip(t):
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)
