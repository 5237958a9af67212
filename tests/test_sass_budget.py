"""CPU: the sm_90a grouped GEMM's K loop, compiled here (CuTeDSL, no GPU) and disassembled (nvdisasm from the [dev]
extra's nvidia-cuda-nvdisasm), stays within its instruction budget, and its decode is what notebook 04b describes: per K
tile and consumer thread, one HMUL2 per fragment register (32), four rotations per code word (32 SHF), eight HGMMA,
no byte permutes (the old per-scale spread), each B descriptor one 64-bit add to the stage's first, and one wait per
tile in the plain loop (8 WGMMAs, one commit group, one wait for all; an earlier overlapped loop that waited per K
block gave wrong sums under an older ptxas). The overlapped bf16 loop (`GemmConfig.overlap`) waits per half tile and
decodes each half while the half before it runs, touching no register of a WGMMA in flight. The W4A8 loops: the F2FP one (E4M3 to f16 and back, two HMUL2 per
register) and the table one (`GemmConfig.table`: two PRMTs per code word, no conversion, no multiply, fewer instructions).
The epilogues: the plain kinds issue all their global loads before their first store, SWIGLU_BF16 one chunk of scales
at a time."""
import pytest

pytest.importorskip("cutlass")
from dsv4_nvfp4.gemm import sm90 as L
from dsv4_nvfp4.gemm import sm90_kernel as S


@pytest.mark.parametrize("row_map", [False, True])         # (the EP receiver's L2: the row map changes the store only)
@pytest.mark.parametrize("tt", sorted(L.CONFIGS))
def test_mainloop_sass_budget(tt, row_map):
    cfg = L.CONFIGS[tt]._replace(epilogue=L.Epilogue.BF16_ROW_GS, row_map=True) if row_map else L.CONFIGS[tt]
    body = S.mainloop_sass(cfg)
    ops = S.sass_opcodes(body)
    n = sum(ops.values())
    assert n <= S.MAINLOOP_SASS_BUDGET, f"tok_tile {tt}: {n} SASS instructions per K tile > {S.MAINLOOP_SASS_BUDGET}: {ops}"
    assert ops.get("HMUL2") == 32 and ops.get("HGMMA") == 8, ops
    assert ops.get("SHF") == 8 * len({s for r in L.DECODE_ROTATIONS for s in r} - {0}), ops
    assert "PRMT" not in ops and "LDS" in ops and ops["LDS"] == 3, ops
    # every multiply takes one half of a scale pair: the half selector folded into HMUL2's operand
    assert all(".H0_H0" in s or ".H1_H1" in s for s in body if s.startswith("HMUL2")), [s for s in body if s.startswith("HMUL2")][:4]
    waits = [s for s in body if s.startswith("WARPGROUP.DEPBAR")]
    if cfg.overlap:                          # a fence and a wait per half tile, each wait leaving the younger half in flight
        assert len(waits) == 2 and all(w.endswith("gsb0, 0x1") for w in waits) and ops["WARPGROUP"] == 4, (waits, ops)
    else:                                    # decode the tile, 8 WGMMAs, wait for all: that wait and one fence
        assert len(waits) == 1 and waits[0].endswith("gsb0, 0x0") and ops["WARPGROUP"] == 2, (waits, ops)
    # the B descriptors: the stage's first plus a 64-bit add per K block, not re-packed from halves per HGMMA (2 UMOV each)
    assert sum(s.startswith("UIADD3.64") for s in body) == 7 and ops.get("UMOV", 0) <= (4 if cfg.overlap else 2), ops


def _in_flight(body: list[str], opcode: str) -> tuple[int, int]:
    "(instructions of `opcode` issued while some WGMMA commit group is in flight, all of them), per trip (two traced)."
    ops = [S._unpredicated(s).split() for s in body]
    groups, n, tot = 0, 0, 0
    for op in ops + ops:
        if op[0].startswith(("HGMMA", "QGMMA")) and op[-1] == "gsb0": groups += 1
        elif op[0].startswith("WARPGROUP.DEPBAR"): groups = min(groups, int(op[-1], 16))
        elif op[0].startswith(opcode):
            tot += 1
            n += groups > 0
    return n // 2, tot // 2


_OVERLAPPED = [c for c in [*L.CONFIGS.values(), *L.DECODE_WIDE.values()] if c.overlap]


@pytest.mark.parametrize("epi", ["BF16", "SWIGLU_NVFP4", "BF16_ROW_GS+row_map"])
@pytest.mark.parametrize("cfg", _OVERLAPPED, ids=[f"tt{c.tok_tile}x{c.wgs}" for c in _OVERLAPPED])
def test_overlapped_loop_decodes_under_the_wgmmas(cfg, epi):
    # GemmConfig.overlap: a half tile is decoded while the half before it is in the tensor cores (measured 24 of the
    # 32 multiplies per tile; ptxas keeps the rest of the first half's after its wait). With one wait per whole tile
    # ptxas moved the whole decode behind the wait: nothing overlapped. The plain loop decodes nothing in flight
    c = cfg._replace(epilogue=getattr(L.Epilogue, epi.split("+")[0]), row_map=epi.endswith("row_map"))
    assert _in_flight(S.mainloop_sass(c), "HMUL2")[0] >= 16, c
    assert _in_flight(S.mainloop_sass(c._replace(overlap=False)), "HMUL2")[0] == 0, c


