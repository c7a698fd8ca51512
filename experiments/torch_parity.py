"""CPU parity check, op by op, between our Flax NNX GPT-2 (models/gpt2.py) and a PyTorch GPT-2 with
nanoGPT's semantics, given identical weights and inputs.

    PYTHONPATH=. /work/torchvenv/bin/python -m experiments.torch_parity [--gpt2-small] [--out PATH]
    # what docs/results/torch-parity-cpu.json holds (about 2 minutes on 2 cores):
    PYTHONPATH=. /work/torchvenv/bin/python -m experiments.torch_parity --extra-attn xla,flash \
        --gpt2-small --gpt2-parts a,b,d

Needs torch (CPU) next to this project's jax/flax/optax; the main venv has no torch, so run it from
a venv that has both (the versions used are recorded in the JSON).

The PyTorch side (``TorchGPT``, written here) follows nanoGPT's model.py: pre-LN blocks, LayerNorm
without bias (eps 1e-5), exact-erf GELU (``nn.GELU()``), no biases, tied wte / lm_head, learned wpe,
one fused ``c_attn`` whose 3*n_embd output splits into q, k, v in that order, causal attention
scaled by 1/sqrt(head_dim), ``c_proj`` residual projections. Our JAX init is copied into it
(``c_attn.weight = concat(wq, wk, wv).T``, every other kernel transposed), and the gradients are
mapped back to our layout, so every tensor is compared under its JAX name.

Parts (``--parts``, comma separated):
  a  FP32: loss, logits, every block's output (the residual stream) and every parameter gradient;
     JAX compute dtype float32 with "standard" attention vs torch FP32 with SDPA's math backend.
     The same again in float64 (``jax.enable_x64``, torch .double(); models.gpt2's hard-coded FP32
     for LayerNorm / GELU / logits / cross-entropy is raised to float64 for that run only): there
     rounding is ~1e-16, so anything above ~1e-10 is a real semantic difference.
     ``--extra-attn xla,flash`` repeats the FP32 run with other JAX attention kinds.
  b  BF16 mixed precision as trained: our default dtypes (FP32 master weights, bf16 matmuls) vs
     torch ``autocast(cpu, bfloat16)``; for logits_dtype float32 and bfloat16 (nanoGPT's lm_head
     output is bf16 under autocast), torch attention via SDPA math (on CPU it upcasts bf16 q, k, v
     to FP32 and rounds O once) and via nanoGPT's manual (non-flash) path.
     Each side is also compared with the FP32 torch run, to put the JAX-vs-torch gap in scale.
  c  Optimizer: (c1) train/gpt2.py's jitted ``train_step`` with ``make_optimizer`` (clip 1.0, AdamW
     betas (0.9, 0.95), eps 1e-8, wd 0, nanoGPT lr schedule) vs ``torch.optim.AdamW`` +
     ``clip_grad_norm_(1.0)`` + nanoGPT's ``get_lr`` for steps 0..3 in FP32, params compared after
     every step; (c2) the optimizer alone: the same (torch) gradients fed to both optimizers.
     Also our ``lr_schedule`` against nanoGPT's get_lr over a whole run.
  d  Init statistics: std of every parameter of our init vs nanoGPT's rules (N(0, 0.02) Linear and
     Embedding, N(0, 0.02/sqrt(2*n_layer)) for the c_proj residual projections, LayerNorm weight 1),
     with torch's own init (nanoGPT rules, run here) alongside.
  ln LayerNorm variance: ours (flax, ``use_fast_variance=False`` since this check found flax's
     default one-pass E[x^2] - E[x]^2 losing digits) and torch's, each against float64, on rows with
     a large common offset (mean^2 >> var) and on rows with one huge outlier feature.

Differences are reported per tensor as rel_max = max|ours - torch| / max|torch| and
rel_l2 = ||ours - torch|| / ||torch||. Results go to ``--out`` (JSON) and a summary to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F
from flax import nnx
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.gpt2 import GPT, GPTConfig, cross_entropy
from train.config import OptimConfig, TrainConfig
from train.gpt2 import init_state, lr_schedule, make_optimizer, split_model, train_step

DEFAULT_OUT = os.path.join("docs", "results", "torch-parity-cpu.json")
SMALL = {"vocab_size": 512, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64}
GPT2_SMALL = {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}


# ----------------------------------------------------------------------------- PyTorch reference


class TorchLayerNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)


DELTA_CHUNK = 128  # query rows per step of the written-out backward


def _attention_rows(q, k, v, scale):
    """Causal attention in FP32 (FP64 for FP64 inputs): O in q's dtype and L = logsumexp of the
    scaled scores per row, [B, H, T] — what FA2's forward returns, off CUDA."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    t = q.shape[2]
    s = s.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=q.device)), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse[..., None]) @ v.to(acc)).to(q.dtype), lse


