"""lab.kernel_isa's scan of dumped PTX and LLVM IR (the GPU run itself is ``python -m lab.kernel_isa``)."""

from lab.kernel_isa import isa_counts

PTX = """
.version 8.4
.target sm_90a
.visible .entry jax_flash_fwd_fa2(
    .param .u64 p0
)
{
    wgmma.fence.sync.aligned;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 0;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd3, %rd4, 1, 1, 1, 0, 0;
    wgmma.commit_group.sync.aligned;
    ex2.approx.f32 %f2, %f3;
}
.visible .entry jax_flash_dkdv_fa2(
    .param .u64 p0
)
{
    ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
}
"""

# Triton writes its MMAs into the LLVM IR as inline PTX
LLVM_IR = """
define ptx_kernel void @jax_flash_dq_fa2(ptr addrspace(1) %0) {
  %r = tail call { float } asm sideeffect "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 ...", "=f"()
  ret void
}
define internal void @helper() {
  ret void
}
"""


def test_counts_per_kernel_entry():
    """Instructions are charged to the kernel whose body holds them, and only the MMA itself counts
    (not the fences and commits around a wgmma)."""
    assert isa_counts(PTX) == {
        "jax_flash_fwd_fa2": {"wgmma": 2, "mma_sync": 0, "ldmatrix": 0, "ex2": 1},
        "jax_flash_dkdv_fa2": {"wgmma": 0, "mma_sync": 1, "ldmatrix": 1, "ex2": 0},
    }
    assert isa_counts("no entries here") == {}


def test_counts_in_llvm_ir():
    assert isa_counts(LLVM_IR) == {
        "jax_flash_dq_fa2": {"wgmma": 1, "mma_sync": 0, "ldmatrix": 0, "ex2": 0},
        "helper": {"wgmma": 0, "mma_sync": 0, "ldmatrix": 0, "ex2": 0},
    }