def test_fp8_overlap_only_in_the_prefill_plan():
    # overlap with fp8 is the overlapped W4A8 loop (test_overlapped_w4a8_loop): the W4A8 variant of every bf16
    # configuration turns the bf16 loop's overlap off, and the W4A8 plan takes W4A8_OV_CONFIG from W4A8_OV_MIN_ROWS
    # expected rows per expert with K % 512 == 0 (measured/w4a8_ov_s39_h200.json: 1.02-1.21x the plain loop's plan at
    # 192-1024 rows per expert; 0.54-0.91x at 12-64 (T = 512), 0.65-0.67x at 48 (Flash, T = 2048))
    from dsv4_nvfp4.gemm import Problem
    from dsv4_nvfp4.gemm.w4a8 import W4A8_OV_CONFIG, W4A8_OV_MIN_ROWS, Sm90W4A8Backend
    b = Sm90W4A8Backend()
    p = Problem(rows=4096, experts=8, n=256, k=4096, act="fp8", epilogue="bf16")
    for c in (*L.CONFIGS.values(), L.WIDE_CONFIG, *L.DECODE_WIDE.values()):
        assert not b.variant(c, p).overlap
    assert L.CONFIGS[128].overlap and not any(c.overlap for c in (L.CONFIGS[64], L.WIDE_CONFIG))
    # the record's rows, literally: Flash at T = 8192 (192 per expert) and Pro at 2048 (256) take it; Flash at 2048 (48)
    # and Pro at 512 (64) do not
    for rows, E, n, k, want in ((49152, 256, 4096, 4096, True), (12288, 48, 6144, 7168, True), (12288, 256, 4096, 4096, False),
                                (3072, 48, 7168, 3072, False)):
        for per_row in (False, True):
            assert b.plan(Problem(rows, E, n, k, act="fp8", per_row=per_row)).cfg.overlap == want, (rows, E, per_row)
    for epi in ("bf16", "swiglu_bf16"):
        for E, n, k in ((256, 4096, 4096), (256, 4096, 2048), (48, 7168, 3072), (48, 6144, 7168)):   # the peer shapes
            at = b.plan(Problem(rows=E * W4A8_OV_MIN_ROWS, experts=E, n=n, k=k, act="fp8", epilogue=epi, sms_free=7))
            assert at.cfg.overlap and at.cfg.fp8 and at.cfg[:3] == W4A8_OV_CONFIG[:3] and at.sms_free == 7
            assert at.cfg.epilogue.swiglu == (epi != "bf16")
            assert not b.plan(Problem(rows=E * W4A8_OV_MIN_ROWS - E, experts=E, n=n, k=k, act="fp8", epilogue=epi)).cfg.overlap
            assert not b.plan(Problem(rows=E * 1024, experts=E, n=n, k=k + 128, act="fp8", epilogue=epi)).cfg.overlap
        big = Problem(rows=1 << 16, experts=8, n=256, k=4096, act="fp8", epilogue=epi)
        assert not b.plan(big, L.CONFIGS[64]).cfg.overlap and not b.plan(big, L.CONFIGS[128]).cfg.overlap   # given: taken
        small = Problem(rows=16, experts=8, n=256, k=4096, act="fp8", epilogue=epi)
        assert b.plan(small, W4A8_OV_CONFIG).cfg.overlap                                  # given, at any row count
        with pytest.raises(ValueError, match="multiple of 512"):
            b.plan(small._replace(k=4096 + 128), W4A8_OV_CONFIG)


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


_PICKED = [L.CONFIGS[t] for t in sorted(L.CONFIGS)] + [L.WIDE_CONFIG, *L.DECODE_WIDE.values()]


@pytest.mark.parametrize("epi", ["BF16", "SWIGLU_NVFP4", "BF16_ROW_GS+row_map"])
@pytest.mark.parametrize("cfg", _PICKED, ids=[f"tt{c.tok_tile}x{c.wgs}" for c in _PICKED])
def test_no_register_of_an_hgmma_in_flight_is_touched(cfg, epi):
    # the deleted overlapped loop failed this in every one-warpgroup configuration (56-86 such instructions per trip
    # pair), with wrong sums where the timing exposed it; the plain loop waits for all 8 HGMMAs inside the tile. Every
    # configuration a plan can pick, four consumer warpgroups included
    body = S.mainloop_sass(cfg._replace(epilogue=getattr(L.Epilogue, epi.split("+")[0]), row_map=epi.endswith("row_map")))
    assert S.wgmma_hazards(body) == []