def fa2_forward(q, k, v, scale):
    """Causal O and L as FlashWithDelta's forward saves them: SDPA's FlashAttention-2 kernel on
    CUDA, ``_attention_rows`` elsewhere."""
    if q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)[:2]
    return _attention_rows(q, k, v, scale)


class FlashWithDelta(torch.autograd.Function):
    """Causal attention with FA2's forward (SDPA's FlashAttention-2 kernel on CUDA; the same O and L
    computed in FP32 elsewhere) and FA2's backward arithmetic written out in PyTorch, with the δ of
    dS = P∘(dP − δ) chosen: "o" = rowsum(dO∘O) with the stored O, as the kernel computes it; "dpp" =
    rowsum(dP∘P), the fix of arXiv 2510.04212 (equal to it in exact arithmetic). P is recomputed
    from L; P and dS are rounded to the inputs' dtype before their products (dV = Pᵀ·dO,
    dK = dSᵀ·Q, dQ = dS·K), every sum in FP32; query rows go in chunks of ``DELTA_CHUNK``.
    ``compiled``: the backward through ``torch.compile`` (see ``compiled_written_out_grads``)."""

    @staticmethod
    def forward(ctx, q, k, v, delta, compiled=False):
        if delta not in ("o", "dpp"):
            raise ValueError(f"delta must be 'o' or 'dpp', got {delta!r}")
        scale = q.shape[-1] ** -0.5
        out, lse = fa2_forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.delta, ctx.scale, ctx.compiled = delta, scale, compiled
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        # every product's operands are representable in q's dtype: TF32 multiplies them exactly
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            grads = compiled_written_out_grads() if ctx.compiled else written_out_grads
            dq, dk, dv = grads(q, k, v, o, lse, do, ctx.delta, ctx.scale)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        return dq, dk, dv, None, None


def written_out_grads(q, k, v, o, lse, do, delta: str, scale: float, chunk: int = DELTA_CHUNK):
    """FlashWithDelta's backward as a function of the saved tensors: dQ, dK, dV in q's dtype."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf, dof = (x.to(acc) for x in (q, k, v, do))
    t = q.shape[2]
    dq, dk, dv = torch.empty_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    delta_o = (dof * o.to(acc)).sum(-1, keepdim=True) if delta == "o" else None
    rnd = lambda x: x.to(q.dtype).to(acc)
    for r0 in range(0, t, chunk):
        r1 = min(t, r0 + chunk)  # causal: these rows see keys [0, r1)
        rows = torch.arange(r0, r1, device=q.device)[:, None]
        seen = rows >= torch.arange(r1, device=q.device)[None, :]
        s = (qf[:, :, r0:r1] @ kf[:, :, :r1].transpose(-2, -1)) * scale
        p = torch.exp(s - lse[:, :, r0:r1, None].to(acc)).masked_fill(~seen, 0.0)
        dp = dof[:, :, r0:r1] @ vf[:, :, :r1].transpose(-2, -1)
        dlt = (dp * p).sum(-1, keepdim=True) if delta_o is None else delta_o[:, :, r0:r1]
        ds = rnd(p * (dp - dlt))
        dv[:, :, :r1] += rnd(p).transpose(-2, -1) @ dof[:, :, r0:r1]
        dk[:, :, :r1] += ds.transpose(-2, -1) @ qf[:, :, r0:r1]
        dq[:, :, r0:r1] = ds @ kf[:, :, :r1]
    return (dq * scale).to(q.dtype), (dk * scale).to(k.dtype), dv.to(v.dtype)


@functools.cache
def compiled_written_out_grads(emulate_precision_casts: bool = True):
    """``written_out_grads`` through ``torch.compile``, built once: the elementwise work between
    the products fused. Inductor's ``emulate_precision_casts`` keeps every BF16 rounding of P and dS
    (without it they are skipped inside fusions); exp, multiply-adds and row sums may still round
    differently in the last FP32 bits (``python -m lab.twin_backward`` measures how far and how
    fast). Opt-in: the twin's runs so far used the eager backward."""
    return torch.compile(written_out_grads, dynamic=False,
                         options={"emulate_precision_casts": emulate_precision_casts})


# eager under torch.compile: its backward sets the TF32 switch and loops over row chunks in Python
_flash_with_delta = torch.compiler.disable(
    lambda q, k, v, delta, compiled=False: FlashWithDelta.apply(q, k, v, delta, compiled))


