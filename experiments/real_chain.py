"""The W_Q-gradient error of every arm's kernel on a trained model's own layer-2 tensors (CPU).

    python -m experiments.real_chain results/repro/<run>/L1_step3000.npz [...] [--arms fa2,fa2-stable]
        [--by-head] [--md FILE]

Input: ``train.probes.save_layer_tensors`` files (q, k, v and the probe loss's dO of one layer, all
heads, as a GPU run computed them: ``SNAP_STEPS=… bash experiments/gpu/repro_seq.sh …``). Each arm's
attention (the jnp executor: the kernels' arithmetic) is re-run on those inputs and its dQ compared
with float64: per causal row, total = q·(dQ_lp − dQ_hp) (the row's share of the error along W_Q in
⟨W_Q, ∂loss/∂W_Q⟩; < 0 grows ‖W_Q‖), its δ part −ε·S̄ (ε = δ_lp − δ_hp, S̄ = Σ P·S) and the rest —
docs/MECHANISM.md §7 on synthetic rows, here on the model's. Rows are split into tied (the "fa2"
tie test on FP32 scores) and tie-free; sums over each (what the gradient receives) and the true
component Σ q·dQ_hp for scale. One snapshot is one batch: a sign is a sample, not a bias.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash as jf
from experiments import arms as registry
from jax_flash import diagnostics as D

# the arms compared by default (experiments/arms.py; their attention arguments)
ARMS = ("fa2", "fa2-stable", "fa2-dpp", "paper", "paper-stable", "paper-dpp", "paper-fp32acc",
        "paper-fp32acc-stable")


def exact_rows(q, k, v, do):
    """float64 per head and causal row: dQ_hp [b, t, H, D], δ_hp, S̄ and the row's max score
    [b, H, t]."""
    q, k, v, do = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, do))
    t = q.shape[1]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p, v)
    dp = np.einsum("bqhd,bkhd->bhqk", do, v)
    delta = np.einsum("bqhd,bqhd->bhq", do, o)
    ds = p * (dp - delta[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, k) / math.sqrt(q.shape[-1])
    s_bar = np.sum(p * np.where(np.isfinite(s), s, 0.0), axis=-1)
    return dq, delta, s_bar, s.max(-1)


def arm_rows(q, k, v, do, **kw):
    """The arm's dQ [b, t, H, D] as its backward returns it and its δ [b, H, t] (jnp executor)."""
    f = lambda q_: jf.attention(q_, k, v, causal=True, impl="jnp", **kw)
    _, vjp = jax.vjp(f, q)
    (dq,) = vjp(do)
    _, dlt = D.flash_stored_o_and_delta(q, k, v, do, causal=True, impl="jnp", **kw)
    return np.asarray(jnp.asarray(dq, jnp.float32), np.float64), np.asarray(dlt, np.float64)


def analyze(tensors, arms=ARMS, by_head=False):
    """Rows of sums per arm (and per head with ``by_head``): total, δ part and rest on tied /
    tie-free rows, Σ q·dQ_hp, and the largest score."""
    q, k, v, do = (tensors[n] for n in ("q", "k", "v", "do"))
    dq_hp, dlt_hp, s_bar, s_max = exact_rows(q, k, v, do)
    q64 = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    tied = np.asarray(D.tied_row_mask(q, k, policy="fa2"))  # [b, H, t]
    own = np.einsum("bqhd,bqhd->bhq", q64, dq_hp)
    groups = [(h, np.s_[:, h]) for h in range(q.shape[2])] if by_head else [(None, np.s_[:])]
    out = []
    for arm in arms:
        dq_lp, dlt_lp = arm_rows(q, k, v, do, **registry.attention_kwargs(arm))
        total = np.einsum("bqhd,bqhd->bhq", q64, dq_lp - dq_hp)
        parts = {"total": total, "δ part": -(dlt_lp - dlt_hp) * s_bar}
        parts["rest"] = total - parts["δ part"]
        for head, sel in groups:
            t_sel = tied[sel]
            row = {"arm": arm, "step": tensors.get("step")} | ({"head": head} if by_head else {})
            row |= {"tied rows": int(t_sel.sum()), "rows": int(t_sel.size),
                    "max score": float(s_max[sel].max()), "Σ q·dQ_hp": float(own[sel].sum())}
            for name, x in parts.items():
                row[f"{name}, tied"] = float(x[sel][t_sel].sum())
                row[f"{name}, tie-free"] = float(x[sel][~t_sel].sum())
            out.append(row)
    return out


def markdown(rows) -> str:
    cols = list(rows[0])
    fmt = lambda v: f"{v:+.3e}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    from train.probes import load_layer_tensors

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="save_layer_tensors .npz files")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--md", default=None, help="also write the table here")
    ap.add_argument("--by-head", action="store_true", help="a row per arm and head")
    args = ap.parse_args(argv)
    rows = []
    for f in args.files:
        rows += [{"file": f, **r} for r in analyze(load_layer_tensors(f), args.arms.split(","),
                                                   by_head=args.by_head)]
    text = markdown(rows)
    print(text, end="")
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
