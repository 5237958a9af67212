"""GPU: the MoE layer's route / permute / combine kernels (kernels_cu/moe_route.cu) against the torch references:
router ids equal to the float64 router (weights to 1e-6), ties to the lower id, the permutation equal to route_topk's
stable sort, W4A4 rows bit-exact with ref_quantize_nvfp4, the combine bit-identical to the fp32 torch sum, padding,
bad ids counted and confined to their token."""
import pytest
import torch

from dsv4_nvfp4 import routing as R
from dsv4_nvfp4.quant import ref_quantize_nvfp4

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def gate(E, H, T, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(E, H, generator=g) * H ** -0.5).to(torch.bfloat16)
    b = torch.randn(E, generator=g) * 0.05 if bias else None
    return x, w, b


@pytest.mark.parametrize("E,H", [(256, 4096), (384, 7168), (48, 7168)])
@pytest.mark.parametrize("T", [1, 5, 32, 33, 300])
def test_router_matches_float64(E, H, T):
    x, w, b = gate(E, H, T, seed=E + T)
    wt, ids = R.dsv4_router(x.to(DEV), w.to(DEV), b.to(DEV), top_k=6, routed_scaling_factor=2.5)
    w64, i64 = R.ref_dsv4_router(x, w, b, top_k=6, routed_scaling_factor=2.5)
    assert ids.dtype == torch.int32 and wt.dtype == torch.float32
    assert torch.equal(ids.cpu().long(), i64)
    assert ((wt.cpu().double() - w64).abs() / w64).max().item() < 1e-6


@pytest.mark.parametrize("T", [1, 32, 200])
def test_router_logits_kernel_and_cublas_agree(T):
    x, w, _ = gate(256, 4096, T, seed=3)
    ref = x.double() @ w.double().T
    for impl in ("kernel", "cublas", "sgemm"):
        got = R.router_logits(x.to(DEV), w.to(DEV), impl=impl)
        assert (got.cpu().double() - ref).abs().max() < 1e-5, impl
    k = R.router_logits(x.to(DEV), w.to(DEV), impl="kernel")
    assert torch.equal(R.router_logits(x.to(DEV), w.to(DEV), impl="kernel"), k), "fixed order: run-to-run identical"


def test_ties_go_to_the_lower_id_and_no_bias():
    E, T, k = 64, 4, 6
    buf = R.route_buffers(T, E, k, 1024, DEV, with_rows=False)
    logits = torch.zeros(T, E, device=DEV)                                # every score equal
    logits[1, 40] = logits[1, 50] = 3.0                                   # two tied winners, then the rest tied
    logits[2] = torch.linspace(-1, 1, E, device=DEV)                      # strictly increasing: the last six
    R.route_rows(buf, T, logits, None, routed_scaling_factor=1.0)
    got = buf.topk_ids[:T].cpu().tolist()
    assert got[0] == [0, 1, 2, 3, 4, 5] and got[3] == [0, 1, 2, 3, 4, 5]
    assert got[1] == [40, 50, 0, 1, 2, 3]
    assert got[2] == [63, 62, 61, 60, 59, 58]
    assert torch.allclose(buf.topk_weights[0].cpu(), torch.full((k,), 1 / k))


def test_hash_routing_matches_reference():
    E, H, T, V = 256, 4096, 70, 1000
    x, w, _ = gate(E, H, T, seed=7, bias=False)
    tid = torch.rand(V, E, generator=torch.Generator().manual_seed(1)).topk(6, 1).indices.to(torch.int32)
    ii = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(2))
    wt, ids = R.dsv4_router(x.to(DEV), w.to(DEV), None, tid2eid=tid.to(DEV), input_ids=ii.to(DEV))
    w64, i64 = R.ref_dsv4_router(x, w, None, tid2eid=tid, input_ids=ii)
    assert torch.equal(ids.cpu().long(), i64)
    # Hashed experts are random, so some have negative logits, where d(log w)/d(logit) -> 1/2 (softplus ~ exp): the
    # weights inherit the fp32 logits' relative error (~1e-6; test_router_logits_* bounds it). From the same fp32
    # logits, the kernel's scores and normalization match float64 to 1e-6:
    lg = R.router_logits(x.to(DEV), w.to(DEV)).cpu().double()
    s = torch.sqrt(torch.nn.functional.softplus(lg)).gather(1, i64)
    wl = s / s.sum(1, keepdim=True) * 1.5
    assert ((wt.cpu().double() - wl).abs() / wl).max().item() < 1e-6
    assert ((wt.cpu().double() - w64).abs() / w64).max().item() < 1e-5


