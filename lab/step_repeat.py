"""Is a training step a function of its inputs on this device? One step of a small GPT-2 executed
``--repeats`` times from one state and one batch, with and without XLA's deterministic ops (the
``xla_gpu_deterministic_ops`` compiler option), and with ``optim.stack_params`` in each mode: per
state leaf, how many elements differ from the first execution (repeats), and the stacked step's
from the tree step's of the same mode (layouts).

    python -m lab.step_repeat [--repeats 5] [--set KEY=VALUE ...] [--out FILE.json]

The model is the test suite's micro model (vocabulary 512, 2 layers, width 64, 2 × 4 × 32 tokens a
step); ``--set`` overrides more settings. On a CPU every count is 0; on a GPU XLA's scatter, the
token embedding's gradient, adds the rows of repeated tokens with atomics unless asked not to.
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np

MICRO = ("model.vocab_size=512", "model.n_layer=2", "model.n_head=4", "model.n_embd=64",
         "model.block_size=32", "data.batch_size=4", "optim.warmup_steps=0", "optim.lr=1e-2",
         "optim.weight_decay=0.1", "progress=false")
DETERMINISTIC = {"xla_gpu_deterministic_ops": True}


def make(overrides, deterministic: bool, stack: bool):
    """(jitted step, initial state in the step's layout, config)."""
    import jax

    from train import config as C, gpt2 as T, stacked

    extra = ["optim.stack_params=true"] if stack else []
    cfg = C.apply_overrides(C.get_preset("tiny-cpu"), [*MICRO, *overrides, *extra,
                                                       "run_dir=/unused"])
    graphdef, params = T.split_model(T.make_model(cfg))
    tx, schedule = T.make_optimizer(cfg)
    step = jax.jit(functools.partial(T.train_step, graphdef=graphdef, tx=tx, schedule=schedule),
                   compiler_options=DETERMINISTIC if deterministic else None)
    state = T.init_state(cfg, params, tx)
    assert stack == any(isinstance(x, stacked.Stacked) for x in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, stacked.Stacked)))
    return step, state, cfg


def as_tree(state):
    """The state's leaves by path, its stacks viewed as the tree's leaves."""
    import jax

    from train import stacked

    tree = jax.tree.map(stacked.view, state, is_leaf=lambda x: isinstance(x, stacked.Stacked))
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def differing(a: dict, b: dict) -> dict:
    """{leaf: elements that differ} for the leaves where any does (NaNs equal to NaNs)."""
    out = {}
    for k in a:
        n = int(np.sum(~((a[k] == b[k]) | (np.isnan(a[k]) & np.isnan(b[k])))))
        if n:
            out[k] = n
    return out


def batch(cfg, seed: int = 0):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    x = rng.integers(0, cfg.model.vocab_size, (2, cfg.data.batch_size, cfg.model.block_size + 1))
    return jnp.asarray(x[..., :-1], jnp.int32), jnp.asarray(x[..., 1:], jnp.int32)


def run(repeats: int = 5, overrides=()) -> dict:
    import jax

    rec = {"repeats": repeats, "overrides": list(overrides), "jax_version": jax.__version__,
           "device": jax.devices()[0].device_kind, "modes": {}}
    for deterministic in (False, True):
        firsts = {}
        mode = {}
        for stack in (False, True):
            step, state, cfg = make(overrides, deterministic, stack)
            b = batch(cfg)
            outs = [as_tree(jax.block_until_ready(step(jax.tree.map(jax.numpy.copy, state),
                                                       b)[0])) for _ in range(repeats)]
            firsts[stack] = outs[0]
            mode["stacked" if stack else "tree"] = {
                "repeats_differing": [differing(outs[0], o) for o in outs[1:]]}
        mode["stacked_vs_tree"] = differing(firsts[False], firsts[True])
        rec["modes"]["deterministic" if deterministic else "default"] = mode
    return rec


def table(rec: dict) -> str:
    lines = [f"One step of the micro model, {rec['repeats']} executions each, {rec['device']}, "
             f"jax {rec['jax_version']}: elements differing from the first execution "
             "(leaves: count)", "", "| mode | layout | repeats | stacked vs tree |",
             "|---|---|---|---|"]
    fmt = lambda d: "; ".join(f"{k}: {v}" for k, v in d.items()) or "none"
    for name, mode in rec["modes"].items():
        for layout in ("tree", "stacked"):
            reps = " / ".join(fmt(d) for d in mode[layout]["repeats_differing"]) or "—"
            vs = fmt(mode["stacked_vs_tree"]) if layout == "stacked" else ""
            lines.append(f"| {name} | {layout} | {reps} | {vs} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None)
    ap.add_argument("--from-json", default=None, help="print a saved --out file")
    args = ap.parse_args(argv)
    if args.from_json:
        rec = json.loads(open(args.from_json).read())
    else:
        rec = run(args.repeats, args.set)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rec, f, indent=1)
    print(table(rec))


if __name__ == "__main__":
    main()
