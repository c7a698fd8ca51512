"""Training probes for the paper's causal chain: ties → biased Ō → biased δ → low-rank accumulation
into dW_Q → growing ‖W_Q‖₂ → blow-up (Qiu & Yao, arXiv 2510.04212).

    from train import gpt2, probes
    gpt2.train(cfg, probes=[probes.CausalChainProbe()])        # with cfg.probe_every > 0

    python -m train.probes --preset tiny-cpu probe_every=25 max_steps=300    # the same from the CLI

A probe is called by ``train.gpt2.train`` every ``cfg.probe_every`` steps as ``probe(step, model,
(x, y))`` with the model after that step's update and the step's first micro-batch (int32
``[batch, seq]``). Each probe runs one jitted function (compiled on the first call, never retraced
while the model's structure and the batch shape stay the same), fetches its results to the host at
once (the model's arrays are donated by the next step) and returns a flat dict of Python floats.

Metric names (layers and heads 0-based, as everywhere in this project: the paper's "layer 2, head 8"
is ``L1/H7``):

================================  ===============================================================
``wq_norm/L{l}/H{h}``             ‖W_Q‖₂ of head h (spectral norm of kernel[:, h·hd:(h+1)·hd]) by
``wk_norm/L{l}/H{h}``             power iteration, warm-started from the previous call's vectors
``wq_norm_max/L{l}``, ``wk_…``    max over heads
``max_logit/L{l}[/H{h}]``         max causal S = q·kᵀ/√d (FP32 from the model's q, k) on the probe
                                  sequences
``tie_frac/L{l}[/H{h}]``          fraction of causal rows whose max is reached by ≥ 2 entries, by
                                  ``jax_flash.tile.tie_count`` of the head's flash policy over the
                                  whole row ("fa2" semantics — bf16(exp(S − max)) == 1 — for heads
                                  that are not flash); masked entries never count
``tie_frac_bf16s/L{l}``           the same fraction when S is rounded to bf16 before the test (what
                                  a probe taking S from a bf16 matmul would count); all heads
``act_rms/L{l}``, ``act_max/L{l}``  RMS and max |·| of the attention input (ln_1 output, compute dtype)
``resid_rms/L{l}``, ``resid_max``  the same for the block's output (residual stream), when the model
                                  captures it (``capture["resid"]``)
``attn_out_rms/L{l}``             RMS of the attention output O (before W_O)
``o_err/L{l}``                    mean signed error O_lp − O_hp of the stored O
``o_err_away/L{l}``               mean of (O_lp − O_hp)·sign(O_hp): > 0 = rounded away from zero
``delta_err/L{l}[/H{h}]``         Σ over probe tokens of δ_lp − δ_hp (below)
``delta_err_abs/L{l}``            Σ |δ_lp − δ_hp| (bias vs noise: |delta_err| / delta_err_abs)
``delta_err_tie/L{l}``            the part of delta_err on the rows tie_frac counts (tied rows)
``wq_grad/L{l}``                  ⟨W_Q, ∂loss/∂W_Q⟩ of the probe loss with the FP32 shadow's dQ
                                  (= Σ q·dQ_hp); < 0: a gradient step grows ‖W_Q‖
``wq_grad_err/L{l}[/H{h}]``       ⟨W_Q, g_lp − g_hp⟩ = Σ q·(dQ_lp − dQ_hp): the component along W_Q
                                  of the error the layer's attention backward puts into W_Q's
                                  gradient (dQ_lp: its own backward on the same q, k, v, dO); < 0
                                  pushes ‖W_Q‖ up — the end of the paper's chain, whatever the cause
                                  (signs as for plain gradient steps; Adam rescales per entry)
``wq_grad_err_delta/L{l}[/H{h}]`` the part of wq_grad_err that comes through δ: −Σ_i (δ_lp − δ_hp)_i·S̄_i,
                                  S̄_i = Σ_j P_ij·S_ij (FP32 softmax); the rest is the recomputed P,
                                  dS's and dQ's own roundings (docs/MECHANISM.md §7)
``delta_err_cum/L{l}[/H{h}]``     running sum of delta_err over this probe's calls (paper Fig. 5a,
                                  sampled every probe_every steps; restarts at 0 on resume)
``probe_loss``, ``probe_time_s``  loss on the probe sequences; wall time of the probe call
================================  ===============================================================

δ definitions, per head: dO is the true cotangent of the layer's attention output for the mean
cross-entropy of the probe sequences (a zero "tap" added to each attention output, differentiated
with ``jax.vjp``: the forward is bitwise the training forward). δ_hp = rowsum(dO ∘ O_hp) with O_hp
the FP32 attention (``jax_flash.reference_attention``) on the same q, k, v. For flash heads δ_lp is
exactly the δ the kernel's backward uses: O as the kernel stores it (the policy's residual dtype)
and the spec's δ mode ("o": rowsum(dO ∘ O_stored); "o_hp" / "dpp": the kernel's alternatives, so
their error is ≈ 0). For other kinds (standard, cudnn, xla, registered) δ_lp = rowsum(dO ∘ O) with
the layer's own output O — the δ a flash backward would form from that O (counterfactual: autodiff
of those kinds does not use it).

Cost: one forward and one activation backward (no parameter gradients) on ``n_seq`` sequences, plus
per layer the FP32 shadow attention and its dQ, one extra flash forward, the layer attention's own
backward for dQ, and the [n_seq, H, T, T] score matrix.
Without probes nothing here runs.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_flash import diagnostics as D
from models import gpt2 as G


# ----------------------------------------------------------------------------- attention taps


@contextlib.contextmanager
def _tapped_attention(taps, plan):
    """While active (i.e. while tracing the model), every attention call ``attend(q, k, v, spec)``
    returns O + tap and records O. ``plan``: the expected calls in order, (layer, h0, h1, spec);
    ``taps``: per layer ``[b, t, n_head, head_dim]``. Yields the list of recorded outputs."""
    saved = dict(G.ATTENTION_FNS)
    outputs = []
    it = iter(plan)

    def wrap(fn):
        def tapped(q, k, v, spec):
            layer, h0, h1, want = next(it)
            if want != spec or q.shape[2] != h1 - h0:
                raise RuntimeError(f"attention calls out of the expected order at layer {layer}")
            o = fn(q, k, v, spec)
            outputs.append(o)
            return o + taps[layer][:, :, h0:h1].astype(o.dtype)

        return tapped

    for kind, fn in saved.items():
        G.ATTENTION_FNS[kind] = wrap(fn)
    try:
        yield outputs
    finally:
        G.ATTENTION_FNS.clear()
        G.ATTENTION_FNS.update(saved)
    if next(it, None) is not None:
        raise RuntimeError("fewer attention calls than expected")


def _plan(model):
    return [
        (l, h0, h1, spec) for l, blk in enumerate(model.blocks) for h0, h1, spec in blk.attn.groups
    ]


_FLASH_FIELDS = ("stable", "beta", "policy", "delta", "impl", "block_q", "block_k")


def chain_tensors(model, x, y):
    """Per-layer tensors of the causal chain on tokens x, targets y ``[b, t]`` (inside jit).

    Returns (loss, layers) with per layer a dict: ``x`` attention input, ``q k v`` [b, t, H, hd],
    ``do`` the loss cotangent of the attention output, ``o_lp`` the O the backward's δ sees, ``o_hp``
    the FP32 shadow, ``dlt_lp`` / ``dlt_hp`` [b, H, t], ``dq_lp`` (dQ from the layer's own attention
    backward) / ``dq_hp`` (from the FP32 shadow) [b, t, H, hd], ``resid`` (block output, if
    captured), and ``groups`` (h0, h1, spec).
    """
    mcfg = model.config
    b, t = x.shape
    n_head, hd = mcfg.n_head, mcfg.head_dim
    dt = jnp.dtype(mcfg.dtype)
    plan = _plan(model)
    taps = [jnp.zeros((b, t, n_head, hd), dt) for _ in range(mcfg.n_layer)]

    def f(taps):
        with _tapped_attention(taps, plan) as outs:
            logits, caps = model(x, return_intermediates=True)
        return G.cross_entropy(logits, y, mcfg.cross_entropy), (caps, outs)

    loss, vjp_fn, (caps, outs) = jax.vjp(f, taps, has_aux=True)
    (dos,) = vjp_fn(jnp.ones_like(loss))
    layers = []
    i = 0
    for l, cap in enumerate(caps):
        q, k, v, do = cap["q"], cap["k"], cap["v"], dos[l]
        o_hp, hp_vjp = jax.vjp(lambda q_: D.hp_attention(q_, k, v), q.astype(jnp.float32))
        (dq_hp,) = hp_vjp(do.astype(jnp.float32))
        o_lp, dlt_lp, dq_lp, groups = [], [], [], []
        for h0, h1, spec in model.blocks[l].attn.groups:
            o = outs[i]
            i += 1
            sl = lambda a: a[:, :, h0:h1]
            if spec.kind == "flash":
                o_st, dlt = D.flash_stored_o_and_delta(
                    sl(q),
                    sl(k),
                    sl(v),
                    sl(do),
                    causal=True,
                    **{f: getattr(spec, f) for f in _FLASH_FIELDS},
                )
            else:
                o_st, dlt = o, D.rowsum_delta(sl(do), o)
            # dQ as training computes it: the layer's attention function differentiated on its own
            # (a flash kernel's backward, or autodiff of the other kinds)
            attend = G.ATTENTION_FNS[spec.kind]
            _, lp_vjp = jax.vjp(lambda q_, spec=spec: attend(q_, sl(k), sl(v), spec), sl(q))
            dq_lp.append(lp_vjp(sl(do).astype(o.dtype))[0].astype(jnp.float32))
            o_lp.append(o_st.astype(jnp.float32))
            dlt_lp.append(dlt)
            groups.append((h0, h1, spec))
        layers.append(
            dict(
                x=cap["x"],
                q=q,
                k=k,
                v=v,
                do=do,
                o_hp=o_hp,
                resid=cap.get("resid"),
                groups=groups,
                o_lp=jnp.concatenate(o_lp, axis=2),
                dlt_lp=jnp.concatenate(dlt_lp, axis=1),
                dlt_hp=D.rowsum_delta(do, o_hp),
                dq_lp=jnp.concatenate(dq_lp, axis=2),
                dq_hp=dq_hp,
            )
        )
    return loss, layers


def _tie_policy(spec):
    return spec.policy if spec.kind == "flash" else "fa2"


# ----------------------------------------------------------------------------- the probe

# Per-layer scalars reported as they are (one value per layer).
_LAYER_SCALARS = ("tie_frac_bf16s", "act_rms", "act_max", "attn_out_rms", "o_err", "o_err_away", "resid_rms", "resid_max")



class CausalChainProbe:
    """All per-layer / per-head metrics of the module docstring in one jitted call.

    n_seq: probe sequences taken from the front of the batch (caps the cost).
    power_iters: power-iteration steps per call (warm-started, so the estimate keeps improving);
        the first call of a probe (a new run, or a resumed one) starts cold and runs ``cold_iters``.
    per_head: also emit the per-head variants of max_logit, tie_frac and delta_err(_cum).
    """

    def __init__(self, n_seq: int = 4, power_iters: int = 16, per_head: bool = True,
                 cold_iters: int = 256):
        self.n_seq, self.power_iters, self.per_head = n_seq, power_iters, per_head
        self.cold_iters = cold_iters
        self._fn = None
        self._graphdef = None
        self._v = None  # (vq, vk) [L, H, hd] warm-start vectors
        self.cum = None  # {"layer": [L], "head": [L, H]} running Σ delta_err (float64)
        self.n_traces = 0
        self.calls = 0

    # -- jitted body
    def _compute(self, graphdef, params, x, y, vq, vk, n_iter):
        self.n_traces += 1  # Python side effect: runs once per trace
        model = nnx.merge(graphdef, params)
        mcfg = model.config
        L, H = mcfg.n_layer, mcfg.n_head
        wq = jnp.stack([G.per_head_weights(params, l, H, "wq") for l in range(L)])
        wk = jnp.stack([G.per_head_weights(params, l, H, "wk") for l in range(L)])
        sq, vq = D.power_iteration(wq, vq, n_iter)  # n_iter traced: the cold call does not retrace
        sk, vk = D.power_iteration(wk, vk, n_iter)

        loss, layers = chain_tensors(model, x, y)
        per = {k: [] for k in ("max_logit", "tie_frac", "delta_err", "delta_err_abs", "delta_err_tie",
                               "wq_grad", "wq_grad_err", "wq_grad_err_delta") + _LAYER_SCALARS}
        for lay in layers:
            q, k = lay["q"], lay["k"]
            per["max_logit"].append(D.max_logit(q, k))
            ties = [
                D.tied_row_mask(q[:, :, h0:h1], k[:, :, h0:h1], policy=_tie_policy(spec))
                for h0, h1, spec in lay["groups"]
            ]
            ties = jnp.concatenate(ties, axis=1)  # [b, H, t]
            per["tie_frac"].append(jnp.mean(ties.astype(jnp.float32), axis=(0, 2)))
            per["tie_frac_bf16s"].append(
                jnp.mean(D.tied_row_mask_rounded_scores(q, k).astype(jnp.float32))
            )
            derr = lay["dlt_lp"] - lay["dlt_hp"]  # [b, H, t]
            per["delta_err"].append(jnp.sum(derr, axis=(0, 2)))
            per["delta_err_abs"].append(jnp.sum(jnp.abs(derr)))
            # the part of Σ δ error carried by tied rows (the paper's mechanism lives there)
            per["delta_err_tie"].append(jnp.sum(jnp.where(ties, derr, 0.0)))
            # ⟨W_Q, ∂L/∂W_Q⟩ per head = Σ over tokens q·dQ (∂L/∂W_Q = xᵀ·dQ and q = x·W_Q): the
            # gradient's component along W_Q, and the part of it the attention backward's error adds
            q32 = q.astype(jnp.float32)
            per["wq_grad"].append(jnp.sum(q32 * lay["dq_hp"], axis=(0, 1, 3)))
            per["wq_grad_err"].append(jnp.sum(q32 * (lay["dq_lp"] - lay["dq_hp"]), axis=(0, 1, 3)))
            # its part that comes through δ: −Σ_i ε_i·S̄_i (docs/MECHANISM.md §7); the rest is the
            # recomputed P, dS's and dQ's own roundings
            per["wq_grad_err_delta"].append(-jnp.sum(derr * D.softmax_mean_score(q, k), axis=(0, 2)))
            xin = lay["x"].astype(jnp.float32)
            per["act_rms"].append(jnp.sqrt(jnp.mean(xin**2)))
            per["act_max"].append(jnp.max(jnp.abs(xin)))
            per["attn_out_rms"].append(jnp.sqrt(jnp.mean(lay["o_lp"] ** 2)))
            oerr = lay["o_lp"] - lay["o_hp"]
            per["o_err"].append(jnp.mean(oerr))
            per["o_err_away"].append(jnp.mean(oerr * jnp.sign(lay["o_hp"])))
            if lay["resid"] is not None:
                r = lay["resid"].astype(jnp.float32)
                per["resid_rms"].append(jnp.sqrt(jnp.mean(r**2)))
                per["resid_max"].append(jnp.max(jnp.abs(r)))
        out = {k: jnp.stack(v) for k, v in per.items() if v}
        out.update(wq_norm=sq, wk_norm=sk, probe_loss=loss)
        return out, (vq, vk)

    def _build(self, graphdef, mcfg):
        self._graphdef = graphdef
        self._fn = jax.jit(functools.partial(self._compute, graphdef))
        shape = (mcfg.n_layer, mcfg.n_head, mcfg.head_dim)
        # a fixed generic start (not orthogonal to any singular vector with probability 1)
        key_q, key_k = jax.random.split(jax.random.key(0))
        self._v = (
            np.asarray(jax.random.normal(key_q, shape)),
            np.asarray(jax.random.normal(key_k, shape)),
        )
        self.cum = {"layer": np.zeros(mcfg.n_layer), "head": np.zeros((mcfg.n_layer, mcfg.n_head))}
        self._cold = True  # start vectors are random: the first call iterates longer

    def __call__(self, step, model, batch) -> dict:
        t0 = time.perf_counter()
        graphdef, state = nnx.split(model)
        params = nnx.to_pure_dict(state)
        if self._fn is None or graphdef != self._graphdef:
            self._build(graphdef, model.config)
        x, y = batch
        n = min(self.n_seq, x.shape[0])
        x = jnp.asarray(np.asarray(x)[:n], jnp.int32)
        y = jnp.asarray(np.asarray(y)[:n], jnp.int32)
        n_iter = self.cold_iters if self._cold else self.power_iters
        out, v = self._fn(params, x, y, *self._v, jnp.int32(n_iter))
        self._cold = False
        # host copies: the same (unsharded numpy) input types on every call, so no retracing
        out, self._v = jax.device_get((out, v))
        self.calls += 1
        return self._metrics(out, time.perf_counter() - t0)

    def _metrics(self, out, dt) -> dict:
        m = {"probe_loss": float(out["probe_loss"])}
        L, H = out["wq_norm"].shape
        derr = np.asarray(out["delta_err"], np.float64)  # [L, H]
        self.cum["head"] += derr
        self.cum["layer"] += derr.sum(axis=1)
        for l in range(L):
            tag = f"L{l}"
            for name in ("wq_norm", "wk_norm"):
                for h in range(H):
                    m[f"{name}/{tag}/H{h}"] = float(out[name][l, h])
                m[f"{name}_max/{tag}"] = float(np.max(out[name][l]))
            m[f"max_logit/{tag}"] = float(np.max(out["max_logit"][l]))
            m[f"tie_frac/{tag}"] = float(np.mean(out["tie_frac"][l]))
            m[f"delta_err/{tag}"] = float(derr[l].sum())
            m[f"delta_err_cum/{tag}"] = float(self.cum["layer"][l])
            m[f"delta_err_abs/{tag}"] = float(out["delta_err_abs"][l])
            m[f"delta_err_tie/{tag}"] = float(out["delta_err_tie"][l])
            m[f"wq_grad/{tag}"] = float(np.sum(out["wq_grad"][l]))
            m[f"wq_grad_err/{tag}"] = float(np.sum(out["wq_grad_err"][l]))
            m[f"wq_grad_err_delta/{tag}"] = float(np.sum(out["wq_grad_err_delta"][l]))
            for name in _LAYER_SCALARS:
                if name in out:
                    m[f"{name}/{tag}"] = float(out[name][l])
            if self.per_head:
                for h in range(H):
                    m[f"max_logit/{tag}/H{h}"] = float(out["max_logit"][l, h])
                    m[f"tie_frac/{tag}/H{h}"] = float(out["tie_frac"][l, h])
                    m[f"delta_err/{tag}/H{h}"] = float(derr[l, h])
                    m[f"delta_err_cum/{tag}/H{h}"] = float(self.cum["head"][l, h])
                    m[f"wq_grad_err/{tag}/H{h}"] = float(out["wq_grad_err"][l, h])
                    m[f"wq_grad_err_delta/{tag}/H{h}"] = float(out["wq_grad_err_delta"][l, h])
        m["probe_time_s"] = dt
        return m


# ----------------------------------------------------------------------------- snapshots (lowrank)


@functools.lru_cache(maxsize=8)
def _snapshot_fn(graphdef, layer: int, head: int):
    def fn(params, x, y):
        model = nnx.merge(graphdef, params)
        _, layers = chain_tensors(model, x, y)
        lay = layers[layer]
        q, k, v = (lay[n][:, :, head].astype(jnp.float32) for n in ("q", "k", "v"))
        s = D.causal_scores(lay["q"][:, :, head : head + 1], lay["k"][:, :, head : head + 1])[:, 0]
        p = jax.nn.softmax(s, axis=-1)  # FP32 P [b, t, t]
        pk = jnp.einsum("bqk,bkd->bqd", p, k, precision=jax.lax.Precision.HIGHEST)
        wq = G.per_head_weights(params, layer, model.config.n_head, "wq")[head]
        return dict(
            x=lay["x"].astype(jnp.float32),
            q=q,
            k=k,
            v=v,
            pk=pk,
            wq=wq,
            delta_err=lay["dlt_lp"][:, head] - lay["dlt_hp"][:, head],
            sm_scale=jnp.float32(1.0 / math.sqrt(q.shape[-1])),
        )

    return jax.jit(fn)


def save_snapshot(model, batch, layer: int, head: int, path, *, n_seq: int = 4, step=None) -> Path:
    """Save, for one layer and head, the ingredients of dW_Q's rank-1 terms on the first ``n_seq``
    sequences of ``batch = (x, y)`` to ``path`` (.npz): ``x`` (attention input, [b, t, n_embd]),
    ``q k v`` and ``pk`` = P·K (FP32 softmax of the causal scores) [b, t, hd], ``delta_err`` =
    δ_lp − δ_hp [b, t] (as in CausalChainProbe), ``wq`` [n_embd, hd], and step / layer / head."""
    graphdef, state = nnx.split(model)
    x, y = batch
    n = min(n_seq, np.asarray(x).shape[0])
    out = _snapshot_fn(graphdef, int(layer), int(head))(
        nnx.to_pure_dict(state),
        jnp.asarray(np.asarray(x)[:n], jnp.int32),
        jnp.asarray(np.asarray(y)[:n], jnp.int32),
    )
    out = {k: np.asarray(v) for k, v in jax.device_get(out).items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, layer=layer, head=head, step=-1 if step is None else step, **out)
    return path


class SnapshotProbe:
    """A probe that calls ``save_snapshot`` at the given steps, to ``out_dir/snap_L{l}_H{h}_step{s}.npz``."""

    def __init__(self, out_dir, layer: int = 1, head: int = 7, steps=(), n_seq: int = 4):
        self.out_dir, self.layer, self.head = Path(out_dir), layer, head
        self.steps, self.n_seq = set(int(s) for s in steps), n_seq
        self.saved: list[Path] = []

    def __call__(self, step, model, batch) -> dict:
        if step not in self.steps:
            return {}
        path = self.out_dir / f"snap_L{self.layer}_H{self.head}_step{step}.npz"
        self.saved.append(
            save_snapshot(model, batch, self.layer, self.head, path, n_seq=self.n_seq, step=step)
        )
        return {}


# ------------------------------------------------------------ a layer's tensors (for CPU analyses)
_TENSORS = ("q", "k", "v", "do")


@functools.lru_cache(maxsize=8)
def _layer_tensors_fn(graphdef, layer: int):
    def fn(params, x, y):
        _, layers = chain_tensors(nnx.merge(graphdef, params), x, y)
        return {n: layers[layer][n] for n in _TENSORS}

    return jax.jit(fn)


def save_layer_tensors(model, batch, layer: int, path, *, n_seq: int = 1, step=None) -> Path:
    """Save one layer's attention inputs q, k, v and the probe loss's cotangent of its output dO, all
    heads, ``[b, t, H, hd]``, as training computed them on the first ``n_seq`` sequences of
    ``batch = (x, y)`` — the inputs on which ``experiments/real_chain.py`` re-runs every arm's kernel
    on a CPU. 16-bit floats are stored as their bits (uint16; ``load_layer_tensors`` restores them):
    GPT-2 small's L1, one sequence: 1.5 MiB per tensor."""
    graphdef, state = nnx.split(model)
    x, y = batch
    n = min(n_seq, np.asarray(x).shape[0])
    out = jax.device_get(_layer_tensors_fn(graphdef, int(layer))(
        nnx.to_pure_dict(state), jnp.asarray(np.asarray(x)[:n], jnp.int32),
        jnp.asarray(np.asarray(y)[:n], jnp.int32)))
    arrays = {}
    for name in _TENSORS:
        a = np.asarray(out[name])
        arrays[name] = a.view(np.uint16) if a.dtype.itemsize == 2 else a
        arrays[f"{name}_dtype"] = np.array(str(a.dtype))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, layer=layer, step=-1 if step is None else step,
                        head_dim=model.config.head_dim, **arrays)
    return path


