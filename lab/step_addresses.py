"""Which of a training step's buffers move from one step to the next, and whether XLA re-records
the step's CUDA graph each time: XLA updates a command buffer (every node, 686 in G's step) when
any buffer allocation its commands read or write has moved since the last execution.

    python -m lab.step_addresses [--preset small-gpu] [--set KEY=VALUE ...] [--batch 16]
        [--batches 1] [--steps 6] [--keep-metrics] [--vlog] [--out FILE.json]

Runs ``bench.train_step``'s step (``build_jax_step``: state donated, replicated over a data mesh)
for ``--steps`` steps, each waited for, and records the device address of every output (the state's
arrays, the metrics) and of the batch each step read. ``--batches``: device batches cycled through
(1: every step reads the same buffers); ``--keep-metrics``: every step's metrics are kept alive, as
a loop that reads them a step late does, so the allocator cannot hand their buffers back at once.
``--vlog`` has XLA log its command-buffer decisions (``TF_CPP_VMODULE=command_buffer_thunk=3``,
set before JAX starts) and counts, per step, the updates and the allocations each update followed.
On a CPU there are no command buffers: the addresses alone are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

UPDATE = re.compile(r"Update command buffer .*?updated_allocs=(\d+)")


def addresses(tree) -> list[int]:
    import jax

    return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)]


def moved(before: list[int], after: list[int]) -> int:
    return sum(a != b for a, b in zip(before, after))


def run(spec: dict, steps: int, keep_metrics: bool) -> list[dict]:
    """Per step: how many state arrays, metrics and batch arrays sit at another address than in
    the step before (the first step's counts compare it with the initial state)."""
    import jax

    from bench.train_step import build_jax_step

    js = build_jax_step(spec)
    kept, rows = [], []
    prev_state = addresses(js.held["state"])
    prev_metrics = prev_batch = None
    for i in range(steps):
        batch = js.batches[js.held["i"] % len(js.batches)]
        metrics = jax.block_until_ready(js.step())
        state, m, b = addresses(js.held["state"]), addresses(metrics), addresses(batch)
        rows.append({"step": i + 1, "state_arrays": len(state),
                     "state_moved": moved(prev_state, state),
                     "metrics_moved": None if prev_metrics is None else moved(prev_metrics, m),
                     "batch_moved": None if prev_batch is None else moved(prev_batch, b)})
        prev_state, prev_metrics, prev_batch = state, m, b
        if keep_metrics:
            kept.append(metrics)
    return rows


def updates_in(log: str) -> list[int]:
    """``updated_allocs`` of each command-buffer update XLA logged, in order."""
    return [int(n) for n in UPDATE.findall(log)]


def command_buffer_lines(log: str, limit: int = 40) -> list[str]:
    """The log's lines about command buffers (the first ``limit``), for wordings ``UPDATE`` misses."""
    return [line for line in log.splitlines() if "command buffer" in line.lower()][:limit]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small-gpu")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--keep-metrics", action="store_true")
    ap.add_argument("--vlog", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.vlog:  # read when XLA starts: before anything imports jax's backend
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
        os.environ["TF_CPP_VMODULE"] = "command_buffer_thunk=3"
    from train import config as config_lib

    cfg = config_lib.apply_overrides(config_lib.get_preset(args.preset),
                                     [*args.set, f"data.batch_size={args.batch}"])
    spec = {"config": config_lib.to_dict(cfg), "seed": 0, "batches": args.batches}
    log = ""
    if args.vlog:  # XLA logs to the process's stderr: catch it at the file descriptor
        with tempfile.TemporaryFile("w+") as tmp:
            saved = os.dup(2)
            sys.stderr.flush()
            os.dup2(tmp.fileno(), 2)
            try:
                rows = run(spec, args.steps, args.keep_metrics)
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
            tmp.seek(0)
            log = tmp.read()
    else:
        rows = run(spec, args.steps, args.keep_metrics)
    result = {"argv": sys.argv[1:] if argv is None else list(argv), "rows": rows,
              "graph_updates": updates_in(log) if args.vlog else None,
              "graph_log": command_buffer_lines(log) if args.vlog else None}
    import jax

    result["device"], result["jax"] = jax.devices()[0].device_kind, jax.__version__
    for r in rows:
        print(f"step {r['step']}: state arrays moved {r['state_moved']} of {r['state_arrays']}, "
              f"metrics moved {r['metrics_moved']}, batch moved {r['batch_moved']}")
    if args.vlog:
        print(f"command-buffer updates logged: {len(result['graph_updates'])} "
              f"(updated allocations each: {result['graph_updates']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