class TorchAttention(nn.Module):
    def __init__(self, d, n_head, block_size, kind, compiled_backward=False):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.n_head, self.kind, self.compiled_backward = n_head, kind, compiled_backward
        self.register_buffer(
            "mask", torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        )

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.kind in ("flash-o", "flash-dpp"):  # FA2's forward, its backward written out
            y = _flash_with_delta(q, k, v, self.kind.removeprefix("flash-"), self.compiled_backward)
        elif self.kind in ("sdpa", "flash"):  # "flash": SDPA's FlashAttention-2 backend (GPU)
            backend = SDPBackend.FLASH_ATTENTION if self.kind == "flash" else SDPBackend.MATH
            with sdpa_kernel([backend]):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # nanoGPT's non-flash path
            s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            s = s.masked_fill(~self.mask[:t, :t], float("-inf"))
            # CUDA autocast runs softmax in FP32 (CPU autocast would not): emulate the GPU policy.
            p = F.softmax(s.float(), dim=-1)
            y = p @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class TorchMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class TorchBlock(nn.Module):
    def __init__(self, c, kind, compiled_backward=False):
        super().__init__()
        self.ln_1 = TorchLayerNorm(c["n_embd"])
        self.attn = TorchAttention(c["n_embd"], c["n_head"], c["block_size"], kind, compiled_backward)
        self.ln_2 = TorchLayerNorm(c["n_embd"])
        self.mlp = TorchMLP(c["n_embd"])

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    def __init__(self, c, kind="sdpa", compiled_backward=False):
        """``compiled_backward``: the flash-o / flash-dpp backward through ``torch.compile``."""
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c["vocab_size"], c["n_embd"])
        self.wpe = nn.Embedding(c["block_size"], c["n_embd"])
        self.h = nn.ModuleList([TorchBlock(c, kind, compiled_backward) for _ in range(c["n_layer"])])
        self.ln_f = TorchLayerNorm(c["n_embd"])
        self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def init_nanogpt(self):
        """nanoGPT's rules: N(0, 0.02) for Linear and Embedding, then 0.02/sqrt(2L) for c_proj."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.c["n_layer"]))

    def forward(self, idx, targets, full: bool = True):
        """(loss, logits, block outputs); only the loss when ``full`` is False (training)."""
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        blocks = []
        for block in self.h:
            x = block(x)
            blocks.append(x)
        logits = self.lm_head(self.ln_f(x))
        # autocast's cross_entropy upcasts bf16 logits to FP32; keep float64 in the float64 run
        lf = logits if logits.dtype == torch.float64 else logits.float()
        loss = F.cross_entropy(lf.view(-1, lf.size(-1)), targets.reshape(-1))
        return (loss, logits, blocks) if full else loss


def load_into_torch(tm: TorchGPT, flat: dict[str, np.ndarray], dtype=torch.float32):
    """Copy our params (flat JAX names) into the torch module; kernel [in, out] = weight.T."""
    t = lambda a: torch.from_numpy(np.array(a, copy=True)).to(dtype)
    with torch.no_grad():
        tm.wte.weight.copy_(t(flat["wte.embedding"]))
        tm.wpe.weight.copy_(t(flat["wpe.embedding"]))
        tm.ln_f.weight.copy_(t(flat["ln_f.scale"]))
        for i, blk in enumerate(tm.h):
            p = f"blocks.{i}."
            qkv = [flat[p + f"attn.{w}.kernel"] for w in ("wq", "wk", "wv")]
            blk.attn.c_attn.weight.copy_(t(np.concatenate(qkv, axis=1).T))
            blk.attn.c_proj.weight.copy_(t(flat[p + "attn.wo.kernel"].T))
            blk.mlp.c_fc.weight.copy_(t(flat[p + "mlp.fc.kernel"].T))
            blk.mlp.c_proj.weight.copy_(t(flat[p + "mlp.proj.kernel"].T))
            blk.ln_1.weight.copy_(t(flat[p + "ln_1.scale"]))
            blk.ln_2.weight.copy_(t(flat[p + "ln_2.scale"]))


def torch_to_flat(tm: TorchGPT, grads: bool = False) -> dict[str, np.ndarray]:
    """Torch params (or their .grad) in our layout and names (the inverse of load_into_torch)."""
    # a copy: .double().numpy() of a float64 tensor would alias it (and see later in-place clips)
    g = lambda p: np.array((p.grad if grads else p).detach().numpy(), np.float64, copy=True)
    d = tm.c["n_embd"]
    out = {
        "wte.embedding": g(tm.wte.weight),
        "wpe.embedding": g(tm.wpe.weight),
        "ln_f.scale": g(tm.ln_f.weight),
    }
    for i, blk in enumerate(tm.h):
        p = f"blocks.{i}."
        w = g(blk.attn.c_attn.weight)
        for j, name in enumerate(("wq", "wk", "wv")):
            out[p + f"attn.{name}.kernel"] = w[j * d : (j + 1) * d].T
        out[p + "attn.wo.kernel"] = g(blk.attn.c_proj.weight).T
        out[p + "mlp.fc.kernel"] = g(blk.mlp.c_fc.weight).T
        out[p + "mlp.proj.kernel"] = g(blk.mlp.c_proj.weight).T
        out[p + "ln_1.scale"] = g(blk.ln_1.weight)
        out[p + "ln_2.scale"] = g(blk.ln_2.weight)
    return out


# ----------------------------------------------------------------------------- helpers


def flatten(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    name = lambda path: ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return {name(p): np.asarray(v) for p, v in leaves}


def diff(a, b) -> dict:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = np.abs(a - b)
    return {
        "rel_max": float(d.max() / max(np.abs(b).max(), 1e-300)),
        "rel_l2": float(np.linalg.norm(d) / max(np.linalg.norm(b), 1e-300)),
        "abs_max": float(d.max()),
    }


def diff_dicts(ours: dict, theirs: dict) -> dict:
    per = {k: diff(ours[k], theirs[k]) for k in theirs}
    worst = max(per, key=lambda k: per[k]["rel_max"])
    return {
        "worst": worst,
        "worst_rel_max": per[worst]["rel_max"],
        "max_rel_l2": max(v["rel_l2"] for v in per.values()),
        "per_tensor": per,
    }


def batch(rng, vocab, b, t):
    tok = rng.integers(0, vocab, size=(b, t + 1), dtype=np.int32)
    return tok[:, :-1], tok[:, 1:]


def jax_fwd_bwd(graphdef_params, x, y):
    """loss, logits, block outputs and grads of our model on (x, y) with the given params."""
    graphdef, params = graphdef_params

    def f(params):
        logits, caps = nnx.merge(graphdef, params)(x, return_intermediates=True)
        return cross_entropy(logits, y), (logits, [c["resid"] for c in caps])

    (loss, (logits, blocks)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return float(loss), np.asarray(logits, np.float32), [np.asarray(b) for b in blocks], flatten(grads)


def torch_fwd_bwd(tm: TorchGPT, x, y, autocast: bool = False):
    tm.zero_grad(set_to_none=True)
    xt, yt = torch.from_numpy(x).long(), torch.from_numpy(y).long()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, logits, blocks = tm(xt, yt)
    loss.backward()
    to_np = lambda z: z.detach().double().numpy()
    return loss.item(), to_np(logits), [to_np(b) for b in blocks], torch_to_flat(tm, grads=True)


def make_jax(mc: dict, seed: int, **kw):
    cfg = GPTConfig(**mc, **kw)
    graphdef, params = split_model(GPT(cfg, rngs=nnx.Rngs(seed)))
    return cfg, graphdef, params


def with_params(cfg, params_flat_src, dtype):
    """(graphdef, params) of a model of ``cfg`` holding the given flat params cast to ``dtype``."""
    graphdef, params = split_model(GPT(cfg, rngs=nnx.Rngs(0)))
    treedef = jax.tree_util.tree_structure(params)
    new = [jnp.asarray(params_flat_src[n], dtype) for n in flatten(params)]  # same leaf order
    return graphdef, jax.tree_util.tree_unflatten(treedef, new)


# ----------------------------------------------------------------------------- parts


class _Float64Jnp:
    """Stands in for ``jnp`` inside models.gpt2 during the float64 run: the model pins LayerNorm,
    GELU, the logits' accumulation and the cross-entropy to ``jnp.float32``; this raises exactly
    those to float64 and leaves every other op as it is, so the float64 run is the same code."""

    float32 = jnp.float64

    def __getattr__(self, name):
        return getattr(jnp, name)


@contextlib.contextmanager
def float64_model():
    import models.gpt2 as mg

    old = mg.jnp
    mg.jnp = _Float64Jnp()
    try:
        with jax.enable_x64(True):
            yield
    finally:
        mg.jnp = old


def part_a(mc, seed, b, t, fp64=True, extra_kinds=()):
    """FP32 (and float64) forward/backward parity."""
    rng = np.random.default_rng(seed + 1)
    x, y = batch(rng, mc["vocab_size"], b, t)
    out = {}
    runs = [("fp32", "float32", torch.float32, "standard")]
    runs += [(f"fp32_{k}", "float32", torch.float32, k) for k in extra_kinds]
    if fp64:
        runs.append(("fp64", "float64", torch.float64, "standard"))
    _, _, p0 = make_jax(mc, seed, dtype="float32")
    flat0 = flatten(p0)
    for name, jdt, tdt, kind in runs:
        t0 = time.perf_counter()
        ctx = float64_model() if jdt == "float64" else contextlib.nullcontext()
        with ctx, jax.default_matmul_precision("highest"):
            cfg = GPTConfig(**mc, dtype=jdt, param_dtype=jdt, attention=kind)
            gp = with_params(cfg, flat0, jdt)
            jl, jlog, jblocks, jgrads = jax_fwd_bwd(gp, x, y)
        tm = TorchGPT(mc, "sdpa").to(tdt)
        load_into_torch(tm, flat0, tdt)
        tl, tlog, tblocks, tgrads = torch_fwd_bwd(tm, x, y)
        out[name] = {
            "jax_attention": kind,
            "loss_jax": jl,
            "loss_torch": tl,
            "loss_rel": abs(jl - tl) / abs(tl),
            "logits": diff(jlog, tlog),
            "blocks": [diff(a, c) for a, c in zip(jblocks, tblocks)],
            "grads": diff_dicts(jgrads, tgrads),
            "time_s": time.perf_counter() - t0,
        }
    return out


def part_b(mc, seed, b, t):
    """BF16 mixed precision: our default dtypes vs torch autocast bf16."""
    rng = np.random.default_rng(seed + 2)
    x, y = batch(rng, mc["vocab_size"], b, t)
    _, _, p0 = make_jax(mc, seed, dtype="float32")
    flat0 = flatten(p0)
    # FP32 truth for scale: torch FP32
    tm32 = TorchGPT(mc, "sdpa")
    load_into_torch(tm32, flat0)
    rl, rlog, _, rgrads = torch_fwd_bwd(tm32, x, y)
    torch_runs = {}
    for kind in ("sdpa", "manual"):
        tm = TorchGPT(mc, kind)
        load_into_torch(tm, flat0)
        torch_runs[kind] = torch_fwd_bwd(tm, x, y, autocast=True)
    out = {
        "fp32_reference_loss": rl,
        "torch_vs_fp32": {
            k: {
                "loss_rel": abs(v[0] - rl) / rl,
                "logits": diff(v[1], rlog),
                "grads_max_rel_l2": diff_dicts(v[3], rgrads)["max_rel_l2"],
            }
            for k, v in torch_runs.items()
        },
    }
    for ldt in ("float32", "bfloat16"):
        cfg = GPTConfig(**mc, logits_dtype=ldt)  # default dtypes: bf16 compute, FP32 params
        gp = with_params(cfg, flat0, "float32")
        jl, jlog, jblocks, jgrads = jax_fwd_bwd(gp, x, y)
        rec = {
            "loss_jax": jl,
            "vs_fp32": {
                "loss_rel": abs(jl - rl) / rl,
                "logits": diff(jlog, rlog),
                "grads_max_rel_l2": diff_dicts(jgrads, rgrads)["max_rel_l2"],
            },
        }
        for kind, (tl, tlog, tblocks, tgrads) in torch_runs.items():
            g = diff_dicts(jgrads, tgrads)
            rec[f"vs_torch_{kind}"] = {
                "loss_torch": tl,
                "loss_rel": abs(jl - tl) / abs(tl),
                "logits": diff(jlog, tlog),
                "blocks_rel_l2": [diff(a, c)["rel_l2"] for a, c in zip(jblocks, tblocks)],
                "grads_worst": g["worst"],
                "grads_worst_rel_max": g["worst_rel_max"],
                "grads_max_rel_l2": g["max_rel_l2"],
                "grads_rel_l2": {k: v["rel_l2"] for k, v in g["per_tensor"].items()},
            }
        out[f"jax_logits_{ldt}"] = rec
    return out


def nanogpt_lr(it, lr, warmup, decay, min_lr):
    """nanoGPT train.py get_lr, verbatim in behaviour."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    ratio = (it - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def part_c(mc, seed, b, t, steps=4):
    """train_step (optax chain of train/gpt2.py) vs torch AdamW + clip_grad_norm_, FP32."""
    oc = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=6)
    tc = TrainConfig(model=GPTConfig(**mc, dtype="float32"), optim=oc, max_steps=6, seed=seed)
    out = {
        "optim": {
            k: getattr(oc, k)
            for k in (
                "lr",
                "min_lr",
                "warmup_steps",
                "decay_steps",
                "b1",
                "b2",
                "eps",
                "weight_decay",
                "clip",
            )
        }
    }

    # the schedule over a whole run, and past decay_steps
    lc = TrainConfig(
        optim=OptimConfig(lr=6e-4, min_lr=6e-5, warmup_steps=200, decay_steps=5000), max_steps=5000
    )
    sched = lr_schedule(lc)
    its = np.arange(0, 6000, 7)
    ours = np.asarray(jax.vmap(sched)(jnp.asarray(its)))
    ref = np.array([nanogpt_lr(int(i), 6e-4, 200, 5000, 6e-5) for i in its])
    out["lr_schedule_max_rel"] = float(np.max(np.abs(ours - ref) / ref))

    with jax.default_matmul_precision("highest"):
        graphdef, params = split_model(GPT(tc.model, rngs=nnx.Rngs(seed)))
        tx, schedule = make_optimizer(tc)
        state = init_state(tc, params, tx)
        step_fn = jax.jit(
            functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=schedule)
        )
        flat0 = flatten(params)
        tm = TorchGPT(mc, "sdpa")
        load_into_torch(tm, flat0)
        opt = torch.optim.AdamW(
            tm.parameters(),
            lr=oc.lr,
            betas=(oc.b1, oc.b2),
            eps=oc.eps,
            weight_decay=oc.weight_decay,
        )
        rng = np.random.default_rng(seed + 3)
        recs = []
        for it in range(steps):
            x, y = batch(rng, mc["vocab_size"], b, t)
            state, m = step_fn(state, (x[None], y[None]))
            lr = nanogpt_lr(it, oc.lr, oc.warmup_steps, oc.decay_steps, oc.min_lr)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss, _, _ = tm(torch.from_numpy(x).long(), torch.from_numpy(y).long())
            loss.backward()
            gn = float(torch.nn.utils.clip_grad_norm_(tm.parameters(), oc.clip))
            opt.step()
            ours, theirs = flatten(state["params"]), torch_to_flat(tm)
            upd = diff_dicts(
                {k: ours[k] - flat0[k] for k in ours}, {k: theirs[k] - flat0[k] for k in theirs}
            )
            # elements whose update differs by more than 1% of an lr-sized step (Adam's unit)
            far = sum(int((np.abs((ours[k] - theirs[k])) > 0.01 * lr).sum()) for k in ours)
            recs.append(
                {
                    "step": it,
                    "lr_ours": float(m["lr"]),
                    "lr_nanogpt": lr,
                    "loss_ours": float(m["loss"]),
                    "loss_torch": loss.item(),
                    "grad_norm_ours": float(m["grad_norm"]),
                    "grad_norm_torch": gn,
                    "params_worst_rel_max": diff_dicts(ours, theirs)["worst_rel_max"],
                    "update_worst": upd["worst"],
                    "update_worst_rel_max": upd["worst_rel_max"],
                    "update_max_rel_l2": upd["max_rel_l2"],
                    "update_abs_max_in_lr_units": max(
                        v["abs_max"] for v in upd["per_tensor"].values()
                    )
                    / lr,
                    "n_elements_off_by_1pct_lr": far,
                }
            )
        out["end_to_end"] = recs

    for name, dt in (("fp32", "float32"), ("fp64", "float64")):
        out[f"same_grads_{name}"] = optimizer_same_grads(mc, seed, b, t, tc, steps, dt)
    return out


