"""The bf16 kernel of the drafters' few-row passes (bf16_linear.py, bf16_linear.c): every build (this CPU's own,
AVX-512 without BF16, AVX2, scalar) must compute exactly the documented sums (float32, each pair's odd product
added before its even one, pairs in order), give a row the same bits in every pass width, and run under
torch.compile."""

from __future__ import annotations

import pytest
import torch

from diffspec import bf16_linear as B

pytestmark = pytest.mark.skipif(B.available() is not None, reason=f"bf16 kernel: {B.available()}")

CPU_FLAGS = open("/proc/cpuinfo").read().split()
BUILDS = {"native": ("-march=native",), "avx512f": ("-mavx512f",), "avx2": ("-mavx2", "-mfma"), "scalar": ()}
NEEDS = {"avx512f": "avx512f", "avx2": "avx2"}


def documented_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 [R, N]: for each pair p in order, acc += w[:, 2p+1] x[:, 2p+1], then acc += w[:, 2p] x[:, 2p] (each
    product of two bf16 values exact in float32, each add rounded)."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range(x.shape[1] // 2):
        for j in (2 * p + 1, 2 * p):
            acc = acc + xf[:, j, None] * wf[None, :, j]
    return acc


def bf16_values(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_every_build_computes_the_documented_sums_bitwise_and_rows_alike(build):
    if build in NEEDS and NEEDS[build] not in CPU_FLAGS:
        pytest.skip(f"this CPU has no {NEEDS[build]}")
    lib = B.build_library(BUILDS[build])
    assert not isinstance(lib, B.KernelUnavailable), lib
    if build != "native":
        assert B.isa(lib) == build
    # 40 rows: two full tiles and a padded one (pairs of tiles, then one alone); K = 70: not a multiple of 32
    w = bf16_values(40, 70, seed=1)
    packed = B.pack(w)
    assert packed.tiles.shape == (3, 35, 16, 2) and packed.n == 40
    x = bf16_values(19, 70, seed=2)
    want = documented_sums(x, w)
    got = B.run_kernel(x, packed, lib=lib)
    assert torch.equal(got[:, :40], want)
    assert torch.equal(got[:, 40:], torch.zeros(19, 8))  # the padding rows are zero weights
    for rows in (1, 3, 4, 5, 8, 9, 17):  # row groups of 4 or 8 and their tails
        assert torch.equal(B.run_kernel(x[:rows], packed, lib=lib), got[:rows]), rows


def test_linear_rounds_once_to_bf16_and_keeps_leading_dimensions():
    w = bf16_values(24, 32, seed=3)
    x = bf16_values(2, 5, 32, seed=4)
    y = B.linear(x, B.pack(w))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 24)
    assert torch.equal(y, documented_sums(x.reshape(10, 32), w).bfloat16().reshape(2, 5, 24))
    # the same product as torch's bf16 matmul up to the order of its float32 sums
    torch.testing.assert_close(y.float(), torch.nn.functional.linear(x, w).float(), rtol=2e-2, atol=2e-2)


def test_pack_takes_only_bf16_cpu_weights_of_even_width():
    assert B.pack(torch.randn(16, 32)) is None               # float32
    assert B.pack(torch.randn(16, 31).bfloat16()) is None    # an odd number of inputs
    assert B.pack(torch.randn(2, 16, 32).bfloat16()) is None  # not a matrix
    assert B.pack(torch.randn(16, 32).bfloat16()) is not None


def test_the_kernel_runs_inside_a_compiled_graph():
    w = B.pack(bf16_values(32, 64, seed=5))
    x = bf16_values(3, 64, seed=6)
    compiled = torch.compile(lambda a: B.linear(a * 2, w) + 1, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), B.linear(x * 2, w) + 1)


