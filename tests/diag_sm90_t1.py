"""Diagnostic variants of the sm90 GEMM kernel (not library code), timed side by side: where the T = 1 time goes.

    PYTHONPATH=<checkout> python tests/diag_sm90_t1.py OUT.json     (GPU)
    python tests/diag_sm90_t1.py sass                              (CPU: the variants compile; their wait structure)

Mem* keep the producer, ring and schedule and drop the consumer's work (the memory pipeline's own ceiling); NoDec drops
the decode; Plain is the loop without the one-warpgroup overlap (the
library's before it); tt16 is the config tok_tile 8 replaced at one token; FullK reorders the slabs K-major."""
import sys, json, time, os, torch
import cutlass, cutlass.cute as cute, cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from dsv4_nvfp4.gemm import sm90_kernel as S
from dsv4_nvfp4.gemm.sm90 import *

class Mem(S.GroupedGemmSm90):
    "consumer only waits and releases: the memory pipeline's ceiling"
    @cute.jit
    def mainloop(self, pipe, cs, sW, tiled_mma, acc_frag, a_frag, tCrB, t, cw, KT):
        for k in cutlass.range(KT, unroll=1):
            pipe.consumer_wait(cs)
            pipe.consumer_release(cs)
            cs.advance()
        return cs

class _P:
  kmajor = False
  acts = True
  @cute.jit
  def produce(self, pipe, tma_w, tW, tma_a, tA, sW, sB, sOff, E, R, TR, MT, MT64, KT):
      pass
      tt, kt_, wgs = self.tt, K_TILE, self.wgs
      bidx, _, _ = cute.arch.block_idx()
      gdim, _, _ = cute.arch.grid_dim()
      ps = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
      e0 = cutlass.Int32(0); acc = cutlass.Int32(0)
      u = bidx
      found, e, start, cnt, local, e0, acc = self.find_unit(u, sOff, E, R, MT, e0, acc)
      while found:
          mt, ti, l, rb = self.unit_tile(e, start, cnt, local, TR)
          gA = cute.local_tile(cute.domain_offset((rb + ti * tt, 0, 0), tA), (tt, kt_), (0, None, l))
          tAs, tAg = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gA, 0, 2))
          for k in cutlass.range(KT, unroll=1):
              pipe.producer_acquire(ps)
              bar = pipe.producer_get_barrier(ps)
              if cutlass.const_expr(self.acts):
                  cute.copy(tma_a, tAg[(None, k)], tAs[(None, ps.index)], tma_bar_ptr=bar)
              for w in cutlass.range_constexpr(wgs):
                  slab = ((e * MT64 + mt * wgs + w) * KT + k)
                  if cutlass.const_expr(self.kmajor):
                      slab = ((e * KT + k) * MT64 + mt * wgs + w)
                  gW = cute.local_tile(tW, (SLAB_ROWS, SLAB_WIDTH), (slab, 0))
                  tWs, tWg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sW[None, None, w, ps.index], 0, 2), cute.group_modes(gW, 0, 2))
                  cute.copy(tma_w, tWg, tWs, tma_bar_ptr=bar)
              pipe.producer_commit(ps)
              ps.advance()
          u = u + gdim
          found, e, start, cnt, local, e0, acc = self.find_unit(u, sOff, E, R, MT, e0, acc)
      pipe.producer_tail(ps)

class MemW(_P, Mem):
    acts = False
    "memory only, weights only (no activation box)"
    @property
    def tx_bytes(self): return SLAB_BYTES * self.wgs
    @tx_bytes.setter
    def tx_bytes(self, v): pass

class MemK(_P, Mem):
    kmajor = True
    "memory only, k-major slab order"

class FullK(_P, S.GroupedGemmSm90):
    kmajor = True
    "the real kernel on k-major slabs (weights permuted on the host)"

