"""Where the fused decode launch's time goes: `%globaltimer` stamps across its CTAs and `clock64` stamps at the phase
boundaries of its last CTA, in a patched copy of kernels_cu/ (nothing else changes), read back from spare rows of the
logits buffer. One GPU, no CuTeDSL needed.

    python tests/route_probe.py OUT.json

Per problem (DSV4-Flash, Pro EP48) and row form (W4A16: moe_route_small; W4A4: moe_route_small_wide), T = 1, medians
of 25 launches: span_ns (first CTA's start to the last CTA's end), logits_ns (first start to the last CTA's arrival at
the ticket), logits_cta_cyc (the slowest CTA's logits phase), then the last CTA's phases in SM cycles (zero: the masks,
route: the top-k, scan, place, permute), and graph_us, the launch graph-replayed behind the clean L2 flush."""
import json, os, shutil, statistics, sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "kernels_cu"
DST = Path("/tmp/dsv4_route_probe")


def patched_source(s: str) -> str:
    "moe_route.cu with the stamps; every patch must apply exactly once (a changed kernel fails loudly, not silently)."
    def once(s, old, new):
        if s.count(old) != 1: raise SystemExit(f"route_probe: the kernel changed, cannot place a stamp at {old!r}")
        return s.replace(old, new)
    a = s.index("template <int kWarps>\n__device__ __forceinline__ void route_small(")
    b = s.index("#define MOE_ROUTE_SMALL_KERNEL")
    body = s[a:b]
    body = once(body, "    if (T > kSmallMaxT || blockDim.x != kWarps * 32) __trap();   // the launcher never does this\n",
                "    if (T > kSmallMaxT || blockDim.x != kWarps * 32) __trap();\n"
                "    u64* PR = reinterpret_cast<u64*>(logits + 32 * NE); const long long c_in = clock64();\n"
                "    if (threadIdx.x == 0) atomicMin(PR + 0, gtimer());\n")
    body = once(body, "    if (!arrive_last(ticket)) return;\n",
                "    if (threadIdx.x == 0) { atomicMax(PR + 1, gtimer()); atomicMax(PR + 2, (u64)(clock64() - c_in)); }\n"
                "    if (!arrive_last(ticket)) return;\n    PST(3);\n")
    body = once(body, "    if (warp < n)\n", "    PST(4);\n    if (warp < n)\n")
    body = once(body, "    for (int e = threadIdx.x; e < ng; e += blockDim.x) tot[e] = __popcll(mask[e]);\n",
                "    PST(5);\n    for (int e = threadIdx.x; e < ng; e += blockDim.x) tot[e] = __popcll(mask[e]);\n")
    body = once(body, "    scan_groups<kWarps * 32>(tot, wsum, ng, offsets);\n", "    scan_groups<kWarps * 32>(tot, wsum, ng, offsets);\n    PST(6);\n")
    body = once(body, "    for (int t = 0; t < n; ++t) permute_token", "    PST(7);\n    for (int t = 0; t < n; ++t) permute_token")
    body = once(body, "    if (threadIdx.x == 0) *ticket = 0u;\n}", "    PST(8);\n    if (threadIdx.x == 0) { PR[9] = gtimer(); *ticket = 0u; }\n}")
    helpers = ("__device__ __forceinline__ u64 gtimer() { u64 t; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t)); return t; }\n"
               "#define PST(i) do { __syncthreads(); if (threadIdx.x == 0) PR[i] = (u64)clock64(); } while (0)\n\n")
    return s[:a] + helpers + body + s[b:]


def main():
    shutil.rmtree(DST, ignore_errors=True); shutil.copytree(SRC, DST)
    (DST / "moe_route.cu").write_text(patched_source((SRC / "moe_route.cu").read_text()))
    os.environ["DSV4_NVFP4_KERNELS_DIR"] = str(DST)           # before the package reads it
    import torch
    from dsv4_nvfp4 import routing as R
    from dsv4_nvfp4.bench.core import Timer
    dev, k, out = "cuda", 6, {"gpu": torch.cuda.get_device_name(0)}
    for name, (H, E) in {"flash": (4096, 256), "pro_ep48": (7168, 48)}.items():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, H, generator=g).bfloat16().to(dev)
        w = (torch.randn(E, H, generator=g) * H ** -0.5).bfloat16().to(dev)
        bias = (torch.randn(E, generator=g) * 0.05).to(dev)
        for act in ("w4a16", "w4a4"):
            buf = R.route_buffers(64, E, k, H, dev)               # rows 32.. of the logits hold the stamps
            a1 = torch.full((buf.groups,), 0.01, device=dev) if act == "w4a4" else None
            PR = buf.logits.view(-1)[32 * E: 32 * E + 20].view(torch.int64)
            recs = []
            for _ in range(30):
                PR.zero_(); PR[0] = 2 ** 62
                R.route_permute_fused(x, w, buf, bias, a1_scales=a1)
                v = PR.tolist()
                recs.append(dict(span_ns=v[9] - v[0], logits_ns=v[1] - v[0], logits_cta_cyc=v[2], zero=v[4] - v[3],
                                 route=v[5] - v[4], scan=v[6] - v[5], place=v[7] - v[6], permute=v[8] - v[7]))
            med = {key: statistics.median(r[key] for r in recs[5:]) for key in recs[0]}
            med["graph_us"] = Timer()(lambda: R.route_permute_fused(x, w, buf, bias, a1_scales=a1))[0]
            out[f"{name} {act}"] = med
            print(name, act, med, flush=True)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
