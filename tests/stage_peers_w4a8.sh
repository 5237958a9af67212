#!/usr/bin/env bash
# Stage issue 29's peers for the GPU host (it has no package index; its nvcc builds JIT kernels):
#   FlashInfer (flashinfer-python 0.7.2.post1, a 62 MB pure-Python wheel that JIT-builds its CUTLASS SM90 fused MoE,
#     MXFP4 x bf16 and MXFP4 x FP8) and the four dependencies the GPU image lacks (cuda-tile, nccl4py,
#     nccl-extensions, nvidia-cudnn-frontend; apache-tvm-ffi and nvidia-cutlass-dsl come with .gpu/);
#   DeepGEMM (deepinfer-gemm 2.8.2: PyPI has only the sdist, 2.6 MB with its CUTLASS headers; one C++ extension is
#     built on the host with DG_FORCE_BUILD=1 (about 2 minutes), the kernels are JIT-built at run time). Its sources
#     include <elfutils/libdwfl.h> (loaded with dlopen at run time, so headers suffice): the libdw-dev and libelf-dev
#     packages ride along in .peer2/dg/deb and are unpacked on the host. The extension is built by the host's g++ 13 and
#     crashes in std::regex under the older libstdc++ the Python process loads first, so env.sh preloads the system's.
# Writes .peer2/ (git-ignored) in three carries of at most 64 MiB each:
#   .peer2/fi_a  the wheel's first half and nccl-extensions   (call 1: carry [".peer2/fi_a", ".peer2/env.sh"], 53 MB)
#   .peer2/fi_b  its second half and the other three          (call 2: carry [".peer2/fi_b", ".peer2/env.sh"], 47 MB)
#   .peer2/dg    the DeepGEMM sdist and the two header packages (call 3: carry [".peer2/dg", ".peer2/env.sh", ...], 3 MB)
# On the host, `source .peer2/env.sh` in each call: it stashes, assembles and installs into /tmp/dsv4-peer2-site
# (logs in /tmp/dsv4-peer2-*.log) and puts that on PYTHONPATH. DeepGEMM's staging has run on an H100;
# FlashInfer's installed and imported on an H200 in session 37; its SM90 MoE module is not JIT-built there but
# prebuilt on a CPU machine and packed by tests/flashinfer_sm90/ (build.sh, stage.sh).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
grep -qx '/.peer2/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.peer2/' >> .git/info/exclude; }
cache=${XDG_CACHE_HOME:-$HOME/.cache}/dsv4-peer2; mkdir -p "$cache"
plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
ls "$cache"/flashinfer_python-0.7.2.post1-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
  "${plat[@]}" -d "$cache" flashinfer-python==0.7.2.post1 cuda-tile==1.7.0 nccl4py==0.6.0 nccl-extensions==0.1.0 \
  nvidia-cudnn-frontend==1.32.0
ls "$cache"/deepinfer_gemm-2.8.2.tar.gz >/dev/null 2>&1 || python3 -m pip download -q --no-deps --no-binary=:all: \
  --no-build-isolation -d "$cache" deepinfer-gemm==2.8.2 2>/dev/null || {
  url=$(curl -s https://pypi.org/simple/deepinfer-gemm/ | grep -o 'https://[^"#]*deepinfer_gemm-2.8.2.tar.gz' | head -1)
  curl -s -o "$cache/deepinfer_gemm-2.8.2.tar.gz" "$url"; }
rm -rf .peer2 && mkdir -p .peer2/fi_a .peer2/fi_b .peer2/dg
whl=$(ls "$cache"/flashinfer_python-0.7.2.post1-*.whl | head -1); name=$(basename "$whl")
half=$(( ($(stat -c %s "$whl") + 1) / 2 ))
head -c "$half" "$whl" > ".peer2/fi_a/$name.0"; tail -c +"$((half + 1))" "$whl" > ".peer2/fi_b/$name.1"
cp "$cache"/nccl_extensions-*.whl .peer2/fi_a/
cp "$cache"/cuda_tile-*.whl "$cache"/nccl4py-*.whl "$cache"/nvidia_cudnn_frontend-*.whl .peer2/fi_b/
cp "$cache/deepinfer_gemm-2.8.2.tar.gz" .peer2/dg/
mkdir -p .peer2/dg/deb && (cd .peer2/dg/deb && apt-get download libdw-dev libelf-dev >/dev/null 2>&1) ||
  { echo "apt-get download libdw-dev libelf-dev failed: DeepGEMM will not build on the host" >&2; }
cat > .peer2/env.sh <<'ENV'
# source on the GPU host in each call (see tests/stage_peers_w4a8.sh)
_s=/tmp/dsv4-peer2-site; _t=/tmp/dsv4-peer2-stash; mkdir -p $_t
[ -d .peer2/fi_a ] && mkdir -p $_t/deps && cp .peer2/fi_a/*.whl.0 $_t/ && cp .peer2/fi_a/*.whl $_t/deps/ &&
  echo "peer2: FlashInfer's first half and nccl-extensions stashed"
if [ -d .peer2/fi_b ] && [ ! -f $_s/.fi ]; then
  _w=$(ls .peer2/fi_b/*.whl.1 | head -1); _n=$(basename "${_w%.1}")
  if [ -f "$_t/$_n.0" ]; then
    cat "$_t/$_n.0" "$_w" > "$_t/$_n" && mkdir -p $_s &&
    python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --target $_s "$_t/$_n" $_t/deps/*.whl .peer2/fi_b/*.whl \
      > /tmp/dsv4-peer2-fi.log 2>&1 && touch $_s/.fi && echo "peer2: FlashInfer installed in $_s" ||
      echo "peer2: FlashInfer install failed: /tmp/dsv4-peer2-fi.log" >&2
  else echo "peer2: FlashInfer's first half missing on this host: a call with .peer2/fi_a first" >&2; fi
fi
if [ -d .peer2/dg/deb ]; then mkdir -p /tmp/dsv4-peer2-inc && for _d in .peer2/dg/deb/*.deb; do dpkg -x "$_d" /tmp/dsv4-peer2-inc; done; fi
[ -d /tmp/dsv4-peer2-inc/usr/include ] && export CPATH=/tmp/dsv4-peer2-inc/usr/include${CPATH:+:$CPATH}
[ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null && export CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
if [ -d .peer2/dg ] && [ ! -f $_s/.dg ]; then
  mkdir -p $_s && (cd $_t && rm -rf deepinfer_gemm-2.8.2 && tar xzf "$OLDPWD/.peer2/dg/deepinfer_gemm-2.8.2.tar.gz" &&
    cd deepinfer_gemm-2.8.2 && MAX_JOBS=${MAX_JOBS:-16} DG_FORCE_BUILD=1 python3 -m pip install --no-index --no-deps --no-build-isolation \
      --no-cache-dir --target $_s . ) > /tmp/dsv4-peer2-dg.log 2>&1 && touch $_s/.dg && echo "peer2: DeepGEMM built in $_s" ||
    echo "peer2: DeepGEMM build failed: /tmp/dsv4-peer2-dg.log" >&2
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$_s
[ -f $_s/.dg ] && _l=$(g++ -print-file-name=libstdc++.so.6 2>/dev/null) && [ -f "$_l" ] && export LD_PRELOAD=$_l${LD_PRELOAD:+:$LD_PRELOAD}
ENV
du -sh .peer2/*; echo "staged .peer2/ (three carries; see this script's header)"