def test_wgmma_hazards_finds_what_it_should():
    mma = ["HGMMA.64x16x16.F32.BF16 R24, R40, gdesc[UR12], R24, gsb0", "HGMMA.64x16x16.F32.BF16 R24, R44, gdesc[UR12], R24, gsb0"]
    ok = ["LDS.128 R40, [R2+0x10]", "WARPGROUP.ARRIVE", *mma, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "FADD R50, R24, R30", "BRA `(.L_x_1)"]
    assert S.wgmma_hazards(ok) == []
    # A fragment rewritten while its HGMMA may still read it: the next trip's load lands before the wait
    late = ["LDS.128 R40, [R2+0x10]", "WARPGROUP.DEPBAR.LE gsb0, 0x1", *mma, "BRA `(.L_x_1)"]
    h = S.wgmma_hazards(late)
    assert len(h) == 1 and "trip 1 [0] LDS.128 R40" in h[0] and "A fragment of HGMMA [2]" in h[0]
    # leaving one in flight retires the older: a write to the older one's registers after the wait is fine, the younger's not
    assert S.wgmma_hazards([*mma, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MOV R41, R3", "@P0 IMAD.WIDE R46, R3, 0x4, R8"]) == \
        ["trip 0 [4] @P0 IMAD.WIDE R46, R3, 0x4, R8: writes the A fragment of HGMMA [1] in flight",
         "trip 1 [4] @P0 IMAD.WIDE R46, R3, 0x4, R8: writes the A fragment of HGMMA [1] in flight"]
    # the accumulator (64x16: 8 registers, R24-R31) may not be read or written in flight; R32 is not its
    acc = S.wgmma_hazards([mma[0], "FADD R50, R31, R2", "MOV R32, R2", "STG.E [R4], R24", "WARPGROUP.DEPBAR.LE gsb0, 0x0"])
    assert [s.split(": ")[1] for s in acc] == ["touches the accumulator of HGMMA [0] in flight"] * 4   # 2 per trip


@pytest.mark.parametrize("fp8", [False, True])
def test_slab_fragment_coordinates_are_cutedsls_a_fragment(fp8):
    # the tilings (sm90._frag_coords for bf16 k16, w4a8._frag_coords_fp8 for E4M3 k32) place each code where the
    # WGMMA A fragment CuTeDSL builds expects it: (row, K) of every register value of every thread, in register order
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import warpgroup
    from dsv4_nvfp4.gemm import w4a8 as W
    dt = cutlass.Float8E4M3FN if fp8 else cutlass.BFloat16
    row, col = W._frag_coords_fp8() if fp8 else L._frag_coords()
    mine = [[(int(r), int(c)) for r, c in zip(row[t].flatten(), col[t].flatten())] for t in range(128)]
    got = []

    @cute.jit
    def coords():
        mma = sm90_utils.make_trivial_tiled_mma(dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                                                cutlass.Float32, (1, 1, 1), tiler_mn=(64, 8), a_source=warpgroup.OperandSource.RMEM)
        idA = cute.make_identity_tensor((64, 128))
        for t in cutlass.range_constexpr(128):
            tA = mma.get_slice(t).partition_A(idA)
            vals = []
            for i in cutlass.range_constexpr(cute.size(tA)):
                vals.append(tuple(int(x) for x in tA[i]))
            got.append(vals)
    cute.compile(coords, options="--gpu-arch=sm_90a")                    # traced here: the coordinates are static
    assert got == mine


@pytest.mark.parametrize("epi", ["BF16_ROW_GS", "SWIGLU_BF16"])
@pytest.mark.parametrize("tt", sorted(L.CONFIGS))
def test_w4a8_mainloop_compiles_to_fp8_wgmma(tt, epi):
    # the W4A8 loop (GemmConfig.fp8): per K tile and thread, 16 A registers of 4 E4M3 bytes from 8 code words: two
    # F2FP up, two HMUL2 and two F2FP down per register, one F2FP per scale pair; four k32 FP8 WGMMAs into a tile
    # accumulator that one FADD per element adds into the fp32 sum after the wait; no hazard
    cfg = L.CONFIGS[tt]._replace(fp8=True, overlap=False, epilogue=getattr(L.Epilogue, epi))
    body = S.mainloop_sass(cfg)
    ops = S.sass_opcodes(body)
    assert ops.get("QGMMA") == 4 and "HGMMA" not in ops, ops
    assert all(f"QGMMA.64x{tt}x32.F32.E4M3.E4M3" in s for s in body if "GMMA" in s)
    assert ops.get("HMUL2") == 32 and ops.get("F2FP") == 16 * 4 + 8, ops
    assert ops.get("FADD") == tt // 2, ops                                 # each tile's sum promoted into fp32: one per accumulator
    assert sum(ops.values()) <= 190 + tt // 2, ops                         # measured 183-247 (tok_tile 8-128)
    assert S.wgmma_hazards(body) == []


def test_w4a8_config_needs_the_per_row_epilogue():
    ok, why = S.GroupedGemmSm90.can_implement(L.CONFIGS[8]._replace(fp8=True, overlap=False), 4, smem_limit=L.HOPPER_SMEM_PER_BLOCK)
    assert not ok and "BF16_ROW_GS and SWIGLU_BF16" in why
    assert S.GroupedGemmSm90.can_implement(L.CONFIGS[8]._replace(fp8=True, overlap=False, epilogue=L.Epilogue.BF16_ROW_GS), 4,
                                           smem_limit=L.HOPPER_SMEM_PER_BLOCK)[0]


def test_w4a8_kernel_compiles_for_the_thin_launch_path():
    # the GPU launches through TVM-FFI (E4M3 activations and the fp32 2^c table as DLPack tensors)
    pytest.importorskip("tvm_ffi")
    for epi in (L.Epilogue.BF16_ROW_GS, L.Epilogue.SWIGLU_BF16):
        assert S.compile_sm90(L.CONFIGS[16]._replace(fp8=True, overlap=False, epilogue=epi), tvm_ffi=True) is not None


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("tt", [64, 32, 16, 8])
def test_four_consumer_warpgroups(tt, fp8):
    # wgs = 4 (five warpgroups, 640 threads): the producer gives registers back and the consumers take CONSUMER_REGS_4
    # (setmaxnreg, within the 96 per thread the launch gives); the K loop is the two-warpgroup one (the decode tiles'
    # bf16 loop overlapped: a second fence and wait), no spills, no hazard; the configurations the plan picks:
    # WIDE_CONFIG and DECODE_WIDE
    base = L.WIDE_CONFIG if tt == 64 else L.DECODE_WIDE[tt]
    cfg = base._replace(epilogue=L.Epilogue.BF16_ROW_GS, fp8=fp8, overlap=base.overlap and not fp8)
    assert S.GroupedGemmSm90.can_implement(cfg, 256, 4096, smem_limit=L.HOPPER_SMEM_PER_BLOCK) == (True, "")
    assert S.PRODUCER_REGS * 128 + S.CONSUMER_REGS_4 * 512 <= 96 * 640
    ptx = " ".join(S.kernel_artifact(cfg, "ptx").decode().split())
    assert f"setmaxnreg.dec.sync.aligned.u32 {S.PRODUCER_REGS};" in ptx and f"setmaxnreg.inc.sync.aligned.u32 {S.CONSUMER_REGS_4};" in ptx
    body = S.mainloop_sass(cfg)
    ops = S.sass_opcodes(body)
    assert "LDL" not in ops and "STL" not in ops, ops
    assert ops.get("QGMMA" if fp8 else "HGMMA") == (4 if fp8 else 8) and S.wgmma_hazards(body) == []
    two = S.sass_opcodes(S.mainloop_sass(L.CONFIGS[64]._replace(fp8=fp8, overlap=False, epilogue=L.Epilogue.BF16_ROW_GS)))
    assert abs(sum(ops.values()) - sum(two.values()) - (tt - 64) // 2 * fp8) <= 8, (ops, two)


def test_four_warpgroups_limits():
    ok, why = S.GroupedGemmSm90.can_implement(L.GemmConfig(128, 4, 4, L.Epilogue.BF16_ROW_GS, fp8=True), 8,
                                              smem_limit=L.HOPPER_SMEM_PER_BLOCK)
    assert not ok and "tok_tile <= 64" in why
    ok, why = S.GroupedGemmSm90.can_implement(L.GemmConfig(64, 3, 4), 8, smem_limit=L.HOPPER_SMEM_PER_BLOCK)
    assert not ok and "1, 2 or 4" in why


_TABLE = [L.CONFIGS[64], L.CONFIGS[128], L.WIDE_CONFIG]


@pytest.mark.parametrize("epi", ["BF16_ROW_GS", "SWIGLU_BF16"])
@pytest.mark.parametrize("cfg", _TABLE, ids=[f"tt{c.tok_tile}x{c.wgs}" for c in _TABLE])
def test_w4a8_table_loop(cfg, epi):
    # GemmConfig.table (gemm.w4a8.tile_weights_w4a8_table's slabs): per K tile and thread 8 code words, each one table
    # (a byte extract and two IMADs) and two PRMTs with their selector masks and sign merges: no F2FP and no HMUL2;
    # the same loads, four FP8 WGMMAs, one wait, no hazard, and fewer instructions than the F2FP loop (measured 62)
    f2fp = cfg._replace(fp8=True, overlap=False, epilogue=getattr(L.Epilogue, epi))
    body = S.mainloop_sass(f2fp._replace(table=True))
    ops = S.sass_opcodes(body)
    assert "F2FP" not in ops and "HMUL2" not in ops, ops
    assert ops.get("PRMT") == 16 and ops.get("QGMMA") == 4 and "HGMMA" not in ops and ops.get("LDS") == 3, ops
    assert ops.get("FADD") == cfg.tok_tile // 2 and "LDL" not in ops and "STL" not in ops, ops
    waits = [s for s in body if s.startswith("WARPGROUP.DEPBAR")]
    assert len(waits) == 1 and waits[0].endswith("gsb0, 0x0"), waits
    assert S.wgmma_hazards(body) == []
    n, n_f2fp = sum(ops.values()), sum(S.sass_opcodes(S.mainloop_sass(f2fp)).values())
    assert n <= n_f2fp - 50, (n, n_f2fp, ops)
    # the table kernel holds both K loops (each expert by its own decode, one uniform branch per unit outside them):
    # its other one is the F2FP kernel's loop (measured: one LOP3 became an ISETP), with no hazard either
    loops = S.mainloop_sass(f2fp._replace(table=True), every=True)
    plain = S.sass_opcodes(S.mainloop_sass(f2fp))
    k_loops = [l for l in loops if len(l) <= sum(plain.values()) + 2]     # not the unit loop (several hundred)
    assert len(k_loops) == 2 and body in k_loops, [len(l) for l in loops]
    other = [l for l in k_loops if l != body]
    o = S.sass_opcodes(other[0])
    assert all(o.get(k) == plain.get(k) for k in ("F2FP", "HMUL2", "QGMMA", "LDS", "WARPGROUP", "FADD")), (o, plain)
    assert abs(sum(o.values()) - sum(plain.values())) <= 2 and S.wgmma_hazards(other[0]) == [], (o, plain)


def _global_order(cfg):
    "'L' per global load and 'S' per global store, in the kernel's SASS order (the producer moves tiles by TMA)."
    ops = [S._unpredicated(s).split()[0] for s in S.kernel_sass(cfg)]
    return "".join("L" if o.startswith("LDG") else "S" for o in ops if o.startswith(("LDG", "STG")))


_EPI_CFGS = [L.CONFIGS[128], L.CONFIGS[8], *[c for c in L.DECODE_WIDE.values() if c.tok_tile == 32]]


@pytest.mark.parametrize("cfg", _EPI_CFGS, ids=[f"tt{c.tok_tile}x{c.wgs}" for c in _EPI_CFGS])
def test_epilogue_loads_run_ahead_of_their_stores(cfg):
    # loaded per element (per token in the SwiGLU kinds), each load sat right before its use, behind the previous
    # store, and waited out its latency: the row-mapped L2 was 616 against 527 + 67 us (2 H200s, 04b). The plain kinds
    # load every token's row, map entry and scale before the first store; SWIGLU_BF16 (W4A16's and W4A8's L1) a chunk of
    # SCALE_CHUNK tokens' scales at a time, so at most one run of loads per chunk follows a store. (SWIGLU_NVFP4 keeps
    # its per-token loads: chunked, the W4A4 layer was 4-6% slower on an H200, 04b.) (The order is read over the whole
    # kernel: the other global loads, the offsets, gs_w, W4A8's per-row 2^c, come before the epilogue today; a failure
    # here after a change elsewhere may be ptxas moving one of those, so look at the epilogue's SASS.)
    for epi, row_map, fp8 in [("BF16", False, False), ("BF16_ROW_GS", False, False), ("BF16_ROW_GS", True, False),
                              ("BF16_ROW_GS", False, True)]:
        c = cfg._replace(epilogue=getattr(L.Epilogue, epi), row_map=row_map, fp8=fp8, overlap=cfg.overlap and not fp8)
        if not S.GroupedGemmSm90.can_implement(c, 8)[0]: continue
        seq = _global_order(c)
        assert "S" in seq and "SL" not in seq, (epi, row_map, fp8, seq)
    nq = cfg.tok_tile // 4                                    # tokens per thread
    chunks = -(-nq // min(nq, S.SCALE_CHUNK))
    for epi, fp8 in [("SWIGLU_BF16", False), ("SWIGLU_BF16", True)]:
        c = cfg._replace(epilogue=getattr(L.Epilogue, epi), fp8=fp8, overlap=cfg.overlap and not fp8)
        if not S.GroupedGemmSm90.can_implement(c, 8)[0]: continue
        seq = _global_order(c)
        assert "S" in seq and seq.count("SL") <= chunks - 1, (epi, fp8, chunks, seq)


_GATHER = [c._replace(gather=True) for c in (L.CONFIGS[8], L.CONFIGS[16], L.CONFIGS[32], L.DECODE_WIDE[8], L.DECODE_WIDE[32])]


@pytest.mark.parametrize("cfg", _GATHER, ids=[f"tt{c.tok_tile}x{c.wgs}" for c in _GATHER])
def test_gather_variant_loads_one_row_per_copy(cfg):
    # GemmConfig.gather: the producer loads the unit's rows one by one through the map (two 64-wide TMA boxes per row
    # under the 128-byte swizzle, one per weight slab as before), nothing spills (a four-warpgroup producer has 40
    # registers), and the consumers' K loop is the plain variant's: the same decode and HGMMAs,
    # within four instructions in all (ptxas allocates the loop's bookkeeping around the changed producer: a UMOV, or two
    # R2UR and a ULEA at tile 16 with BF16_ROW_GS), inside the budget
    for epi in ("BF16", "BF16_ROW_GS"):
        c = cfg._replace(epilogue=getattr(L.Epilogue, epi))
        sass = S.kernel_sass(c)
        ops = S.sass_opcodes(sass)
        assert "LDL" not in ops and "STL" not in ops, (c, ops)
        plain = c._replace(gather=False)
        mine, theirs = S.sass_opcodes(S.mainloop_sass(c)), S.sass_opcodes(S.mainloop_sass(plain))
        assert all(mine.get(o) == theirs.get(o) for o in ("HGMMA", "HMUL2", "SHF", "LDS")), (c, mine, theirs)
        assert abs(mine.get("LOP3", 0) - theirs.get("LOP3", 0)) <= 2, (c, mine, theirs)   # (a ring-index LOP3 may go uniform)
        assert abs(sum(mine.values()) - sum(theirs.values())) <= 4 and sum(mine.values()) <= S.MAINLOOP_SASS_BUDGET, (c, mine, theirs)
        assert not S.wgmma_hazards(S.mainloop_sass(c)), c
    ptx = S.kernel_artifact(cfg, "ptx").decode()                # one loop over the unit's rows: lane i's map entry
    import re                                                   # shuffled to all, two boxes at that row, tok_tile x 128
    cp = re.findall(r"cp\.async\.bulk\.tensor\.2d\S*\s+\[(%r\d+)\+(\d+)\], \[%rd\d+, \{(%r\d+), (%r\d+)\}\]", ptx)
    assert len(cp) == 2 + cfg.wgs, (cfg, cp)                    # bytes apart in shared memory; the slabs' copies as before
    shuffled = set(re.findall(r"shfl\.sync\.idx\.b32\s+(%r\d+),", ptx))
    rows = [c for c in cp if c[3] in shuffled]
    assert len(rows) == 2 and rows[0][3] == rows[1][3] and rows[0][2] != rows[1][2], (cfg, rows)
    assert rows[0][0] == rows[1][0] and abs(int(rows[1][1]) - int(rows[0][1])) == cfg.tok_tile * 128, (cfg, rows)
    # the stage's barrier: the weights' bytes on the producer's arrive, the unit's rows' on one expect_tx before the copies
    arrive = re.findall(r"mov\.b32\s+(%r\d+), (\d+);\s+mbarrier\.arrive\.expect_tx\.shared\.b64 %rd\d+, \[%r\d+\], (%r\d+);", ptx)
    assert [int(n) for r, n, u in arrive if r == u] == [L.SLAB_BYTES * cfg.wgs], (cfg, arrive)
    assert ptx.count("mbarrier.expect_tx") == 1 and ptx.index("mbarrier.expect_tx") < ptx.index(rows[0][0] + "+" + rows[0][1]), cfg


_PDL = [L.CONFIGS[8]._replace(pdl=True), L.CONFIGS[16]._replace(pdl=True), L.CONFIGS[32]._replace(pdl=True),
        L.DECODE_WIDE[8]._replace(pdl=True)]


@pytest.mark.parametrize("cfg", _PDL, ids=[f"tt{c.tok_tile}x{c.wgs}" for c in _PDL])
def test_pdl_variant_waits_after_the_first_weights(cfg):
    # GemmConfig.pdl (the decode step's L2, a programmatic dependent of the L1): one griddepcontrol.wait, in the producer,
    # after the first ring's weight copies and before any activation copy; every kernel lets its dependents launch
    # (griddepcontrol.launch_dependents), the plain one never waits; the consumers' K loop is the plain one's; no spills
    import re
    plain = cfg._replace(pdl=False)
    ptx, ptx0 = S.kernel_artifact(cfg, "ptx").decode(), S.kernel_artifact(plain, "ptx").decode()
    assert ptx.count("griddepcontrol.wait;") == 1 and "griddepcontrol.wait" not in ptx0, cfg
    assert ptx.count("griddepcontrol.launch_dependents;") == 1 and ptx0.count("griddepcontrol.launch_dependents;") == 1, cfg
    wait = ptx.index("griddepcontrol.wait;")
    copies = [m.start() for m in re.finditer(r"cp\.async\.bulk\.tensor\.2d", ptx)]
    assert len(copies) == 2 * (cfg.wgs + 2), (cfg, len(copies))         # the prologue's, then the unit loop's: a slab per
    assert copies[cfg.wgs - 1] < wait < copies[cfg.wgs], cfg             # warpgroup, two 64-wide boxes of A (swizzle);
                                                                         # in the prologue the slabs, the wait, then A
    # every stage's barrier (the prologue's and the unit loop's) expects the weights and the A tile: a prologue stage
    # whose barrier counted the slabs alone would complete before its A landed
    regs = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64 \S+ \[\S+\], (%r\d+);", ptx)
    tx = {int(v) for r in regs for v in re.findall(r"mov\.[bus]32\s+" + re.escape(r) + r", (\d+);", ptx)}
    assert len(regs) == 2 and tx == {L.SLAB_BYTES * cfg.wgs + cfg.tok_tile * L.K_TILE * 2}, (cfg, regs, tx)
    ops = S.sass_opcodes(S.kernel_sass(cfg))
    assert "LDL" not in ops and "STL" not in ops, (cfg, ops)
    mine, theirs = S.sass_opcodes(S.mainloop_sass(cfg)), S.sass_opcodes(S.mainloop_sass(plain))
    assert all(mine.get(o) == theirs.get(o) for o in ("HGMMA", "HMUL2", "SHF", "LDS")), (cfg, mine, theirs)
    assert abs(mine.get("LOP3", 0) - theirs.get("LOP3", 0)) <= 2, (cfg, mine, theirs)   # (a ring-index LOP3 may go uniform)
    assert abs(sum(mine.values()) - sum(theirs.values())) <= 4 and sum(mine.values()) <= S.MAINLOOP_SASS_BUDGET, (cfg, mine, theirs)


def test_pdl_limits():
    # pdl's wait guards only the producer's loads of A: epilogues that read what the kernel before may write (per-row
    # scales, maps) and the gathered or FP8 activations are refused before anything compiles
    base = L.CONFIGS[8]._replace(pdl=True)
    assert S.GroupedGemmSm90.can_implement(base, 16, 1024)[0]
    for bad in (base._replace(epilogue=L.Epilogue.BF16_ROW_GS), base._replace(epilogue=L.Epilogue.SWIGLU_BF16),
                base._replace(gather=True), base._replace(row_map=True),
                base._replace(fp8=True, overlap=False, epilogue=L.Epilogue.BF16_ROW_GS)):
        ok, why = S.GroupedGemmSm90.can_implement(bad, 16, 1024)
        assert not ok and "pdl" in why, (bad, why)


@pytest.mark.parametrize("epi", ["BF16_ROW_GS", "SWIGLU_BF16"])
@pytest.mark.parametrize("tt", [64, 128])
def test_overlapped_w4a8_loop(tt, epi):
    # overlap with fp8 (mainloop_fp8_ov, two consumer warpgroups): 4 K tiles per trip, each decoded into one of two A
    # fragments while the tile before it is on the tensor cores; a wait leaving one group in flight after each tile
    # but the group's last, which drains (wait 0) and promotes the tile accumulator: one FADD per element per 4
    # tiles; the consumers take CONSUMER_REGS_2 (setmaxnreg), no spills, no hazard. Both loops of the table kernel
    # (the table decode and the F2FP one), each with fewer instructions per K tile than the plain loop's
    from dsv4_nvfp4.gemm.w4a8 import W4A8_OV_CONFIG
    plain = L.GemmConfig(tt, 2, 5 if tt == 64 else W4A8_OV_CONFIG.stages, getattr(L.Epilogue, epi), fp8=True, table=True)
    if tt == 128: assert plain._replace(overlap=True)[:3] == W4A8_OV_CONFIG[:3]     # the configuration the plan runs
    cfg = plain._replace(overlap=True)
    assert S.GroupedGemmSm90.can_implement(cfg, 256, 4096, smem_limit=L.HOPPER_SMEM_PER_BLOCK) == (True, "")
    assert S.PRODUCER_REGS * 128 + S.CONSUMER_REGS_2 * 256 <= 168 * 384        # the pool the launch gives 384 threads
    ptx = " ".join(S.kernel_artifact(cfg, "ptx").decode().split())
    assert f"setmaxnreg.dec.sync.aligned.u32 {S.PRODUCER_REGS};" in ptx and f"setmaxnreg.inc.sync.aligned.u32 {S.CONSUMER_REGS_2};" in ptx
    body = S.kernel_sass(cfg)
    assert not any(s.split()[0].startswith(("LDL", "STL")) for s in body)
    # and in the SASS: ptxas drops setmaxnreg (C7508) unless the launch holds the whole pool (min_blocks_per_mp=1)
    alloc = [s for s in body if s.startswith("USETMAXREG")]
    assert any("TRY_ALLOC" in s and hex(S.CONSUMER_REGS_2) in s for s in alloc), alloc
    assert any("DEALLOC" in s and hex(S.PRODUCER_REGS) in s for s in alloc), alloc
    loops = [l for l in S.mainloop_sass(cfg, every=True) if S.sass_opcodes(l).get("QGMMA") == 4 * S.W4A8_PROMOTE]
    base = [l for l in S.mainloop_sass(plain, every=True) if S.sass_opcodes(l).get("QGMMA") == 4]
    assert len(loops) >= 2 and len(base) >= 2, ([len(l) for l in loops], [len(l) for l in base])
    for name, body_, ref in (("table", loops[0], base[0]), ("F2FP", loops[1], base[1])):
        ops = S.sass_opcodes(body_)
        waits = [s for s in body_ if s.startswith("WARPGROUP.DEPBAR")]
        assert [w.split()[-1] for w in waits] == ["0x1"] * (S.W4A8_PROMOTE - 1) + ["0x0"], (name, waits)
        assert ops.get("FADD") == tt // 2 and ops.get("LDS") == 3 * S.W4A8_PROMOTE, (name, ops)
        assert all(f"QGMMA.64x{tt}x32.F32.E4M3.E4M3" in s for s in body_ if "GMMA" in s)
        assert S.wgmma_hazards(body_) == [], name
        per_tile, plain_tile = len(body_) / S.W4A8_PROMOTE, len(ref)
        assert per_tile <= plain_tile - 20, (name, per_tile, plain_tile)        # measured 114-186 against 149-249
        dec = "PRMT" if name == "table" else "F2FP"
        n, tot = _in_flight(body_, dec)
        assert tot > 0 and n >= 0.7 * tot, (name, n, tot)                     # the decode runs under the WGMMAs (measured 75%)


@pytest.mark.parametrize("tt", [64, 128])
def test_staged_w4a8_epilogue(tt):
    # the overlapped W4A8 loop's BF16_ROW_GS (the plan's prefill GEMM) stores through shared memory: per thread tt / 16
    # stmatrix.x4.trans (4 8x8 bf16 blocks each: its tt / 2 values), two named barriers of its warpgroup, tt / 16 16-byte
    # reads and as many 16-byte global stores, and not one 2-byte store; the SwiGLU kind and the plain loop keep the
    # per-element epilogue; the block (64 rows x tt bf16 per warpgroup) and the warpgroup's tt token scales are in
    # smem_bytes. Its scales are loaded at the unit's start (staged_prefetch: one token scale a thread, shared through
    # shared memory), so the kernel has no per-token global load: 8 LDG in all, where the per-element SwiGLU kind loads
    # each of a thread's tt / 4 tokens' scales (measured 40 and 72 at tt 64 and 128)
    E = L.Epilogue
    cfg = L.GemmConfig(tt, 2, 4, E.BF16_ROW_GS, fp8=True, table=True, overlap=True)
    assert L.staged_store(cfg) and not L.staged_store(cfg._replace(epilogue=E.SWIGLU_BF16))
    assert not L.staged_store(cfg._replace(overlap=False)) and not L.staged_store(L.CONFIGS[128]._replace(epilogue=E.BF16_ROW_GS))
    assert L.smem_bytes(cfg) - L.smem_bytes(cfg._replace(epilogue=E.SWIGLU_BF16)) == 2 * (L.WG_ROWS * tt * 2 + tt * 4)
    body = S.kernel_sass(cfg)
    assert not any(s.split()[0].startswith(("LDL", "STL")) for s in body)
    ops = [s.split()[1] if s.startswith("@") else s.split()[0] for s in body]
    assert ops.count("STSM.16.MT88.4") == tt // 16, [o for o in ops if o.startswith("STSM")]
    stg = [o for o in ops if o.startswith("STG")]
    assert stg == ["STG.E.128"] * (tt // 16), stg
    swi = S.kernel_sass(cfg._replace(epilogue=E.SWIGLU_BF16))
    assert not any("STSM" in s for s in swi) and any("STG.E.U16" in s for s in swi)
    bars = lambda b: sum("BAR.SYNC" in s for s in b)
    assert bars(body) == bars(swi) + 2, (bars(body), bars(swi))
    ldg = lambda b: sum((s.split()[1] if s.startswith("@") else s.split()[0]).startswith("LDG") for s in b)
    assert ldg(body) <= 8 and ldg(swi) >= ldg(body) + tt // 4, (ldg(body), ldg(swi))


def test_overlapped_w4a8_loop_limits():
    E = L.Epilogue.BF16_ROW_GS
    ok, why = S.GroupedGemmSm90.can_implement(L.GemmConfig(64, 4, 6, E, fp8=True, overlap=True), 8, 4096, smem_limit=L.HOPPER_SMEM_PER_BLOCK)
    assert not ok and "2 consumer warpgroups" in why
    ok, why = S.GroupedGemmSm90.can_implement(L.GemmConfig(64, 2, 5, E, fp8=True, overlap=True), 8, 4096 + 128, smem_limit=L.HOPPER_SMEM_PER_BLOCK)
    assert not ok and "multiple of 512" in why
    assert S.GroupedGemmSm90.can_implement(L.GemmConfig(64, 2, 5, E, fp8=True, overlap=True), 8, 1536, smem_limit=L.HOPPER_SMEM_PER_BLOCK)[0]
    # the staged epilogue stores tok_tile / 16 stmatrix blocks: tok_tile 8 would store nothing, so it is refused
    ok, why = S.GroupedGemmSm90.can_implement(L.GemmConfig(8, 2, 5, E, fp8=True, overlap=True), 8, 1536, smem_limit=L.HOPPER_SMEM_PER_BLOCK)
    assert not ok and "tok_tile >= 16" in why, why
