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


# --- the metadata serving stacks read: parsed by the libraries themselves ---

def _folder_ckpt(tmp_path, config=True):
    "A tiny sharded-style folder: two linears, a router and an LM head (kept), stacked experts, and a llama config.json."
    import json
    src = tmp_path / "in"
    src.mkdir()
    g = torch.Generator().manual_seed(3)
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).bfloat16(),
               "model.layers.0.mlp.experts.gate_up_proj": torch.randn(2, 32, 64, generator=g).bfloat16(),
               "model.layers.0.mlp.gate.weight": torch.randn(2, 64, generator=g).bfloat16(),
               "model.norm.weight": torch.ones(64).bfloat16(),
               "lm_head.weight": torch.randn(100, 64, generator=g).bfloat16()}, str(src / "model.safetensors"))
    if config:
        (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                                                     "num_attention_heads": 4, "vocab_size": 100}))
    return src


def test_compressed_tensors_output_config_parses_in_the_library_and_transformers(tmp_path):
    import json
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy
    transformers = pytest.importorskip("transformers")
    src = _folder_ckpt(tmp_path)
    CK.quantize_checkpoint(src, tmp_path / "ct", progress=False, format="compressed-tensors")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])           # the library's own schema
    w = qc.config_groups["group_0"].weights
    assert (w.num_bits, w.type, w.group_size, w.strategy) == (4, "float", 16, QuantizationStrategy.TENSOR_GROUP)
    assert qc.format == "nvfp4-pack-quantized" and qc.quant_method == "compressed-tensors"
    assert sorted(qc.ignore) == ["lm_head", "model.layers.0.mlp.gate"]
    want = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])},
                              format="nvfp4-pack-quantized", quantization_status="compressed", ignore=qc.ignore)
    assert qc.config_groups["group_0"].weights == want.config_groups["group_0"].weights       # the NVFP4A16 preset's weights
    auto = transformers.AutoConfig.from_pretrained(tmp_path / "ct")               # transformers reads the folder
    assert auto.model_type == "llama"
    qd = auto.quantization_config if isinstance(auto.quantization_config, dict) else auto.quantization_config.to_dict()
    assert qd["format"] == "nvfp4-pack-quantized" and qd["quant_method"] == "compressed-tensors"
    from compressed_tensors.compressors import ModelCompressor                   # transformers' loading path
    mc = ModelCompressor.from_compression_config(transformers.CompressedTensorsConfig.from_dict(cfg["quantization_config"]))
    assert mc.quantization_config.format == "nvfp4-pack-quantized"
    assert mc.quantization_config.config_groups["group_0"].weights == want.config_groups["group_0"].weights
    fmt, layers = CK.load_nvfp4_checkpoint(tmp_path / "ct")                       # and our own loader reads it back
    assert fmt == "compressed-tensors" and sorted(layers) == ["model.layers.0.mlp.experts.0.gate_up_proj",
                                                              "model.layers.0.mlp.experts.1.gate_up_proj",
                                                              "model.layers.0.self_attn.q_proj"]


def test_modelopt_output_writes_hf_quant_config(tmp_path):
    import json
    transformers = pytest.importorskip("transformers")
    src = _folder_ckpt(tmp_path)
    CK.quantize_checkpoint(src, tmp_path / "mo", progress=False)
    hq = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "dsv4_nvfp4"
    assert hq["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                  "exclude_modules": ["lm_head", "model.layers.0.mlp.gate"]}
    assert transformers.AutoConfig.from_pretrained(tmp_path / "mo").model_type == "llama"
    layers = CK.load_modelopt_nvfp4(tmp_path / "mo")
    assert sorted(layers) == ["model.layers.0.mlp.experts.0.gate_up_proj", "model.layers.0.mlp.experts.1.gate_up_proj",
                              "model.layers.0.self_attn.q_proj"]


def test_no_config_json_gets_a_block_to_paste(tmp_path):
    "Without an input config.json, compressed-tensors output holds quantization_config.json (no invented model type)."
    import json
    from compressed_tensors.quantization import QuantizationConfig
    src = _folder_ckpt(tmp_path, config=False)
    st = CK.quantize_checkpoint(src, tmp_path / "ct", progress=False, format="compressed-tensors")
    assert not (tmp_path / "ct" / "config.json").exists() and "no config.json" in st["notes"][0]
    QuantizationConfig.model_validate(json.loads((tmp_path / "ct" / "quantization_config.json").read_text()))
    CK.quantize_checkpoint(src, tmp_path / "mo", progress=False)
    assert sorted(p.name for p in (tmp_path / "mo").iterdir()) == ["hf_quant_config.json", "model.safetensors",
                                                                  "model.safetensors.index.json"]
