"""The benchmark sub-package on the CPU: its tables and goal text are rendered from the rows (nothing typed by hand),
the one renderer they share, and the peer harness's discovery and loading. The timing itself needs a GPU (the stage
notebooks run it with `--flags gpu`)."""
import pytest

from dsv4_nvfp4.bench import core as BC
from dsv4_nvfp4.bench import gemm as BG
from dsv4_nvfp4.bench import mlp as BM


def test_every_table_goes_through_the_one_renderer(monkeypatch):
    "Each *_table of the sub-package renders through bench.core.table (so through formats.markdown_text)."
    from dsv4_nvfp4.bench import kernels as BK, kv as BV, moe as BO
    seen = []
    real = BC.table
    for mod in (BK, BG, BM, BV, BO):
        monkeypatch.setattr(mod, "table", lambda *a, **k: seen.append(1) or real(*a, **k))
    info = dict(gpu="G", sms=1, torch="x", memory_gib=1, driver_cuda="13", torch_cuda="13")
    BK.kernels_table(dict(info=info, ceiling_tbs=1.0, rows=[]))
    BG.mxfp4_table(dict(info=info, rows=[]))
    BG.launch_table(dict(rows=[]))
    BM.mlp_table(dict(info=info, copy_tbs=1.0, bf16_tflops=1.0, rows=[]))
    BV.kv_table(dict(info=info, ceiling_tbs=1.0, rows=[]))
    BO.moe_table(dict(info=info, rows=[]))
    BG.gemm_table(dict(info=info, copy_tbs=1.0, bf16_tflops=1.0, rows=[]))
    assert len(seen) == 7
    assert BC.table([dict(a=1.5, b=None)], [("a", "a"), ("b", BC.fmt("b"))], head="h") == "h\n\n| a | b |\n|---|---|\n| 1.5 | - |"


def test_peer_harness_is_loaded_explicitly(tmp_path):
    "load_peer_harness loads bench_peer.py from its file and names what it lacks."
    with pytest.raises(FileNotFoundError, match="no bench_peer.py"):
        BG.load_peer_harness(tmp_path)
    (tmp_path / "bench_peer.py").write_text("def bench_ours(args, rows): pass\n")
    with pytest.raises(ImportError, match="bench_marlin, bench_triton, Timer"):
        BG.load_peer_harness(tmp_path)
    (tmp_path / "bench_peer.py").write_text("def bench_ours(a, r): pass\ndef bench_marlin(a, f, r): pass\ndef bench_triton(a, r): pass\n"
                                            "class Timer:\n    def __init__(self, flush=True): self.flush = 'memset' if flush else None\n")
    m = BG.load_peer_harness(tmp_path)
    assert m.__name__ == "dsv4_bench_peer"
    assert m.Timer.__name__ == "CleanTimer" and m.Timer(flush=False).flush is None   # the clean flush replaces the memset


def test_benchmark_text_is_rendered_from_the_rows():
    "bench.gemm's gemm_table / launch_table / gemm_goals render what the rows say (goals met or missed follow the numbers)."
    info = dict(gpu="GPU", sms=1, torch="2.x")
    row = lambda T, us, eager, xb, xf, per: dict(problem="Flash L1 gate+up K=4096 N=4096", tokens=T, rows=per, active=1,
                                                 tok_tile=16, time_us=us, eager_us=eager, tbs=2.0, tflops=1.0, pct=50.0,
                                                 bf16_us=us * xb, x_bf16=xb, fp8_us=us * xf, x_fp8=xf,
                                                 launch=dict(graph_us=us, eager_us=eager, host_us=5.0, py_eager_us=200.0, py_host_us=150.0))
    res = dict(info=info, copy_tbs=4.0, bf16_tflops=700.0, rows=[row(1, 30.0, 35.0, 3.2, 1.9, 1), row(8, 160.0, 175.0, 2.9, 1.7, 1)])
    res["rows"][0]["pct_same_read"] = 68.0                     # a decode row's own-size read: rendered; missing: "-"
    text = BG.gemm_table(res)
    assert "| 50% | 68% |" in text and "| 50% | - |" in text
    assert "| Flash L1 gate+up K=4096 N=4096 | 1 | 1 | 16 | 30.0 | 35.0 |" in text and "Launch cost" in text
    assert "| 8 | 160.0 | 175.0 | +15.0 | 5.0 | 200.0 | 150.0 |" in BG.launch_table(res)
    goals = BG.gemm_goals(res)
    assert "met on 1 of 2 rows" in goals and "missed: Flash L1 gate+up T=8" in goals
    assert "those of up to 128 tokens (1 of 2) run at 68% of the speed of a pure read of their own bytes." in goals
    assert "Launch cost" in goals and ": missed:" in goals          # T=8: eager 15 us over graph


