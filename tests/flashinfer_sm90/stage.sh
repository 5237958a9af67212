#!/usr/bin/env bash
# Pack the library build.sh made for the GPU host: .peer3/carry/ (the flashinfer_jit_cache shim with the stripped
# library in it, apache-tvm-ffi's wheel, smoke.py), about 15 MB. FlashInfer's wheel itself rides in tests/stage_peers_w4a8.sh's
# two .peer2 carries. The working tree and a carry must stay under 64 MiB together, so on the host, each call within
# 30 s of the last:
#   1. carry [".peer2/fi_a", ".peer2/env.sh"]:  source .peer2/env.sh
#   2. carry [".peer3/carry"]:                   mkdir -p /tmp/fi_stash && cp -r .peer3/carry/* /tmp/fi_stash/
#   3. carry [".peer2/fi_b", ".peer2/env.sh"]:  source .peer2/env.sh; source /tmp/fi_stash/env.sh; python3 /tmp/fi_stash/smoke.py
# (env.sh installs tvm-ffi into /tmp/fi_tvm, puts the shim on PYTHONPATH and sets FLASHINFER_DISABLE_JIT=1, so a missing
# module raises instead of compiling.)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(git -C "$here" rev-parse --show-toplevel)
FI_ROOT=${FI_ROOT:-$root/.peer3}; C=$FI_ROOT/carry
rm -rf "$C"; mkdir -p "$C/shim/flashinfer_jit_cache/jit_cache/fused_moe_90"
cp "$here/shim/flashinfer_jit_cache/__init__.py" "$C/shim/flashinfer_jit_cache/"
strip --strip-unneeded -o "$C/shim/flashinfer_jit_cache/jit_cache/fused_moe_90/fused_moe_90.so" "$FI_ROOT/out/fused_moe_90.so"
mkdir -p "$C/shim/flashinfer_jit_cache/jit_cache/trtllm_utils"          # the autotuner's stream delay kernel
cp "$FI_ROOT/ws/.cache/flashinfer/0.7.2.post1/90a/cached_ops/trtllm_utils/trtllm_utils.so" "$C/shim/flashinfer_jit_cache/jit_cache/trtllm_utils/"
cp "$here/smoke.py" "$C/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$C" apache-tvm-ffi==0.1.15.post2
cat > "$C/env.sh" <<'ENV'
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fi_tvm /tmp/fi_stash/apache_tvm_ffi-*.whl > /tmp/fi_tvm.log 2>&1 || tail -3 /tmp/fi_tvm.log
export PYTHONPATH=/tmp/fi_stash/shim:/tmp/fi_tvm${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_DISABLE_JIT=1
ENV
du -sh "$C"; echo "stage.sh: staged $C"