class NoDec(S.GroupedGemmSm90):
    "memory + MMA, no decode (A fragment constant)"
    @cute.jit
    def mainloop(self, pipe, cs, sW, tiled_mma, acc_frag, a_frag, tCrB, t, cw, KT):
        a_u32 = cute.recast_tensor(a_frag, cutlass.Uint32)
        for i in cutlass.range_constexpr(32):
            a_u32[i] = cutlass.Uint32(0x3f803f80)
        for k in cutlass.range(KT, unroll=1):
            pipe.consumer_wait(cs)
            bi = cs.index
            warpgroup.fence()
            for kb in cutlass.range_constexpr(8):
                tiled_mma.set(warpgroup.Field.ACCUMULATE, k > 0 or kb > 0)
                cute.gemm(tiled_mma, acc_frag, a_frag[None, None, kb], tCrB[None, None, kb, bi], acc_frag)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            pipe.consumer_release(cs)
            cs.advance()
        return cs

class Plain(S.GroupedGemmSm90):
    "the plain K loop for every configuration: decode the tile, 8 WGMMAs, wait_group(0), release"
    @cute.jit
    def mainloop(self, pipe, cs, sW, tiled_mma, acc_frag, a_frag, tCrB, t, cw, KT):
        a_u32 = cute.recast_tensor(a_frag, cutlass.Uint32)
        for k in cutlass.range(KT, unroll=1):
            pipe.consumer_wait(cs)
            bi = cs.index
            c0, c1, sc = self.load_codes(sW, cw, bi, t)
            for kb in cutlass.range_constexpr(8):
                d = self.decode_kb(c0, c1, sc, kb)
                for j in cutlass.range_constexpr(4):
                    a_u32[j + 4 * kb] = d[j]
            warpgroup.fence()
            for kb in cutlass.range_constexpr(8):
                tiled_mma.set(warpgroup.Field.ACCUMULATE, k > 0 or kb > 0)
                cute.gemm(tiled_mma, acc_frag, a_frag[None, None, kb], tCrB[None, None, kb, bi], acc_frag)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            pipe.consumer_release(cs)
            cs.advance()
        return cs

def compile_variant(cls, cfg, arch="sm_90a"):
    return cute.compile(cls(cfg), *S._fake_args(True, cfg), options=f"--gpu-arch={arch} --enable-tvm-ffi")

if __name__ == "__main__" and sys.argv[1] == "sass":          # local: the variants compile; SASS of the K loop
    import subprocess, tempfile, re
    from pathlib import Path
    for cls in (Mem, MemW, MemK, FullK, NoDec, Plain):
        for cfg in (GemmConfig(16, 1, 8), GemmConfig(8, 1, 8), GemmConfig(128, 2, 4)):
            with tempfile.TemporaryDirectory() as d:
                cute.compile(cls(cfg), *S._fake_args(False, cfg), options=f"--gpu-arch=sm_90a --keep-cubin --dump-dir={d}")
                (f,) = Path(d).glob("*.cubin")
                text = subprocess.run([S._nvdisasm(), "-c", str(f)], capture_output=True, text=True).stdout
            n = text.count("HGMMA"); dep = len(re.findall(r"WARPGROUP.DEPBAR", text)); arr = len(re.findall(r"WARPGROUP.ARRIVE", text))
            print(cls.__name__, cfg.tok_tile, "HGMMA", n, "DEPBAR", dep, "ARRIVE", arr, flush=True)
    sys.exit()

