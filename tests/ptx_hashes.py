"""SHA-256 of the PTX of every kept kernel: the NVRTC kernels of kernels_cu/ (default defines and every tuning value
the tests compile) and every kept configuration of the sm_90a grouped GEMM (CuTeDSL, fake tensors). No GPU needed.

    python tests/ptx_hashes.py OUT.json            # write the hashes
    python tests/ptx_hashes.py OUT.json --diff A.json   # and compare with an earlier run (names in both)

A refactor that must not change the machine code runs it before and after and compares. Kernel symbol names are
kept in the PTX (a rename would show)."""
import hashlib, json, os, re, sys
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels_cu"


def nvrtc_ptx(file: str, arch: str, defines=()) -> bytes:
    from cuda.bindings import nvrtc as N
    import dsv4_nvfp4.runtime as rt
    inc = rt.cuda_include_dirs() + [str(KERNELS)]
    err, prog = N.nvrtcCreateProgram((KERNELS / file).read_bytes(), file.encode(), 0, [], [])
    opts = [f"-arch=compute_{arch[3:]}".encode(), b"-std=c++17"] + [f"-I{d}".encode() for d in inc]
    opts += [f"-D{d}".encode() for d in defines]
    (res,) = N.nvrtcCompileProgram(prog, len(opts), opts)[:1]
    if res != N.nvrtcResult.NVRTC_SUCCESS:
        err, n = N.nvrtcGetProgramLogSize(prog); log = b" " * n; N.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"{file} {arch} {defines}: {log.decode(errors='replace')[-2000:]}")
    err, n = N.nvrtcGetPTXSize(prog); buf = b" " * n; N.nvrtcGetPTX(prog, buf)
    return buf


def tuning_builds():
    """(file, defines) of every non-default build of kernels_cu/ that the launchers (or the GPU tests) make: the
    compile-time constants of a file are shape parameters or tuning constants, and each value used is compiled here and
    in tests/test_runtime.py. The other files take no defines (their launchers pass none)."""
    from dsv4_nvfp4 import kv as K
    from dsv4_nvfp4.moe import FLASH, PRO
    out = []
    for r in (K.CSA_RATIO, K.HCA_RATIO):                      # kv.compress_prefill / compress_decode
        split, unroll = K.kv_split(r), K.kv_unroll(r)
        kv = lambda split, u: dict(RATIO=r, KV_D=K.KV_DIM, ROPE=K.DSV4_ROPE.dim, SPLIT=split, KV_UNROLL=u)
        out += [("nvfp4_kv_compress.cu", kv(split, u)) for u in sorted({unroll, 1, 8})]   # 1, 8: tests/test_kv_gpu.py
        if split != 1: out.append(("nvfp4_kv_compress.cu", kv(1, unroll)))           # split= given by the caller
    for hid, topk, ne in sorted({(c.hidden, c.top_k, c.num_experts) for c in (FLASH, PRO)} | {(1024, 1, 1), (1024, 31, 1023)}):
        out.append(("moe_route.cu", dict(HID=hid, TOPK=topk, NE=ne)))   # routing.route_buffers' range and DSV4's layers
    out += [("moe_route.cu", dict(HID=c.hidden)) for c in (FLASH, PRO)]  # routing.router_logits
    return out


def build_name(file: str, defines: dict) -> str:
    return f"{file}[{','.join(f'{k}={v}' for k, v in defines.items())}]"


