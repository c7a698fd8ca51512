"""lab.ncu_sass on a small hand-written Nsight Compute SASS export (two kernels)."""

import csv
import gzip
import io

import pytest

from lab import ncu_sass as ns

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "# Samples", "Instructions Executed",
          "stall_barrier", "stall_long_sb", "stall_selected", "stall_wait",
          "stall_barrier (Not Issued)", "stall_long_sb (Not Issued)"]

# (address, SASS, all samples, executed, barrier, long_sb, selected, wait). The "Not-issued" and
# "(Not Issued)" columns get values that would change every total if they were read as reasons.
KERNELS = {
    "jax_flash_dkdv_fa2": [
        (0x7F00, "      LDC R1, c[0x0][0x28]", 3, 16, 0, 0, 3, 0),
        (0x7F10, "      DEPBAR.LE SB0, 0x0", 5, 270, 0, 0, 1, 4),
        (0x7F20, "      BAR.SYNC.DEFER_BLOCKING 0x0", 100, 270, 0, 95, 2, 3),
        (0x7F30, "      HGMMA.64x64x16.F32.BF16 R152, gdesc[UR28], RZ, !UPT", 40, 270, 0, 0, 5, 10),
        (0x7F40, "      WARPGROUP.DEPBAR.LE gsb0, 0x0", 60, 270, 58, 0, 2, 0),
        (0x7F50, "      MUFU.EX2 R152, R185", 7, 270, 0, 0, 7, 0),
        (0x7F60, "@!P0  LDGSTS.E desc[UR32][R8.64], [R4]", 7, 270, 0, 0, 2, 5),
        (0x7F70, "      LDS.64 R214, [R22+0x18000]", 20, 270, 0, 0, 10, 10),
    ],
    "jax_flash_dq_fa2": [
        (0x9000, "      FFMA R1, R2, R3, R4", 9, 8, 0, 0, 9, 0),
        (0x9010, "      F2FP.BF16.F32.PACK_AB R194, R12, R11", 9, 8, 0, 0, 4, 5),
        (0x9020, "      LDG.E.128 R36, desc[UR32][R2.64]", 2, 8, 0, 0, 2, 0),
    ],
}


def export_text(kernels=KERNELS) -> str:
    buf = io.StringIO()
    buf.write("==PROF== Connected to process 1 (python3)\n")  # ncu's own lines before the first block
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for name, rows in kernels.items():
        buf.write(f'"Kernel Name","{name}",\n')
        w.writerow(HEADER)
        for addr, sass, total, executed, bar, lsb, sel, wait in rows:
            w.writerow([f"{addr:#x}", sass, total, 999, 777, executed, bar, lsb, sel, wait, 555, 444])
    return buf.getvalue()


@pytest.fixture
def kernels():
    return ns.parse(export_text())


def test_blocks_totals_and_reasons(kernels):
    dkdv, dq = kernels
    assert [k.name for k in kernels] == ["jax_flash_dkdv_fa2", "jax_flash_dq_fa2"]
    assert [len(k.instrs) for k in kernels] == [8, 3]
    assert dkdv.total == 242 and dq.total == 20  # the "All Samples" column, not "# Samples"
    rt = dkdv.reason_totals()
    assert rt == {"long_sb": 95, "barrier": 58, "selected": 32, "wait": 32, "unlisted": 25}
    assert list(rt)[:2] == ["long_sb", "barrier"]  # largest first
    # the HGMMA row's 40 samples: 15 in listed reasons, the other 25 in no exported column
    hgmma = dkdv.instrs[3]
    assert hgmma.reasons["unlisted"] == 25 and "unlisted" not in dkdv.instrs[2].reasons
    assert dq.reason_totals() == {"selected": 15, "wait": 5}
    assert dkdv.instrs[2].address == 0x7F20 and dkdv.instrs[2].executed == 270
    assert dkdv.instrs[6].sass.startswith("@!P0") and dkdv.instrs[6].opcode == "LDGSTS.E"


def test_gzip_and_plain_read_the_same(tmp_path):
    plain, packed = tmp_path / "x.csv", tmp_path / "x.csv.gz"
    plain.write_text(export_text())
    packed.write_bytes(gzip.compress(export_text().encode()))
    assert ns.read_text(plain) == ns.read_text(packed) == export_text()


