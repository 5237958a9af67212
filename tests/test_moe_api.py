"The MoE layer's public surface on the CPU: what `help()` and `repr()` tell a first-time user, and the build's progress bar."
import torch

from dsv4_nvfp4.moe import DSV4MoE, MoEConfig

SMALL = MoEConfig(hidden=64, inter=32, num_experts=4, top_k=2)


def test_moe_config_docstring_names_every_field():
    doc = MoEConfig.__doc__
    missing = [f for f in MoEConfig._fields if f"`{f}`" not in doc]
    assert not missing, f"MoEConfig's docstring does not name {missing}"


def test_forward_has_a_docstring():
    doc = DSV4MoE.forward.__doc__ or ""
    assert "(T, H)" in doc and "input_ids" in doc, doc


def test_repr_shows_config_act_experts_device():
    lay = DSV4MoE.synthetic(SMALL, seed=0, keep_bf16=False)
    r = repr(lay)
    for s in ("hidden=64", "inter=32", "num_experts=4", "top_k=2", "act='w4a16'", "experts=all 4 + shared", "device=cpu"):
        assert s in r, (s, r)
    r = repr(lay.local([1, 3], shared=False))
    assert "experts=2 of 4 [1, 3], no shared" in r, r
    assert "act='w4a4'" in repr(DSV4MoE.synthetic(SMALL, seed=0, act="w4a4", calib_tokens=8, keep_bf16=False))


def test_repr_abbreviates_many_experts():
    lay = DSV4MoE.synthetic(MoEConfig(hidden=32, inter=16, num_experts=16, top_k=2), seed=0, keep_bf16=False)
    assert "experts=10 of 16 [0, 1, ..., 15] + shared" in repr(lay.local([0, 1, 2, 4, 5, 7, 9, 11, 13, 15]))


def test_synthetic_shows_progress(capsys):
    DSV4MoE.synthetic(SMALL, seed=0, progress=True, keep_bf16=False)
    err = capsys.readouterr().err
    assert "DSV4MoE.synthetic" in err and "5/5" in err, err        # E + 1 = 5 experts, counted on stderr
    DSV4MoE.synthetic(SMALL, seed=0, keep_bf16=False)               # a small layer: no bar by default
    assert capsys.readouterr().err == ""


def test_synthetic_progress_does_not_change_the_layer():
    a = DSV4MoE.synthetic(SMALL, seed=3, progress=True)
    b = DSV4MoE.synthetic(SMALL, seed=3, progress=False)
    assert torch.equal(a.w13.data, b.w13.data) and torch.equal(a.w2.scale.view(torch.uint8), b.w2.scale.view(torch.uint8))


def test_a_copy_leaves_the_cached_decode_graphs_behind():
    "copy.deepcopy of a layer drops its cached decode graphs (a CUDA graph cannot be copied); the copy makes its own."
    import copy
    lay = DSV4MoE.synthetic(SMALL, seed=1)
    class Uncopyable:
        def __deepcopy__(self, memo): raise AssertionError("a cached graph was copied")
        def __reduce__(self): raise AssertionError("a cached graph was pickled")
    lay._graphs[("cuda:0", None)] = Uncopyable()
    lay.eager_graphs = False
    twin = copy.deepcopy(lay)
    assert twin._graphs == {} and twin.eager_graphs is False and twin.op_key != lay.op_key
    assert len(lay._graphs) == 1, "the original keeps its own"


def test_synthetic_hash_w4a4_comes_from_the_seed_alone():
    "A hash-routed W4A4 layer's calibrated scales depend on the seed only (the calibration's token ids drew from torch's global RNG once)."
    mk = lambda: DSV4MoE.synthetic(SMALL, seed=3, act="w4a4", hash_vocab=20, calib_tokens=16, keep_bf16=False)
    torch.manual_seed(1); a = mk()
    torch.manual_seed(2); b = mk()
    assert torch.equal(a.a1_scales, b.a1_scales) and torch.equal(a.a2_scales, b.a2_scales)


def test_buffers_made_under_inference_mode_stay_writable():
    "A first forward under torch.inference_mode makes the layer's buffers; later calls outside it fill them in place."
    lay = DSV4MoE.synthetic(MoEConfig(hidden=1024, inter=256, num_experts=4, top_k=2), seed=0, act="w4a8", keep_bf16=False)
    with torch.inference_mode(): bufs = lay.buffers(2, "cpu")
    assert not bufs[0].offsets.is_inference() and not bufs[1].is_inference() and not bufs[2][0].data.is_inference()
    bufs[0].offsets.fill_(1)