def routed(E, H, T, k=6, seed=0, cap=None, n=None, a1=None):
    "Route T tokens on the GPU with the kernels; also the torch reference routing of the same ids."
    x, w, b = gate(E, H, T, seed)
    buf = R.route_buffers(cap or T, E, k, H, DEV)
    xd = x.to(DEV)
    nt = None if n is None else torch.tensor(n, device=DEV)
    R.route_rows(buf, T, R.router_logits(xd, w.to(DEV), out=buf.logits[:T]), b.to(DEV), n_tokens=nt)
    rows, rs = R.permute_rows(xd, buf, a1, n_tokens=nt)
    return x, xd, buf, rows, rs, nt


@pytest.mark.parametrize("T", [1, 15, 16, 17, 1000, 3000])
def test_permutation_is_route_topks_stable_sort(T):
    E, H, k = 256, 4096, 6
    x, xd, buf, rows, rs, _ = routed(E, H, T, seed=T)
    ids = buf.topk_ids[:T].cpu().long()
    ids1 = torch.cat([ids, torch.full((T, 1), E)], 1)
    rt = R.route_topk(ids1, E + 1)
    assert torch.equal(buf.offsets.cpu(), rt.expert_offsets)
    assert torch.equal(buf.inv[:T].cpu().long(), rt.inv)
    assert torch.equal(rows.cpu(), x[rt.token])
    w1 = torch.cat([buf.topk_weights[:T].cpu(), torch.ones(T, 1)], 1).reshape(-1)[rt.perm]
    assert torch.equal(rs[:, 1].cpu(), w1) and torch.equal(rs[:, 0].cpu(), torch.ones(T * (k + 1)))


