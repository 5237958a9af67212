"""GPU script: issue 29's W4A8 peers against ours, in one run, each timed the way `bench moe` / `bench gemm` time ours
(`bench.core.Timer`: median of CUDA events, L2 flushed clean, graph-replayed where the call captures, else eager).

* layer: FlashInfer's CUTLASS SM90 fused MoE (`flashinfer.fused_moe.cutlass_fused_moe`), MXFP4 weights x bf16
  activations (`prepare_cutlass_w4a16_weights`, `use_w4_group_scaling`) and MXFP4 x FP8 (the "Humming" path,
  `prepare_cutlass_humming_weights`, `use_wfp4afp8_humming`), quantized by FlashInfer from the same bf16 weights as our
  synthetic DSV4-Flash layer, on the same given routing: the 6 routed experts plus the shared one as a seventh slot of
  weight 1 (expert 256), so both compute the same experts. Ours: `DSV4MoE.forward_routed` (W4A16, W4A8 on NVFP4
  weights, and W4A8 on the same weights quantized to MXFP4 and carried, DeepSeek-V4's form, FlashInfer's format: the
  table loop), which also permutes and combines. Accuracy: cosine of each output against the unquantized layer in float64 (`ref_moe_bf16`) on
  8 tokens, which also shows that FlashInfer got the [up, gate] row order and the SwiGLU limit the way DSV4 has them.
* gemm: DeepGEMM's FP8 grouped GEMM (`deep_gemm.m_grouped_fp8_gemm_nt_contiguous`: E4M3 weights with 128x128 fp32
  scales, E4M3 activations with 1x128 scales, each expert's rows padded to its M alignment, as its contiguous layout
  asks), the FP8-weight anchor, on the four peer shapes, against our sm90 kernel's W4A16 loop and both W4A8 loops (the
  F2FP loop on E4M3 block scales, the table loop on power-of-two ones), each in its backend's planned configuration (the
  W4A8 one the overlapped loop at prefill), on the same rows per expert; each of ours also
  timed as kernel time alone from the profiler, the way FlashInfer's are read (below).
* fi_gemm: FlashInfer's two grouped GEMMs, W4A16 and W4A8, read as kernel durations from its fused MoE's timeline
  (torch.profiler): FC1 and FC2 of the DSV4-Flash and Pro EP48 layer shapes are the four peer shapes; the same rows per
  expert as `gemm`. FlashInfer has no grouped GEMM entry of its own, so its kernels are read from inside its MoE.

A peer that does not import, build or run is reported with its exception text (`error`), never skipped silently.
Run with the staged peers on the path (`source .peer2/env.sh`, after tests/stage_peers_w4a8.sh's staging). argv:
OUT.json [--what layer,gemm,fi_gemm] [--tokens 1 8 128 2048 8192]."""
import argparse
import json
import traceback

import torch

from dsv4_nvfp4.bench.core import Timer, gpu_info
from dsv4_nvfp4 import moe as M


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


