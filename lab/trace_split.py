"""Where one attention call's time goes on the GPU: kernels, gaps between them, and the wait before
the first — read from a JAX profiler trace (CUPTI's kernel records, in situ: no cache flush or
serialisation as under Nsight Compute).

    python -m lab.trace_split [--shape 4x8192x16x128] [--pass fwd+bwd]
        [--variants new,new@k64] [--entries lab/entries.json] [--calls 20] [--out F.json]

Variants as in ``lab.ab`` (``new``, ``new@ENTRY``, ``mosaic``, ``:stable``, ``cudnn``). Each variant is
jitted, warmed up, then called ``--calls`` times inside ``jax.profiler.trace``, each call waited for
on its own (as ``lab.ab``'s ``sync="call"``). The trace's device events are split per call at the
host's ``PjitFunction`` events; per call: the host-to-first-kernel wait, each kernel's time, the
device's busy time (union of its events), the span from first start to last end, and the idle time
inside that span.
Printed as medians per variant; ``--out`` keeps them with the per-call rows. What it answers: why
a faster kernel need not make the call faster (time spent between kernels or before the first).

Without a GPU: ``--from-json F.json`` prints a saved run again, with the medians of the first and
the second half of the calls apart (the GPU's clocks fall as it warms: later calls are slower);
``--smi F.csv[.gz]`` summarises an ``nvidia-smi --query-gpu=...,clocks.sm,...,power.draw,...,
clocks_throttle_reasons.active --format=csv`` log over its busy samples (power above ``--busy-watts``).

A training step's kernel time by op family (matmuls, attention, layer norms, GELU / elementwise,
logits + cross-entropy, optimizer, copies, other; ``families``, rules in ``classify``), from the trace
and the step's optimized HLO that ``python -m bench.train_step --profile DIR`` writes:
``python -m lab.trace_split --families DIR/trace.json.gz --hlo DIR/hlo.txt.gz --steps 3``.

Where such a step's GPU idles (``gaps``): span, kernel time and count, idle time between events, the
gaps by size, the largest with their neighbours, the gap between steps and the host's CUDA graph
launches, per step of a JAX or PyTorch trace: ``python -m lab.trace_split --gaps TRACE --steps 3``.

What the host does in each jitted call (``host``): the call's length, the time to its first launch
(what a step waited for adds to the GPU's time) and the runtime's phases before and after it:
``python -m lab.trace_split --host TRACE``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import statistics
import tempfile


def trace_file(log_dir: str) -> str:
    """The newest perfetto trace under ``log_dir`` (written by jax.profiler.trace), or ``log_dir``
    itself when it is a file."""
    if os.path.isfile(log_dir):
        return log_dir
    files = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    return files[-1]


def load_trace(log_dir: str) -> list[dict]:
    """The events of the newest perfetto trace under ``log_dir`` (or of the trace file ``log_dir``)."""
    path = trace_file(log_dir)
    t = json.load(gzip.open(path) if path.endswith(".gz") else open(path))
    return t["traceEvents"] if isinstance(t, dict) else t


def device_pids(events) -> set:
    """Process ids whose name is a GPU device (``/device:GPU:0`` …)."""
    return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")}


def _union(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def split_calls(events, call_marker: str = "PjitFunction(") -> list[dict]:
    """Per host call (an X event whose name starts with ``call_marker``, outside any other such event):
    the device X events that start between it and the next call. Times in ms."""
    gpu = device_pids(events)
    calls = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") not in gpu
                    and str(e.get("name", "")).startswith(call_marker)), key=lambda e: e["ts"])
    top = []  # nested markers (a jitted call inside another) belong to the outer one
    for c in calls:
        if top and c["ts"] < top[-1]["ts"] + top[-1].get("dur", 0):
            continue
        top.append(c)
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in gpu), key=lambda e: e["ts"])
    rows = []
    for i, c in enumerate(top):
        t0, t1 = c["ts"], top[i + 1]["ts"] if i + 1 < len(top) else float("inf")
        mine = [e for e in dev if t0 <= e["ts"] < t1]
        if not mine:
            rows.append({"kernels": [], "wait_ms": None, "busy_ms": 0.0, "span_ms": 0.0, "idle_ms": 0.0})
            continue
        iv = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in mine]
        first, last = min(s for s, _ in iv), max(e for _, e in iv)
        busy = _union(iv)
        rows.append({"kernels": [(e["name"], e.get("dur", 0) / 1e3) for e in mine],
                     "wait_ms": (first - t0) / 1e3, "busy_ms": busy / 1e3,
                     "span_ms": (last - first) / 1e3, "idle_ms": (last - first - busy) / 1e3})
    return rows


def summarize(rows: list[dict]) -> dict:
    """Medians over calls; per kernel name, the median of its summed time per call."""
    med = lambda xs: statistics.median(xs) if xs else None
    names = sorted({n for r in rows for n, _ in r["kernels"]})
    per_kernel = {n: med([sum(d for m, d in r["kernels"] if m == n) for r in rows]) for n in names}
    return {"calls": len(rows), "wait_ms": med([r["wait_ms"] for r in rows if r["wait_ms"] is not None]),
            "busy_ms": med([r["busy_ms"] for r in rows]), "span_ms": med([r["span_ms"] for r in rows]),
            "idle_ms": med([r["idle_ms"] for r in rows]), "kernels_ms": per_kernel}


def halves(rows: list[dict]) -> tuple[dict, dict]:
    """``summarize`` of the first and of the second half of the calls (in call order)."""
    n = len(rows) // 2
    return summarize(rows[:n]), summarize(rows[n:])


def smi_summary(path: str, busy_watts: float = 300.0) -> dict:
    """Over the samples of an nvidia-smi CSV log drawing more than ``busy_watts``: their count, the
    median and minimum SM clock (MHz), the median and maximum power (W), and the fraction with the
    software power cap (throttle/event reason bit 0x4) active (``bench.step_timing.summarize_smi``,
    which ``bench.train_step`` applies to its own samples)."""
    import csv

    from bench.step_timing import summarize_smi

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [[c.strip() for c in r] for r in csv.reader(f)]
    head, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    col = lambda test: next((i for i, h in enumerate(head) if test(h)), None)
    # nvidia-smi names the clocks.sm column "clocks.current.sm [MHz]"; values carry their units
    sm = col(lambda h: h.startswith("clocks.") and h.split(" ")[0].endswith(".sm"))
    pw, why = col(lambda h: h.startswith("power.draw")), col(lambda h: "reasons.active" in h)
    temp = col(lambda h: h.startswith("temperature.gpu"))
    num = lambda r, i: "nan" if i is None else r[i].split()[0]
    busy = [[num(r, sm), num(r, pw), num(r, temp), r[why]] for r in body
            if float(num(r, pw)) > busy_watts]
    got = summarize_smi(busy)
    if got is None:
        return {"samples": len(body), "busy": 0}
    return {"samples": len(body), "busy": got["samples"],
            **{k: got[k] for k in ("sm_mhz_median", "sm_mhz_min", "power_w_median", "power_w_max")},
            "power_cap_fraction": got["power_cap_share"]}


# ----------------------------------------------------------------------------- op families of a step
# A training step's kernel time grouped by what the kernels compute. Each kernel is matched to the
# HLO instruction that launched it (the trace's ``hlo_op`` argument, else its name, which XLA derives
# from the instruction's) in the step's optimized HLO (``compiled.as_text()``), whose instructions
# carry the Python call stack they were traced from. A fusion is judged by its own metadata (XLA
# copies its root op's), so neighbours fused into it count with its root.

FAMILIES = {  # key -> label, in table order
    "matmul": "matmuls",
    "attention": "attention",
    "layernorm": "layer norms",
    "elementwise": "GELU / elementwise",
    "logits_ce": "logits + cross-entropy",
    "optimizer": "optimizer",
    "copy": "copies / casts / transposes",
    "other": "other",
}

# Kernel names that say what they are without the HLO: our kernels (jax_flash_*, model_layernorm_*),
# cuDNN's attention (…sdpa…flash_fprop/bprop…, fmha), cuBLAS / CUTLASS GEMMs (nvjet_*, *xmma_gemm*,
# cutlass*), CUDA copies.
_ATTENTION_NAME = re.compile(r"jax_flash|fmha|sdpa|flash_[fb]prop")
_GEMM_NAME = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul")
# the Pallas LayerNorm kernels of models/layernorm.py (custom calls: no fusion of their own to read)
_LAYERNORM_NAME = re.compile(r"model_(add_)?layernorm")
# the Pallas loss kernels of models/loss_kernels.py, the GELU's of models/gelu_kernels.py
_CE_NAME = re.compile(r"model_cross_entropy")
_GELU_NAME = re.compile(r"model_gelu")
_COPY_NAME = re.compile(r"memcpy|memset|^(wrapped_)?(copy|transpose)")
_GEMM_TARGET = re.compile(r"cublas|gemm|matmul")
# Ops that only move, lay out or cast data: a fusion of nothing else is a copy (the bf16 copies of the
# FP32 weights that mixed precision makes each step are such fusions).
_MOVE_OPS = {"parameter", "constant", "copy", "transpose", "bitcast", "reshape", "broadcast", "slice",
             "concatenate", "dynamic-slice", "dynamic-update-slice", "pad", "tuple", "get-tuple-element",
             "iota", "reverse", "copy-start", "copy-done", "bitcast-convert", "convert"}
# Ops that make a non-matmul kernel more than elementwise arithmetic.
_NOT_ELEMENTWISE = {"reduce", "reduce-window", "sort", "scatter", "gather", "rng", "rng-bit-generator",
                    "while", "conditional", "call", "custom-call", "all-reduce", "select-and-scatter"}


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``text[start]`` (``(``, ``{`` or ``[``)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i
    return len(text) - 1


_DIMS = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")
_ATTR_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%[\w.\-]+)")


def _dims(shape: str) -> set[int]:
    return {int(d) for m in _DIMS.finditer(shape) for d in m.group(1).split(",") if d}


class HloIndex:
    """The instructions of an optimized HLO module's text: per name its opcode, shape, operands,
    called computations, custom-call target, fusion kind and call stack (``FileNames`` …
    ``StackFrames`` sections and ``stack_frame_id``; older modules' ``source_file`` metadata)."""

    _SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")

    def __init__(self, text: str):
        self.module = None
        self.instrs: dict[str, dict] = {}
        self.comps: dict[str, list[str]] = {}
        sections = {k: {} for k in self._SECTIONS}
        section, comp = None, None
        for line in text.splitlines():
            if line.startswith("HloModule "):
                self.module = line.split()[1].rstrip(",")
                continue
            if line.strip() in self._SECTIONS:
                section = line.strip()
                continue
            if section:
                m = re.match(r"^(\d+) (.*)$", line)
                if m:
                    sections[section][int(m.group(1))] = m.group(2)
                    continue
                section = None
            head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$", line)
            if head and not line.startswith(" "):
                comp = head.group(1)
                self.comps[comp] = []
                continue
            if comp is not None and line.startswith(" "):
                ins = self._parse_instruction(line)
                if ins:
                    ins["computation"] = comp
                    self.instrs[ins["name"]] = ins
                    self.comps[comp].append(ins["name"])
        self._frames = self._stack_frames(sections)
        self._info: dict[str, dict] = {}
        self._by_norm: dict[str, list[str]] = {}
        for name in self.instrs:
            self._by_norm.setdefault(_norm(name), []).append(name)

    @staticmethod
    def _parse_instruction(line: str) -> dict | None:
        m = re.match(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
        if not m:
            return None
        name, rest = m.group(1), m.group(2)
        if rest.startswith("("):
            end = _matching(rest, 0)
            shape, after = rest[: end + 1], rest[end + 1 :].lstrip()
        else:
            shape, _, after = rest.partition(" ")
        op = re.match(r"([\w\-$]+)\(", after)
        if not op:
            return None
        open_at = op.end() - 1
        close_at = _matching(after, open_at)
        operands = re.findall(r"%([\w.\-]+)", after[open_at:close_at])
        attrs = after[close_at + 1 :]
        calls = [c for m2 in _ATTR_CALLS.finditer(attrs) for c in re.findall(r"%([\w.\-]+)", m2.group(1))]
        target = re.search(r'custom_call_target="([^"]*)"', attrs)
        kind = re.search(r"\bkind=(k\w+)", attrs)
        backend_kind = re.search(r'"kind":"([^"]+)"', attrs)
        frame = re.search(r"\bstack_frame_id=(\d+)", attrs)
        source = re.search(r'\bsource_file="([^"]*)"', attrs)
        op_name = re.search(r'\bop_name="((?:[^"\\]|\\.)*)"', attrs)
        return {"name": name, "opcode": op.group(1), "shape": shape, "operands": operands,
                "calls": calls, "target": target.group(1) if target else None,
                "kind": kind.group(1) if kind else None,
                "backend_kind": backend_kind.group(1) if backend_kind else None,
                "frame": int(frame.group(1)) if frame else None,
                "source_file": source.group(1) if source else None,
                "op_name": op_name.group(1) if op_name else ""}

    @staticmethod
    def _stack_frames(sections) -> dict[int, tuple[str, str, int | None]]:
        """frame id -> (file, function, parent id or None)."""
        unq = lambda s: s.strip().strip('"')
        files = {k: unq(v) for k, v in sections["FileNames"].items()}
        funcs = {k: unq(v) for k, v in sections["FunctionNames"].items()}
        locs = {}
        for k, v in sections["FileLocations"].items():
            d = dict(re.findall(r"(\w+)=(\d+)", v))
            locs[k] = (files.get(int(d.get("file_name_id", 0)), "?"),
                       funcs.get(int(d.get("function_name_id", 0)), "?"))
        raw = {}
        for k, v in sections["StackFrames"].items():
            d = dict(re.findall(r"(\w+)=(\d+)", v))
            raw[k] = (int(d.get("file_location_id", 0)), int(d.get("parent_frame_id", 0)))
        # The printed parent is the parent's listed id + 1 (1 for a root) in the modules seen so far;
        # the listed id itself (0 for a root) is the other reading. Parents are listed before their
        # children, and the first frame is a root: only one reading fits a module.
        offset = next((off for off in (1, 0)
                       if all(0 <= p - off < k for k, (_, p) in raw.items())), None)
        frames = {}
        for k, (loc, p) in raw.items():
            parent = p - offset if offset is not None and p - offset in raw else None
            frames[k] = (*locs.get(loc, ("?", "?")), parent)
        return frames

    def stack(self, frame: int | None) -> list[tuple[str, str]]:
        """(file, function) from the innermost frame outwards."""
        out, seen = [], set()
        while frame is not None and frame in self._frames and frame not in seen:
            seen.add(frame)
            file, func, frame = self._frames[frame]
            out.append((file, func))
        return out

    def lookup(self, name: str) -> str | None:
        """The instruction a kernel or ``hlo_op`` name refers to: the same name, or the one name whose
        dots and dashes read as underscores (XLA's kernel names); None when none or several do."""
        if name in self.instrs:
            return name
        hits = self._by_norm.get(_norm(name), [])
        return hits[0] if len(hits) == 1 else None

    def info(self, name: str) -> dict:
        """What classifying instruction ``name`` needs: its opcodes (its own and those of the
        computations it calls, recursively), the dimensions of its shapes and operands', custom-call
        targets, fusion kinds and call stack (its own frame; else the union of its inner ops')."""
        if name not in self._info:
            self._info[name] = self._collect(name)
        return self._info[name]

    def _collect(self, name: str) -> dict:
        ins = self.instrs[name]
        opcodes, dims, targets, kinds, inner_stacks = set(), set(), set(), set(), []
        todo, seen = [name], set()
        while todo:
            n = todo.pop()
            if n in seen or n not in self.instrs:
                continue
            seen.add(n)
            i = self.instrs[n]
            opcodes.add(i["opcode"])
            dims |= _dims(i["shape"])
            for o in i["operands"]:
                if o in self.instrs:
                    dims |= _dims(self.instrs[o]["shape"])
            targets.update(t for t in (i["target"],) if t)
            kinds.update(k for k in (i["kind"], i["backend_kind"]) if k)
            if n != name:
                inner_stacks.append(self._stack_of(i))
            for c in i["calls"]:
                todo.extend(self.comps.get(c, []))
        stack = self._stack_of(ins)
        if not stack:
            stack = [f for s in inner_stacks for f in s]
        if ins["opcode"] == "fusion":  # what a fusion computes is what it calls
            opcodes.discard("fusion")
        return {"name": name, "opcode": ins["opcode"], "opcodes": opcodes, "dims": dims,
                "targets": targets, "kinds": kinds, "stack": stack, "op_name": ins["op_name"]}

    def _stack_of(self, ins) -> list[tuple[str, str]]:
        if ins["frame"] is not None:
            return self.stack(ins["frame"])
        return [(ins["source_file"], "?")] if ins["source_file"] else []


def _norm(name: str) -> str:
    return re.sub(r"[.\-]", "_", name)


def classify(kernel: str, info: dict | None, vocab: int | None = None) -> tuple[str, str]:
    """(family, rule) of one kernel; ``info`` is ``HloIndex.info`` of its instruction (None: the
    kernel's name alone decides). Rules in order, the first that holds wins."""
    k = kernel.lower()
    if _ATTENTION_NAME.search(k):
        return "attention", "kernel name"
    if _LAYERNORM_NAME.search(k):
        return "layernorm", "kernel name"
    if _CE_NAME.search(k):
        return "logits_ce", "kernel name"
    if _GELU_NAME.search(k):
        return "elementwise", "kernel name"
    if info is None:
        if _GEMM_NAME.search(k):
            return "matmul", "kernel name"
        if _COPY_NAME.search(k):
            return "copy", "kernel name"
        return "other", "no HLO op"
    files = [f for f, _ in info["stack"]]
    funcs = [fn for _, fn in info["stack"]]
    ops = info["opcodes"]
    # everything models/gpt2.py's attend() runs, and jax_flash's own code (incl. XLA's δ = rowsum(dO∘O))
    if "attend" in funcs or any("/jax_flash/" in f for f in files):
        return "attention", "stack: attend / jax_flash"
    if any(t.startswith("__cudnn$fmha") or "mosaic" in t for t in info["targets"]):
        return "attention", "custom call"
    # optax's update, and the step's own gradient bookkeeping in train_step (accumulate, average)
    if any("/optax/" in f for f in files) or "apply_updates" in funcs:
        return "optimizer", "stack: optax"
    if "Embed.__call__" in funcs or ops & {"gather", "scatter"}:
        return "other", "embedding lookup / scatter"
    # the loss, and whatever holds a vocab-sized axis: the tied head's GEMMs, the logits' casts
    if "cross_entropy" in funcs:
        return "logits_ce", "stack: cross_entropy"
    if vocab and vocab in info["dims"]:
        return "logits_ce", "vocab-sized axis"
    if "LayerNorm.__call__" in funcs or any(f.endswith("normalization.py") for f in files):
        return "layernorm", "stack: LayerNorm"
    if ops & {"dot", "convolution"} or any(_GEMM_TARGET.search(t.lower()) for t in info["targets"]) \
            or any("gemm" in kd for kd in info["kinds"]) or _GEMM_NAME.search(k):
        return "matmul", "dot / GEMM"
    if ops <= _MOVE_OPS or _COPY_NAME.search(k):
        return "copy", "data movement / casts only"
    # arithmetic written in train_step itself: gradient accumulation and averaging, the rng split
    if funcs and funcs[0].startswith("train_step"):
        return "optimizer", "stack: train_step"
    if "MLP.__call__" in funcs:
        return "elementwise", "stack: MLP (GELU)"
    if not ops & _NOT_ELEMENTWISE:
        return "elementwise", "elementwise ops"
    return "other", "reduction / control / custom"


_WRAPPERS = {"while", "call", "conditional", "async-start", "async-done"}

# Lines of a device that profiler viewers derive from its kernels (one event per op or module spanning
# them): counting them too would count the kernels twice.
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Framework", "Source Code", "Steps",
                  "TensorFlow", "Launch Stats")


def kernel_events(events: list[dict], module: str | None = None) -> tuple[list[dict], int]:
    """The kernel events of a trace and how many were left out as another module's: a GPU's device
    events; without a GPU (XLA:CPU), the host events that carry an ``hlo_op`` (innermost ones: a loop's
    event encloses its body's). With ``module``, events whose ``hlo_module`` names another are left out."""
    gpu = device_pids(events)
    if gpu:
        derived = {(e.get("pid"), e.get("tid")) for e in events
                   if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in gpu
                   and str(e.get("args", {}).get("name", "")).startswith(_DERIVED_LINES)}
        ev = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu
              and (e.get("pid"), e.get("tid")) not in derived]
    else:
        ev = [e for e in events if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})]
        ev = _innermost(ev)
    if module is None:
        return ev, 0
    keep = [e for e in ev if (e.get("args") or {}).get("hlo_module", module) == module]
    if ev and not keep:  # the trace names its modules otherwise: keep them all
        return ev, 0
    return keep, len(ev) - len(keep)


