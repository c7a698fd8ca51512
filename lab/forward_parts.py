"""Where the forward's time goes at one shape (head_dim 64 in mind, where cuDNN's forward kernel is
faster than ours): each form leaves one part of ``tile.py``'s forward tile out while the kernel is
traced — not shippable, the values are wrong by construction.

    python -m lab.forward_parts [--shape 16x1024x12x64] [--rounds 20] [--reps 6]
        [--sync round] [--out FILE.json]

* ``base``: the forward as it ships (stable shift off), ``stable``: with the shift;
* ``no exp``: the exponentials replaced by their arguments (the MUFU work gone, the rest kept);
* ``no P·V``: the second product replaced by zeros (V no longer read; Triton kernel only: the
  Mosaic forward issues its own wgmma);
* ``no Q·Kᵀ``: the scores replaced by a broadcast of each row's sum of Q (K no longer read).

A form's time against ``base`` bounds what its part costs where the others overlap it; ``python
-m lab.ab ratio FILE --variant V --base base`` pairs them by round. Timing and records as
``lab.stable_parts``'.
"""

from __future__ import annotations

import jax.numpy as jnp

from lab import stable_parts


def _no_exp(x, pol):
    return x


def _no_pv(p, v, pol):
    return jnp.zeros((p.shape[0], v.shape[1]), jnp.float32)


def _no_qk(q, k, cfg, bias=None):
    # a row reduction, not a slice: Pallas' Triton lowering has no slice
    row = jnp.sum(q.astype(jnp.float32), axis=1, keepdims=True)
    return jnp.broadcast_to(row, (q.shape[0], k.shape[0]))


FORMS = {"base": (False, {}), "stable": (True, {}),
         "no exp": (False, {"_exp": _no_exp}),
         "no P·V": (False, {"dot_nn": _no_pv}),
         "no Q·Kᵀ": (False, {"forward_scores": _no_qk})}


def main(argv=None):
    argv = list(argv if argv is not None else __import__("sys").argv[1:])
    if not any(a.startswith("--shape") for a in argv):
        argv = ["--shape", "16x1024x12x64", *argv]
    stable_parts.main(argv, parts=FORMS, doc=__doc__)


if __name__ == "__main__":
    main()