class _FlashInfer:
    """FlashInfer's CUTLASS SM90 fused MoE on given bf16 weights (w13: (E, 2I, H) in its [up, gate] row order, w2: (E, H, I)),
    quantized by FlashInfer itself to MXFP4 for both paths: "flashinfer_w4a16" (MXFP4 x bf16) and "flashinfer_w4a8" (MXFP4
    x FP8, Humming). A path whose preparation fails, or both when FlashInfer does not import, is left out of `prepared`
    with its error in `errors`."""
    NAMES = ("flashinfer_w4a16", "flashinfer_w4a8")
    def __init__(self, w13, w2, H, I, max_T, errors, log=print, swiglu_limit=None, topk=6):
        self.max_T, self.prepared, self.ws = max_T, {}, {}
        try:
            from flashinfer.fused_moe import cutlass_fused_moe, cutlass_fused_moe_workspace_size
            from flashinfer.fused_moe.prepare import prepare_cutlass_humming_weights, prepare_cutlass_w4a16_weights
        except Exception as e:                                               # not staged: no paths, the reason recorded
            errors["flashinfer"] = "import: " + _err(e); log(errors["flashinfer"]); return
        self.run = cutlass_fused_moe
        E, dev = w13.shape[0], w13.device
        kw = dict(num_local_experts=E, hidden_size=H, intermediate_size=I, device=dev)
        for name, prep in zip(self.NAMES, (prepare_cutlass_w4a16_weights, prepare_cutlass_humming_weights)):
            try: self.prepared[name] = prep(w13, w2, **kw)
            except Exception as e: errors[name] = "prepare: " + _err(e); log(f"{name}: {errors[name]}")
        self.limit = None if swiglu_limit is None else torch.full((E,), swiglu_limit, device=dev)
        for name in self.prepared:                                           # one workspace per path, sized for max_T
            try:
                n = cutlass_fused_moe_workspace_size(max_T, H, I, E, topk, x_dtype=torch.bfloat16, weight_dtype=torch.uint8,
                                                     use_w4_group_scaling=True, use_wfp4afp8_humming=name == "flashinfer_w4a8",
                                                     device=dev)
                self.ws[name] = torch.empty(n, dtype=torch.uint8, device=dev)
            except Exception as e: self.ws[name] = None; log(f"{name}: workspace size: {_err(e)} (allocated per call instead)")
        torch.cuda.empty_cache()

    def call(self, name, x, ids, w, y):
        "y (T, H) bf16 = the fused MoE of x (T, H) bf16 over experts ids (T, k) int32 with weights w (T, k) fp32."
        v = self.prepared[name]
        if name == "flashinfer_w4a16":
            qs = [v["fc1_expert_scales"].view(torch.int32), v["fc2_expert_scales"].view(torch.int32)]
            extra = dict(use_w4_group_scaling=True)
        else:
            qs = [v["fc1_expert_scales"].view(torch.int32), v["fc1_residual_scale"], v["fc2_act_global"],
                  v["fc2_expert_scales"].view(torch.int32), v["fc2_residual_scale"]]
            extra = dict(use_w4_group_scaling=True, use_wfp4afp8_humming=True)
        self.run(x, ids, w, v["fc1_expert_weights"], v["fc2_expert_weights"], torch.bfloat16, qs, swiglu_limit=self.limit,
                 output=y, tune_max_num_tokens=self.max_T, workspace_buffer=self.ws[name], **extra)
        return y                                                             # (the call returns a list whose first item is y)

    def tune(self, name, x, ids, w, y):
        """Its autotuner's tactic sweep for this T (as serving stacks run it), eagerly, before timing; only this T's bucket
        (every T timed here is a power of two, so the untuned lookup later finds the same bucket)."""
        from flashinfer import autotune
        with autotune(True, tuning_buckets=(x.shape[0],)): self.call(name, x, ids, w, y)
        torch.cuda.synchronize()


def is_cutlass_gemm(name: str) -> bool:
    """A CUTLASS GEMM kernel (`cutlass::device_kernel<...>`, mangled or not): FlashInfer's two grouped GEMMs, not its own
    permute, activation, finalize or CUTLASS-extension helpers (its tile-map builder's name says cutlass too)."""
    return name.startswith("_ZN7cutlass13device_kernel") or name.startswith("void cutlass::device_kernel")


def kernel_split(fn, flush, n=15) -> dict:
    """Per-kernel median durations of `fn()` (eager; torch.profiler/CUPTI, L2 flushed before each call, as
    tests/moe_timeline.py's `timeline`) and the two grouped GEMMs' (`fc1_us`, `fc2_us`: the first and second
    `is_cutlass_gemm` kernel; None unless there are exactly two)."""
    from types import SimpleNamespace as NS
    from moe_timeline import timeline
    tl = timeline(NS(graph=NS(replay=fn)), flush, n)
    gem = [k for k in tl["kernels"] if is_cutlass_gemm(k["name"])]
    tl["fc1_us"] = gem[0]["dur_us"] if len(gem) == 2 else None
    tl["fc2_us"] = gem[-1]["dur_us"] if len(gem) == 2 else None
    tl["kernels_sum_us"] = round(sum(k["dur_us"] for k in tl["kernels"]), 2)
    return tl


FI_LAYERS = (("Flash", 256, 4096, 2048, "Flash L1 K=4096 N=4096", "Flash L2 K=2048 N=4096"),
             ("Pro EP48", 48, 7168, 3072, "Pro EP48 K=7168 N=6144", "Pro EP48 K=3072 N=7168"))


