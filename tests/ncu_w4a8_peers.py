"""GPU script for Nsight Compute: one W4A8 grouped GEMM of ours and FlashInfer's on the same shape and rows per expert,
each inside a cudaProfilerStart/Stop bracket after its warm-up (our kernel compiled, FlashInfer's autotuner run for this
T), so that `ncu --profile-from-start off` profiles exactly the timed call and nothing of the set-up.

    python tests/ncu_w4a8_peers.py MODE [SHAPE] [T]

MODE: `ours` (the W4A8 backend's plan for the shape: the overlapped loop from W4A8_OV_MIN_ROWS rows per expert), `plain`
(pick_config's configuration with the plain W4A8 loop), `fi` (FlashInfer's SM90 fused MoE, W4A8 "Humming" path, on the
layer whose FC1 or FC2 is SHAPE; its two GEMMs are the `cutlass::device_kernel` launches of the bracket). SHAPE: an index
into bench_peers_w4a8.SHAPES (default 0, Flash L1); T default 8192. Ours runs on MXFP4-carried experts (the table loop,
FlashInfer's format). Run from tests/ with the staged peers on the path, e.g.

    ncu --clock-control none --profile-from-start off --set full -o OUT/ours python ncu_w4a8_peers.py ours
    ncu --clock-control none --profile-from-start off --set full -k regex:^cutlass::device_kernel -o OUT/fi python ncu_w4a8_peers.py fi
    ncu -i OUT/ours.ncu-rep --page details --csv > OUT/ours.csv"""
import sys

import torch

from bench_peers_w4a8 import FI_LAYERS, SHAPES, _experts, _FlashInfer


def main():
    mode = sys.argv[1]
    shape = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    T = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
    if T > 8192: raise SystemExit("T <= 8192 (FlashInfer is tuned for up to 8192 tokens here)")
    if mode not in ("ours", "plain", "fi"): raise SystemExit(f"MODE must be ours, plain or fi, not {mode!r}")
    name, E, N, K = SHAPES[shape]
    dev = torch.device("cuda")
    ids = torch.rand(T, E, generator=torch.Generator().manual_seed(T)).topk(6, dim=1).indices   # bench_peers_w4a8's draw
    if mode == "fi":
        lname, E_, H, I, p1, p2 = next(l for l in FI_LAYERS if name in (l[4], l[5]))
        g = torch.Generator(device=dev).manual_seed(1)
        errors = {}
        fi = _FlashInfer((torch.randn(E_, 2 * I, H, generator=g, device=dev) * 0.02).to(torch.bfloat16),   # tuned for
                         (torch.randn(E_, H, I, generator=g, device=dev) * 0.02).to(torch.bfloat16), H, I, 8192,   # up to
                         errors, topk=6)                                    # 8192 tokens, as bench_peers_w4a8's records
        if "flashinfer_w4a8" not in fi.prepared: raise SystemExit(f"FlashInfer's W4A8 path is not available: {errors}")
        x = (torch.randn(T, H, generator=g, device=dev) * 0.5).to(torch.bfloat16)
        w = torch.full((T, 6), 1 / 6, device=dev)
        y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        ids = ids.to(torch.int32).to(dev)
        fi.tune("flashinfer_w4a8", x, ids, w, y)
        run = lambda: fi.call("flashinfer_w4a8", x, ids, w, y)
        what = f"FlashInfer W4A8 fused MoE, {lname} layer (FC1 = {p1}, FC2 = {p2})"
    else:
        from dsv4_nvfp4.gemm import Problem, sm90 as S90, sm90_kernel as Kn, w4a8 as W
        g = torch.Generator(device=dev).manual_seed(0)
        w8t, c2, tab = W.tile_weights_w4a8_mixed(_experts(E, N, K, True, g, dev))
        rs = W.w4a8_row_scales(c2, table=tab)
        cnt = torch.bincount(ids.flatten(), minlength=E)
        offs = cnt.cumsum(0).to(torch.int32).to(dev)
        R = int(cnt.sum())
        a8 = W.ref_quantize_fp8_act((torch.randn(R, K, generator=g, device=dev) * 0.5).float())
        if mode == "ours": cfg = W.Sm90W4A8Backend().plan(Problem(R, E, N, K, act="fp8", per_row=True)).cfg
        else: cfg = S90.pick_config(R, E, K, N)._replace(epilogue=S90.Epilogue.BF16_ROW_GS, fp8=True, overlap=False)
        cfg = cfg._replace(table=True)
        o = torch.empty(R, N, dtype=torch.bfloat16, device=dev)
        gs = torch.ones(E, device=dev)                              # made outside the bracket: one kernel in it
        run = lambda: Kn.run_sm90(cfg, w8t, a8.data, o, offs, gs, a8.scale, sf_c=rs)
        what = f"ours W4A8 table loop {tuple(cfg[:3])}{' overlapped' if cfg.overlap else ''}, {name}, {R} rows"
    for _ in range(3): run()                                    # compiled / tuned and warm
    torch.cuda.synchronize()
    torch.cuda.profiler.start(); run(); torch.cuda.synchronize(); torch.cuda.profiler.stop()
    print(f"profiled: {what}, T = {T}", flush=True)


if __name__ == "__main__":
    main()