def main(out_path):
    from dsv4_nvfp4.bench.core import Timer
    from dsv4_nvfp4.bench.gemm import synthetic_weights
    from dsv4_nvfp4.gemm import prepare_weights, grouped_gemm_nvfp4
    from dsv4_nvfp4.routing import random_topk, route_topk
    dev = torch.device("cuda"); timer = Timer(); res = {"gpu": torch.cuda.get_device_name(0)}
    per_block, per_sm, sms = device_smem(dev)
    comp = {}
    def fn_of(cls, cfg):
        key = (cls.__name__, cfg)
        if key not in comp:
            t0 = time.time(); comp[key] = compile_variant(cls, cfg)
            print(f"  compiled {cls.__name__} {cfg.tok_tile},{cfg.wgs},{cfg.stages} in {time.time()-t0:.1f}s", flush=True)
        return comp[key]
    x = torch.empty(56_623_104, dtype=torch.uint8, device=dev)
    g, _ = timer(lambda: x.clone()); res["copy GB/s"] = 2 * x.numel() / g / 1e3
    print(f"copy {res['copy GB/s']:.0f} GB/s (read + write)", flush=True); del x
    probs = [("FlashL1", 256, 4096, 4096, 1), ("FlashL1 K128", 256, 4096, 128, 1), ("FlashL1 K1024", 256, 4096, 1024, 1),
             ("FlashL1", 256, 4096, 4096, 8), ("FlashL1", 256, 4096, 4096, 32), ("FlashL1", 256, 4096, 4096, 128),
             ("FlashL2", 256, 4096, 2048, 1), ("Pro", 48, 6144, 7168, 1), ("Pro", 48, 6144, 7168, 32)]
    for name, E, N, K, T in probs:
        pw = synthetic_weights(E, N, K, dev)
        w = pw.w_sm90; KT = K // K_TILE; MT64 = w.shape[0] // (SLAB_ROWS * KT * E)
        wk = w.view(E, MT64, KT, SLAB_BYTES).transpose(1, 2).contiguous().view(w.shape)
        rt = route_topk(random_topk(T, E, 6, generator=torch.Generator().manual_seed(0)), E)
        offs, R = rt.expert_offsets.to(dev).int(), rt.perm.numel()
        a = torch.randn(R, K, device=dev).to(torch.bfloat16)
        gs1 = torch.ones(1, 1, device=dev)
        base = pick_config(R, E, K)
        active = int((torch.diff(torch.cat([torch.zeros(1, dtype=torch.int32), rt.expert_offsets.int()])) > 0).sum())
        wbytes = active * N * K * 9 // 16
        variants = [("base", S.GroupedGemmSm90, base, w), ("Plain", Plain, base, w), ("NoDec", NoDec, base, w),
                    ("FullK", FullK, base, wk)]
        if base.tok_tile == 8:
            variants += [("tt16", S.GroupedGemmSm90, GemmConfig(16, 1, 8), w), ("Plain tt16", Plain, GemmConfig(16, 1, 8), w)]
        if T == 1 and K >= 1024:
            variants += [("Mem", Mem, base, w), ("MemW", MemW, base, w), ("MemK", MemK, base, w),
                         ("Mem st4", Mem, base._replace(stages=4), w), ("Mem st12", Mem, base._replace(stages=12), w),
                         ("MemW st12", MemW, base._replace(stages=12), w)]
        ref = None
        for vn, cls, cfg, wt in variants:
            out = torch.zeros(R, N, dtype=torch.bfloat16, device=dev)
            f = fn_of(cls, cfg)
            n_ctas = sms * max(1, min(per_sm // smem_bytes(cfg), MAX_CTAS_PER_SM))
            call = lambda: f(wt, a, out, offs, pw.w_gs, gs1, n_ctas, None, None, None, None)
            call(); torch.cuda.synchronize()
            same = ""
            if not vn.startswith("Mem") and vn != "NoDec":
                if ref is None: ref = out.clone()
                else: same = "bit-identical" if torch.equal(out, ref) else f"DIFFERS ({(out.float() - ref.float()).abs().max().item():.3g})"
            g, e = timer(call)
            key = f"{name} K{K} T{T} {vn}"
            res[key] = dict(us=g, tbps=wbytes / g / 1e6, ctas=n_ctas, cfg=list(cfg[:3]), same=same)
            print(f"{key:32s} {g:8.1f} us  {wbytes / g / 1e6:5.2f} TB/s  ctas {n_ctas}  {same}", flush=True)
        del pw, w, wk; torch.cuda.empty_cache()
    json.dump(res, open(out_path, "w"), indent=1)

if __name__ == "__main__" and sys.argv[1] != "sass":
    main(sys.argv[1])