def test_prepared_remembers_the_backend_choice_until_what_decides_it_changes(monkeypatch):
    """`DSV4MoE.prepared` remembers the device's backend (the eager decode call's host time) but asks again when the
    layer's backend or the registry changes, or when the launch device type does: the choice follows each of them."""
    from dsv4_nvfp4 import runtime as rt
    from dsv4_nvfp4 import gemm as GC
    from dsv4_nvfp4.gemm.reference import ReferenceBackend
    cfg = MoEConfig(hidden=1024, inter=128, num_experts=4, top_k=2)
    lay = DSV4MoE.synthetic(cfg, seed=3)
    asked = []
    class Counting(ReferenceBackend):
        def supports(self, device): asked.append(device); return super().supports(device)
    w = lay.prepared("cpu")
    assert type(w[0]).backend == "reference" and lay.prepared("cpu") is w
    GC.register_backend("counting", Counting(), first=True)
    try:
        w2 = lay.prepared("cpu")                       # the registry changed: the new first choice is asked and used
        assert asked and w2 is not w and ("cpu" in str(asked[-1]))
        n = len(asked); lay.prepared("cpu"); lay.prepared("cpu")
        assert len(asked) == n, "asked once per registry state, not per call"
        lay.backend = "reference"
        assert lay.prepared("cpu") is w, "a named backend is the layer's choice"
        lay.backend = None
        monkeypatch.setattr(rt, "_DEVICE_TYPE", "cpu")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
        GC.unregister_backend("counting")
        assert type(lay.prepared("cpu")[0]).backend == "sm90", "a CPU tensor that looks like Hopper's gets sm90"
        import copy, io
        buf = io.BytesIO(); torch.save(lay, buf); buf.seek(0)
        for twin in (copy.deepcopy(lay), torch.load(buf, weights_only=False)):
            assert twin._choice == {}, "a copy asks again: the choice belongs to this process and the device it saw"
        monkeypatch.setattr(rt, "_DEVICE_TYPE", "cuda")
        assert lay.prepared("cpu") is w, "and the reference again once it does not"
        lay._prepared.clear()                          # a remembered choice whose weights were dropped prepares them again
        assert type(lay.prepared("cpu")[0]).backend == "reference"
        w = lay.prepared("cpu")
        other = DSV4MoE.synthetic(cfg, seed=4)
        lay.w13, lay.w2 = other.w13, other.w2             # new weights assigned: prepared again from them
        w3 = lay.prepared("cpu")
        assert w3 is not w and torch.equal(w3[0].data, other.prepared("cpu")[0].data) and not torch.equal(w3[0].data, w[0].data)
        assert lay.prepared("cpu") is w3
    finally:
        if "counting" in GC.backend_names(): GC.unregister_backend("counting")


def test_graph_signature_follows_what_the_graphs_read(monkeypatch):
    """The cached decode graphs' signature (`DSV4MoE._graph_sig`) changes with every buffer a graph reads (gate weight,
    bias, hash table, activation scales), the backend and the prepared weights; a new preparation (new w13 assigned)
    drops the device's graphs and shared-expert views first; a shallow copy gets its own preparation dict."""
    import copy
    from dsv4_nvfp4 import runtime as rt
    monkeypatch.setattr(rt, "_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    cfg = MoEConfig(hidden=1024, inter=128, num_experts=4, top_k=2)
    for lay, names in ((DSV4MoE.synthetic(cfg, seed=3, hash_vocab=20), ("gate_weight", "gate_bias", "tid2eid")),
                       (DSV4MoE.synthetic(cfg, seed=3, act="w4a4", calib_tokens=16), ("a1_scales", "a2_scales"))):
        if lay.gate_bias is None: lay.gate_bias = torch.zeros(cfg.num_experts)
        w = lay.prepared("cpu")
        s0 = lay._graph_sig(w)
        assert lay._graph_sig(lay.prepared("cpu")) == s0, "nothing changed: the same signature"
        for name in names:
            old = getattr(lay, name)
            assert old is not None, name
            setattr(lay, name, old.clone())
            assert lay._graph_sig(w) != s0, f"{name} reassigned"
            setattr(lay, name, old)
            assert lay._graph_sig(w) == s0
        lay.backend = "reference"
        assert lay._graph_sig(lay.prepared("cpu")) != s0, "another backend"
        lay.backend = None
        lay._graphs[torch.device("cpu")] = ("a stale entry", {}, w)
        other = DSV4MoE.synthetic(cfg, seed=4)
        lay.w13 = other.w13
        w2 = lay.prepared("cpu")
        assert w2 is not w and lay._graph_sig(w2) != s0
        assert torch.device("cpu") not in lay._graphs, "what the old layout fed is dropped"
        assert copy.copy(lay)._prepared is not lay._prepared
