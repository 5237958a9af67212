"""GPU tests of the sm_90a NVFP4 grouped GEMM (dsv4_nvfp4.gemm.grouped_gemm_nvfp4 / wo_a_nvfp4 on the sm90
backend, kernel in dsv4_nvfp4.gemm.sm90_kernel).

Reference: the float64 GEMM of the same dequantized operands (weights `e2m1 * s * gs_w` built from the formats
tables, activations bf16 or `e2m1 * s` times gs_a), computed in float64 on the GPU. Pass criteria from the issue:
Frobenius relative error <= 2e-3 and >= 99% of the outputs within one bf16 ulp of the exact value. The "exact decode"
test needs no tolerance: with one-hot activation rows the output *is* a decoded weight, which bf16 holds exactly.
"""
import pytest
import torch

from dsv4_nvfp4 import formats as F
from dsv4_nvfp4 import quant as Q
from dsv4_nvfp4 import routing as R
from dsv4_nvfp4 import gemm as GC
from dsv4_nvfp4.gemm import sm90 as S90
from dsv4_nvfp4.gemm import sm90_kernel as S90K
from dsv4_nvfp4.formats import E2M1_VALUES
from dsv4_nvfp4.quant import ref_quantize_nvfp4
from _gpu_helpers import assert_gemm_close as assert_close, hopper, ref_grouped as ref

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
I32 = torch.int32


if torch.cuda.is_available() and not hopper():
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="the sm_90a kernel needs a Hopper GPU")]


def wdeq(we, gs=True):
    "float64 (E, N, K) weights of NVFP4Experts `we` (what the kernel must decode): e2m1 * s (* gs_w)."
    E, N, K = we.shape
    c = we.data.to(DEV)
    codes = torch.stack([c & 15, c >> 4], -1).view(E, N, -1).long()
    x = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=DEV)[codes]
    w = x * we.scale.to(DEV).double().repeat_interleave(16, -1)
    if gs: w = w * we.global_scale.to(DEV).double().view(E, 1, 1)
    return w[..., :K]


def experts(E, N, K, seed):
    "(the weights prepared for this GPU (the sm90 backend), the NVFP4Experts they were prepared from)."
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * (1 + 3 * torch.rand(E, 1, 1, generator=g))
    we = Q.quantize_experts(w)
    pw = GC.prepare_weights(we, device=DEV)
    assert type(pw) is S90.Sm90Weights
    return pw, we


def routed(T, E, k, seed, empty=1):
    "Random top-k routing of T tokens with expert `empty` given no rows (its tokens go to expert 0)."
    g = torch.Generator().manual_seed(seed)
    ids = R.random_topk(T, E, k, generator=g)
    ids[ids == empty] = 0
    rt = R.route_topk(ids, E)
    return rt.expert_offsets.to(DEV), rt.perm.numel()


# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tok_tile", sorted(S90.CONFIGS))
def test_exact_decode(tok_tile):
    # every code and scale (zero blocks, e4m3 subnormal scales, all 16 codes): one-hot rows return the weights exactly
    g = torch.Generator().manual_seed(7)
    w = torch.randn(2, 128, 256, generator=g) * torch.rand(2, 128, 1, generator=g) ** 8
    w[0, 3, :48] = 0
    we = Q.quantize_experts(w)
    we.global_scale.fill_(1.0)
    pw = GC.prepare_weights(we, device=DEV)
    assert (we.scale.float()[we.scale.float() > 0].min() < 2 ** -6) and F.unpack_fp4(we.data).unique().numel() == 16
    a = torch.eye(256, dtype=torch.bfloat16, device=DEV).repeat(2, 1)
    offs = torch.tensor([256, 512], dtype=I32, device=DEV)
    got = GC.grouped_gemm_nvfp4(a, pw, offs, config=S90.CONFIGS[tok_tile])
    want = torch.cat([wdeq(we)[0].T, wdeq(we)[1].T]).to(torch.bfloat16)
    assert torch.equal(got, want), f"{(got != want).sum().item()} decoded weights differ"


