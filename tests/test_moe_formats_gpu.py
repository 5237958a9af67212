"""GPU: one DSV4 MoE layer read from DSV4's released format, ModelOpt and compressed-tensors: the same quantized values
give the same layer output, bit for bit, on the kernels."""
import pytest
import torch

from dsv4_nvfp4 import moe as M
from dsv4_nvfp4.checkpoint import quantize_fp8_blocks, save_dsv4_mxfp4
from dsv4_nvfp4.quant import ref_quantize_mxfp4

pytestmark = pytest.mark.gpu
CFG = M.MoEConfig(hidden=2048, inter=1024, num_experts=16, top_k=6, routed_scaling_factor=1.5)


def dsv4_file(path, seed=0):
    "A DSV4-format layer 0: MXFP4 routed experts of different magnitudes, an FP8 block-scaled shared expert, the router."
    g = torch.Generator().manual_seed(seed)
    H, I, E = CFG.hidden, CFG.inter, CFG.num_experts
    mx, extra = {}, {"layers.0.ffn.gate.weight": (torch.randn(E, H, generator=g) * H ** -0.5).to(torch.bfloat16),
                     "layers.0.ffn.gate.bias": torch.randn(E, generator=g) * 0.05}
    for e in range(E):
        for w, shp in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            mx[f"layers.0.ffn.experts.{e}.{w}"] = ref_quantize_mxfp4(torch.randn(shp, generator=g) * shp[1] ** -0.5 * (1 + e / 4))
    for w, shp in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
        w8, s8 = quantize_fp8_blocks(torch.randn(shp, generator=g) * shp[1] ** -0.5)
        extra[f"layers.0.ffn.shared_experts.{w}.weight"], extra[f"layers.0.ffn.shared_experts.{w}.scale"] = w8, s8
    save_dsv4_mxfp4(path, mx, extra)
    return mx


@pytest.mark.parametrize("T", [1, 37, 300])
def test_dsv4_modelopt_and_compressed_tensors_layers_agree(tmp_path, T):
    mx = dsv4_file(tmp_path / "dsv4.safetensors")
    d = M.DSV4MoE.from_checkpoint(tmp_path / "dsv4.safetensors", layer=0, cfg=CFG)
    assert len(d.load_report["exact"]) == 3 * CFG.num_experts
    d.save(tmp_path / "mo.safetensors", layer=0)
    d.save(tmp_path / "ct.safetensors", layer=0, format="compressed-tensors")
    mo = M.DSV4MoE.from_checkpoint(tmp_path / "mo.safetensors", layer=0, cfg=CFG)
    ct = M.DSV4MoE.from_checkpoint(tmp_path / "ct.safetensors", layer=0, cfg=CFG)
    ct.save(tmp_path / "mo2.safetensors", layer=0)
    mo2 = M.DSV4MoE.from_checkpoint(tmp_path / "mo2.safetensors", layer=0, cfg=CFG)
    x = (torch.randn(T, CFG.hidden, generator=torch.Generator().manual_seed(T)) * 0.5).to(torch.bfloat16)
    dev = torch.device("cuda")
    y = {k: lay.to(dev)(x.to(dev)) for k, lay in (("dsv4", d), ("modelopt", mo), ("ct", ct), ("ct->modelopt", mo2))}
    assert torch.isfinite(y["dsv4"].float()).all()
    assert torch.equal(y["dsv4"], y["modelopt"]), "DSV4's format and ModelOpt differ on the same values"
    assert torch.equal(y["ct"], y["ct->modelopt"]), "compressed-tensors and ModelOpt differ on the same values"
    # the layer computes DSV4's own expert values: the float64 reference on the MXFP4 weights agrees
    ref = M.ref_moe(x, d)
    rel = ((y["dsv4"].cpu().double() - ref).norm() / ref.norm()).item()
    assert rel < 5e-3, rel
    w2 = torch.stack([mx[f"layers.0.ffn.experts.{e}.w2"].dequantize() for e in range(CFG.num_experts)])
    assert torch.equal(d.w2.dequantize()[: CFG.num_experts], w2)