def optimizer_same_grads(mc, seed, b, t, tc, steps, dtype):
    """c2: make_optimizer's chain vs torch AdamW + clip_grad_norm_, fed the same (torch) gradients.
    In float64 the only differences left are FP32 lr values (our schedule) and torch's 1e-6 in the
    clip coefficient."""
    oc = tc.optim
    tdt = {"float32": torch.float32, "float64": torch.float64}[dtype]
    x, y = batch(np.random.default_rng(seed + 4), mc["vocab_size"], b, t)
    with jax.enable_x64(dtype == "float64"):
        tx, _ = make_optimizer(tc)
        _, params = split_model(GPT(tc.model, rngs=nnx.Rngs(seed)))
        flat0 = flatten(params)
        treedef = jax.tree_util.tree_structure(params)
        names = list(flat0)
        params = jax.tree_util.tree_unflatten(
            treedef, [jnp.asarray(flat0[n], dtype) for n in names]
        )
        flat0 = flatten(params)
        tm = TorchGPT(mc, "sdpa").to(tdt)
        load_into_torch(tm, flat0, tdt)
        opt = torch.optim.AdamW(
            tm.parameters(),
            lr=oc.lr,
            betas=(oc.b1, oc.b2),
            eps=oc.eps,
            weight_decay=oc.weight_decay,
        )
        opt_state = tx.init(params)
        recs = []
        for it in range(steps):
            tm.zero_grad(set_to_none=True)
            loss, _, _ = tm(torch.from_numpy(x).long(), torch.from_numpy(y).long())
            (loss * (3.0 if it == 0 else 0.3)).backward()  # one step clipped, the rest not
            tg = torch_to_flat(tm, grads=True)
            grads = jax.tree_util.tree_unflatten(
                treedef, [jnp.asarray(tg[n], dtype) for n in names]
            )
            gn = float(torch.nn.utils.clip_grad_norm_(tm.parameters(), oc.clip))
            lr = nanogpt_lr(it, oc.lr, oc.warmup_steps, oc.decay_steps, oc.min_lr)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            ours, theirs = flatten(params), torch_to_flat(tm)
            upd = diff_dicts(
                {k: ours[k] - flat0[k] for k in ours}, {k: theirs[k] - flat0[k] for k in theirs}
            )
            recs.append(
                {
                    "step": it,
                    "grad_norm": gn,
                    "clipped": gn > oc.clip,
                    "update_worst": upd["worst"],
                    "update_worst_rel_max": upd["worst_rel_max"],
                    "update_max_rel_l2": upd["max_rel_l2"],
                    "params_abs_max_in_lr_units": max(
                        v["abs_max"] for v in upd["per_tensor"].values()
                    )
                    / lr,
                }
            )
    return recs