def test_peer_rows_are_optional_and_rendered_from_the_rows(tmp_path, monkeypatch):
    "No staged peers: no rows and no peer text; staged: the table and the Marlin / faster-peer verdicts follow the numbers."
    monkeypatch.delenv("DSV4_PEER_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p2").mkdir(); (tmp_path / "p2" / "bench_peer.py").write_text("")
    assert BG.find_peer_dir(tmp_path / "p2") == tmp_path / "p2"                # an explicit folder wins
    (tmp_path / ".peer").mkdir(); (tmp_path / ".peer" / "bench_peer.py").write_text("")
    assert BG.find_peer_dir() == tmp_path / ".peer"
    monkeypatch.setenv("DSV4_PEER_DIR", str(tmp_path / "elsewhere"))          # not staged there: falls back to ./.peer
    assert BG.find_peer_dir() == tmp_path / ".peer"
    l1, pro = "Flash L1 gate+up K=4096 N=4096", "Pro EP48 K=7168 N=6144"
    pr = lambda p, T, b, us: dict(problem=p, T=T, backend=b, median_us=us)
    res = dict(info=dict(gpu="G", sms=1, torch="x"), copy_tbs=4.0, bf16_tflops=700.0, rows=[], peers=[
        pr(l1, 1, "ours_nvfp4(graph)", 30.0), pr(l1, 1, "ours_nvfp4(eager)", 41.0), pr(l1, 1, "marlin_nvfp4", 36.0),
        pr(l1, 8, "ours_nvfp4(graph)", 170.0), pr(l1, 8, "marlin_nvfp4(graph)", 166.0),
        pr(pro, 8192, "ours_nvfp4(graph)", 8000.0), pr(pro, 8192, "marlin_nvfp4", 14000.0), pr(pro, 8192, "triton_mxfp4", 7700.0)])
    table = BG.peer_table(res)
    assert f"| {l1} | 1 | 30.0 | - | 30.0 | 36.0 | - | 1.20 | 1.20 |" in table
    assert f"| {pro} | 8192 | 8000.0 | - | 8000.0 | 14000.0 | 7700.0 | 1.75 | 0.96 |" in table
    goals = BG.gemm_goals(res)
    assert "Faster than Marlin" in goals and "met on 1 of 2 rows" in goals and "slower: Flash L1 gate+up K=4096 N=4096 T=8" in goals
    assert "met on 0 of 1 rows (0.96-0.96x)" in goals
    # ours with the gather in the GEMM: the faster of the two ways to call ours is "ours", in the table and the goals
    res["peers"].append(pr(l1, 8, "ours_gather(graph)", 160.0))
    assert f"| {l1} | 8 | 170.0 | 160.0 | 160.0 | 166.0 | - | 1.04 | 1.04 |" in BG.peer_table(res)
    goals = BG.gemm_goals(res)
    assert "met on 2 of 2 rows." in goals and "slower" not in goals
    assert BG.peer_table(dict(res, peers=[])) == "" and "peers" not in BG.gemm_table(dict(res, peers=[]))


def test_mlp_benchmark_text_is_rendered_from_the_rows():
    "bench.mlp's mlp_table / mlp_goals render what the rows say: the verdicts follow the numbers, nothing is typed by hand."
    row = lambda name, T, rows, active, w16, w4, bf, f8: dict(
        problem=name, tokens=T, rows=rows, active=active, w4a16_us=w16, w4a16_eager_us=w16 + 9, w4a4_us=w4,
        bf16_us=bf, fp8_us=f8, tbs=3.0, pct_copy=80.0,
        **{f"{k}_x_bf16": bf / v for k, v in (("w4a16", w16), ("w4a4", w4))},
        **{f"{k}_x_fp8": f8 / v for k, v in (("w4a16", w16), ("w4a4", w4))})
    res = dict(info=dict(gpu="G", sms=1, torch="x"), copy_tbs=4.0, bf16_tflops=700.0, rows=[
        row("Flash", 1, 6, 6, 60.0, 62.0, 200.0, 120.0),          # decode: 3.33x bf16, 2.0x fp8 -> met
        row("Flash", 8, 48, 45, 100.0, 98.0, 250.0, 160.0),       # decode: 2.5x bf16 -> missed
        row("Flash", 2048, 12288, 256, 1000.0, 900.0, 2600.0, 1400.0)])   # 2.6x bf16 but 1.4x fp8 -> missed
    t = BM.mlp_table(res)
    assert "| Flash | 1 | 1 | 60.0 | 69.0 | 62.0 | 200.0 | 120.0 | 3.33 | 2.00 | 3.23 | 3.00 | 80% |" in t
    g = BM.mlp_goals(res)
    assert "met on 1 of 2 rows" in g and "missed: Flash T=8." in g
    assert "Flash at 2048 tokens" in g and "met on 0 of 1 rows" in g


def test_timer_waits_for_the_callers_stream_first(monkeypatch):
    """Timer runs the call on its own stream: it must first wait for the caller's stream, where the inputs are made
    (without the wait a call could read inputs still being written and write into memory the caller's kernels still
    use: the `bench attn` fault 07c explains). Recorded on CPU with the CUDA calls faked."""
    import contextlib
    import torch
    events = []

    class FakeStream:
        def wait_stream(self, other): events.append(("wait", other))

    class FakeGraph:
        def replay(self): events.append("replay")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "CALLER")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, stream=None: contextlib.nullcontext())
    t = BC.Timer.__new__(BC.Timer)
    t.stream = FakeStream()
    monkeypatch.setattr(t, "_median", lambda run, n: (run(), 1.0)[1])
    t(lambda: events.append("fn"), warmup=2)
    assert events[0] == ("wait", "CALLER") and events.count(("wait", "CALLER")) == 1, events
    assert "fn" in events[1:]


@pytest.mark.gpu
def test_timer_sees_inputs_the_caller_is_still_making():
    "On a GPU: the caller's stream sleeps, then writes the input; the timed call's first run must see the written value."
    import torch
    timer = BC.Timer(flush_mb=1)
    x, y = torch.zeros(1 << 20, device="cuda"), torch.zeros(1 << 20, device="cuda")
    seen = []
    torch.cuda._sleep(200_000_000)                   # ~0.1 s of GPU time on the caller's stream before the write
    x.fill_(7.0)
    timer(lambda: seen.append(x.clone()) if not seen else y.copy_(x), warmup=1, budget_s=0.01)
    torch.cuda.synchronize()
    assert bool((seen[0] == 7.0).all()), "the timed call ran before the caller's stream had written its input"
