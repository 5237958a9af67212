"""GPU A/B of the overlapped W4A8 loop (GemmConfig.overlap with fp8: two A fragments, the tile accumulator promoted
every 4 K tiles, a wait that leaves one tile in flight) against the plain W4A8 loop in pick_config's configuration (the
W4A8 plan below W4A8_OV_MIN_ROWS rows per expert), in one process (records: measured/w4a8_ov_s39_h200.json, w4a8_ov_s40_h200.json): the four peer shapes at T = 512, 2048 and 8192 (top 6 of E, one draw per T, as tests/bench_peers_w4a8.py's
gemm rows), MXFP4-carried experts (the table loop, DeepSeek-V4's weights), graph-replayed, L2 flushed, median us, each
timed twice in alternation; the overlapped outputs' relative Frobenius distance to the plain loop's is printed too (not
the same bits: the promotion interval differs; tests/test_w4a8_gpu.py bounds both against float64), and a digest of
each output, so that runs of two checkouts (an A/B of a change that must keep the bits) compare bit for bit.

    python tests/ab_w4a8_ov.py OUT.json [--swiglu] [T ...]

--swiglu: the fused SwiGLU epilogue (SWIGLU_BF16, the W4A8 layer's L1: h of N / 2 columns, the routing weight 1) in
place of BF16_ROW_GS, on the shapes that are an L1 (Flash L1, Pro EP48 K = 7168)."""
import hashlib, json, sys

import torch

from dsv4_nvfp4.bench.core import Timer, gpu_info
from dsv4_nvfp4.gemm import sm90 as S90, sm90_kernel as K, w4a8 as W
from bench_peers_w4a8 import SHAPES, _experts


def main():
    args = sys.argv[2:]
    swiglu = "--swiglu" in args
    out, Ts = sys.argv[1], [int(a) for a in args if a != "--swiglu"] or [512, 2048, 8192]
    dev, timer = torch.device("cuda"), Timer()
    res = dict(info=gpu_info(), rows=[], epilogue="SWIGLU_BF16" if swiglu else "BF16_ROW_GS")
    E_ = S90.Epilogue.SWIGLU_BF16 if swiglu else S90.Epilogue.BF16_ROW_GS
    for name, E, N, Kd in [s for s in SHAPES if not swiglu or s[0].startswith(("Flash L1", "Pro EP48 K=7168"))]:
        g = torch.Generator(device=dev).manual_seed(0)
        ex = _experts(E, N, Kd, True, g, dev)
        w8t, c2, tab = W.tile_weights_w4a8_mixed(ex)
        rs = W.w4a8_row_scales(c2, table=tab)
        gs = torch.ones(E, device=dev)
        for T in Ts:
            ids = torch.rand(T, E, generator=torch.Generator().manual_seed(T)).topk(6, dim=1).indices
            cnt = torch.bincount(ids.flatten(), minlength=E)
            offs = cnt.cumsum(0).to(torch.int32).to(dev); R = int(cnt.sum())
            a8 = W.ref_quantize_fp8_act((torch.randn(R, Kd, generator=g, device=dev) * 0.5).float())
            plan = S90.pick_config(R, E, Kd, N)._replace(epilogue=E_, fp8=True, overlap=False, table=True)
            # two consumer warpgroups hold one CTA per SM by registers (384 x 168), so the ring may take the whole shared
            # memory: the deep ring (s7, the plan's) also makes the persistent grid one CTA per SM
            cfgs = dict(plain=plan, ov128=S90.GemmConfig(128, 2, 4, E_, fp8=True, table=True, overlap=True),
                        ov128s7=S90.GemmConfig(128, 2, 7, E_, fp8=True, table=True, overlap=True))
            o = {k: torch.empty(R, N // 2 if swiglu else N, dtype=torch.bfloat16, device=dev) for k in cfgs}
            sc = torch.cat([a8.scale, torch.ones_like(a8.scale)], 1) if swiglu else a8.scale   # SwiGLU: (gs_a, p) per row
            call = lambda k: K.run_sm90(cfgs[k], w8t, a8.data, o[k], offs, gs, sc, sf_c=rs)
            row = dict(problem=name, T=T, rows=R, plan=str(tuple(plan[:3])))
            for rep in range(2):
                for k in cfgs:
                    gr, ea = timer(lambda: call(k))
                    row.setdefault(f"{k}_us", []).append(round(gr or ea, 1))
            torch.cuda.synchronize()
            for k in cfgs:                                     # output digests: two checkouts' runs compare bit for bit
                row[f"{k}_sha"] = hashlib.sha256(o[k].view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16]
            for k in [k for k in cfgs if k != "plain"]:
                row[f"{k}_vs_plain_fro"] = float(((o[k].float() - o["plain"].float()).norm() / o["plain"].float().norm()).item())
                row[f"plain_over_{k}"] = round(min(row["plain_us"]) / min(row[f"{k}_us"]), 3)
            res["rows"].append(row); print(row, flush=True)
            json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