def fi_gemm_rows(Ts, timer, log=print) -> dict:
    """FlashInfer's two grouped GEMMs, read from its fused MoE's kernel timeline: FC1 (N = 2I, K = H) and FC2 (N = H,
    K = I, the combine fused in its epilogue) of the DSV4-Flash and Pro EP48 layer shapes are exactly the four peer shapes.
    Random bf16 weights quantized by FlashInfer, routing the same as `gemm_rows` (top 6 of E, one draw per T, so the same
    rows per expert), the whole call timed by `timer` and its kernels by `kernel_split`."""
    dev = torch.device("cuda")
    out = dict(rows=[], errors={})
    flush = torch.zeros(32 << 20, dtype=torch.int64, device=dev)             # 256 MB read before each profiled call
    for lname, E, H, I, p1, p2 in FI_LAYERS:
        g = torch.Generator(device=dev).manual_seed(1)
        fi = _FlashInfer((torch.randn(E, 2 * I, H, generator=g, device=dev) * 0.02).to(torch.bfloat16),
                         (torch.randn(E, H, I, generator=g, device=dev) * 0.02).to(torch.bfloat16), H, I, max(Ts),
                         out["errors"], log, topk=6)
        if not fi.prepared: return out                                       # not staged (or no path prepared): reported
        for T in Ts:
            ids = torch.rand(T, E, generator=torch.Generator().manual_seed(T)).topk(6, dim=1).indices
            R = T * 6
            ids = ids.to(torch.int32).to(dev)
            w = torch.full((T, 6), 1 / 6, device=dev)
            x = (torch.randn(T, H, generator=g, device=dev) * 0.5).to(torch.bfloat16)
            y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
            for name in list(fi.prepared):
                row = dict(layer=lname, fc1=p1, fc2=p2, T=T, rows=R, path=name)
                try:
                    fi.tune(name, x, ids, w, y)
                    gr, ea = timer(lambda: fi.call(name, x, ids, w, y))
                    row.update(call_us=round(gr or ea, 1), graph=gr is not None)
                    ks = kernel_split(lambda: fi.call(name, x, ids, w, y), flush)
                    row.update(fc1_us=ks["fc1_us"], fc2_us=ks["fc2_us"], kernels_sum_us=ks["kernels_sum_us"],
                               span_us=ks["span_us"], kernels=ks["kernels"])
                except Exception as e: row["error"] = _err(e); out["errors"].setdefault(name, f"{lname} T={T}: " + _err(e))
                out["rows"].append(row)
                log({k: v for k, v in row.items() if k != "kernels"})
                for k in row.get("kernels", []): log(f"     {k['dur_us']:9.2f}  {k['name']}")
        fi = None; torch.cuda.empty_cache()
    return out


def layer_rows(Ts, timer, log=print) -> dict:
    "FlashInfer's SM90 fused MoE (MXFP4 x bf16, MXFP4 x FP8) against our layer, DSV4-Flash shape, given routing."
    dev = torch.device("cuda")
    cfg = M.FLASH
    E, H, I, k = cfg.num_experts, cfg.hidden, cfg.inter, cfg.top_k
    out = dict(rows=[], accuracy={}, errors={})
    ours = {act: M.DSV4MoE.flash(0, act=act, device=dev, keep_bf16=act == "w4a16").to(dev) for act in ("w4a16", "w4a8")}
    ours["w4a8_mxfp4"] = M.DSV4MoE.flash(0, act="w4a8", device=dev, mxfp4=True, keep_bf16=False).to(dev)   # the table loop
    lay = ours["w4a16"]
    w1, w3, w2 = lay.bf16_weights                                            # (E+1, I, H), (E+1, I, H), (E+1, H, I), CPU
    fi = _FlashInfer(torch.cat([w3, w1], dim=1).to(dev), w2.to(dev), H, I, max(Ts), out["errors"], log,  # [up, gate] rows
                     swiglu_limit=float(cfg.swiglu_limit), topk=k + 1)
    def routing(x):
        w, ids = lay.route(x)                                                # the layer's own router (fp32, int)
        T = x.shape[0]
        ids7 = torch.cat([ids.to(torch.int32), torch.full((T, 1), E, dtype=torch.int32, device=dev)], 1)
        w7 = torch.cat([w.float(), torch.ones(T, 1, device=dev)], 1)
        return w.float(), ids.to(torch.int32), w7, ids7

    g = torch.Generator(device=dev).manual_seed(3)
    xa = (torch.randn(8, H, generator=g, device=dev) * 0.5).to(torch.bfloat16)   # accuracy: 8 tokens
    want = M.ref_moe_bf16(xa.cpu(), lay)
    cos = lambda a: torch.nn.functional.cosine_similarity(a.double().cpu().flatten(), want.flatten(), 0).item()
    w, ids, w7, ids7 = routing(xa)
    for act, l in ours.items(): out["accuracy"][f"ours_{act}"] = round(cos(l.forward_routed(xa, w, ids)), 5)
    for name in list(fi.prepared):
        try: out["accuracy"][name] = round(cos(fi.call(name, xa, ids7, w7, torch.empty(8, H, dtype=torch.bfloat16, device=dev))), 5)
        except Exception as e: out["errors"][name] = "run: " + _err(e); log(f"{name}: {out['errors'][name]}"); fi.prepared.pop(name)
    log(f"accuracy (cosine vs the unquantized layer, 8 tokens): {out['accuracy']}")
    for T in Ts:
        x = (torch.randn(T, H, generator=g, device=dev) * 0.5).to(torch.bfloat16)
        w, ids, w7, ids7 = routing(x)
        row = dict(T=T)
        for act, l in ours.items():
            gr, ea = timer(lambda: l.forward_routed(x, w, ids, check=False))
            row[f"ours_{act}_us"] = round(gr or ea, 1)
        for name in fi.prepared:
            y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
            try:
                fi.tune(name, x, ids7, w7, y)
                gr, ea = timer(lambda: fi.call(name, x, ids7, w7, y))
                row[f"{name}_us"] = round(gr or ea, 1); row[f"{name}_graph"] = gr is not None
            except Exception as e: out["errors"].setdefault(name, f"T={T}: " + _err(e))
        out["rows"].append(row); log(row)
    return out


