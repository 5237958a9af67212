"""Find undefined symbols of a linked .so that no runtime library provides and emit
an x86-64 assembly file defining each as a function that throws std::runtime_error.
usage: make_stubs.py LIB.so OUT_DIR"""
import subprocess, sys, os
lib, out = sys.argv[1], sys.argv[2]
cuda = os.environ["CUDA_HOME"]                        # the nvidia-cuda-* wheels' cu13 folder (build.sh)
import tvm_ffi
provider_libs = [
    f"{cuda}/lib/libcudart.so.13", f"{cuda}/lib/libnvrtc.so.13",
    os.path.join(os.path.dirname(tvm_ffi.__file__), "lib", "libtvm_ffi.so"),
]
for name in ["libstdc++.so.6", "libc.so.6", "libm.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2"]:
    p = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    provider_libs.append(os.path.realpath(p))
provided = set()
for p in provider_libs:
    r = subprocess.run(["nm", "-D", "--defined-only", p], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            provided.add(parts[2].split("@")[0])
und = []
for line in subprocess.run(["nm", "-D", "--undefined-only", lib], capture_output=True, text=True).stdout.splitlines():
    parts = line.split()
    sym = parts[-1].split("@")[0]
    if parts[0] == "w":  # weak undefined: fine
        continue
    und.append(sym)
missing = [s for s in und if s not in provided]
driver = [s for s in missing if not s.startswith("_Z") and s.startswith("cu")]
cxx = [s for s in missing if s.startswith("_Z")]
other = [s for s in missing if s not in driver and s not in cxx]
data_like = [s for s in cxx if s.startswith(("_ZTV", "_ZTI", "_ZTS", "_ZGV", "_ZTH", "_ZTW"))]
os.makedirs(out, exist_ok=True)
open(f"{out}/undefined_driver.txt", "w").write("\n".join(driver) + "\n")
open(f"{out}/undefined_cxx.txt", "w").write("\n".join(cxx) + "\n")
open(f"{out}/undefined_other.txt", "w").write("\n".join(other) + "\n")
print(f"undefined total={len(und)} unresolved={len(missing)} driver(cu*)={len(driver)} cxx={len(cxx)} data_like={len(data_like)} other={other}")
fn_syms = [s for s in cxx if s not in data_like]
with open(f"{out}/missing_stubs.S", "w") as f:
    f.write("\t.text\n")
    for i, s in enumerate(fn_syms):
        f.write(f"\t.section .rodata.fi_stub_name_{i},\"a\"\n.Lname{i}:\n\t.asciz \"{s}\"\n")
        f.write(f"\t.text\n\t.globl {s}\n\t.type {s}, @function\n{s}:\n\tleaq .Lname{i}(%rip), %rdi\n\tjmp fi_missing_symbol_stub@PLT\n\t.size {s}, .-{s}\n")
    f.write("\t.section .note.GNU-stack,\"\",@progbits\n")
with open(f"{out}/missing_stubs_impl.cpp", "w") as f:
    f.write('#include <stdexcept>\n#include <string>\n'
            'extern "C" [[noreturn]] __attribute__((visibility("default"))) void fi_missing_symbol_stub(const char* name) {\n'
            '  throw std::runtime_error(std::string("fused_moe_90 (minimal MXFP4 W4A16/W4A8 build): kernel/runner not compiled into this library: ") + name);\n}\n')
print("stubs:", len(fn_syms), "data-like (NOT stubbed):", data_like[:10])

# demangled category summary of the stubs
import re, collections
dem = subprocess.run(["c++filt"], input="\n".join(fn_syms), capture_output=True, text=True).stdout.splitlines()
open(f"{out}/stubs_demangled.txt", "w").write("\n".join(dem) + "\n")
cat = collections.Counter()
for d in dem:
    m = re.match(r"(?:void )?([A-Za-z_0-9:]+)(<|\()", d)
    name = m.group(1) if m else d[:60]
    if "kernelLauncher<" in d:
        args = d.split("kernelLauncher<", 1)[1].split(", ")
        name = name.split("::")[-1] + "<" + ", ".join(args[:3]) + ", ...>"
    if "MoeGemmRunner<" in d: name = "MoeGemmRunner<" + d.split("MoeGemmRunner<")[1].split(">::")[0][:80] + ">::*"
    cat[name] += 1
for k, v in cat.most_common():
    print(f"  {v:5d}  {k}")
