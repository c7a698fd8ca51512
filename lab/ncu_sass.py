"""Where do a kernel's warp stalls sit, per SASS instruction? Reads Nsight Compute's source page
exported as CSV (``ncu --import R.ncu-rep --csv --page source --print-source sass``, written by
``SOURCE=1 bash lab/ncu_profile.sh``; plain or gzipped) and prints, per kernel: the
stall samples, their reasons, the instruction groups they sit on (cp.async, shared memory, barrier,
wgmma wait, MUFU, ...), which groups carry each of the top reasons, and the top-N instructions.

    python -m lab.ncu_sass FILE.csv[.gz] [--top N] [--md OUT.md]
    python -m lab.ncu_sass FILE.csv[.gz] --against BASE.csv[.gz] [--per MUFU.EX2] [--loop]

``--against``: what a variant adds, per opcode — executed (warp-level) instructions and stall samples
of the first kernel of each file side by side, largest change first, then samples per stall reason;
``--per OPCODE`` also divides the executed counts by that opcode's (e.g. ``MUFU.EX2``, one per score
entry in our forward: the change as instructions per entry); ``--loop`` compares the main loops only
(the instructions sharing the execution count that carries the most executed instructions).

Reading it: a sample is charged to the instruction the warp is *waiting to issue*, so a stall on an
instruction is a wait for something before it (a long-scoreboard stall on ``BAR.SYNC`` after
``DEPBAR.LE SB0`` is the wait for the cp.async copies; a stall on ``WARPGROUP.DEPBAR`` is the wait
for the wgmma results, which ncu counts as ``barrier``; the wait at a ``BAR.SYNC`` itself shows on
the instruction after it). ``selected`` samples are issues, not stalls. Samples that no exported reason
column accounts for (on Hopper: the ``warpgroup_arrive`` reason, which the CSV lacks) are reported
as ``unlisted``.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
UNLISTED = "unlisted"

# (group, base opcodes — the mnemonic before its first ".") in display order. WARPGROUP.* is matched
# on the full opcode first: WARPGROUP.DEPBAR is the wait for wgmma results, WARPGROUP.ARRIVE opens
# a wgmma batch.
GROUPS = [
    ("global ld/st", {"LDG", "STG", "LD", "ST", "ATOM", "ATOMG", "RED"}),
    ("cp.async/TMA", {"LDGSTS", "LDGDEPBAR", "UTMALDG", "UTMASTG", "UTMAPF", "UTMAREDG", "UTMACCTL",
                      "UBLKCP", "UBLKRED", "UBLKPF"}),
    ("shared ld/st", {"LDS", "STS", "LDSM", "STSM", "ATOMS"}),
    ("barrier/sync", {"BAR", "SYNCS", "DEPBAR", "WARPSYNC", "BSYNC", "ARRIVES"}),
    ("fence", {"MEMBAR", "FENCE"}),
    ("wgmma start", {"HGMMA", "QGMMA", "IGMMA", "BGMMA", "HMMA"}),
    ("wgmma wait", set()),
    ("MUFU", {"MUFU"}),
    ("FP32 math", {"FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK"}),
    ("conversion", {"F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "FRND"}),
    ("integer/address", {"IMAD", "IADD3", "IADD", "VIADD", "LEA", "SHF", "LOP3", "PLOP3", "ISETP",
                         "SEL", "MOV", "IABS", "IMNMX", "VIMNMX", "PRMT", "SGXT", "CS2R", "UIADD3",
                         "UMOV", "ULEA", "USHF", "ULOP3", "UISETP", "USEL", "USGXT", "UIMAD", "UPRMT"}),
    ("other", set()),
]
GROUP_NAMES = [g for g, _ in GROUPS]


def opcode(sass: str) -> str:
    """``"@!P0 LDGSTS.E [R1], ..."`` → ``"LDGSTS.E"`` (the predicate dropped)."""
    tokens = sass.split()
    if tokens and tokens[0].startswith("@"):
        tokens = tokens[1:]
    return tokens[0].rstrip(",;") if tokens else ""


def classify(op: str) -> str:
    if op.startswith("WARPGROUP."):
        return "wgmma wait" if op.startswith(("WARPGROUP.DEPBAR", "WARPGROUP.WAIT")) else "wgmma start"
    base = op.split(".")[0]
    for name, bases in GROUPS:
        if base in bases:
            return name
    return "other"


@dataclass
class Instr:
    index: int
    address: int
    sass: str
    samples: int
    executed: int
    reasons: dict[str, int]  # reason (without "stall_") → samples, incl. UNLISTED when > 0

    @property
    def opcode(self) -> str:
        return opcode(self.sass)

    @property
    def group(self) -> str:
        return classify(self.opcode)

    def top_reasons(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(((r, v) for r, v in self.reasons.items() if v), key=lambda x: -x[1])[:n]


@dataclass
class Kernel:
    name: str
    instrs: list[Instr] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(i.samples for i in self.instrs)

    def reason_totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in self.instrs:
            for r, v in i.reasons.items():
                out[r] = out.get(r, 0) + v
        return {r: v for r, v in sorted(out.items(), key=lambda x: -x[1]) if v}

    def group_totals(self, reason: str | None = None) -> dict[str, int]:
        """Samples per group (of one reason if given), every group listed, display order."""
        out = dict.fromkeys(GROUP_NAMES, 0)
        for i in self.instrs:
            out[i.group] += i.samples if reason is None else i.reasons.get(reason, 0)
        return out

    def top(self, n: int, reason: str | None = None) -> list[Instr]:
        """The n instructions with the most samples (of one reason if given); ties in address order."""
        key = (lambda i: i.samples) if reason is None else (lambda i: i.reasons.get(reason, 0))
        return sorted(self.instrs, key=lambda i: (-key(i), i.index))[:n]


def _int(s: str) -> int:
    s = s.strip().replace(",", "")
    return int(float(s)) if s not in ("", "-") else 0


def read_text(path: str | Path) -> str:
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return raw.decode("utf-8", errors="replace")


def parse(text: str) -> list[Kernel]:
    """One Kernel per ``"Kernel Name","<name>"`` block; the line after it is the block's header."""
    kernels: list[Kernel] = []
    header: list[str] | None = None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append(Kernel(row[1]))
            header = None
            continue
        if not kernels:  # ncu's own messages before the first block
            continue
        if header is None:
            header = row
            col = {h: n for n, h in enumerate(header)}
            reasons = [h for h in header if h.startswith("stall_") and not h.endswith("(Not Issued)")]
            continue
        samples = _int(row[col[SAMPLES]])
        rs = {h[len("stall_"):]: _int(row[col[h]]) for h in reasons}
        rest = samples - sum(rs.values())
        if rest > 0:
            rs[UNLISTED] = rest
        k = kernels[-1]
        k.instrs.append(Instr(len(k.instrs), int(row[col["Address"]], 16), row[col["Source"]].strip(),
                              samples, _int(row[col[EXECUTED]]) if EXECUTED in col else 0, rs))
    return kernels