def part_d(mc, seed):
    """Per-parameter init std: ours vs nanoGPT's rules (and torch running those rules)."""
    _, _, params = make_jax(mc, seed)
    ours = flatten(params)
    torch.manual_seed(seed)
    tm = TorchGPT(mc)
    tm.init_nanogpt()
    theirs = torch_to_flat(tm)
    res_std = 0.02 / math.sqrt(2 * mc["n_layer"])
    rows = {}
    for k, v in ours.items():
        if k.endswith(".scale"):
            expect = None  # LayerNorm weight: all ones
        elif k.endswith(("attn.wo.kernel", "mlp.proj.kernel")):
            expect = res_std
        else:
            expect = 0.02
        v = v.astype(np.float64)
        rows[k] = {
            "shape": list(v.shape),
            "expected_std": expect,
            "std": float(v.std()),
            "mean": float(v.mean()),
            "torch_std": float(theirs[k].std()),
            # 0.27% of an untruncated normal lies beyond 3 sigma; ~0 for a 2-sigma truncated one
            "frac_beyond_3std": float(np.mean(np.abs(v) > 3 * expect)) if expect else None,
            "ratio": float(v.std() / expect) if expect else None,
            "all_ones": bool(np.all(v == 1.0)) if expect is None else None,
        }
    # group by parameter kind (over layers) for the summary
    groups = {}
    for k, r in rows.items():
        g = k.split(".", 2)[-1] if k.startswith("blocks.") else k
        groups.setdefault(g, []).append(r)
    summary = {}
    for g, rs in groups.items():
        e = rs[0]["expected_std"]
        summary[g] = {
            "n": len(rs),
            "expected_std": e,
            "std_min": min(r["std"] for r in rs),
            "std_max": max(r["std"] for r in rs),
            "torch_std_mean": float(np.mean([r["torch_std"] for r in rs])),
            "frac_beyond_3std": (
                float(np.mean([r["frac_beyond_3std"] for r in rs])) if e else None
            ),
            "all_ones": all(r["all_ones"] for r in rs) if e is None else None,
        }
    return {"by_kind": summary, "per_tensor": rows}