def gemm_configs():
    "Every configuration the library can launch: the pick_config candidates (and WIDE_CONFIG, DECODE_WIDE) x every epilogue kind (+ dump, no clamp, the plain kinds' row map, the plain bf16 kind as a programmatic dependent), and W4A8's two, each with the F2FP loop alone and with both loops (`table`), and W4A8's prefill plan (`W4A8_OV_CONFIG`) likewise."
    import math
    from dsv4_nvfp4.gemm import sm90 as L
    out = []
    for name, cfg in [(f"tt{tt}", c) for tt, c in sorted(L.CONFIGS.items())] + [("tt64x4", L.WIDE_CONFIG)] + [(f"tt{tt}x4", c) for tt, c in sorted(L.DECODE_WIDE.items())]:
        for epi in L.Epilogue:
            c = cfg._replace(epilogue=epi)
            out.append((f"{name}_{epi.value}", c))
            if epi.fp4_out: out.append((f"{name}_{epi.value}_dump", c._replace(dump=True)))
            if epi.swiglu: out.append((f"{name}_{epi.value}_nolimit", c._replace(swiglu_limit=math.inf)))
            if epi in (L.Epilogue.BF16, L.Epilogue.BF16_ROW_GS): out.append((f"{name}_{epi.value}_rowmap", c._replace(row_map=True)))
            if epi is L.Epilogue.BF16: out.append((f"{name}_{epi.value}_pdl", c._replace(pdl=True)))   # moe's decode L2
        for epi in (L.Epilogue.BF16_ROW_GS, L.Epilogue.SWIGLU_BF16):     # W4A8 (the sm90_w4a8 backend)
            out.append((f"{name}_w4a8_{epi.value}", cfg._replace(epilogue=epi, fp8=True, overlap=False)))
            out.append((f"{name}_w4a8_table_{epi.value}", cfg._replace(epilogue=epi, fp8=True, overlap=False, table=True)))
    from dsv4_nvfp4.gemm.w4a8 import W4A8_OV_CONFIG                     # W4A8's prefill plan: the overlapped W4A8 loop
    for epi in (L.Epilogue.BF16_ROW_GS, L.Epilogue.SWIGLU_BF16):
        out.append((f"w4a8_ov_{epi.value}", W4A8_OV_CONFIG._replace(epilogue=epi)))
        out.append((f"w4a8_ov_table_{epi.value}", W4A8_OV_CONFIG._replace(epilogue=epi, table=True)))
    return out


def cute_ptx(cfg) -> bytes:
    from dsv4_nvfp4.gemm import sm90_kernel as S
    return S.kernel_artifact(cfg, "ptx", "sm_90a")


def main():
    out = Path(sys.argv[1]); only = os.environ.get("PTX_ONLY", "")
    res = {}
    if only in ("", "nvrtc"):
        for f in sorted(p.name for p in KERNELS.glob("*.cu")):
            for arch in ("sm_90a", "sm_100a"):
                res[f"nvrtc/{f}/{arch}"] = hashlib.sha256(nvrtc_ptx(f, arch)).hexdigest()
        for f, d in tuning_builds():
            for arch in ("sm_90a", "sm_100a"):
                defs = [f"{k}={v}" for k, v in d.items()]
                res[f"nvrtc/{build_name(f, d)}/{arch}"] = hashlib.sha256(nvrtc_ptx(f, arch, defs)).hexdigest()
    if only in ("", "cute"):
        for name, cfg in gemm_configs():
            ptx = cute_ptx(cfg)
            # the dump's file name and header lines carry no code; hash the text from the first .version on
            text = ptx[ptx.find(b".version"):]
            res[f"cute/{name}"] = hashlib.sha256(text).hexdigest()
            # the entry's symbol carries the Python module path of the kernel class (truncated): with it replaced by
            # one placeholder, a hash that matches says the code is the same wherever the class lives
            for sym in set(re.findall(rb"\.entry\s+(\w+)", text)): text = text.replace(sym, b"KERNEL")
            res[f"cute-code/{name}"] = hashlib.sha256(text).hexdigest()
            print(name, res[f"cute/{name}"][:16], flush=True)
    out.write_text(json.dumps(res, indent=1, sort_keys=True))
    if "--diff" in sys.argv:
        old = json.loads(Path(sys.argv[sys.argv.index("--diff") + 1]).read_text())
        common = sorted(set(old) & set(res))
        bad = [k for k in common if old[k] != res[k]]
        print(f"{len(common)} kernels in both, {len(bad)} differ: {bad}")
        print("only before:", sorted(set(old) - set(res))); print("only after:", sorted(set(res) - set(old)))
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
