#!/usr/bin/env bash
# Link the objects of the trimmed fused_moe_90 that compiled (their /usr/bin/time record says exit 0), give every
# symbol no object and no runtime library defines a stub that throws (make_stubs.py), link again: $FI_ROOT/out/fused_moe_90.so.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(git -C "$here" rev-parse --show-toplevel)
export FI_ROOT=${FI_ROOT:-$root/.peer3}; V=$FI_ROOT/venv
export CUDA_HOME=${CUDA_HOME:-$(ls -d "$V"/lib/python3*/site-packages/nvidia/cu13 | head -1)}
B=$FI_ROOT/ws/.cache/flashinfer/0.7.2.post1/90a/cached_ops/fused_moe_90
OUT=$FI_ROOT/out; mkdir -p "$OUT/tmp"
objs=()
for t in "$B"/*.o.time; do o=${t%.time}; if grep -q "Exit status: 0" "$t" 2>/dev/null && [ -f "$o" ]; then objs+=("$o"); fi; done
echo "link.sh: ${#objs[@]} objects"
LDFLAGS="-shared -L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda -lnvrtc"
c++ "${objs[@]}" $LDFLAGS -o "$OUT/tmp/pass1.so"
"$V/bin/python" "$here/make_stubs.py" "$OUT/tmp/pass1.so" "$OUT/tmp"
c++ -c -fPIC -O2 "$OUT/tmp/missing_stubs_impl.cpp" -o "$OUT/tmp/missing_stubs_impl.o"
c++ -c "$OUT/tmp/missing_stubs.S" -o "$OUT/tmp/missing_stubs.o"
c++ "${objs[@]}" "$OUT/tmp/missing_stubs.o" "$OUT/tmp/missing_stubs_impl.o" $LDFLAGS -o "$OUT/fused_moe_90.so"
"$V/bin/python" "$here/make_stubs.py" "$OUT/fused_moe_90.so" "$OUT/tmp/check" | sed 's/^/after stubs: /'
printf "%s\n" "${objs[@]}" | xargs -n1 basename > "$OUT/objects_linked.txt"
ls -la "$OUT/fused_moe_90.so"