SHAPES = [(2048, 1024), (2048, 4096), (3072, 6144), (3072, 7168), (4096, 1024), (4096, 4096), (7168, 6144), (7168, 7168)]


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a4_rows"])
def test_grouped_gemm_shapes(K, N, mode):
    E = 6 if K * N <= 4096 * 4096 else 4
    pw, we = experts(E, N, K, seed=K + N)
    wd = wdeq(we)
    for T, k in ((1, 1), (9, 2), (53, 3)):                   # one token in total; ragged groups; rows % tile != 0
        offs, R = routed(T, E, k, seed=T)
        x = torch.randn(R, K, generator=torch.Generator().manual_seed(T)) * 3
        if mode == "w4a16":
            a = x.to(torch.bfloat16)
            got = GC.grouped_gemm_nvfp4(a.to(DEV), pw, offs, check=True)
            want = ref(a.to(DEV).double(), wd, offs.cpu())
        else:
            q = ref_quantize_nvfp4(x, per_row=mode == "w4a4_rows")
            au = (torch.tensor(E2M1_VALUES, dtype=torch.float64)[F.unpack_fp4(q.data).long()] *
                  q.scale.double().repeat_interleave(16, -1))[:, :K].to(DEV)
            gs = q.global_scale.double().to(DEV)
            got = GC.grouped_gemm_nvfp4(q.to(DEV), pw, offs, check=True)
            want = ref(au, wd, offs.cpu()) * (gs.view(-1, 1) if gs.dim() else gs)
        assert_close(got, want, f"{mode} K={K} N={N} T={T}")


@pytest.mark.parametrize("tok_tile", sorted(S90.CONFIGS))
def test_every_config_and_empty_experts(tok_tile):
    E, N, K = 10, 1024, 2048
    pw, we = experts(E, N, K, seed=3)
    wd = wdeq(we)
    sizes = torch.tensor([0, 5, 0, 0, 300, 17, 0, 1, 129, 0])           # empty experts first, last and in between
    offs = torch.cumsum(sizes, 0).to(I32).to(DEV)
    a = torch.randn(int(sizes.sum()), K, device=DEV).to(torch.bfloat16)
    got = GC.grouped_gemm_nvfp4(a, pw, offs, config=S90.CONFIGS[tok_tile], check=True)
    assert_close(got, ref(a.double(), wd, offs.cpu()), f"tok_tile={tok_tile}")


def test_every_configuration_gives_the_same_bits():
    """Each output row of the grouped GEMM is the same bits whatever configuration computes it (token tile, consumer
    warpgroups, stages): the plain and the fused SwiGLU epilogues (bf16 h, and W4A4's NVFP4 h). The layer relies on it
    where the same rows run in
    launches of different sizes (EP slices, captured graphs of other capacities)."""
    from dsv4_nvfp4 import swiglu as SW
    E, N, K = 6, 1024, 2048
    pw, _ = experts(E, N, K, seed=21)
    sizes = torch.tensor([1, 0, 3, 8, 2, 1])
    offs = torch.cumsum(sizes, 0).to(I32).to(DEV)
    R_ = int(sizes.sum())
    a = torch.randn(R_, K, generator=torch.Generator().manual_seed(21)).to(torch.bfloat16).to(DEV)
    rs = torch.stack([torch.ones(R_), torch.rand(R_, generator=torch.Generator().manual_seed(22))], 1).to(DEV)
    cfgs = list(S90.CONFIGS.values()) + [S90.WIDE_CONFIG] + list(S90.DECODE_WIDE.values())
    plain = [GC.grouped_gemm_nvfp4(a, pw, offs, config=c) for c in cfgs]
    fused = [SW.grouped_gemm_swiglu_nvfp4(a, pw, offs, swiglu_limit=7.0, row_scales=rs, scales_given=True, config=c) for c in cfgs]
    a2 = torch.rand(E, generator=torch.Generator().manual_seed(23)).to(DEV) * 0.01 + 1e-3   # W4A4's L1: h in NVFP4
    q4 = [SW.grouped_gemm_swiglu_nvfp4(a, pw, offs, swiglu_limit=7.0, row_scales=rs, scales_given=True, config=c,
                                       out_dtype="nvfp4", out_scale=a2) for c in cfgs]
    for c, y, h, q in zip(cfgs, plain, fused, q4):
        assert torch.equal(y, plain[0]) and torch.equal(h, fused[0]), f"{c} differs from {cfgs[0]}"
        assert torch.equal(q.data, q4[0].data) and torch.equal(q.scale.view(torch.uint8), q4[0].scale.view(torch.uint8)) \
            and torch.equal(q.global_scale, q4[0].global_scale), f"{c}: W4A4's NVFP4 h differs from {cfgs[0]}'s"


