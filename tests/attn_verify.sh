#!/bin/bash
# One GPU run that checks an attention kernel change against a base tree: the outputs bit for bit on fixed inputs
# (tests/attn_bits.py under both trees), the GPU tests, the sanitizers, and each kernel timed beside the base's in the
# same process (tests/attn_ab.py --base) with the peer. Run from the repository root on the GPU host:
#     bash tests/attn_verify.sh BASE_TREE OUT [BATCH ...]   # BASE_TREE: a folder holding the base's dsv4_nvfp4/ and kernels_cu/
set -u
base=$1; out=$2; shift 2; batches=${*:-8 32 64 128}; mkdir -p "$out"
PYTHONPATH=$base timeout 150 python3 tests/attn_bits.py "$out/base.pt" 2>&1 | tail -1
PYTHONPATH=$PWD timeout 150 python3 tests/attn_bits.py "$out/new.pt" 2>&1 | tail -1
python3 tests/attn_bits.py --compare "$out/base.pt" "$out/new.pt"; echo "bits rc $?"
export PYTHONPATH=$PWD
timeout 240 python3 -m pytest -q tests/test_attention_gpu.py tests/test_attention.py -p no:cacheprovider 2>&1 | tail -1
for t in memcheck racecheck synccheck; do
  timeout 120 compute-sanitizer --tool $t --report-api-errors no python3 tests/attn_sanitize.py > "$out/san_$t.log" 2>&1
  echo "$t rc $?: $(tail -1 "$out/san_$t.log")"
done
cp "$base/kernels_cu/nvfp4_sparse_attn.cu" kernels_cu/attn_base.cu; trap 'rm -f kernels_cu/attn_base.cu' EXIT
timeout 240 python3 tests/attn_ab.py "$out/attn_ab.json" --base attn_base.cu --batches $batches --contexts 32768 > "$out/attn_ab.log" 2>&1
echo "ab rc $?"
python3 - "$out/attn_ab.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["problem"], r["batch"], r["plan"][18:], " ".join(
        f"{k} {r[k + '_us']} (base {r.get('base_' + k + '_us')}, same bits {r.get(k + '_same_bits')})" for k in ("wg", "cta64", "cta16")), "peer", r["peer_us"])
P