def part_ln(seed, d=768, rows=4096):
    """Our LayerNorm (models.gpt2._layer_norm) and torch's layer_norm, each vs float64.
    Rows are N(0, 1) plus either a common offset (mean^2 >> var: the cancellation case) or one
    outlier feature (a "massive activation": it raises mean^2 and var alike)."""
    from models.gpt2 import _layer_norm

    rng = np.random.default_rng(seed + 5)
    ln = _layer_norm(d, jnp.float32, nnx.Rngs(0))
    cases = {f"offset_{o:g}": ("offset", o) for o in (0.0, 3.0, 10.0, 100.0, 1000.0)}
    cases.update({f"outlier_{o:g}": ("outlier", o) for o in (100.0, 1000.0, 3000.0)})
    out = {}
    for name, (how, val) in cases.items():
        x = rng.standard_normal((rows, d))
        if how == "offset":
            x += val
        else:
            x[:, 7] = val
        x = x.astype(np.float32)
        x64 = x.astype(np.float64)
        ref = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
        ours = np.asarray(ln(jnp.asarray(x)))
        theirs = F.layer_norm(torch.from_numpy(x), (d,), None, None, 1e-5).numpy()
        out[name] = {"flax_vs_fp64": diff(ours, ref), "torch_vs_fp64": diff(theirs, ref)}
    return out


