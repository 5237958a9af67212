"""Session 42 experiment (kept in history only). The 256-token unpromoted loop with a chunked staged epilogue (CH tokens at a time through a (CH x 64) bf16 block per
warpgroup), so that the ring can be 4-5 stages deep. Imported by ab_t256b.py / ncu_var.py (session 42 experiment)."""
import cutlass
import cutlass.cute as cute
import w4a8_ablation as A
from dsv4_nvfp4.gemm import sm90 as S90, sm90_kernel as K

_orig = S90.staged_bytes
CH = {}                                   # tok_tile 256 configs -> chunk tokens (by stages: 4 -> 64, 5 -> 32)
def _staged_bytes(cfg):
    if cfg.tok_tile == 256 and cfg.stages in CH: return CH[cfg.stages] * S90.WG_ROWS * 2
    return _orig(cfg)
S90.staged_bytes = _staged_bytes
K.staged_bytes = _staged_bytes
CH[4] = 64; CH[5] = 32

def cfg256(stages):
    return S90.GemmConfig(256, 2, stages, epilogue=S90.Epilogue.BF16_ROW_GS, fp8=True, table=True, overlap=True)


class NP256C(A.NoPromote):
    @cute.jit
    def store_staged(self, acc_frag, tCc, mC, mGa, g, row0, rend, n0, N, e, l, t, cw, mSfC, sbuf):
        tt = self.tt
        C = CH[self.cfg.stages]
        sn = cute.make_rmem_tensor((2,), cutlass.Float32)
        self.w4a8_row_scales(tCc, n0, N, e, mSfC, sn)
        lane = t % 32
        w = t // 32
        blk = sbuf.iterator.toint() + cw * _staged_bytes(self.cfg)
        k = lane % 8
        mi = lane // 8
        words = cute.make_tensor(cute.recast_ptr(sbuf.iterator, dtype=cutlass.Uint32),
                                 cute.make_layout(self.wgs * _staged_bytes(self.cfg) // 4))
        v = cute.flat_divide(words, (4,))
        chk = t % 8
        col = n0 + S90.WG_ROWS * cw + 8 * chk
        for cc in cutlass.range_constexpr(tt // C):
            nqc = C // 4                                          # tokens per thread in this chunk (q = 2 j + a)
            oga = cute.make_rmem_tensor((nqc,), cutlass.Float32)
            for qq in cutlass.range_constexpr(nqc):
                q = cc * nqc + qq
                m_, c_ = tCc[(q // 2) * 4 + q % 2]
                row = row0 + c_
                ga = mGa[0, 0]
                if row < rend:
                    ga = mGa[row, l]
                oga[qq] = ga
            cute.arch.barrier(barrier_id=2 + cw, number_of_threads=S90.WG_THREADS)
            for jl in cutlass.range_constexpr(C // 16):
                jp = cc * (C // 16) + jl
                r = [None] * 4
                for i in cutlass.range_constexpr(4):
                    j = 2 * jp + i // 2
                    h = i % 2
                    jq = 2 * (j - cc * (C // 8))
                    v0 = acc_frag[4 * j + 2 * h] * g * (oga[jq] * sn[h])
                    v1 = acc_frag[4 * j + 2 * h + 1] * g * (oga[jq + 1] * sn[h])
                    r[i] = K._asm(K._PACK_BF16, K._f32_bits(v0), K._f32_bits(v1))
                n = 16 * jl + 8 * (mi // 2) + k
                c = 2 * w + mi % 2
                K._asm_store(K._STSM4T, blk + n * 128 + ((c ^ k) << 4), r[0], r[1], r[2], r[3])
            cute.arch.barrier(barrier_id=2 + cw, number_of_threads=S90.WG_THREADS)
            if n0 + S90.WG_ROWS * cw < N:
                for p in cutlass.range_constexpr(C // 16):
                    n = 16 * p + t // 8
                    x = cute.make_rmem_tensor((4,), cutlass.Uint32)
                    cute.autovec_copy(v[None, cw * (C * 8) + n * 8 + (chk ^ (n % 8))], x)
                    row = row0 + cc * C + n
                    if row < rend and row < mC.shape[0]:
                        a = (mC.iterator + cute.crd2idx((row, col, l), mC.layout)).toint()
                        K._asm_store(K._STG128, a, x[0], x[1], x[2], x[3])

A.VARIANTS["np256c"] = NP256C

# ---- the A/B (was ab_t256b.py) ----
def main():
    import json, sys, torch
    from dsv4_nvfp4.gemm import w4a8 as W
    from dsv4_nvfp4.bench.core import Timer, gpu_info
    from bench_peers_w4a8 import SHAPES, _experts
    TC = sys.modules[__name__]
    out = sys.argv[1]; Ts = [int(x) for x in sys.argv[2:]] or [8192, 2048]
    dev, timer = torch.device("cuda"), Timer()
    plan = W.W4A8_OV_CONFIG._replace(epilogue=S90.Epilogue.BF16_ROW_GS, table=True)
    _, n_ctas, _ = K._compiled(plan, dev, False)
    fns = {"plan": A.compile_variant("full", plan), "np128": A.compile_variant("no_promote", plan),
           "np256c4": A.compile_variant("np256c", TC.cfg256(4)), "np256c5": A.compile_variant("np256c", TC.cfg256(5))}
    res = dict(info=gpu_info(), plan=str(plan), t256=[str(TC.cfg256(4)), str(TC.cfg256(5))], chunks=TC.CH, n_ctas=n_ctas, rows=[])
    for T in Ts:
        for name, E, N, Kd in SHAPES:
            g = torch.Generator(device=dev).manual_seed(0)
            ex = _experts(E, N, Kd, True, g, dev)
            w8t, c2, tab = W.tile_weights_w4a8_mixed(ex)
            rs = W.w4a8_row_scales(c2, table=tab)
            gs = torch.ones(E, device=dev)
            ids = torch.rand(T, E, generator=torch.Generator().manual_seed(T)).topk(6, dim=1).indices
            cnt = torch.bincount(ids.flatten(), minlength=E)
            offs = cnt.cumsum(0).to(torch.int32).to(dev); R = int(cnt.sum())
            a8 = W.ref_quantize_fp8_act((torch.randn(R, Kd, generator=g, device=dev) * 0.5).float())
            outs = {}
            for k, fn in fns.items():
                o = torch.full((R, N), float("nan"), dtype=torch.bfloat16, device=dev)
                fn(w8t, a8.data, o, offs, gs, a8.scale, n_ctas, rs, None, None, None); torch.cuda.synchronize()
                outs[k] = o
            eq = lambda a, b: bool(torch.equal(outs[a].view(torch.int16), outs[b].view(torch.int16)))
            row = dict(problem=name, T=T, rows=R, np256c4_same_as_np128=eq("np256c4", "np128"), np256c5_same_as_np128=eq("np256c5", "np128"))
            for rep in range(3):
                for k, fn in fns.items():
                    gr, ea = timer(lambda: fn(w8t, a8.data, outs[k], offs, gs, a8.scale, n_ctas, rs, None, None, None))
                    row.setdefault(f"{k}_us", []).append(round(gr or ea, 1))
            for k in fns: row[f"{k}_over_plan"] = round(min(row["plan_us"]) / min(row[f"{k}_us"]), 3)
            res["rows"].append(row); print(row, flush=True)
            json.dump(res, open(out, "w"), indent=1)

if __name__ == "__main__":
    main()