def _pct(v: int, total: int) -> str:
    return f"{100 * v / total:.1f} %" if total else "–"


def report(kernels: list[Kernel], top: int = 15, reasons_shown: int = 6) -> str:
    out = []
    for k in kernels:
        t, base = k.total, (k.instrs[0].address if k.instrs else 0)
        rt = k.reason_totals()
        loop = main_loop(k)
        hot = loop.instrs[0].executed if loop.instrs else 0
        head = (f"{t} samples over {len(k.instrs)} instructions, {t - rt.get('selected', 0)} of "
                f"them stalled; {_pct(loop.total, t)} in the main loop ({len(loop.instrs)} "
                f"instructions, {hot} executions each).")
        out += [f"## {k.name}", "", head, "",
                "| reason | samples | share |", "|---|---:|---:|"]
        out += [f"| {r} | {v} | {_pct(v, t)} |" for r, v in rt.items()]
        out += ["", "| group | samples | share |", "|---|---:|---:|"]
        out += [f"| {g} | {v} | {_pct(v, t)} |"
                for g, v in sorted(k.group_totals().items(), key=lambda x: -x[1]) if v]
        out += ["", "Where the top reasons sit (share of that reason's samples):", ""]
        for r in [r for r in rt if r != "selected"][:reasons_shown]:
            g = sorted(k.group_totals(r).items(), key=lambda x: -x[1])
            gs = ", ".join(f"{n} {_pct(v, rt[r])}" for n, v in g[:3] if v)
            ins = ", ".join(f"SASS {i.index} {i.opcode} {i.reasons[r]}" for i in k.top(3, r)
                            if i.reasons.get(r))
            out.append(f"* **{r}** {rt[r]} ({_pct(rt[r], t)}): {gs}; top: {ins}")
        out += ["", f"Top {top} instructions (# = index in the kernel's SASS):", "",
                "| # | offset | samples | share | group | reasons | SASS |",
                "|---:|---:|---:|---:|---|---|---|"]
        for i in k.top(top):
            rs = " ".join(f"{r}={v}" for r, v in i.top_reasons())
            out.append(f"| {i.index} | +{i.address - base:#x} | {i.samples} | {_pct(i.samples, t)} "
                       f"| {i.group} | {rs} | `{i.sass[:64]}` |")
        out.append("")
    return "\n".join(out)


def opcode_totals(k: Kernel) -> dict[str, tuple[int, int]]:
    """opcode → (executed warp-level instructions, stall samples), summed over the kernel."""
    out: dict[str, tuple[int, int]] = {}
    for i in k.instrs:
        e, s = out.get(i.opcode, (0, 0))
        out[i.opcode] = (e + i.executed, s + i.samples)
    return out