def _innermost(ev):
    by_thread = {}
    for e in ev:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = []
    for group in by_thread.values():
        group.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        for i, e in enumerate(group):
            nxt = group[i + 1] if i + 1 < len(group) else None
            if nxt is not None and nxt["ts"] < e["ts"] + e.get("dur", 0):
                continue  # encloses the next event: a loop or call around its body
            out.append(e)
    return out


def families(events: list[dict], index: HloIndex | None = None, steps: int = 1,
             vocab: int | None = None) -> dict:
    """Kernel time per family, per step (ms), over ``steps`` steps traced back to back, with the
    device's busy time and the span from the first kernel's start to the last one's end."""
    ev, foreign = kernel_events(events, index.module if index is not None else None)

    def judge(e):
        args = e.get("args") or {}
        op, via = None, "kernel name only"
        if index is not None:
            # the trace's hlo_op names the launching instruction, unless it is a wrapper (a loop,
            # a call) around it; XLA names a fusion's kernel after the fusion
            by_op = index.lookup(args["hlo_op"]) if args.get("hlo_op") else None
            if by_op and index.instrs[by_op]["opcode"] not in _WRAPPERS:
                op, via = by_op, "hlo_op"
            elif index.lookup(e["name"]):
                op, via = index.lookup(e["name"]), "kernel name = HLO op"
        return (op, *classify(e["name"], index.info(op) if op else None, vocab), via)

    return _tally(ev, judge, steps, foreign)


