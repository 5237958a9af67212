"""GPU microbenchmark: the FP8 tensor pipe's ceiling per WGMMA shape on sm_90a. Back-to-back `wgmma.mma_async
m64nNk32.f32.e4m3.e4m3` (N = 64, 128, 192, 256), A from registers (RS, as the W4A8 loop) or from shared memory (SS), B
from shared memory (128-byte swizzle, K-major), two warpgroups per CTA, one CTA per SM, nothing else in the loop: per
trip a fence, 4 WGMMAs (one 128-K tile), a commit and a wait that leaves one group in flight (the W4A8 loop's rhythm).
Host-timed (best of 3 launches of 0.6-2.3 ms on an H200 at 4000 trips, so the launch adds about 1-2% at the smallest
shape); the MAC rate per clock assumes the SM clock holds 1980 MHz. Record: measured/qgmma_ceiling_s41_h200.json.

    python tests/qgmma_ceiling.py [OUT.json] [ITERS]"""
import json, sys, time


def source(N: int, rs: bool) -> str:
    "CUDA C++ of the benchmark kernel `bench(out, iters)` for m64nNk32, A from registers (rs) or shared memory."
    nacc = N // 2
    d = ", ".join(f"%{i}" for i in range(nacc))
    a_part = "{" + ", ".join(f"%{nacc + i}" for i in range(4)) + "}" if rs else f"%{nacc}"
    bdesc, flag = (nacc + 4, nacc + 5) if rs else (nacc + 1, nacc + 2)
    asm = (f'"{{ .reg .pred p; setp.ne.b32 p, %{flag}, 0; wgmma.mma_async.sync.aligned.m64n{N}k32.f32.e4m3.e4m3 '
           f'{{{d}}}, {a_part}, %{bdesc}, p, 1, 1; }}"')
    outs = ", ".join(f'"+f"(acc[{i}])' for i in range(nacc))
    ins = (", ".join(f'"r"(a[{i}])' for i in range(4)) if rs else '"l"(adesc + kb * 2)') + ', "l"(bdesc + kb * 2), "r"(flag)'
    a_decl = ("unsigned a[4] = {0x38383838u ^ threadIdx.x, 0x30303030u, 0x38303830u, 0x30383038u};" if rs else
              "unsigned long long adesc = desc(base + 32768 + 8192 * (threadIdx.x / 128));   // A: 64 x 128 B per warpgroup")
    return f"""
__device__ unsigned long long desc(unsigned long long addr) {{   // K-major, 128-byte swizzle, 1024 B between 8-row groups
  return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}}
extern "C" __global__ void __launch_bounds__(256, 1) bench(float* out, int iters) {{
  extern __shared__ __align__(1024) unsigned char smem[];
  float acc[{nacc}];
  #pragma unroll
  for (int i = 0; i < {nacc}; ++i) acc[i] = 0.f;
  for (int i = threadIdx.x; i < 48 * 1024 / 4; i += blockDim.x) ((unsigned*)smem)[i] = 0x38303830u;
  __syncthreads();
  unsigned base = (unsigned)__cvta_generic_to_shared(smem);
  unsigned long long bdesc = desc(base);                       // B: N x 128 B (N <= 256: 32 KB)
  {a_decl}
  int flag = 1;
  for (int it = 0; it < iters; ++it) {{
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    #pragma unroll
    for (int kb = 0; kb < 4; ++kb) {{
      asm volatile({asm} : {outs} : {ins});
    }}
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
  }}
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  float s = 0.f;
  #pragma unroll
  for (int i = 0; i < {nacc}; ++i) s += acc[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}}
"""


def compile_cubin(N: int, rs: bool, arch: str = "sm_90a"):
    "The compiled module (cuda.core ObjectCode) of `source(N, rs)` for arch, by NVRTC."
    from cuda.core import Program, ProgramOptions
    return Program(source(N, rs), code_type="c++", options=ProgramOptions(arch=arch, std="c++17")).compile("cubin")


def main():
    import torch
    from cuda.core import Device, LaunchConfig, launch
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 4000
    dev = Device(0); dev.set_current()
    torch.cuda.init()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(sms * 256, device="cuda")
    st = dev.create_stream()
    rows = []
    for rs in (True, False):
        for N in (64, 128, 192, 256):
            k = compile_cubin(N, rs).get_kernel("bench")
            cfg = LaunchConfig(grid=(sms,), block=(256,), shmem_size=48 * 1024)
            best = float("inf")
            for _ in range(3):
                st.sync()
                t0 = time.perf_counter()
                launch(st, cfg, k, out.data_ptr(), iters)
                st.sync()
                best = min(best, time.perf_counter() - t0)
            macs = sms * 2 * iters * 4 * 64 * N * 32
            row = dict(a="registers" if rs else "shared", shape=f"m64n{N}k32", ms=round(best * 1e3, 3),
                       tflops=round(2 * macs / best / 1e12), mac_per_clk_per_sm_at_1980=round(macs / best / sms / 1.98e9))
            rows.append(row); print(row, flush=True)
    if out_path:
        json.dump(dict(gpu=torch.cuda.get_device_name(0), sms=sms, iters=iters, rows=rows), open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