def load_layer_tensors(path) -> dict:
    """``save_layer_tensors``'s file: q, k, v, dO as jnp arrays in their training dtype, and layer /
    step."""
    f = np.load(path)
    out = {"layer": int(f["layer"]), "step": int(f["step"])}
    for name in _TENSORS:
        dtype = jnp.dtype(str(f[f"{name}_dtype"]))
        a = f[name]
        out[name] = jnp.asarray(a.view(dtype) if dtype.itemsize == 2 else a)
    return out


class LayerTensorProbe:
    """Calls ``save_layer_tensors`` on a fixed batch at the given steps, to
    ``out_dir/L{layer}_step{step}.npz``."""

    def __init__(self, out_dir, batch, layer: int = 1, steps=(), n_seq: int = 1):
        self.out_dir, self.batch, self.layer = Path(out_dir), batch, layer
        self.steps, self.n_seq = set(int(s) for s in steps), n_seq
        self.saved: list[Path] = []

    def __call__(self, step, model, batch) -> dict:
        del batch  # the fixed batch, the same in every arm
        if step in self.steps:
            path = self.out_dir / f"L{self.layer}_step{step}.npz"
            self.saved.append(save_layer_tensors(model, self.batch, self.layer, path,
                                                 n_seq=self.n_seq, step=step))
        return {}


def default_probes(cfg) -> list:
    """The probes ``python -m train.probes`` runs: the causal-chain probe (when probe_every > 0)."""
    return [CausalChainProbe()] if cfg.probe_every else []


def main(argv=None) -> None:
    """``python -m train.probes [--preset P] [key=value ...] [--snapshot L,H,STEP1,STEP2]``: train
    with the causal-chain probe (``probe_every`` defaults to 50 if unset)."""
    import argparse
    import sys

    from train import config as config_lib
    from train import gpt2 as T

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument(
        "--snapshot", default=None, help="layer,head,step[,step...] for lowrank snapshots"
    )
    ns, rest = ap.parse_known_args(argv)
    cfg = T.parse_args(rest)
    if not cfg.probe_every:
        cfg = config_lib.apply_overrides(cfg, ["probe_every=50"])
    probes = default_probes(cfg)
    if ns.snapshot:
        l, h, *steps = (int(s) for s in ns.snapshot.split(","))
        probes.append(SnapshotProbe(Path(cfg.run_dir) / "snapshots", l, h, steps))
    T.run_cli(cfg, probes)  # exit status 2 refused, 3 diverged, 4 stopped by a signal, like train.gpt2


if __name__ == "__main__":
    main()