# ----------------------------------------------------------------------------- CLI


def run_size(label, mc, parts, args):
    res = {"config": mc, "batch": args.batch, "seq": args.seq or mc["block_size"]}
    t = args.seq or mc["block_size"]
    timed = {
        "a": lambda: part_a(mc, args.seed, args.batch, t, not args.no_fp64, args.extra_attn),
        "b": lambda: part_b(mc, args.seed, args.batch, t),
        "c": lambda: part_c(mc, args.seed, args.batch, t),
        "d": lambda: part_d(mc, args.seed),
    }
    for p in parts:
        if p in timed:
            t0 = time.perf_counter()
            res[p] = timed[p]()
            print(f"[{label}] part {p}: {time.perf_counter() - t0:.1f}s", flush=True)
    return res


def print_summary(results):
    for label, r in results["sizes"].items():
        print(f"\n=== {label}: {r['config']} batch {r['batch']} x seq {r['seq']}")
        for name, a in r.get("a", {}).items():
            print(
                f"(a) {name:14s} loss {a['loss_jax']:.7f} vs {a['loss_torch']:.7f}"
                f" (rel {a['loss_rel']:.1e})"
                f"  logits rel_max {a['logits']['rel_max']:.1e}"
                f"  blocks rel_max {max(bb['rel_max'] for bb in a['blocks']):.1e}"
                f"  grads worst rel_max {a['grads']['worst_rel_max']:.1e} ({a['grads']['worst']})"
                f" max rel_l2 {a['grads']['max_rel_l2']:.1e}"
            )
        b = r.get("b")
        if b:
            for k, v in b["torch_vs_fp32"].items():
                print(
                    f"(b) torch bf16 [{k}] vs torch fp32: loss rel {v['loss_rel']:.1e}, "
                    f"grads max rel_l2 {v['grads_max_rel_l2']:.1e}"
                )
            for ldt in ("float32", "bfloat16"):
                v = b[f"jax_logits_{ldt}"]
                print(
                    f"(b) jax bf16 logits={ldt} vs torch fp32:"
                    f" loss rel {v['vs_fp32']['loss_rel']:.1e}, "
                    f"grads max rel_l2 {v['vs_fp32']['grads_max_rel_l2']:.1e}"
                )
                for kind in ("sdpa", "manual"):
                    w = v[f"vs_torch_{kind}"]
                    print(
                        f"    vs torch bf16 [{kind}]: loss rel {w['loss_rel']:.1e}, logits rel_l2 "
                        f"{w['logits']['rel_l2']:.1e}, grads max rel_l2 {w['grads_max_rel_l2']:.1e}"
                        f" ({max(w['grads_rel_l2'], key=w['grads_rel_l2'].get)})"
                    )
        c = r.get("c")
        if c:
            print(f"(c) lr schedule vs nanoGPT get_lr: max rel {c['lr_schedule_max_rel']:.1e}")
            for s in c["end_to_end"]:
                print(
                    f"(c) step {s['step']} lr {s['lr_ours']:.3e}/{s['lr_nanogpt']:.3e} "
                    f"loss {s['loss_ours']:.6f}/{s['loss_torch']:.6f}"
                    f" gnorm {s['grad_norm_ours']:.4f}/{s['grad_norm_torch']:.4f}"
                    f"  params rel_max {s['params_worst_rel_max']:.1e}"
                    f"  update rel_l2 {s['update_max_rel_l2']:.1e}"
                    f" max|d| {s['update_abs_max_in_lr_units']:.1e} lr,"
                    f" {s['n_elements_off_by_1pct_lr']} elems >1% lr"
                )
            for dt in ("fp32", "fp64"):
                for s in c[f"same_grads_{dt}"]:
                    print(
                        f"(c2) {dt} same grads step {s['step']}"
                        f" (gnorm {s['grad_norm']:.3f}, clipped"
                        f" {s['clipped']}): update rel_max {s['update_worst_rel_max']:.1e} rel_l2"
                        f" {s['update_max_rel_l2']:.1e},"
                        f" params max|d| {s['params_abs_max_in_lr_units']:.1e} lr"
                    )
        d = r.get("d")
        if d:
            print("(d) kind                 expected   ours std (min..max)      torch std  >3sd")
            for g, v in d["by_kind"].items():
                e = f"{v['expected_std']:.5f}" if v["expected_std"] else "ones"
                tail = (
                    f"{v['frac_beyond_3std']:.4f}"
                    if v["expected_std"]
                    else f"all_ones={v['all_ones']}"
                )
                print(
                    f"    {g:20s} {e:>9s}  {v['std_min']:.5f}..{v['std_max']:.5f}  "
                    f"{v['torch_std_mean']:.5f}  {tail}"
                )
    if "ln" in results:
        for k, v in results["ln"].items():
            print(
                f"(ln) {k:12s} flax rel_max {v['flax_vs_fp64']['rel_max']:.1e}  "
                f"torch rel_max {v['torch_vs_fp64']['rel_max']:.1e}"
            )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--parts", default="a,b,c,d,ln")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="default: block_size")
    ap.add_argument("--no-fp64", action="store_true", help="skip part a's float64 run")
    ap.add_argument(
        "--extra-attn", default="", help="more JAX attention kinds for part a (e.g. xla)"
    )
    ap.add_argument("--gpt2-small", action="store_true", help="also run GPT-2 small sizes")
    ap.add_argument("--gpt2-parts", default="a,d")
    ap.add_argument("--gpt2-batch", type=int, default=1)
    ap.add_argument("--gpt2-seq", type=int, default=256)
    args = ap.parse_args(argv)
    args.extra_attn = tuple(k for k in args.extra_attn.split(",") if k)
    torch.manual_seed(args.seed)
    parts = args.parts.split(",")
    cuda_be = torch.backends.cuda  # the math-SDP precision flag lives there but is not CUDA-only
    results = {
        "versions": {
            "jax": jax.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(),
            # False: math SDPA upcasts bf16 q, k, v to FP32 (on CPU: bitwise = FP32 SDPA, rounded)
            "torch_math_sdp_bf16_reduction": cuda_be.fp16_bf16_reduction_math_sdp_allowed(),
        },
        "metric": "rel_max = max|ours-torch|/max|torch|; rel_l2 = ||ours-torch||/||torch||",
        "sizes": {},
    }
    results["sizes"]["small"] = run_size("small", SMALL, parts, args)
    if args.gpt2_small:
        g = argparse.Namespace(**{**vars(args), "batch": args.gpt2_batch, "seq": args.gpt2_seq})
        results["sizes"]["gpt2_small"] = run_size(
            "gpt2_small", GPT2_SMALL, args.gpt2_parts.split(","), g
        )
    if "ln" in parts:
        results["ln"] = part_ln(args.seed)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print_summary(results)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