@pytest.mark.parametrize("K", [128, 384, 2048])
def test_overlapped_loop_is_the_plain_loop(K):
    """GemmConfig.overlap (each half tile decoded under the WGMMAs of the one before, two ring stages held at once)
    gives the plain loop's bits, for every configuration that has it: one K tile (the loop body never runs), an odd
    and an even count; ragged experts with an empty one; the plain and the NVFP4 SwiGLU epilogues; and a grid of one
    SM's CTAs (sms_free), so each CTA runs many units and the ring's phases carry from one unit's loop to the next."""
    from dsv4_nvfp4 import swiglu as SW
    E, N = 6, 1024
    pw, _ = experts(E, N, K, seed=43)
    g = torch.Generator().manual_seed(43)
    sizes = torch.tensor([1, 0, 37, 8, 2, 140])
    offs = torch.cumsum(sizes, 0).to(I32).to(DEV)
    R_ = int(sizes.sum())
    a = torch.randn(R_, K, generator=g).to(torch.bfloat16).to(DEV)
    rs = torch.stack([torch.ones(R_), torch.rand(R_, generator=g)], 1).to(DEV)
    a2 = torch.rand(E, generator=g).to(DEV) * 0.01 + 1e-3
    cfgs = [c for c in [*S90.CONFIGS.values(), *S90.DECODE_WIDE.values()] if c.overlap]
    assert len(cfgs) == 7
    for c in cfgs:
        for free in (0, 10_000):
            run = lambda cf: (GC.grouped_gemm_nvfp4(a, pw, offs, config=cf, sms_free=free),
                              SW.grouped_gemm_swiglu_nvfp4(a, pw, offs, swiglu_limit=7.0, row_scales=rs, scales_given=True,
                                                           config=cf, out_dtype="nvfp4", out_scale=a2, sms_free=free))
            (y, q), (y0, q0) = run(c), run(c._replace(overlap=False))
            assert torch.isfinite(y).all() and torch.equal(y, y0), (c, K, free)
            assert torch.equal(q.data, q0.data) and torch.equal(q.scale.view(torch.uint8), q0.scale.view(torch.uint8)), (c, K, free)


def test_pdl_variant_is_the_plain_bits():
    """GemmConfig.pdl (the decode L2's configuration, launched as a programmatic dependent; here with nothing before it,
    so its wait returns at once) gives the plain configuration's bits: ragged experts with an empty one; a grid of one
    SM's worth (sms_free), so a CTA's later units follow its prologue's; and a problem of fewer units than CTAs, so
    most CTAs find no unit at all. One- and four-warpgroup decode tiles."""
    E, N, K = 6, 1024, 2048
    pw, _ = experts(E, N, K, seed=41)
    g = torch.Generator().manual_seed(41)
    for sizes in ([1, 0, 3, 8, 2, 1], [0, 0, 1, 0, 0, 0]):
        sizes = torch.tensor(sizes)
        offs = torch.cumsum(sizes, 0).to(I32).to(DEV)
        R_ = int(sizes.sum())
        a = torch.randn(R_, K, generator=g).to(torch.bfloat16).to(DEV)
        for c in (S90.CONFIGS[8], S90.CONFIGS[16], S90.CONFIGS[32], S90.DECODE_WIDE[8]):
            want = GC.grouped_gemm_nvfp4(a, pw, offs, config=c)
            for free in (0, 10_000):
                got = GC.grouped_gemm_nvfp4(a, pw, offs, config=c._replace(pdl=True), sms_free=free)
                assert torch.isfinite(got).all() and torch.equal(got, want), (c, sizes.tolist(), free)


