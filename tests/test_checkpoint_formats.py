"""compressed-tensors NVFP4 files checked against the compressed-tensors library itself (a dev dependency): what we
write, the library decompresses to our values; what the library compresses, we load to the reference quantizer's bits."""
import pytest
import torch
from safetensors.torch import save_file

from dsv4_nvfp4 import checkpoint as CK
from dsv4_nvfp4.quant import ref_quantize_nvfp4

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402

SCHEME = preset_name_to_scheme("NVFP4", ["Linear"])


def _ulps_bf16(a, b):
    "Largest distance between two bf16 tensors in units in the last place."
    ia, ib = a.contiguous().view(torch.int16).int(), b.contiguous().view(torch.int16).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia); ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs().max().item()


def test_what_we_write_the_library_decompresses_to_our_values(tmp_path):
    g = torch.Generator().manual_seed(0)
    ws = {"m.l0.up_proj": ref_quantize_nvfp4(torch.randn(64, 128, generator=g) * 0.05),
          "m.l0.down_proj": ref_quantize_nvfp4(torch.randn(32, 256, generator=g) * 3)}
    path = tmp_path / "ct.safetensors"
    CK.save_compressed_tensors_nvfp4(path, ws, {"m.l0.up_proj": 0.02})
    from safetensors.torch import load_file
    raw = load_file(str(path))
    fmt, ours = CK.load_nvfp4_checkpoint(path)
    assert fmt == "compressed-tensors"
    for name in ws:
        sd = {k.split(".")[-1]: v for k, v in raw.items() if k.startswith(name + ".") and not k.endswith("input_global_scale")}
        lib = NVFP4PackedCompressor.decompress(sd, SCHEME)["weight"]
        mine = ours[name].weight.dequantize().to(lib.dtype)
        assert _ulps_bf16(lib, mine) <= 1, name                  # the library's x_q * s / g against our x_q * s * (1/g)
        assert torch.equal(ours[name].weight.data, ws[name].data)
    assert abs(ours["m.l0.up_proj"].input_scale - 0.02) < 1e-8


def test_what_the_library_compresses_we_load_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 160, generator=g)
    ref = ref_quantize_nvfp4(w)
    sd = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": ref.scale.float(),
                                         "weight_global_scale": (1 / ref.global_scale).reshape(1)}, SCHEME)
    save_file({f"m.l0.gate_proj.{k}": v.contiguous() for k, v in sd.items()}, str(tmp_path / "lib.safetensors"))
    fmt, layers = CK.load_nvfp4_checkpoint(tmp_path / "lib.safetensors")
    q = layers["m.l0.gate_proj"].weight
    assert fmt == "compressed-tensors"
    assert torch.equal(q.data, ref.data) and torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    assert abs(q.global_scale.item() / ref.global_scale.item() - 1) < 2 ** -23


def test_quantize_to_compressed_tensors_the_library_decompresses(tmp_path):
    # `dsv4-nvfp4 quantize --format compressed-tensors` output: the library decodes it to the reference quantizer's values
    g = torch.Generator().manual_seed(2)
    src = {"m.l0.up_proj.weight": (torch.randn(96, 256, generator=g) * 0.1).bfloat16()}
    save_file(src, str(tmp_path / "in.safetensors"))
    CK.quantize_checkpoint(tmp_path / "in.safetensors", tmp_path / "ct.safetensors", progress=False, format="compressed-tensors")
    from safetensors.torch import load_file
    raw = load_file(str(tmp_path / "ct.safetensors"))
    assert sorted(raw) == ["m.l0.up_proj.weight_global_scale", "m.l0.up_proj.weight_packed", "m.l0.up_proj.weight_scale"]
    lib = NVFP4PackedCompressor.decompress({k.split(".")[-1]: v for k, v in raw.items()}, SCHEME)["weight"]
    ref = ref_quantize_nvfp4(src["m.l0.up_proj.weight"]).dequantize().to(lib.dtype)
    assert _ulps_bf16(lib, ref) <= 1