SHAPES = (("Flash L1 K=4096 N=4096", 256, 4096, 4096), ("Flash L2 K=2048 N=4096", 256, 4096, 2048),
          ("Pro EP48 K=3072 N=7168", 48, 7168, 3072), ("Pro EP48 K=7168 N=6144", 48, 6144, 7168))


def _experts(E, N, Kd, pow2, g, dev):
    "Random NVFP4 experts: E4M3 block scales drawn from 0x28-0x38, or (pow2) powers of two shared by each 32-group (MXFP4 carried)."
    from dsv4_nvfp4.quant import NVFP4Experts
    codes = torch.randint(0, 256, (E, N, Kd // 2), generator=g, device=dev, dtype=torch.uint8)
    if pow2: sb = (torch.randint(3, 9, (E, N, Kd // 32), generator=g, device=dev, dtype=torch.uint8) << 3).repeat_interleave(2, -1)
    else: sb = torch.randint(0x28, 0x39, (E, N, Kd // 16), generator=g, device=dev, dtype=torch.uint8)
    return NVFP4Experts(codes, sb.view(torch.float8_e4m3fn), torch.ones(E, device=dev), (E, N, Kd))


def gemm_rows(Ts, timer, log=print) -> dict:
    """DeepGEMM's FP8 grouped GEMM (E4M3 weights, twice our weight bytes) against our W4A16 loop and both W4A8 loops
    (F2FP on E4M3 block scales, the table loop on MXFP4-carried ones), the four peer shapes, the same rows per expert."""
    from dsv4_nvfp4.gemm import sm90 as S90, sm90_kernel as K, w4a8 as W
    from dsv4_nvfp4.gemm import Problem
    dev = torch.device("cuda")
    out = dict(rows=[], errors={})
    try:
        import deep_gemm
        from deep_gemm.utils.math import per_block_cast_to_fp8, per_token_cast_to_fp8
        torch.zeros(1, device=dev)                                            # a CUDA context before DeepGEMM's runtime looks
        align = deep_gemm.get_mk_alignment_for_contiguous_layout()           # (its "theoretical" query crashed on an H100)
    except Exception as e:
        deep_gemm = None
        out["errors"]["deepgemm"] = "build or import: " + _err(e) + "\n" + traceback.format_exc()[-1500:]; log(out["errors"]["deepgemm"])
    flush = torch.zeros(32 << 20, dtype=torch.int64, device=dev)
    for name, E, N, Kd in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        ex = _experts(E, N, Kd, False, g, dev)
        w16 = S90.tile_weights_sm90(ex.data, ex.scale)
        w8f, c = W.tile_weights_w4a8(ex)
        rs_f, gs = W.w4a8_row_scales(c), torch.ones(E, device=dev)
        ex2 = _experts(E, N, Kd, True, g, dev)
        w8t, c2, tab = W.tile_weights_w4a8_mixed(ex2)
        assert bool(tab.all()), "the pow2 experts must all take the table decode"
        rs_t = W.w4a8_row_scales(c2, table=tab)
        del ex, ex2
        dg = None
        if deep_gemm is not None:
            try:
                bw = torch.empty(E, N, Kd, dtype=torch.float8_e4m3fn, device=dev)
                bs = torch.empty(E, N // 128, Kd // 128, dtype=torch.float32, device=dev)
                for e in range(E):
                    q, s = per_block_cast_to_fp8((torch.randn(N, Kd, generator=g, device=dev) * 0.02).to(torch.bfloat16), use_ue8m0=False)
                    bw[e], bs[e] = q, s
                dg = (bw, bs)
            except Exception as e: out["errors"].setdefault("deepgemm", f"{name} weights: " + _err(e))
        for T in Ts:
            ids = torch.rand(T, E, generator=torch.Generator().manual_seed(T)).topk(6, dim=1).indices
            cnt = torch.bincount(ids.flatten(), minlength=E)
            offs = cnt.cumsum(0).to(torch.int32).to(dev); R = int(cnt.sum())
            a16 = (torch.randn(R, Kd, generator=g, device=dev) * 0.5).to(torch.bfloat16)
            a8 = W.ref_quantize_fp8_act(a16.float())
            o = torch.empty(R, N, dtype=torch.bfloat16, device=dev)
            cfg = S90.pick_config(R, E, Kd, N)._replace(epilogue=S90.Epilogue.BF16_ROW_GS)
            cfg8 = W.Sm90W4A8Backend().plan(Problem(R, E, N, Kd, act="fp8", per_row=True)).cfg    # the W4A8 backend's plan
            row = dict(problem=name, T=T, rows=R, config=str(tuple(cfg[:3])), config_w4a8=str((*cfg8[:3], "overlap") if cfg8.overlap else tuple(cfg8[:3])))
            calls = dict(w4a16=lambda: K.run_sm90(cfg, w16, a16, o, offs, gs, a8.scale),
                         w4a8_f2fp=lambda: K.run_sm90(cfg8, w8f, a8.data, o, offs, gs, a8.scale, sf_c=rs_f),
                         w4a8_table=lambda: K.run_sm90(cfg8._replace(table=True), w8t, a8.data, o, offs, gs, a8.scale, sf_c=rs_t))
            for c, fn in calls.items():
                gr, ea = timer(fn)
                row[f"ours_{c}_us"] = round(gr or ea, 1)
                row[f"ours_{c}_kernel_us"] = kernel_split(fn, flush)["span_us"]    # kernel time alone, as FlashInfer's is read
            if dg is not None:
                try:
                    bw, bs = dg
                    pad = ((cnt + align - 1) // align) * align               # each expert's rows padded to the alignment
                    Mp = int(pad.sum())
                    m_idx = torch.full((Mp,), -1, dtype=torch.int32)
                    starts = torch.cumsum(pad, 0) - pad
                    for e in range(E): m_idx[int(starts[e]):int(starts[e]) + int(cnt[e])] = e
                    m_idx = m_idx.to(dev)
                    ap = torch.zeros(Mp, Kd, dtype=torch.bfloat16, device=dev); ap[m_idx >= 0] = a16
                    af, asf = per_token_cast_to_fp8(ap, use_ue8m0=False)
                    asf = deep_gemm.get_mn_major_tma_aligned_tensor(asf)     # the layout the call wants, made before timing
                    d = torch.empty(Mp, N, dtype=torch.bfloat16, device=dev)
                    gr, ea = timer(lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous((af, asf), (bw, bs), d, m_idx))
                    row.update(deepgemm_fp8_us=round(gr or ea, 1), deepgemm_rows_padded=Mp, deepgemm_graph=gr is not None)
                except Exception as e: out["errors"].setdefault("deepgemm", f"{name} T={T}: " + _err(e))
            best = min(row["ours_w4a8_f2fp_us"], row["ours_w4a8_table_us"])
            row["tflops_w4a8_table"] = round(2 * R * N * Kd / row["ours_w4a8_table_us"] / 1e6, 1)
            row["w4a16_over_w4a8_table"] = round(row["ours_w4a16_us"] / row["ours_w4a8_table_us"], 3)
            if "deepgemm_fp8_us" in row: row["deepgemm_over_w4a8_best"] = round(row["deepgemm_fp8_us"] / best, 3)
            out["rows"].append(row); log(row)
        w16 = w8f = w8t = dg = None; torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--what", default="layer,gemm")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 128, 2048, 8192])
    args = ap.parse_args()
    timer, res = Timer(), dict(info=gpu_info())
    for what in args.what.split(","):
        try: res[what] = dict(layer=layer_rows, gemm=gemm_rows, fi_gemm=fi_gemm_rows)[what](args.tokens, timer)
        except Exception as e: res[what] = dict(error=_err(e) + "\n" + traceback.format_exc()[-2000:]); print(res[what]["error"], flush=True)
        json.dump(res, open(args.out, "w"), indent=1, default=str)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
