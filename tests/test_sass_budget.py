"""CPU: the sm_90a grouped GEMM's K loop, compiled here (CuTeDSL, no GPU) and disassembled (nvdisasm from the [dev]
extra's nvidia-cuda-nvdisasm), stays within its instruction budget, and its decode is what notebook 04b describes: per K
tile and consumer thread, one HMUL2 per fragment register (32), four rotations per code word (32 SHF), eight HGMMA, and
no byte permutes (the old per-scale spread), and one wait per tile in every configuration (decode the tile, 8 WGMMAs, one
commit group, wait: the overlapped one-warpgroup loop that waited per K block was deleted, it gave wrong sums)."""
import pytest

pytest.importorskip("cutlass")
from dsv4_nvfp4.gemm import sm90 as L
from dsv4_nvfp4.gemm import sm90_kernel as S


@pytest.mark.parametrize("tt", sorted(L.CONFIGS))
def test_mainloop_sass_budget(tt):
    body = S.mainloop_sass(L.CONFIGS[tt])
    ops = S.sass_opcodes(body)
    n = sum(ops.values())
    assert n <= S.MAINLOOP_SASS_BUDGET, f"tok_tile {tt}: {n} SASS instructions per K tile > {S.MAINLOOP_SASS_BUDGET}: {ops}"
    assert ops.get("HMUL2") == 32 and ops.get("HGMMA") == 8, ops
    assert ops.get("SHF") == 8 * len({s for r in L.DECODE_ROTATIONS for s in r} - {0}), ops
    assert "PRMT" not in ops and "LDS" in ops and ops["LDS"] == 3, ops
    # every multiply takes one half of a scale pair: the half selector folded into HMUL2's operand
    assert all(".H0_H0" in s or ".H1_H1" in s for s in body if s.startswith("HMUL2")), [s for s in body if s.startswith("HMUL2")][:4]
    waits = [s for s in body if s.startswith("WARPGROUP.DEPBAR")]
    assert len(waits) == 1 and waits[0].endswith("gsb0, 0x0"), waits      # decode the tile, 8 WGMMAs, wait for all
    assert ops["WARPGROUP"] == 2, ops                                       # that wait and one fence


def test_mainloop_sass_finds_the_loop():
    # the helper sees the loop, not the whole kernel: a kernel has several hundred more instructions (epilogue, schedule)
    body = S.mainloop_sass(L.CONFIGS[16])
    assert 100 < len(body) < 400 and body[-1].split()[-1].startswith("`(.L_x_") and "BRA" in body[-1]


def test_kernel_artifact():
    ptx = S.kernel_artifact(L.CONFIGS[16], "ptx")
    assert b".target sm_90a" in ptx and b"wgmma.mma_async" in ptx and b"shf.l.wrap.b32" in ptx
    assert S.kernel_artifact(L.CONFIGS[16], "cubin")[:4] == b"\x7fELF"
    with pytest.raises(ValueError, match="'ptx' or 'cubin'"):
        S.kernel_artifact(L.CONFIGS[16], "sass")
