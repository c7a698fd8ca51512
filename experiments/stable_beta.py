"""Does the stable shift leave a bias that grows with β? (In training, the one β = 7 execution's
δ-error probe was positive at 14 of 16 probes and it ran away: docs/REPRODUCTION.md.)

    python -m experiments.stable_beta [--rows 2048] [--seed 0] [--out DIR]

"fa2" numerics, 512 keys in eight 64-key tiles, on ``bias_map.bias_rows`` problems: two exactly tied
maxima in half the rows — in one key tile, or split over two tiles (the shift sees each tile on its
own, so split ties are not shifted) — remainders at r_m − gap ± 1 (gap 13: many tiny
P̄; gap 6: more remainder mass), V ~ N(−1.5, 1), maxima r_m ~ U(2, 4) (where β = 7's guard starts to
fold: (β − 1)·r_m > 20 nats above 3.3), U(6, 10) and U(20, 30) (a run that has started to run
away). Baseline and stable at β = 2, 3 and 7. Per cell, against float64: the mean signed O error
and its t, and the δ error with dO along V's sign, on tied and on tie-free rows
(``bias_map.measure_cell``). Writes ``stable_beta.csv`` and ``stable_beta.md`` into ``--out``.
"""

from __future__ import annotations

import itertools
import os

import jax.numpy as jnp
import numpy as np

from .bias_map import BF16, bias_rows, exact, kernel_config, make_do, ablation_main, measure_cell, stat_cells

DEFAULT_OUT = os.path.join("experiments", "results", "stable_beta")
BETAS = (None, 2.0, 3.0, 7.0)  # None: the baseline
TOPS = ((2.0, 4.0), (6.0, 10.0), (20.0, 30.0))
GAPS = (13.0, 6.0)
KV_LEN = 512
COLUMNS = ("o_tie_mean", "o_tie_t", "o_free_mean", "o_free_t", "delta_tie_mean", "delta_tie_t",
           "delta_free_mean", "delta_free_t", "o_tie_mabs", "shift_fired_tie", "shift_fired_free")


def run(rows: int, seed: int, progress=True, tops=TOPS, gaps=GAPS):
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    cases = list(itertools.product(tops, gaps, (False, True)))
    results = []
    bar = tqdm(total=len(cases) * len(BETAS), desc="stable-β cells", disable=not progress)
    for top, gap, split in cases:
        q, k, v, counts = bias_rows(rng, rows, kv_len=KV_LEN, ties=2, top=top, gap=gap, split=split)
        q, k, v = (np.asarray(jnp.asarray(x, BF16)) for x in (q, k, v))
        ref = exact(q, k, v)
        do = make_do(rng, np.asarray(v, np.float32))
        for beta in BETAS:
            cfg = kernel_config("fa2", beta is not None, KV_LEN, beta=beta or 2.0)
            row = measure_cell(cfg, (q, k, v, counts), ref, do)
            results.append(dict(top=f"{top[0]:g}–{top[1]:g}", gap=gap,
                                ties="split" if split else "one tile",
                                beta="off" if beta is None else f"{beta:g}",
                                **{c: row[c] for c in COLUMNS}))
            bar.update(1)
    bar.close()
    return results


def markdown(results) -> str:
    lines = ["| r_m | gap | ties | β | O tie rows: mean (t) | O tie-free rows: mean (t) | "
             "δ tie rows: mean (t) | δ tie-free rows: mean (t) | O tie rows mean abs | shift fired (tie / free) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['top']} | {r['gap']:g} | {r['ties']} | {r['beta']} | " + stat_cells(r) + " | "
            f"{r['shift_fired_tie']:.0%} / {r['shift_fired_free']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ablation_main(argv, __doc__, run, markdown, "stable_beta", DEFAULT_OUT)


if __name__ == "__main__":
    main()