def main_loop(k: Kernel) -> Kernel:
    """The instructions of the kernel's main loop: those sharing the execution count that carries the
    most executed instructions (straight-line code runs once per warp; a spin loop has few instructions)."""
    by_count: dict[int, int] = {}
    for i in k.instrs:
        by_count[i.executed] = by_count.get(i.executed, 0) + i.executed
    hot = max(by_count, key=by_count.get) if by_count else 0
    return Kernel(f"{k.name} (main loop: {hot:,} executions each)", [i for i in k.instrs if i.executed == hot])


def compare(base: Kernel, new: Kernel, per: str | None = None, rows: int = 25) -> str:
    """Per opcode, base vs new: executed instructions and samples, largest |Δ executed| first; then
    the samples per stall reason."""
    a, b = opcode_totals(base), opcode_totals(new)
    unit = (a.get(per, (0, 0))[0], b.get(per, (0, 0))[0]) if per else None
    if per and not all(unit):
        raise ValueError(f"--per {per}: the opcode is not executed in both kernels")
    ex_a, ex_b = sum(e for e, _ in a.values()), sum(e for e, _ in b.values())
    sm_a, sm_b = base.total, new.total

    def row(label, ops):
        ea, eb = sum(a.get(o, (0, 0))[0] for o in ops), sum(b.get(o, (0, 0))[0] for o in ops)
        sa, sb = sum(a.get(o, (0, 0))[1] for o in ops), sum(b.get(o, (0, 0))[1] for o in ops)
        per_unit = (f" | {ea / unit[0]:.3f} | {eb / unit[1]:.3f} | {eb / unit[1] - ea / unit[0]:+.3f}"
                    if unit else "")
        return f"| {label} | {ea:,} | {eb:,} | {eb - ea:+,}{per_unit} | {sa:,} | {sb:,} | {sb - sa:+,} |"

    extra = f" | per {per}, base | new | Δ" if per else ""
    out = [f"{new.name}: executed {ex_a:,} → {ex_b:,} ({_delta(ex_a, ex_b)}), samples {sm_a:,} → {sm_b:,} "
           f"({_delta(sm_a, sm_b)})", "",
           f"| opcode | executed, base | new | Δ{extra} | samples, base | new | Δ |",
           "|---|---:|---:|---:|" + ("---:|---:|---:|" if per else "") + "---:|---:|---:|"]
    ops = sorted(set(a) | set(b), key=lambda o: (-abs(b.get(o, (0, 0))[0] - a.get(o, (0, 0))[0]), o))
    out += [row(f"`{o}`", [o]) for o in ops[:rows]]
    if len(ops) > rows:
        out.append(row(f"{len(ops) - rows} others", ops[rows:]))
    out.append(row("**all**", ops))
    ra, rb = base.reason_totals(), new.reason_totals()
    out += ["", "| stall reason | samples, base | new | Δ |", "|---|---:|---:|---:|"]
    for r in sorted(set(ra) | set(rb), key=lambda r: (-(rb.get(r, 0) - ra.get(r, 0)), r)):
        out.append(f"| {r} | {ra.get(r, 0):,} | {rb.get(r, 0):,} | {rb.get(r, 0) - ra.get(r, 0):+,} |")
    return "\n".join(out) + "\n"


def _delta(a: int, b: int) -> str:
    return f"{100 * (b - a) / a:+.1f} %" if a else "–"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="ncu source-page CSV export (.csv or .csv.gz)")
    ap.add_argument("--top", type=int, default=15, help="instructions listed per kernel")
    ap.add_argument("--md", help="also write the report to this markdown file")
    ap.add_argument("--against", help="a base export: per-opcode changes from its first kernel to FILE's")
    ap.add_argument("--per", help="with --against: executed counts also per this opcode's (e.g. MUFU.EX2)")
    ap.add_argument("--loop", action="store_true", help="with --against: the main loops only (main_loop)")
    a = ap.parse_args(argv)
    kernels = parse(read_text(a.file))
    base = parse(read_text(a.against)) if a.against else None
    if not kernels or base == []:
        print(f"no 'Kernel Name' blocks in {a.file if not kernels else a.against}", file=sys.stderr)
        return 1
    try:
        pick = main_loop if a.loop else (lambda k: k)
        text = compare(pick(base[0]), pick(kernels[0]), a.per, max(a.top, 1)) if base else report(kernels, a.top)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    print(text)
    if a.md:
        title = (f"Per opcode: {Path(a.against).name} → {Path(a.file).name}" if base
                 else f"Warp stalls per instruction: {Path(a.file).name}")
        Path(a.md).write_text(f"# {title}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