def test_w4a4_rows_are_the_reference_quantization_decoded():
    E, H, k, T = 48, 7168, 6, 40
    a1 = (torch.rand(E + 1, generator=torch.Generator().manual_seed(3)) * 2e-3 + 5e-4)   # some blocks saturate
    x, xd, buf, rows, rs, _ = routed(E, H, T, seed=9, a1=a1.to(DEV))
    ids1 = torch.cat([buf.topk_ids[:T].cpu().long(), torch.full((T, 1), E)], 1)
    rt = R.route_topk(ids1, E + 1)
    expert = torch.repeat_interleave(torch.arange(E + 1), R.group_sizes(rt.expert_offsets))
    q = ref_quantize_nvfp4(x[rt.token].float(), a1[expert])
    from dsv4_nvfp4.formats import e2m1_decode
    want = (e2m1_decode(q.codes()).float().view(-1, H // 16, 16) * q.scale.float()[..., None]).reshape(-1, H)
    assert torch.equal(rows.cpu().float(), want), "code * block scale, exact in bf16"
    assert torch.equal(rs[:, 0].cpu(), a1[expert])


@pytest.mark.parametrize("E,H", [(256, 4096), (48, 7168)])
@pytest.mark.parametrize("T", [1, 9, 77, 129])    # up to COMBINE_SPLIT_MAX_T each row split over hidden / 1024 CTAs
def test_combine_is_the_fixed_order_fp32_sum(T, E, H):
    k = 6
    x, xd, buf, rows, rs, _ = routed(E, H, T, seed=4)
    y_rows = torch.randn(T * (k + 1), H, device=DEV).to(torch.bfloat16)
    g = y_rows[buf.inv[:T].long()]
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)   # a chunk left unwritten stays NaN
    R.combine_tokens(y_rows, buf, out)
    acc = g[:, 0].float()
    for j in range(1, k + 1): acc += g[:, j].float()
    assert torch.equal(out, acc.to(torch.bfloat16))


def test_padding_is_not_routed():
    E, H, k, T, n = 256, 4096, 6, 130, 70
    x, xd, buf, rows, rs, nt = routed(E, H, T, seed=5, n=n)
    assert buf.offsets[-1].item() == n * (k + 1)
    buf3 = R.route_buffers(n, E, k, H, DEV)
    _, w, b = gate(E, H, T, 5)                                            # the same gate: route the first n alone
    R.route_rows(buf3, n, R.router_logits(xd[:n], w.to(DEV)), b.to(DEV))
    R.permute_rows(xd[:n], buf3)
    assert torch.equal(buf.offsets, buf3.offsets) and torch.equal(buf.inv[:n], buf3.inv[:n])
    assert torch.equal(rows[: n * (k + 1)], buf3.rows[: n * (k + 1)])


def test_bad_given_ids_are_counted_and_confined():
    E, H, k, T = 16, 1024, 3, 6
    buf = R.route_buffers(T, E, k, H, DEV)
    ids = torch.tensor([[0, 1, 2], [3, 16, 4], [5, 5, 6], [7, 8, 9], [-1, 2, 3], [10, 11, 12]], dtype=torch.int32, device=DEV)
    w = torch.full((T, k), 0.5, device=DEV)
    R.route_rows(buf, T, None, given=(w, ids))
    with pytest.raises(ValueError, match="3 token"):
        R.check_bad(buf)
    R.check_bad(buf)                                                      # cleared after the report
    tw = buf.topk_weights[:T].cpu()
    assert tw[[1, 2, 4]].isnan().all() and not tw[[0, 3, 5]].isnan().any()
    assert torch.equal(buf.topk_ids[[0, 3, 5]].cpu(), ids[[0, 3, 5]].cpu())
    assert buf.offsets[-1].item() == T * (k + 1)                          # every token still has k + 1 distinct rows


def _snapshot(buf, T, k):
    R_ = T * (k + 1)
    return dict(logits=buf.logits[:T].clone(), w=buf.topk_weights[:T].clone(), ids=buf.topk_ids[:T].clone(),
                offsets=buf.offsets.clone(), inv=buf.inv[:T].clone(), rs=buf.row_scales[:R_].clone())


@pytest.mark.parametrize("E,H,a1", [(256, 4096, False), (256, 4096, True), (384, 7168, False), (48, 7168, True)])
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_fused_decode_launch_equals_the_three_launches(E, H, a1, T):
    "moe_route_small (logits + route + permute in one launch) writes the same bits as the three kernels."
    k = 6
    x, w, b = gate(E, H, T, seed=E + T)
    xd, wd, bd = x.to(DEV), w.to(DEV), b.to(DEV)
    s1 = (torch.rand(E + 1, generator=torch.Generator().manual_seed(T)) * 2e-3 + 5e-4).to(DEV) if a1 else None
    ref = R.route_buffers(T, E, k, H, DEV)
    R.route_rows(ref, T, R.router_logits(xd, wd, out=ref.logits[:T], impl="kernel"), bd, routed_scaling_factor=2.5)
    rows_ref, _ = R.permute_rows(xd, ref, s1)
    got = R.route_buffers(T, E, k, H, DEV)
    for _ in range(2):                                                    # twice: the ticket was reset
        rows, rs = R.route_permute_fused(xd, wd, got, bd, routed_scaling_factor=2.5, a1_scales=s1)
        a, c = _snapshot(got, T, k), _snapshot(ref, T, k)
        for key in a: assert torch.equal(a[key], c[key]), key
        assert torch.equal(rows, rows_ref)
    assert got.ticket.item() == 0


@pytest.mark.parametrize("a1", [False, True])      # bf16 rows (moe_route_small) and W4A4 (moe_route_small_wide)
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_fused_decode_launch_ties_slices_and_padding(T, a1):
    """The fused launch with score routing on expert-parallel slices and with a padding token: the same ids, weights,
    offsets, inverse and rows as the three launches; a third of the experts score alike for token 0 and it takes the
    six lowest of them (ties to the lower id)."""
    E, H, k = 256, 4096, 6
    x, w, b = gate(E, H, T, seed=40 + T)
    w[::3] = (x[0].float() * H ** -0.5).to(torch.bfloat16)                # logit ~ sqrt(H) for token 0, alike
    b[::3] = b[0]
    xd, wd, bd = x.to(DEV), w.to(DEV), b.to(DEV)
    nt = torch.tensor(max(T - 1, 1), device=DEV)                          # T > 1: the last token is padding
    n = nt.item()
    for experts, shared in ((None, True), (list(range(0, 256, 3)), True), (list(range(1, 256, 2)), False)):
        ref = R.route_buffers(T, E, k, H, DEV, experts=experts, shared=shared)
        s1 = (torch.rand(ref.groups, generator=torch.Generator().manual_seed(T)) * 2e-3 + 5e-4).to(DEV) if a1 else None
        R.route_rows(ref, T, R.router_logits(xd, wd, out=ref.logits[:T], impl="kernel"), bd, routed_scaling_factor=2.5, n_tokens=nt)
        R.permute_rows(xd, ref, s1, n_tokens=nt)
        got = R.route_buffers(T, E, k, H, DEV, experts=experts, shared=shared)
        R.route_permute_fused(xd, wd, got, bd, routed_scaling_factor=2.5, n_tokens=nt, a1_scales=s1)
        assert got.topk_ids[0].tolist() == [0, 3, 6, 9, 12, 15]
        assert torch.equal(got.topk_ids[:n], ref.topk_ids[:n]) and torch.equal(got.topk_weights[:n], ref.topk_weights[:n])
        assert torch.equal(got.offsets, ref.offsets) and torch.equal(got.inv[:n], ref.inv[:n])
        n_rows = got.offsets[-1].item()
        assert torch.equal(got.rows[:n_rows], ref.rows[:n_rows]) and torch.equal(got.row_scales[:n_rows], ref.row_scales[:n_rows])


@pytest.mark.parametrize("a1", [False, True])      # bf16 rows (moe_route_small) and W4A4 (moe_route_small_wide)
def test_fused_decode_launch_hash_routing_padding_and_slices(a1):
    E, H, k, T, V = 256, 4096, 6, 4, 100
    x, w, b = gate(E, H, T, seed=21)
    xd, wd = x.to(DEV), w.to(DEV)
    tid = torch.rand(V, E, generator=torch.Generator().manual_seed(5)).topk(k, 1).indices.to(torch.int32).to(DEV)
    ii = torch.tensor([3, 99, 0, 150], device=DEV)                        # the last is outside the table: NaN, counted
    nt = torch.tensor(3, device=DEV)                                      # 3 real tokens: the bad one is padding here
    for experts, shared in ((None, True), ([5, 17, 100, 200, 255], True), (list(range(0, 256, 2)), False)):
        ref = R.route_buffers(T, E, k, H, DEV, experts=experts, shared=shared)
        s1 = (torch.rand(ref.groups, generator=torch.Generator().manual_seed(9)) * 2e-3 + 5e-4).to(DEV) if a1 else None
        R.route_rows(ref, T, R.router_logits(xd, wd, out=ref.logits[:T], impl="kernel"), None, tid2eid=tid, input_ids=ii, n_tokens=nt)
        R.permute_rows(xd, ref, s1, n_tokens=nt)
        got = R.route_buffers(T, E, k, H, DEV, experts=experts, shared=shared)
        R.route_permute_fused(xd, wd, got, None, tid2eid=tid, input_ids=ii, n_tokens=nt, a1_scales=s1)
        assert torch.equal(got.offsets, ref.offsets) and torch.equal(got.inv[:3], ref.inv[:3])
        n_rows = got.offsets[-1].item()
        assert torch.equal(got.rows[:n_rows], ref.rows[:n_rows]) and torch.equal(got.row_scales[:n_rows], ref.row_scales[:n_rows])
        R.check_bad(got); R.check_bad(ref)                                # padding is never read: nothing counted
    got = R.route_buffers(T, E, k, H, DEV)
    R.route_permute_fused(xd, wd, got, None, tid2eid=tid, input_ids=ii)   # all four real: token 3 is bad
    with pytest.raises(ValueError, match="1 token"):
        R.check_bad(got)
    assert got.topk_weights[3].isnan().all() and not got.topk_weights[:3].isnan().any()
    with pytest.raises(ValueError, match="T <= 4"):
        R.route_permute_fused(torch.zeros(5, H, dtype=torch.bfloat16, device=DEV), wd, R.route_buffers(8, E, k, H, DEV))


@pytest.mark.parametrize("T", [1, 16, 17, 300])
def test_a_slice_routes_only_its_experts(T):
    "A local layer's buffers (route_buffers(experts=...)): its groups' rows in the reference order, -1 for the rest."
    from dsv4_nvfp4.moe import route_with_shared
    E, H, k = 256, 4096, 6
    x, w, b = gate(E, H, T, seed=T + 50)
    xd = x.to(DEV)
    for experts, shared in (([3, 7, 64, 65, 66, 200], True), (list(range(128, 256)), False), (list(range(256)), True)):
        buf = R.route_buffers(T, E, k, H, DEV, experts=experts, shared=shared)
        R.route_rows(buf, T, R.router_logits(xd, w.to(DEV), out=buf.logits[:T]), b.to(DEV))
        rows, rs = R.permute_rows(xd, buf)
        rt, p = route_with_shared(buf.topk_ids[:T].cpu(), buf.topk_weights[:T].cpu(), E, experts, shared)
        assert torch.equal(buf.offsets.cpu(), rt.expert_offsets)
        assert torch.equal(buf.inv[:T].cpu().long(), rt.inv)
        n_rows = rt.token.numel()
        assert torch.equal(rows[:n_rows].cpu(), x[rt.token]) and torch.equal(rs[:n_rows, 1].cpu(), p)
        y_rows = torch.randn(T * (k + 1), H, device=DEV).to(torch.bfloat16)
        out = torch.empty(T, H, dtype=torch.bfloat16, device=DEV)
        R.combine_tokens(y_rows, buf, out)
        inv = rt.inv.to(DEV)
        acc = torch.zeros(T, H, device=DEV)
        first = torch.ones(T, dtype=torch.bool, device=DEV)
        for j in range(k + 1):                                            # held slots only, in slot order
            v = y_rows[inv[:, j].clamp(min=0)].float()
            held = (inv[:, j] >= 0)[:, None]
            acc = torch.where(held, torch.where(first[:, None], v, acc + v), acc)
            first &= ~held[:, 0]
        assert torch.equal(out, acc.to(torch.bfloat16))


@pytest.mark.parametrize("T", [5, 300])
def test_fp8_permute_is_the_bf16_permute_quantized(T):
    """W4A8's permute (permute_rows_fp8): the E4M3 rows, their scales, row_scales and inv are bit for bit
    quantize_fp8_act of permute_rows' bf16 rows with those scales in row_scales[:, 0]: a whole layer and a slice, a zero
    token (scale 1), a token with NaN (scale NaN, its rows only), one scaled by 1e30, padding
    with n_tokens (rows of padding tokens never written); bad operands refused."""
    from dsv4_nvfp4.gemm.w4a8 import quantize_fp8_act
    E, H, k = 256, 4096, 6
    x, w, b = gate(E, H, T, seed=T + 70)
    x[1] = 0; x[2, 17] = float("nan"); x[3] *= 1e30
    xd = x.to(DEV)
    n = T - 1                                                            # token 3 (x 1e30) is real at T = 5 too
    nt = torch.tensor(n, device=DEV)
    for experts, shared in ((None, True), ([3, 7, 64, 65, 66, 200], True)):
        a = R.route_buffers(T, E, k, H, DEV, experts=experts, shared=shared)
        bb = R.route_buffers(T, E, k, H, DEV, experts=experts, shared=shared)
        for buf in (a, bb):
            R.route_rows(buf, T, R.router_logits(xd, w.to(DEV), out=buf.logits[:T]), b.to(DEV), n_tokens=nt)
        rows, rs = R.permute_rows(xd, a, n_tokens=nt)
        Rn = int(a.offsets[-1].item())                                   # the real tokens' rows
        want = quantize_fp8_act(rows[:Rn])
        q = torch.full((T * (k + 1), H), float("nan"), device=DEV).to(torch.float8_e4m3fn)
        s = torch.full((T * (k + 1), 1), -7.0, device=DEV)
        bb.row_scales.fill_(-7.0)
        q8, s8, rs8 = R.permute_rows_fp8(xd, bb, q, s, n_tokens=nt)
        assert q8.shape == (T * (k + 1), H) and s8.shape == (T * (k + 1), 1)
        assert torch.equal(q8[:Rn].view(torch.uint8), want.data.view(torch.uint8)), "E4M3 rows"
        bits = lambda t: t.contiguous().view(torch.int32)                 # NaN scales compare by their bits
        assert torch.equal(bits(s8[:Rn]), bits(want.scale)) and torch.equal(bits(rs8[:Rn, 0:1]), bits(want.scale)), "row scales"
        assert torch.equal(bits(rs8[:Rn, 1]), bits(rs[:Rn, 1])) and torch.equal(bb.inv[:n], a.inv[:n]), "weights (NaN for the NaN token) and inv"
        assert (s8[Rn:] == -7.0).all(), "no row past the real tokens' is written"
        held = a.inv[2][a.inv[2] >= 0].long()
        assert torch.isnan(s8[held]).all() and not torch.isnan(s8[a.inv[0][a.inv[0] >= 0].long()]).any()
        if (a.inv[1] >= 0).any(): assert (s8[a.inv[1][a.inv[1] >= 0].long()] == 1.0).all(), "a zero token's scale is 1"
    with pytest.raises(TypeError): R.permute_rows_fp8(xd, bb, q.view(torch.uint8), s)
    with pytest.raises(ValueError): R.permute_rows_fp8(xd, bb, q[: T * (k + 1) - 1], s)
    with pytest.raises(ValueError): R.permute_rows_fp8(xd, bb, q, s[:5])
    bare = R.route_buffers(T, E, k, H, DEV, with_rows=False)              # no row scales or inv to write into
    R.route_rows(bare, T, R.router_logits(xd, w.to(DEV), out=bare.logits[:T]), b.to(DEV))
    with pytest.raises(ValueError, match="with_rows"): R.permute_rows_fp8(xd, bare, q, s)