def test_k_padding():
    # K = 208: the weights are zero-padded to 256, the activations are not (TMA fills zeros past K)
    pw, we = experts(3, 1024, 208, seed=5)
    offs = torch.tensor([4, 4, 11], dtype=I32, device=DEV)
    a = torch.randn(11, 208, device=DEV).to(torch.bfloat16)
    assert_close(GC.grouped_gemm_nvfp4(a, pw, offs), ref(a.double(), wdeq(we), offs.cpu()), "K=208")


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("nvfp4", [False, True])
def test_wo_a_strided(T, nvfp4):
    G_, K, N = 8, 4096, 1024
    pw, we = experts(G_, N, K, seed=T)
    x = torch.randn(T, G_, K, generator=torch.Generator().manual_seed(1))
    wd = wdeq(we)
    if nvfp4:
        q = ref_quantize_nvfp4(x, per_row=True)                              # gs (T, G)
        xu = (torch.tensor(E2M1_VALUES, dtype=torch.float64)[F.unpack_fp4(q.data).long()] *
              q.scale.double().repeat_interleave(16, -1)).to(DEV)
        got = GC.wo_a_nvfp4(q.to(DEV), pw)
        want = torch.einsum("tgk,gnk->tgn", xu, wd) * q.global_scale.double().to(DEV)[..., None]
    else:
        xb = x.to(torch.bfloat16).to(DEV)
        ptr = xb.data_ptr()
        got = GC.wo_a_nvfp4(xb, pw)
        assert xb.data_ptr() == ptr
        want = torch.einsum("tgk,gnk->tgn", xb.double(), wd)
    assert got.shape == (T, G_, N)
    assert_close(got, want, f"wo_a T={T}")


def test_graph_replay_with_new_routing():
    E, N, K, T, k = 16, 2048, 2048, 8, 2
    pw, we = experts(E, N, K, seed=11)
    wd = wdeq(we)
    R = T * k
    a = torch.randn(R, K, device=DEV).to(torch.bfloat16)
    offs = torch.zeros(E, dtype=I32, device=DEV)
    out = torch.empty(R, N, dtype=torch.bfloat16, device=DEV)
    cfg = S90.pick_config(R, E)
    offs.copy_(routed(T, E, k, seed=0)[0])
    GC.grouped_gemm_nvfp4(a, pw, offs, out=out, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        GC.grouped_gemm_nvfp4(a, pw, offs, out=out, config=cfg)
    for seed in (1, 2, 3):
        offs.copy_(routed(T, E, k, seed=seed, empty=seed)[0])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, ref(a.double(), wd, offs.cpu()), f"replay {seed}")


def test_w4a4_workspace_and_out_no_allocation():
    E, N, K = 4, 1024, 2048
    pw, _ = experts(E, N, K, seed=2)
    offs = torch.tensor([3, 3, 9, 12], dtype=I32, device=DEV)
    q = ref_quantize_nvfp4(torch.randn(12, K)).to(DEV)
    ws = torch.empty(12, K, dtype=torch.bfloat16, device=DEV)
    out = torch.empty(12, N, dtype=torch.bfloat16, device=DEV)
    y = GC.grouped_gemm_nvfp4(q, pw, offs, out=out, workspace=ws)
    assert y.data_ptr() == out.data_ptr()
    y2 = GC.grouped_gemm_nvfp4(q, pw, offs)
    assert torch.equal(y, y2)