@pytest.mark.parametrize("sass, group", [
    ("LDG.E.128 R36, desc[UR32][R2.64]", "global ld/st"),
    ("STG.E.128 desc[UR4][R2.64], R4", "global ld/st"),
    ("@!P0  LDGSTS.E desc[UR32][R8.64], [R4]", "cp.async/TMA"),
    ("LDGSTS.E.BYPASS.128 desc[UR32][R6.64], !P1, [R167]", "cp.async/TMA"),
    ("LDGDEPBAR", "cp.async/TMA"),
    ("UTMALDG.2D [UR8], [UR4]", "cp.async/TMA"),
    ("UBLKCP.S.G [UR4], [UR6], UR8", "cp.async/TMA"),
    ("LDS.64 R214, [R22+0x18000]", "shared ld/st"),
    ("LDSM.16.M88.4 R12, [R0+UR19]", "shared ld/st"),
    ("STS.128 [R2+UR19+0x10000], R36", "shared ld/st"),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", "barrier/sync"),
    ("DEPBAR.LE SB0, 0x0", "barrier/sync"),
    ("SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR4], RZ", "barrier/sync"),
    ("WARPSYNC.ALL", "barrier/sync"),
    ("MEMBAR.ALL.CTA", "fence"),
    ("FENCE.VIEW.ASYNC.S", "fence"),
    ("HGMMA.64x128x16.F32.BF16 R88, R184, gdesc[UR28].tnspB, R88", "wgmma start"),
    ("WARPGROUP.ARRIVE", "wgmma start"),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", "wgmma wait"),
    ("MUFU.EX2 R152, R185", "MUFU"),
    ("FFMA R1, R2, R3, R4", "FP32 math"),
    ("FMUL R215, R215, R215", "FP32 math"),
    ("FADD R185, -R218, R155", "FP32 math"),
    ("FMNMX R113, R116, R117, !PT", "FP32 math"),
    ("F2FP.BF16.F32.PACK_AB R194, R12, R11", "conversion"),
    ("F2F.F16.F32 R1, R2", "conversion"),
    ("IMAD.WIDE R6, R157, 0x2, R16", "integer/address"),
    ("NOP", "other"),
    ("BRA 0x7fe4e77afd40", "other"),
])
def test_classify(sass, group):
    assert ns.classify(ns.opcode(sass)) == group


def test_group_totals(kernels):
    dkdv, dq = kernels
    g = dkdv.group_totals()
    assert list(g) == ns.GROUP_NAMES  # every group, display order
    assert (g["barrier/sync"], g["wgmma start"], g["wgmma wait"], g["MUFU"], g["cp.async/TMA"],
            g["shared ld/st"], g["other"]) == (105, 40, 60, 7, 7, 20, 3)
    assert sum(g.values()) == dkdv.total
    assert dkdv.group_totals("long_sb")["barrier/sync"] == 95
    assert dkdv.group_totals("barrier") == dict.fromkeys(ns.GROUP_NAMES, 0) | {"wgmma wait": 58}
    assert dq.group_totals() == dict.fromkeys(ns.GROUP_NAMES, 0) | {
        "FP32 math": 9, "conversion": 9, "global ld/st": 2}


def test_top_order(kernels):
    dkdv, dq = kernels
    assert [i.opcode for i in dkdv.top(4)] == [
        "BAR.SYNC.DEFER_BLOCKING", "WARPGROUP.DEPBAR.LE", "HGMMA.64x64x16.F32.BF16", "LDS.64"]
    # ties (7 and 7 samples; 9 and 9; 10 and 10 wait samples) keep address order
    assert [i.index for i in dkdv.top(8)] == [2, 4, 3, 7, 5, 6, 1, 0]
    assert [i.index for i in dq.top(2)] == [0, 1]
    assert [i.index for i in dkdv.top(2, "wait")] == [3, 7]
    assert dkdv.instrs[2].top_reasons(2) == [("long_sb", 95), ("wait", 3)]


def test_cli_report(tmp_path, capsys):
    src, md = tmp_path / "p.csv.gz", tmp_path / "p.md"
    src.write_bytes(gzip.compress(export_text().encode()))
    assert ns.main([str(src), "--top", "2", "--md", str(md)]) == 0
    out = capsys.readouterr().out
    text = md.read_text()
    assert out.strip() in text and "## jax_flash_dkdv_fa2" in out and "## jax_flash_dq_fa2" in out
    dkdv = out.split("## jax_flash_dq_fa2")[0]
    assert "242 samples" in dkdv and "| long_sb | 95 | 39.3 % |" in dkdv
    assert "| barrier/sync | 105 | 43.4 % |" in dkdv
    table = dkdv.split("Top 2 instructions")[1].splitlines()
    top_rows = [line for line in table if line.startswith("| ") and not line.startswith("| #")]
    assert len(top_rows) == 2
    assert top_rows[0].startswith("| 2 | +0x20 | 100 | 41.3 % | barrier/sync | long_sb=95 wait=3")
    assert top_rows[1].startswith("| 4 | +0x40 | 60 | 24.8 % | wgmma wait | barrier=58")