def test_a_bf16_block_drafter_runs_its_layers_through_the_kernel_and_stays_lossless(tiny_model, monkeypatch, tmp_path):
    """The block-diffusion drafter in bf16 on a target with measured kernels routes its linear layers through
    the kernel (the dtype trial included); a layer whose weight changed falls back to F.linear; greedy output
    stays the target's."""
    from conftest import make_model, reference_greedy
    from test_diffusion_drafters import dllm
    from diffspec import FixedPolicy, SpeculativeEngine, Target
    from diffspec.drafters import BlockDiffusionConfig, BlockDiffusionDrafter

    monkeypatch.setenv("DIFFSPEC_COST_CACHE", str(tmp_path))
    monkeypatch.setattr(B, "faster_here", lambda weights, rows: True)  # its timing: the test below
    model = make_model(tiny_model.config.vocab_size, seed=0)  # tiny_model's weights: a target with measured kernels
    target = Target(model, kernels="auto")  # routes the layers of the model it is given, and tiny_model is the session's
    vocab = model.config.vocab_size
    drafter = BlockDiffusionDrafter(dllm(vocab), BlockDiffusionConfig(mask_token_id=vocab, block_size=4, sub_block_size=2))
    drafter.compute_dtype = "bfloat16"
    calls = []
    real = B.run_kernel
    monkeypatch.setattr(B, "run_kernel", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = SpeculativeEngine(target, drafter, FixedPolicy(3))
    layer = drafter.model.model.layers[0].mlp.down_proj
    assert next(drafter.model.parameters()).dtype == torch.bfloat16 and "bf16_packed" in layer.__dict__
    for prompt in ([5, 6, 7, 8, 9, 10], [30, 31, 30, 31]):
        calls.clear()
        out = engine.generate(prompt, max_new_tokens=20, stop_token_ids=[])
        assert out.token_ids == reference_greedy(model, prompt, 20, stop_ids=())
        assert calls  # the drafter's passes ran the kernel
    x = torch.randn(3, layer.in_features).bfloat16()
    assert torch.equal(layer(x), B.linear(x, layer.bf16_packed[0]))
    with torch.no_grad():
        layer.weight.mul_(2)  # the pack is stale now: F.linear on the new weight
    torch.testing.assert_close(layer(x).float(), torch.nn.functional.linear(x, layer.weight).float())


def test_the_kernel_is_taken_only_where_it_timed_faster_and_the_choice_is_cached(monkeypatch, tmp_path):
    import time

    monkeypatch.setenv("DIFFSPEC_COST_CACHE", str(tmp_path))
    B._decided.clear()
    weights = [bf16_values(64, 64, seed=7), bf16_values(32, 64, seed=8)]
    fast = B.linear
    monkeypatch.setattr(B, "linear", lambda x, p: (time.sleep(0.003), fast(x, p))[1])  # a kernel slower than torch
    assert B.faster_here(weights, rows=4) is False
    assert len(list(tmp_path.glob("bf16-linear-choice-*.json"))) == 1
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False)).bfloat16()
    with torch.no_grad():
        model[0].weight.copy_(weights[0])
        model[1].weight.copy_(weights[1])
    assert B.install(model, rows=4) == 0 and "forward" not in model[0].__dict__  # stays torch's
    B._decided.clear()  # a new process: the choice is read back, not timed again (a fast kernel now changes nothing)
    monkeypatch.setattr(B, "linear", fast)
    assert B.faster_here(weights, rows=4) is False
    assert B.faster_here(weights, rows=8) in (True, False) and len(list(tmp_path.glob("*.json"))) == 2  # per rows


def test_rows_the_kernel_cannot_take_are_refused_by_name():
    packed = B.pack(bf16_values(16, 32, seed=9))
    for x in (torch.randn(2, 32), bf16_values(2, 30, seed=10)):  # float32 rows; rows of another width
        with pytest.raises(ValueError, match="bf16 CPU rows of 32"):
            B.linear(x, packed)


def test_routed_layers_compile_in_one_graph_and_add_the_bias_before_rounding(monkeypatch):
    monkeypatch.setattr(B, "faster_here", lambda weights, rows: True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.SiLU(), torch.nn.Linear(48, 16)).bfloat16()
    assert B.install(model) == 2
    x = bf16_values(3, 32, seed=11)
    eager = model(x)
    w, b = model[0].weight, model[0].bias
    assert torch.equal(model[0](x), (documented_sums(x, w) + b.float()).bfloat16())  # one rounding
    with torch.inference_mode():  # as drafters run their passes
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        assert torch.equal(torch.compile(model, backend="aot_eager")(x), eager)
