"""GPU script: where the overlapped W4A8 loop's time goes, by ablation. The plan's prefill kernel (W4A8_OV_CONFIG, table
decode, BF16_ROW_GS staged epilogue) is timed beside subclasses that take one piece out, each compiled here from the
same kernel class (no switch in the library; only the times count: the variants without the decode or the epilogue
compute wrong values or store none, `no_promote` sums without the fp32 promotion):

- `no_decode`: the A fragments get fixed E4M3 words and the code words are not read (the ring, the WGMMAs, the
  promotion and the epilogue stay);
- `no_epilogue`: the unit's results are not stored (one predicated store a thread keeps the accumulators live);
- `neither`: both out: the ring, the WGMMAs and the promotion alone;
- `no_promote`: every K tile summed on the tensor core into the fp32 fragment (no drain every 4 tiles, no FADDs);
- `bare`: the ring and the WGMMAs alone.

The first rungs of the ladder from tests/qgmma_ceiling.py's ceiling (1887-1929 TFLOP/s on an H200) to the loop (about
57% of it under Nsight Compute on Flash FC1 at 8192, counting the tiles' padding): if `bare` is already far below the
ceiling, the ring (its barriers, the producer's copies, L2) holds it; the steps from `bare` to `full` say what each
piece costs. One process, graph-replayed, L2 flushed, median, best of 2 alternating rounds.

    python tests/w4a8_ablation.py OUT.json [T]"""
import json, sys

import torch
import cutlass
import cutlass.cute as cute

from dsv4_nvfp4.gemm import sm90 as S90, sm90_kernel as K, w4a8 as W


class NoDecode(K.GroupedGemmSm90):
    "The loop with fixed A words and no code-word loads."
    @cute.jit
    def load_codes_into(self, sW, cw, idx, t, c0, c1, sc):
        pass

    @cute.jit
    def decode_tile(self, c0, c1, sc, a_u32, add, table: cutlass.Constexpr):
        for i in cutlass.range_constexpr(16):
            a_u32[i] = cutlass.Uint32(0x38303830 ^ i)


class NoEpilogue(K.GroupedGemmSm90):
    "The loop without the unit's stores: one store a thread where its first sum is exactly 12345 (never), so the sums stay live."
    @cute.jit
    def store(self, acc_frag, tCc, mC, mGw, mGa, e, rb, ti, cnt, mt, l, N, t, cw, xbuf, mSfC, mGc, mGr, mDump, sbuf, pre):
        s = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc_frag)):
            s = s + acc_frag[i]
        if s == cutlass.Float32(12345.0):
            mC[0, 0, 0] = s.to(cutlass.BFloat16)


class Neither(NoDecode, NoEpilogue):
    "Both pieces out."


