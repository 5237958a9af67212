"""GPU: torch.compile(fullgraph=True) of the DSV4 MoE layer traces it as one custom op and matches eager bit for bit."""
import pytest
import torch

from dsv4_nvfp4 import moe as M

pytestmark = pytest.mark.gpu
CFG = M.MoEConfig(hidden=2048, inter=1024, num_experts=16, top_k=6, routed_scaling_factor=1.5)
DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def layers():
    return {act: M.DSV4MoE.synthetic(CFG, seed=1, act=act, device=DEV).to(DEV) for act in ("w4a16", "w4a4")}


def x_of(T):
    return (torch.randn(T, CFG.hidden, generator=torch.Generator().manual_seed(T)) * 0.5).to(torch.bfloat16).to(DEV)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("act", ["w4a16", "w4a4"])
def test_compiled_layer_equals_eager(layers, act, backend):
    lay = layers[act]
    torch._dynamo.reset()
    comp = torch.compile(lay, fullgraph=True, backend=backend)        # fullgraph: a graph break raises
    for T in (1, 37, 300):
        x = x_of(T)
        assert torch.equal(comp(x), lay(x)), f"{act} {backend} T={T}"


def test_compiled_forward_routed_and_reduce_overhead(layers):
    lay = layers["w4a16"]
    torch._dynamo.reset()
    x = x_of(64)
    w, ids = lay.route(x)
    routed = torch.compile(lambda x, w, i: lay.forward_routed(x, w, i, check=False), fullgraph=True)
    assert torch.equal(routed(x, w, ids), lay.forward_routed(x, w, ids))
    ro = torch.compile(lay, fullgraph=True, mode="reduce-overhead")    # CUDA graphs (cudagraph trees) around the op
    want = lay(x)
    for _ in range(3):                                                 # warm-up, record, replay
        got = ro(x).clone()
        assert torch.equal(got, want)
    cap = lay.capture(64)                                              # our own graph capture still works beside it
    assert torch.equal(cap(x), want)


def test_graph_count_is_one(layers):
    lay = layers["w4a16"]
    torch._dynamo.reset()
    ex = torch._dynamo.explain(lay)(x_of(8))
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex
    ops = [n.target for g in ex.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.dsv4_nvfp4.moe_forward.default in ops or torch.ops.dsv4_nvfp4.moe_forward in ops, ops


def test_quantize_ops_on_the_gpu():
    "The quantize / dequantize custom ops on CUDA tensors: opcheck, the kernels' bits, and a compiled round trip."
    from dsv4_nvfp4 import quantize_cuda as QC
    x = (torch.randn(33, 4096, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16).to(DEV)
    for gs, per_row in ((None, False), (None, True), (torch.tensor(0.01, device=DEV), False)):
        torch.library.opcheck(torch.ops.dsv4_nvfp4.quantize_nvfp4.default, (x, gs, per_row))
        d, s, g = torch.ops.dsv4_nvfp4.quantize_nvfp4(x, gs, per_row)
        r = QC.quantize_nvfp4(x, gs, per_row=per_row)
        assert torch.equal(d, r.data) and torch.equal(s.view(torch.uint8), r.scale.view(torch.uint8)) and torch.equal(g, r.global_scale)
    f = lambda x: torch.ops.dsv4_nvfp4.dequantize_nvfp4(*torch.ops.dsv4_nvfp4.quantize_nvfp4(x, None, True), torch.bfloat16)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))
