"""GPU smoke test of the FlashInfer peer (build.sh, stage.sh): FlashInfer 0.7.2.post1's SM90 CUTLASS fused MoE from the
cross-built trimmed fused_moe_90.so, MXFP4 x bf16 and MXFP4 x FP8 (Humming), one small MoE (E = 8, H = 4096, I = 2048,
64 tokens, top 2) against a float32 reference on the unquantized bf16 weights (both orders of FC1's gated halves, as the
order is FlashInfer's convention), run twice for determinism, then 20 eager calls timed. Not a benchmark: the peer
harness times the shapes of the issue. Run after stage.sh's env.sh (the shim on PYTHONPATH, FLASHINFER_DISABLE_JIT=1)."""
import os, sys, time, traceback
os.environ.setdefault("FLASHINFER_DISABLE_JIT", "1")
import torch
t0 = time.time()
try:
    import tvm_ffi; print("tvm_ffi", getattr(tvm_ffi, "__version__", "?"))
except Exception as e: print("tvm_ffi import:", repr(e))
try:
    import flashinfer
    from flashinfer.fused_moe import cutlass_fused_moe, ActivationType
    from flashinfer.fused_moe.prepare import prepare_cutlass_w4a16_weights, prepare_cutlass_humming_weights
    print("flashinfer", flashinfer.__version__, "imported in %.1fs" % (time.time() - t0), flush=True)
except Exception:
    traceback.print_exc(); sys.exit(1)
E, H, I, T, TOPK = 8, 4096, 2048, 64, 2
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
w1 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device=dev, generator=g) * 0.02
w2 = torch.randn(E, H, I, dtype=torch.bfloat16, device=dev, generator=g) * 0.02
x = torch.randn(T, H, dtype=torch.bfloat16, device=dev, generator=g)
logits = torch.randn(T, E, device=dev, generator=g)
scores, experts = torch.topk(torch.softmax(logits, -1), TOPK, dim=-1)
experts = experts.to(torch.int32).contiguous(); scores = (scores / scores.sum(-1, keepdim=True)).float()

def ref(first_is_gate):
    out = torch.zeros(T, H, dtype=torch.float32, device=dev)
    for t in range(T):
        for k in range(TOPK):
            e = int(experts[t, k]); a = (w1[e].float() @ x[t].float())
            gt, up = (a[:I], a[I:]) if first_is_gate else (a[I:], a[:I])
            out[t] += scores[t, k] * (w2[e].float() @ (torch.nn.functional.silu(gt) * up))
    return out
refs = {"gate first": ref(True), "up first": ref(False)}
cos = lambda a, b: float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))
for name in ("w4a16", "w4a8_humming"):
    try:
        t1 = time.time()
        if name == "w4a16":
            p = prepare_cutlass_w4a16_weights(w1, w2, num_local_experts=E, hidden_size=H, intermediate_size=I)
            call = lambda: cutlass_fused_moe(x, experts, scores, p["fc1_expert_weights"], p["fc2_expert_weights"], torch.bfloat16,
                quant_scales=[p["fc1_expert_scales"].view(torch.int32), p["fc2_expert_scales"].view(torch.int32)],
                use_w4_group_scaling=True, activation_type=ActivationType.Swiglu)[0]
        else:
            q = prepare_cutlass_humming_weights(w1, w2, num_local_experts=E, hidden_size=H, intermediate_size=I)
            call = lambda: cutlass_fused_moe(x, experts, scores, q["fc1_expert_weights"], q["fc2_expert_weights"], torch.bfloat16,
                quant_scales=[q["fc1_expert_scales"].view(torch.int32), q["fc1_residual_scale"], q["fc2_act_global"],
                              q["fc2_expert_scales"].view(torch.int32), q["fc2_residual_scale"]],
                use_w4_group_scaling=True, use_wfp4afp8_humming=True, activation_type=ActivationType.Swiglu)[0]
        y = call(); torch.cuda.synchronize()
        first = time.time() - t1
        y2 = call(); torch.cuda.synchronize()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(20): call()
        en.record(); torch.cuda.synchronize()
        print(name, "ok: first call %.1fs" % first, "finite", bool(torch.isfinite(y).all()), "same bits twice", bool(torch.equal(y, y2)),
              {k: round(cos(y, r), 5) for k, r in refs.items()}, "us/call (eager, whole MoE, T=%d)" % T, round(st.elapsed_time(en) * 1e3 / 20, 1), flush=True)
    except Exception:
        print(name, "FAILED"); traceback.print_exc()