def test_bad_input_gpu():
    E, N, K = 4, 1024, 2048
    pw, _ = experts(E, N, K, seed=4)
    a = torch.randn(12, K, device=DEV).to(torch.bfloat16)
    offs = torch.tensor([3, 3, 9, 12], dtype=I32, device=DEV)
    with pytest.raises(TypeError, match="int32"):
        GC.grouped_gemm_nvfp4(a, pw, offs.long())
    with pytest.raises(ValueError, match=r"\(E,\)"):
        GC.grouped_gemm_nvfp4(a, pw, offs[:3])
    with pytest.raises(ValueError, match="non-decreasing"):
        GC.grouped_gemm_nvfp4(a, pw, torch.tensor([3, 2, 9, 12], dtype=I32, device=DEV), check=True)
    with pytest.raises(ValueError, match="end at the row count"):
        GC.grouped_gemm_nvfp4(a, pw, torch.tensor([3, 3, 9, 11], dtype=I32, device=DEV), check=True)
    with pytest.raises(ValueError, match="K mismatch"):
        GC.grouped_gemm_nvfp4(a[:, :1024].contiguous(), pw, offs)
    with pytest.raises(ValueError, match="out must have shape"):
        GC.grouped_gemm_nvfp4(a, pw, offs, out=torch.empty(12, N + 8, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="aligned"):
        GC.grouped_gemm_nvfp4(a, pw, offs, out=torch.empty(12 * N + 1, dtype=torch.bfloat16, device=DEV)[1:].view(12, N))
    with pytest.raises(ValueError, match="prepared for the reference backend on cpu, the activations are on cuda"):
        GC.grouped_gemm_nvfp4(a, GC.prepare_weights(Q.quantize_experts(torch.randn(E, N, K)), device="cpu"), offs)
    with pytest.raises(ValueError, match=r"prepared for the sm90 backend on cpu, the activations are on cuda"):
        GC.grouped_gemm_nvfp4(a, pw.to("cpu"), offs)
    # unchecked garbage offsets: clamped in the kernel, so it finishes and touches nothing outside the buffers
    out = torch.zeros(12 + 64, N, dtype=torch.bfloat16, device=DEV)
    bad = torch.tensor([7, 2, 1000, -5], dtype=I32, device=DEV)
    GC.grouped_gemm_nvfp4(a, pw, bad, out=out[:12])
    torch.cuda.synchronize()
    assert bool((out[12:] == 0).all())


@pytest.mark.parametrize("mode", ["w4a16", "w4a4_rows"])
def test_out_rows_is_the_plain_store_scattered(mode):
    """`out_rows`: the row-map variant stores row i of the plain product at out[out_rows[i]], the same bits; a map
    entry outside out's rows (negative, or past them) stores nothing, and the rows past the last expert's end are not
    stored (their places keep what was there): every configuration, both launch paths' default (W4A16: a bf16 gs; W4A4:
    the EP receiver's case, a per-row gs over the exact decode); and with an out of fewer rows than A, and offsets past
    A's rows."""
    E, N, K = 6, 1024, 2048
    pw, _ = experts(E, N, K, seed=31)
    sizes = torch.tensor([3, 0, 70, 1, 0, 9])
    offs = torch.cumsum(sizes, 0).to(I32).to(DEV)
    R_ = int(sizes.sum()) + 5                                  # 5 rows past the last expert's end: not computed
    g = torch.Generator().manual_seed(31)
    x = torch.randn(R_, K, generator=g) * 2
    a = x.to(torch.bfloat16).to(DEV) if mode == "w4a16" else ref_quantize_nvfp4(x, per_row=True).to(DEV)
    M = R_ + 7
    to = torch.randperm(M, generator=g)[:R_].to(I32)
    to[[0, 5, R_ - 1]] = torch.tensor([-1, M, -5], dtype=I32)  # outside out: not stored
    to = to.to(DEV)
    for c in [None] + list(S90.CONFIGS.values()) + [S90.WIDE_CONFIG]:
        plain = GC.grouped_gemm_nvfp4(a, pw, offs, config=c)
        out = torch.full((M, N), 3.0, device=DEV, dtype=torch.bfloat16)
        GC.grouped_gemm_nvfp4(a, pw, offs, out=out, out_rows=to, config=c)   # (the plan adds the row map)
        want = torch.full((M, N), 3.0, device=DEV, dtype=torch.bfloat16)
        ok = (to >= 0) & (to < M)
        ok[int(sizes.sum()):] = False                              # (no expert's rows)
        want[to[ok].long()] = plain[ok]
        assert torch.equal(out, want), f"{mode} {c}: {(out != want).any(1).sum().item()} rows differ"
    # an out of fewer rows than A (the kernel's row count is the map's, not out's), and offsets past A's rows (clamped
    # to them, as the plain store clamps them): the same scatter of the same rows
    Ms = R_ - 20
    to_s = torch.randperm(R_, generator=g).to(I32).to(DEV)             # a third of the rows land past out's Ms rows
    long = offs.clone(); long[-1] = R_ + 50                             # (unchecked: the kernels clamp it to R_)
    plain = GC.grouped_gemm_nvfp4(a, pw, long)
    out = torch.full((Ms, N), 3.0, device=DEV, dtype=torch.bfloat16)
    GC.grouped_gemm_nvfp4(a, pw, long, out=out, out_rows=to_s)
    want = torch.full((Ms, N), 3.0, device=DEV, dtype=torch.bfloat16)
    ok = to_s < Ms
    want[to_s[ok].long()] = plain[ok]
    assert torch.equal(out, want), f"{mode}: out of {Ms} rows, offsets past R: {(out != want).any(1).sum().item()} rows differ"


@pytest.mark.parametrize("T", [1, 3, 9, 40])
def test_in_rows_gather_is_the_gathered_product(T):
    """`in_rows`: the gather variant (each activation row loaded by one TMA copy through the map) gives the bits of the
    plain GEMM of the gathered rows, for every configuration that gathers (tiles 8, 16, 32, one and four warpgroups)
    and the plan's own (which gathers at up to one routed row per expert on average), also where a token's row is NaN (it stays
    in its own rows); an index outside x's rows reads a zero row; rows past the last expert's end (garbage map entries
    there) are not stored; an x of no rows gives the product of zero rows; captured in a CUDA graph, a new map and new
    offsets replay with the bits of a fresh call."""
    E, N, K, k = 16, 512, 1024, 6
    pw, _ = experts(E, N, K, seed=41)
    g = torch.Generator().manual_seed(41 + T)
    x = (torch.randn(T + 2, K, generator=g) * 2).to(torch.bfloat16).to(DEV)       # 2 token rows no route reads
    def routing(seed):
        rt = R.route_topk(R.random_topk(T, E, k, generator=torch.Generator().manual_seed(seed)), E)
        rows = rt.token.to(I32)
        rows[0] = -3 if T > 1 else rows[0]                                          # outside x: a zero row
        if T > 2: rows[-1] = T + 40
        return rt.expert_offsets.to(DEV), rows.to(DEV)
    offs, rows = routing(T)
    gathered = GC.gather_rows(x, rows)
    assert S90.Sm90Backend().gathers(GC.Problem(rows.numel(), E, N, K, in_rows=True)) == (rows.numel() <= E)
    assert all(S90.Sm90Backend().gathers(GC.Problem(rows.numel(), E, N, K, in_rows=True), c) for c in list(S90.CONFIGS.values())[:3])
    cfgs = [None, S90.CONFIGS[8], S90.CONFIGS[16], S90.CONFIGS[32], S90.DECODE_WIDE[8], S90.DECODE_WIDE[16], S90.DECODE_WIDE[32]]
    for c in cfgs:
        want = GC.grouped_gemm_nvfp4(gathered, pw, offs, config=c)
        got = GC.grouped_gemm_nvfp4(x, pw, offs, in_rows=rows, config=c)
        assert torch.equal(got, want), f"T={T} {c}: {(got != want).any(1).sum().item()} rows differ"
    xn = x.clone(); xn[0 if T == 1 else 1] = float("nan")     # the kernel copies only a unit's own rows: the slots past them
    one_sm = torch.cuda.get_device_properties(DEV).multi_processor_count - 1   # keep what an earlier unit copied into the
    for c in cfgs:                                             # stage (here NaN: one SM's CTAs run every unit), never stored
        want = GC.grouped_gemm_nvfp4(GC.gather_rows(xn, rows), pw, offs, config=c)
        got = GC.grouped_gemm_nvfp4(xn, pw, offs, in_rows=rows, config=c, sms_free=one_sm)
        assert bool(want.isnan().any()) and torch.equal(got.isnan(), want.isnan()), f"T={T} {c}: NaN rows differ"
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"T={T} {c}: the rows differ (NaN token)"
    short = offs.clamp(max=rows.numel() - 3)                                             # the last 3 rows: no expert's
    junk = rows.clone(); junk[int(short[-1]):] = torch.tensor([2 ** 30, -2 ** 30, 7], dtype=I32, device=DEV)[:rows.numel() - int(short[-1])]
    end = int(short[-1])
    got = torch.full((rows.numel(), N), 5.0, dtype=torch.bfloat16, device=DEV)
    GC.grouped_gemm_nvfp4(x, pw, short, out=got, in_rows=junk, config=S90.CONFIGS[8])
    want = GC.grouped_gemm_nvfp4(GC.gather_rows(x, junk), pw, short)
    assert end == rows.numel() - 3 and torch.equal(got[:end], want[:end]) and bool((got[end:] == 5.0).all()), f"T={T}: the tail"
    z = GC.grouped_gemm_nvfp4(x[:0], pw, offs, in_rows=rows)                            # no token rows: all zero rows
    assert torch.equal(z, GC.grouped_gemm_nvfp4(torch.zeros(rows.numel(), K, dtype=torch.bfloat16, device=DEV), pw, offs))
    out = torch.empty(rows.numel(), N, dtype=torch.bfloat16, device=DEV)
    offs_g, rows_g = offs.clone(), rows.clone()
    c8 = S90.CONFIGS[8]                                                                 # the kernel's gather at every T
    GC.grouped_gemm_nvfp4(x, pw, offs_g, out=out, in_rows=rows_g, config=c8); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        GC.grouped_gemm_nvfp4(x, pw, offs_g, out=out, in_rows=rows_g, config=c8)
    offs2, rows2 = routing(T + 1000)
    offs_g.copy_(offs2); rows_g.copy_(rows2); out.fill_(7.0)
    graph.replay(); torch.cuda.synchronize()
    assert torch.equal(out, GC.grouped_gemm_nvfp4(GC.gather_rows(x, rows2), pw, offs2)), f"T={T}: the replay differs"


def test_tvm_ffi_and_python_launch_paths_agree(monkeypatch):
    """The thin TVM-FFI launch and CuTeDSL's Python launch run the same compiled kernel: bit-identical outputs
    (W4A16, W4A4 per-row gs, wo_a), and the TVM-FFI path is the one taken when apache-tvm-ffi is installed."""
    pytest.importorskip("tvm_ffi")
    E, N, K = 6, 1024, 2048
    pw, we = experts(E, N, K, seed=21)
    offs, R = routed(7, E, 3, seed=5)
    offs = offs.to(DEV)
    a = torch.randn(R, K, device=DEV).to(torch.bfloat16)
    q = ref_quantize_nvfp4(torch.randn(R, K), per_row=True).to(DEV)
    x = torch.randn(5, 8, 4096, device=DEV).to(torch.bfloat16)
    pwo, wo = experts(8, 1024, 4096, seed=22)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setattr(S90K, "USE_TVM_FFI", flag == "1")
        assert S90K.have_tvm_ffi() == (flag == "1")
        outs[flag] = (GC.grouped_gemm_nvfp4(a, pw, offs), GC.grouped_gemm_nvfp4(q, pw, offs), GC.wo_a_nvfp4(x, pwo))
    wd = wdeq(we)
    for flag, (y16, y4, yo) in outs.items():              # each path against the float64 reference first
        assert_close(y16, ref(a.double(), wd, offs.cpu()), f"W4A16, tvm-ffi={flag}")
        assert_close(yo, torch.einsum("tgk,gnk->tgn", x.double(), wdeq(wo)), f"wo_a, tvm-ffi={flag}")
    for t1, t0, what in zip(outs["1"], outs["0"], ("W4A16", "W4A4", "wo_a")):
        assert torch.equal(t1, t0), f"{what}: the two launch paths differ in {(t1 != t0).sum().item()} outputs"
    assert any(key[2] for key in S90K._COMPILED), "no TVM-FFI compile was cached"


def test_sms_free_same_bits_smaller_grid(tmp_path):
    """With `sms_free=n` the persistent grid is n SMs' worth of CTAs smaller (read off the profiler's record of the
    launch), at least one SM's worth, and every output bit is what the full grid gives: W4A16 and W4A4."""
    import json
    from torch.profiler import profile, ProfilerActivity
    E, N, K = 8, 1024, 2048
    pw, _ = experts(E, N, K, seed=31)
    offs, R = routed(300, E, 3, seed=9)
    a = torch.randn(R, K, device=DEV).to(torch.bfloat16)
    q = ref_quantize_nvfp4(torch.randn(R, K), per_row=True).to(DEV)
    run = lambda n=0: (GC.grouped_gemm_nvfp4(a, pw, offs, sms_free=n), GC.grouped_gemm_nvfp4(q, pw, offs, sms_free=n))

    def grids(n=0):
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            y = run(n); torch.cuda.synchronize()
        f = tmp_path / "trace.json"
        p.export_chrome_trace(str(f))
        ev = json.load(open(f))["traceEvents"]
        return y, [e["args"]["grid"][0] for e in ev if e.get("cat") == "kernel" and "GroupedGemm" in e["name"]]

    base, full = grids()
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert len(full) == 2 and all(f % sms == 0 for f in full), full
    per = [f // sms for f in full]                                 # CTAs per SM of each launch's config
    for n, left in ((32, sms - 32), (sms - 1, 1), (10 * sms, 1)):  # SMs' worth left: never fewer than one
        got, grid = grids(n)
        assert grid == [left * p_ for p_ in per], (n, grid, full)
        for g_, b_, what in zip(got, base, ("W4A16", "W4A4")):
            assert torch.equal(g_, b_), f"{what} with sms_free={n}: {(g_ != b_).sum().item()} outputs differ"


@pytest.mark.parametrize("backend", ["sm90", "sm90_w4a8"])
def test_prepare_on_the_gpu_gives_the_cpu_layout(backend):
    "prepare_weights for a CUDA device lays out there (NVFP4 source copied first): every tensor equals the CPU layout's."
    g = torch.Generator().manual_seed(3)
    w = torch.randn(5, 320, 384, generator=g) * (1 + 3 * torch.rand(5, 1, 1, generator=g))
    w[1, 7, :16] = 0                                     # a dead block (W4A8 clears its codes and scale)
    we = Q.quantize_experts(w)
    on_gpu = GC.prepare_weights(we, device=DEV, backend=backend)
    on_cpu = GC.get_backend(backend).prepare(we, None)
    assert type(on_gpu) is type(on_cpu) and on_gpu.device.type == "cuda"
    a, b = on_gpu.tensors(), on_cpu.tensors()
    assert a.keys() == b.keys() and a
    for k in a: assert torch.equal(a[k].cpu(), b[k]), k