class NoPromote(K.GroupedGemmSm90):
    """The loop without the promotion: every K tile accumulates into the fp32 fragment on the tensor core (FlashInfer's
    way), so no drain every 4 tiles and no FADDs; the overlap (two A fragments, one tile left in flight) stays."""
    @cute.jit
    def mainloop_fp8_ov(self, pipe, cs, sW, tiled_mma, acc_frag, tile_frag, a_frag, a_frag2, tCrB, t, cw, KT, add,
                        table: cutlass.Constexpr):
        acc_frag.fill(0.0)
        frags = (a_frag, a_frag2)
        words = (cute.recast_tensor(a_frag, cutlass.Uint32), cute.recast_tensor(a_frag2, cutlass.Uint32))
        pv = cs.clone()
        pipe.consumer_wait(cs)
        c0, c1, sc = self.load_codes(sW, cw, cs.index, t)
        for k2 in cutlass.range(KT // 2, unroll=1):
            for j in cutlass.range_constexpr(2):
                d0 = K.smem_descriptor_to_int(tCrB[None, None, 0, cs.index].iterator)
                self.decode_tile(c0, c1, sc, words[j], add, table)
                K.warpgroup.fence()
                for kb in cutlass.range_constexpr(4):
                    tiled_mma.set(K.warpgroup.Field.ACCUMULATE, True)    # (set where it is used: see mainloop_fp8_ov)
                    cute.gemm(tiled_mma, acc_frag, frags[j][None, None, kb], self._b_kb(tCrB, d0, kb), acc_frag)
                K.warpgroup.commit_group()
                cs.advance()
                if 2 * k2 + j + 1 < KT:
                    pipe.consumer_wait(cs)
                    self.load_codes_into(sW, cw, cs.index, t, c0, c1, sc)
                if cutlass.const_expr(j == 1):
                    K.warpgroup.wait_group(1)
                    pipe.consumer_release(pv)
                    pv.advance()
                else:
                    if k2 > 0:
                        K.warpgroup.wait_group(1)
                        pipe.consumer_release(pv)
                        pv.advance()
        K.warpgroup.wait_group(0)
        pipe.consumer_release(pv)
        pv.advance()
        return cs


class Bare(NoDecode, NoEpilogue, NoPromote):
    "The ring and the WGMMAs alone: no decode, no promotion, no epilogue."


VARIANTS = {"full": K.GroupedGemmSm90, "no_decode": NoDecode, "no_epilogue": NoEpilogue, "neither": Neither,
            "no_promote": NoPromote, "bare": Bare}


def compile_variant(name: str, cfg, arch: str = "sm_90a", tvm_ffi: bool = True):
    "The compiled kernel of VARIANTS[name] for cfg (fake operands, as compile_sm90)."
    opts = f"--gpu-arch={arch}" + (" --enable-tvm-ffi" if tvm_ffi else "")
    return cute.compile(VARIANTS[name](cfg), *K._fake_args(tvm_ffi, cfg), options=opts)


def variant_sass(name: str, cfg, arch: str = "sm_90a") -> list[str]:
    "The SASS of VARIANTS[name] for cfg, one string per instruction (compiled here, no GPU; `sm90_kernel.cubin_sass`)."
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        cute.compile(VARIANTS[name](cfg), *K._fake_args(False, cfg), options=f"--gpu-arch={arch} --keep-cubin --dump-dir={d}")
        (cub,) = Path(d).glob("*.cubin")
        return K.cubin_sass(cub.read_bytes())


def main():
    from dsv4_nvfp4.bench.core import Timer, gpu_info
    from bench_peers_w4a8 import SHAPES, _experts
    out = sys.argv[1]
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    dev, timer = torch.device("cuda"), Timer()
    cfg = W.W4A8_OV_CONFIG._replace(epilogue=S90.Epilogue.BF16_ROW_GS, table=True)
    _, n_ctas, _ = K._compiled(cfg, dev, False)
    fns = {k: compile_variant(k, cfg) for k in VARIANTS}
    res = dict(info=gpu_info(), cfg=str(cfg), T=T, rows=[])
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
        o = torch.empty(R, N, dtype=torch.bfloat16, device=dev)
        row = dict(problem=name, T=T, rows=R)
        for rep in range(2):
            for k, fn in fns.items():
                gr, ea = timer(lambda: fn(w8t, a8.data, o, offs, gs, a8.scale, n_ctas, rs, None, None, None))
                row.setdefault(f"{k}_us", []).append(round(gr or ea, 1))
        useful = 2 * R * N * Kd                               # the real rows; issued: with the tiles' padding
        issued = 2 * int(((cnt + cfg.tok_tile - 1) // cfg.tok_tile * cfg.tok_tile).sum()) * N * Kd
        row["full_tflops"] = round(useful / min(row["full_us"]) / 1e6)
        row["full_tflops_issued"] = round(issued / min(row["full_us"]) / 1e6)
        for k in VARIANTS:
            row[f"full_over_{k}"] = round(min(row["full_us"]) / min(row[f"{k}_us"]), 3)
        res["rows"].append(row); print(row, flush=True)
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