def _tally(ev: list[dict], judge, steps: int, foreign: int = 0) -> dict:
    """Kernel time of events ``ev`` per step: by family, by how each was placed, and per kernel;
    ``judge(event)`` gives (HLO op or None, family, rule, how placed)."""
    fam = {k: 0.0 for k in FAMILIES}
    how = {"hlo_op": 0.0, "kernel name = HLO op": 0.0, "kernel name only": 0.0}
    rows: dict[tuple, dict] = {}
    for e in ev:
        name, dur = e["name"], e.get("dur", 0.0) / 1e3
        op, family, rule, via = judge(e)
        fam[family] += dur
        how[via] += dur
        r = rows.setdefault((name, op), {"kernel": name, "hlo_op": op, "family": family, "rule": rule,
                                         "ms": 0.0, "launches": 0})
        r["ms"] += dur
        r["launches"] += 1
    iv = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in ev]
    span = (max(b for _, b in iv) - min(a for a, _ in iv)) / 1e3 if iv else 0.0
    per = lambda x: x / steps
    kernels = sorted(rows.values(), key=lambda r: -r["ms"])
    for r in kernels:
        r["ms"], r["launches"] = per(r["ms"]), per(r["launches"])
    return {"steps": steps, "total_ms": per(sum(fam.values())), "busy_ms": per(_union(iv) / 1e3),
            "span_ms": per(span), "families_ms": {k: per(v) for k, v in fam.items()},
            "attributed_ms": {k: per(v) for k, v in how.items()}, "foreign_events": foreign,
            "kernels": kernels}