def test_no_kernel_blocks_is_an_error(tmp_path):
    f = tmp_path / "empty.csv"
    f.write_text("==ERROR== no source page\n")
    assert ns.main([str(f)]) == 1


def test_compare_per_opcode(tmp_path, capsys):
    """--against: per-opcode executed instructions and samples, base → new, largest change first,
    and per entry of a reference opcode (--per)."""
    base = {"k": [(0x10, "MUFU.EX2 R1, R2", 5, 100, 0, 0, 5, 0), (0x20, "FADD R1, R2, R3", 4, 100, 0, 0, 4, 0),
                  (0x30, "FMNMX R1, R2, R3, !PT", 2, 100, 0, 0, 2, 0)]}
    new = {"k": [(0x10, "MUFU.EX2 R1, R2", 6, 100, 0, 0, 6, 0), (0x20, "FADD R1, R2, R3", 9, 200, 0, 0, 9, 0),
                 (0x30, "FSET.BF.GE.AND R4, R5, R6, PT", 3, 100, 0, 0, 3, 0),
                 (0x40, "@P0 FADD R1, R2, R3", 1, 50, 0, 0, 1, 0)]}
    a, b = tmp_path / "a.csv", tmp_path / "b.csv.gz"
    a.write_text(export_text(base))
    b.write_bytes(gzip.compress(export_text(new).encode()))
    totals = ns.opcode_totals(ns.parse(export_text(new))[0])
    assert totals["FADD"] == (250, 10)  # the predicated FADD is the same opcode
    md = tmp_path / "d.md"
    assert ns.main([str(b), "--against", str(a), "--per", "MUFU.EX2", "--md", str(md)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "k: executed 300 → 450 (+50.0 %), samples 11 → 19 (+72.7 %)"
    rows = [r for r in out.splitlines() if r.startswith("| `")]
    assert rows[0] == "| `FADD` | 100 | 250 | +150 | 1.000 | 2.500 | +1.500 | 4 | 10 | +6 |"
    assert rows[1].startswith("| `FMNMX` | 100 | 0 | -100 |") and rows[2].startswith("| `FSET.BF.GE.AND` | 0 | 100 | +100 |")
    assert "| **all** | 300 | 450 | +150 | 3.000 | 4.500 | +1.500 | 11 | 19 | +8 |" in out
    assert md.read_text().startswith("# Per opcode: a.csv → b.csv.gz")
    assert ns.main([str(b), "--against", str(a), "--per", "HGMMA.64x64x16.F32.BF16"]) == 1  # not in either


def test_main_loop_and_reason_deltas(tmp_path, capsys):
    """--loop keeps the instructions whose execution count carries the most executed instructions
    (not the most-executed one: a two-instruction spin loop), and the reason table follows."""
    def kernel(extra_fadd):
        rows = [(0x10, "LDC R1, c[0x0][0x28]", 1, 8, 0, 0, 1, 0),            # once per warp
                (0x20, "BRA 0x10", 50, 250, 0, 50, 0, 0),                     # spin: most executed
                (0x30, "MUFU.EX2 R1, R2", 5, 100, 0, 0, 2, 3),                # the loop: 100 each
                (0x40, "FMNMX R1, R2, R3, !PT", 2, 100, 0, 0, 2, 0),
                (0x50, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", 4, 100, 0, 0, 1, 3)]
        if extra_fadd:
            rows.append((0x60, "FADD R1, R2, R3", 6, 100, 0, 0, 2, 4))
        return {"k": rows}
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(export_text(kernel(False)))
    b.write_text(export_text(kernel(True)))
    loop = ns.main_loop(ns.parse(export_text(kernel(True)))[0])
    assert [i.opcode.split(".")[0] for i in loop.instrs] == ["MUFU", "FMNMX", "HGMMA", "FADD"]
    assert "100 executions each" in loop.name
    assert ns.main([str(b), "--against", str(a), "--loop", "--per", "MUFU.EX2"]) == 0
    out = capsys.readouterr().out
    assert "BRA" not in out and "LDC" not in out
    assert "| **all** | 300 | 400 | +100 | 3.000 | 4.000 | +1.000 | 11 | 17 | +6 |" in out
    assert "| wait | 6 | 10 | +4 |" in out and "| selected | 5 | 7 | +2 |" in out
    assert out.index("| wait |") < out.index("| selected |")  # largest increase first
    assert ns.main([str(b), "--against", str(a)]) == 0
    assert "| `BRA` | 250 | 250 | +0 |" in capsys.readouterr().out  # without --loop: every instruction