# PyTorch's kernels by name alone (no HLO to read): Inductor names a generated kernel after the ops
# it fused (``triton_poi_fused_gelu_…``, ``triton_per_fused_add_native_layer_norm_…``), ATen and
# cuBLAS after the op. First rule that holds wins; the loss before layer norms and elementwise,
# since Inductor fuses its casts and softmax into one kernel.
_TORCH_RULES = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention|cudnn")),  # cuDNN: its SDPA passes
    ("matmul", _GEMM_NAME),
    ("logits_ce", re.compile(r"log_softmax|nll_loss|cross_entropy")),
    ("layernorm", re.compile(r"layer_norm")),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach")),
    ("elementwise", re.compile(r"gelu|triton_poi|elementwise|vectorized|unrolled")),
    ("copy", re.compile(r"memcpy|memset|copy|cat_|clone|transpose")),
)


def torch_families(events: list[dict], steps: int = 1) -> dict:
    """``families`` for a PyTorch profiler trace (``export_chrome_trace``): its CUDA kernel, memcpy
    and memset events, each judged by its name (``_TORCH_RULES``); without any (a CPU run), the
    innermost CPU ops. The same keys as ``families``, for ``families_markdown``."""
    ev = [e for e in events if e.get("ph") == "X"
          and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not ev:
        ev = _innermost([e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"])

    def judge(e):
        family = next((f for f, rule in _TORCH_RULES if rule.search(e["name"].lower())), "other")
        return None, family, "kernel name", "kernel name only"

    return _tally(ev, judge, steps)


MAX_PROFILE_FILE = 15 << 20  # bytes: the device machine returns files of up to 16 MiB


def profile_record(pdir, res: dict, title: str, files: list[str]) -> dict:
    """Writes ``pdir``/profile.md (``families_markdown``) beside the ``files`` already there and
    returns what a results file keeps of a profile: the families, the 40 largest kernels, the files."""
    from pathlib import Path

    (Path(pdir) / "profile.md").write_text(families_markdown(res, title))
    return {**res, "kernels": res["kernels"][:40], "files": [*files, "profile.md"], "dir": str(pdir)}


def families_markdown(res: dict, title: str = "", top: int = 12) -> str:
    """A families table (ms per step, share of kernel time), then the largest kernels."""
    total = res["total_ms"] or float("nan")
    lines = [f"{title}\n" if title else "", "| family | ms / step | share |", "|---|---|---|"]
    for k, label in FAMILIES.items():
        ms = res["families_ms"][k]
        lines.append(f"| {label} | {ms:.2f} | {100 * ms / total:.1f} % |")
    lines.append(f"| **all kernels** | **{res['total_ms']:.2f}** | 100 % |")
    att = res["attributed_ms"]
    lines += ["", f"Per step over {res['steps']} steps traced back to back: the device busy "
              f"{res['busy_ms']:.2f} ms of a {res['span_ms']:.2f} ms span from the first kernel's start to "
              f"the last one's end (idle {res['span_ms'] - res['busy_ms']:.2f} ms). Kernel time matched "
              f"to its HLO op by the trace's hlo_op {att['hlo_op']:.2f} ms, by the kernel's name "
              f"{att['kernel name = HLO op']:.2f} ms; judged by kernel name alone {att['kernel name only']:.2f} ms."
              + (f" {res['foreign_events']} kernel events of other modules left out."
                 if res["foreign_events"] else ""),
              "", "| kernel | HLO op | family | rule | ms / step | launches / step |",
              "|---|---|---|---|---|---|"]
    for r in res["kernels"][:top]:
        lines.append(f"| `{r['kernel'][:60]}` | {r['hlo_op'] or '—'} | {FAMILIES[r['family']]} | "
                     f"{r['rule']} | {r['ms']:.3f} | {r['launches']:g} |")
    return "\n".join(lines).lstrip("\n") + "\n"


# ----------------------------------------------------------------------------- idle gaps of a step
# Where a step's GPU timeline is empty: the gaps between its device events (kernels, memsets,
# memcpys), all streams taken together, so an event overlapping another leaves no gap.

GAP_BUCKETS = ((2.0, "<2 µs"), (5.0, "2–5 µs"), (20.0, "5–20 µs"), (100.0, "20–100 µs"),
               (float("inf"), ">100 µs"))
_TORCH_KINDS = {"kernel": "kernel", "gpu_memset": "memset", "gpu_memcpy": "memcpy"}
_GRAPH_LAUNCH = re.compile(r"^cu(da)?GraphLaunch")


def _corr(e) -> str | None:
    """The CUPTI correlation id tying a device event to its host launch (JAX's or PyTorch's key)."""
    a = e.get("args") or {}
    c = a.get("correlation_id", a.get("correlation"))
    return None if c is None else str(c)


def _device_events(events: list[dict]) -> list[dict]:
    """A trace's GPU events by start, each with its kind: PyTorch's kernel / gpu_memset / gpu_memcpy
    events, else ``kernel_events`` (a JAX trace's, whose memsets and memcpys carry details args)."""
    ev = [e for e in events if e.get("ph") == "X" and e.get("cat") in _TORCH_KINDS]
    if ev:
        kinds = [_TORCH_KINDS[e["cat"]] for e in ev]
    else:
        ev = kernel_events(events)[0]
        kinds = ["memset" if "Memset_details" in (e.get("args") or {}) else
                 "memcpy" if "Memcpy_details" in (e.get("args") or {}) else "kernel" for e in ev]
    out = [{"ts": e["ts"], "end": e["ts"] + e.get("dur", 0.0), "name": e["name"], "kind": k,
            "corr": _corr(e)} for e, k in zip(ev, kinds)]
    return sorted(out, key=lambda d: (d["ts"], d["end"]))


def _gaps_between(ev: list[dict]) -> list[tuple]:
    """(µs, event before, event after) wherever the next event (by start) begins after every
    earlier one has ended; the event before is the one that ended last."""
    out, last = [], ev[0]
    for d in ev[1:]:
        if d["ts"] > last["end"]:
            out.append((d["ts"] - last["end"], last, d))
        if d["end"] > last["end"]:
            last = d
    return out


def _split_steps(ev: list[dict], launches: list[dict], steps: int) -> tuple[list[list[dict]], str]:
    """``ev`` in ``steps`` groups: by the host graph launch each event's correlation id names, when
    there are ``steps`` launches that cover every event; else equal groups when the event names
    repeat ``steps`` times (steps run back to back); else cut at the ``steps - 1`` largest gaps
    (steps waited for one by one)."""
    if steps == 1:
        return [ev], "one step"
    step_of = {_corr(e): i for i, e in enumerate(sorted(launches, key=lambda e: e["ts"]))}
    if len(step_of) == steps and all(d["corr"] in step_of for d in ev):
        return [[d for d in ev if step_of[d["corr"]] == i] for i in range(steps)], "graph launches"
    n, names = len(ev) // steps, [d["name"] for d in ev]
    if n * steps == len(ev) and all(names[i] == names[i + n] for i in range(len(ev) - n)):
        return [ev[i * n:(i + 1) * n] for i in range(steps)], "repeated event names"
    at = {id(d): i for i, d in enumerate(ev)}
    widest = sorted(_gaps_between(ev), key=lambda g: -g[0])[:steps - 1]
    cuts = sorted(at[id(b)] for _, _, b in widest)
    return [ev[a:b] for a, b in zip([0, *cuts], [*cuts, len(ev)])], "largest gaps"


def gaps(trace, steps: int = 1, top: int = 12) -> dict:
    """Per step of a trace of ``steps`` training steps (a path, or its events), means over the
    steps: the span from the first GPU event's start to the last one's end, kernel time and count,
    memsets and memcpys, idle time inside the span (gaps between events, overlaps counted once),
    the gaps by size; the ``top`` largest gaps, the gaps between steps, host graph launches."""
    events = load_trace(trace) if isinstance(trace, str) else trace
    ev = _device_events(events)
    if not ev:
        raise ValueError("no GPU events in the trace")
    launches = [e for e in events
                if e.get("ph") == "X" and _GRAPH_LAUNCH.match(str(e.get("name", "")))]
    groups, split = _split_steps(ev, launches, steps)
    hist = [[0, 0.0] for _ in GAP_BUCKETS]
    per_step, largest = [], []
    for i, g in enumerate(groups):
        within = _gaps_between(g)
        for us, a, b in within:
            h = hist[next(j for j, (hi, _) in enumerate(GAP_BUCKETS) if us < hi)]
            h[0], h[1] = h[0] + 1, h[1] + us
            largest.append({"us": us, "step": i + 1, "before": a["name"], "after": b["name"]})
        count = lambda kind: sum(d["kind"] == kind for d in g)
        kernel_us = sum(d["end"] - d["ts"] for d in g if d["kind"] == "kernel")
        per_step.append({"span_ms": (max(d["end"] for d in g) - g[0]["ts"]) / 1e3,
                         "kernel_ms": kernel_us / 1e3, "idle_ms": sum(w[0] for w in within) / 1e3,
                         "kernels": count("kernel"), "memsets": count("memset"),
                         "memcpys": count("memcpy")})
    mean = {k: statistics.fmean(r[k] for r in per_step) for k in per_step[0]}
    graph_corr = {_corr(e) for e in launches}
    return {"steps": steps, "split": split, **mean, "busy_ms": mean["span_ms"] - mean["idle_ms"],
            "per_step": per_step,
            "histogram": [{"bucket": label, "count": n / steps, "ms": us / 1e3 / steps}
                          for (_, label), (n, us) in zip(GAP_BUCKETS, hist)],
            "largest": sorted(largest, key=lambda r: -r["us"])[:top],
            "between_steps_us": [b[0]["ts"] - max(d["end"] for d in a)
                                 for a, b in zip(groups, groups[1:])],
            "graph_launches": len(launches),
            "in_graph": sum(d["corr"] in graph_corr for d in ev) / len(ev)}


def gaps_markdown(res: dict, title: str = "") -> str:
    """``gaps`` as tables: the step's numbers, the gaps by size, the largest gaps."""
    ps = lambda k, f: " / ".join(f.format(r[k]) for r in res["per_step"])
    between = ", ".join(f"{x:.2f}" for x in res["between_steps_us"]) or "—"
    graph = (f"{res['graph_launches']} graph launches on the host; {100 * res['in_graph']:.0f} % "
             "of the GPU events launched by one" if res["graph_launches"]
             else "no graph launches on the host")
    lines = [f"{title}\n" if title else "",
             f"Per step, mean of {res['steps']} (steps split by {res['split']}):", "",
             "| | per step | each step |", "|---|---|---|",
             f"| span, first GPU event's start to last end | {res['span_ms']:.2f} ms | "
             f"{ps('span_ms', '{:.2f}')} |",
             f"| kernel time (sum) | {res['kernel_ms']:.2f} ms | {ps('kernel_ms', '{:.2f}')} |",
             f"| busy (union of events) | {res['busy_ms']:.2f} ms | |",
             f"| idle between events | **{res['idle_ms']:.3f} ms** | {ps('idle_ms', '{:.3f}')} |",
             f"| kernels / memsets / memcpys | {res['kernels']:g} / {res['memsets']:g} / "
             f"{res['memcpys']:g} | |",
             f"| gap between steps | {between} µs | |", f"| CUDA graph | {graph} | |",
             "", "| gap | count / step | ms / step |", "|---|---|---|"]
    lines += [f"| {h['bucket']} | {h['count']:.1f} | {h['ms']:.4f} |" for h in res["histogram"]]
    lines += ["", "| largest gaps, µs | step | event before | event after |", "|---|---|---|---|"]
    lines += [f"| {r['us']:.2f} | {r['step']} | `{r['before'][:60]}` | `{r['after'][:60]}` |"
              for r in res["largest"]]
    return "\n".join(lines).lstrip("\n") + "\n"


# host phases of one JAX call, in the order the runtime enters them
HOST_PHASES = ("ParseArguments", "ExecutePrepare", "Build buffer allocations", "Thunks::Initialize",
               "command_buffer::update", "cuGraphLaunch", "CreateOutputs")
_LAUNCH_API = re.compile(r"^cu(da)?(GraphLaunch|LaunchKernel)")


def _outermost(ev: list[dict]) -> list[dict]:
    """Events of one thread not inside an earlier one (by start, then the longer first)."""
    out, end = [], float("-inf")
    for e in sorted(ev, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e.get("dur", 0.0)
    return out


def host(trace, call_marker: str = "PjitFunction(") -> dict:
    """The host's side of each jitted call in a JAX trace (the outermost ``call_marker`` events of
    the thread that makes them): the call's length, the time from its start to its first launch
    (a CUDA graph or a kernel), which a step waited for adds to the GPU's time, and the
    ``HOST_PHASES`` inside it. Medians over the calls, µs. In calls dispatched back to back the
    graph launch blocks while the previous step runs, so its own length is not host work."""
    events = load_trace(trace) if isinstance(trace, str) else trace
    xs = [e for e in events if e.get("ph") == "X"]
    marks = [e for e in xs if str(e.get("name", "")).startswith(call_marker)]
    if not marks:
        raise ValueError(f"no {call_marker!r} events in the trace")
    thread = statistics.mode((e["pid"], e["tid"]) for e in marks)
    same = [e for e in xs if (e["pid"], e["tid"]) == thread]
    calls = _outermost([e for e in marks if (e["pid"], e["tid"]) == thread])
    rows = []
    for c in calls:
        lo, hi = c["ts"], c["ts"] + c.get("dur", 0.0)
        inside = [e for e in same if lo <= e["ts"] < hi]
        launch = min((e["ts"] for e in inside if _LAUNCH_API.match(str(e["name"]))), default=None)
        phases = {ph: sum(e.get("dur", 0.0) for e in inside if ph in str(e["name"]))
                  for ph in HOST_PHASES}
        rows.append({"call_us": hi - lo, "to_launch_us": None if launch is None else launch - lo,
                     **{f"{ph}_us": v for ph, v in phases.items()}})
    med = lambda k: (statistics.median(v) if (v := [r[k] for r in rows if r[k] is not None])
                     else None)
    return {"calls": len(rows), **{k: med(k) for k in rows[0]}, "per_call": rows}


def host_markdown(res: dict, title: str = "") -> str:
    fmt = lambda x: "—" if x is None else f"{x:.0f}"
    lines = [f"{title}\n" if title else "",
             f"Host side of {res['calls']} jitted calls, median µs:", "",
             "| | µs |", "|---|---|",
             f"| call | {fmt(res['call_us'])} |",
             f"| call start to first launch | **{fmt(res['to_launch_us'])}** |"]
    lines += [f"| {ph} | {fmt(res[ph + '_us'])} |" for ph in HOST_PHASES]
    return "\n".join(lines).lstrip("\n") + "\n"


def _print_summary(shape, pss, spec, s, tag=""):
    fmt = lambda x: "—" if x is None else f"{x:.3f}"
    print(f"{shape} {pss} {spec:>20}{tag}: wait {fmt(s['wait_ms'])}  span {fmt(s['span_ms'])}  "
          f"busy {fmt(s['busy_ms'])}  idle {fmt(s['idle_ms'])} ms  | "
          + "  ".join(f"{n[:32]} {fmt(t)}" for n, t in s["kernels_ms"].items()))


def trace_variant(fn, args, calls: int, log_dir: str) -> list[dict]:
    import jax

    jax.block_until_ready(fn(*args))  # compile, warm up
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    return split_calls(load_trace(log_dir))


def _emit(text: str, out: str | None) -> None:
    """Print a table, and write it to ``out`` when given."""
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(text, end="")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4x8192x16x128")
    p.add_argument("--pass", dest="pss", default="fwd+bwd", choices=("fwd", "bwd", "fwd+bwd"))
    p.add_argument("--variants", default="new")
    p.add_argument("--entries", default=None, help="JSON file: NAME -> entry (default lab.ab's)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--from-json", default=None, help="print a saved --out file (no GPU), with halves")
    p.add_argument("--smi", default=None, help="summarise an nvidia-smi CSV log (no GPU)")
    p.add_argument("--busy-watts", type=float, default=300.0)
    p.add_argument("--families", default=None, metavar="TRACE",
                   help="kernel time per op family of a training-step trace (no GPU), with --hlo")
    p.add_argument("--hlo", default=None, help="the step's optimized HLO text (.txt or .txt.gz)")
    p.add_argument("--gaps", default=None, metavar="TRACE",
                   help="idle gaps between a step trace's GPU events (no GPU), with --steps")
    p.add_argument("--host", default=None, metavar="TRACE",
                   help="the host's side of each jitted call in a JAX trace (no GPU)")
    p.add_argument("--steps", type=int, default=1, help="steps in the --families / --gaps trace")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary size (logits' axis)")
    p.add_argument("--top", type=int, default=12, help="largest kernels (or gaps) listed")
    a = p.parse_args(argv)
    if a.host:
        return _emit(host_markdown(host(a.host)), a.out)
    if a.gaps:
        return _emit(gaps_markdown(gaps(a.gaps, a.steps, a.top)), a.out)
    if a.families:
        index = None
        if a.hlo:
            raw = open(a.hlo, "rb").read()
            index = HloIndex((gzip.decompress(raw) if a.hlo.endswith(".gz") else raw).decode())
        res = families(load_trace(a.families), index, steps=a.steps, vocab=a.vocab)
        return _emit(families_markdown(res, top=a.top), a.out)
    if a.smi:
        print(json.dumps(smi_summary(a.smi, a.busy_watts)))
    if a.from_json:
        saved = json.load(open(a.from_json))
        shape = "x".join(str(x) for x in saved["shape"])
        for spec, v in saved["variants"].items():
            _print_summary(shape, saved["pass"], spec, summarize(v["rows"]), " all")
            for tag, h in zip((" 1st half", " 2nd half"), halves(v["rows"])):
                _print_summary(shape, saved["pass"], spec, h, tag)
    if a.smi or a.from_json:
        return
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_flash
    from bench.attention import _jax_pass
    from lab import ab

    shape = tuple(int(x) for x in a.shape.split("x"))
    entries = json.load(open(a.entries or ab.ENTRIES))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    out = {"shape": list(shape), "pass": a.pss, "jax_version": jax.__version__,
           "device": jax.devices()[0].device_kind, "variants": {}}
    for spec in a.variants.split(","):
        fn = _jax_pass(ab._attention_fn(spec, {"new": jax_flash}, entries, True, "fa2"), a.pss,
                       ab.compiler_options(spec))
        rows = trace_variant(fn, (q, k, v), a.calls, tempfile.mkdtemp(prefix="trace-"))
        s = summarize(rows)
        out["variants"][spec] = {**s, "rows": rows}
        _print_summary(a.shape, a.pss, spec, s)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
