"""flexfa.attention inside torch.compile (Note [flexfa under torch.compile] in flexfa/compiled.py).

CPU tests run the tiled backend with the `aot_eager` backend (AOTAutograd traces forward and
backward through the ops' fake implementations and registered autograd, without Inductor's
compile time). The GPU tests run the Triton backend under Inductor, also with CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import flexfa

TABLE = torch.nn.Parameter(torch.randn(4, 65) * 0.1)


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + TABLE[h, torch.clamp(q_idx - kv_idx, -32, 32) + 32]


class Attention(torch.nn.Module):
    """A block whose attention reads a learned relative-position table (a global nn.Parameter)."""

    def __init__(self, dim: int = 16, backend: str = "auto") -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.table = TABLE
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)
        return flexfa.attention(
            q, x, x, score_mod=rel_bias, block_mask=flexfa.masks.causal, backend=self.backend
        )


def _grads(model: torch.nn.Module, x: torch.Tensor, fn) -> tuple[torch.Tensor, ...]:
    for p in (*model.parameters(), x):
        p.grad = None
    out = fn(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return (out.detach(), x.grad.clone(), TABLE.grad.clone(), model.proj.weight.grad.clone())


def test_fullgraph_forward_backward_with_a_captured_parameter(compiler="aot_eager"):
    """(Inductor compiles the same graph in the GPU test; on the CPU it costs 45 s of CI.)"""
    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(1, 4, 40, 16, requires_grad=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend(compiler)
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    eager = _grads(model, x, model)
    got = _grads(model, x, compiled)
    for e, g in zip(eager, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert TABLE.grad.abs().sum() > 0  # the parameter got its gradient through the op
    assert counter.frame_count == 1  # one graph: no graph break


@pytest.mark.parametrize(
    "backend",
    ["tiled"]
    + (
        [pytest.param("triton", marks=pytest.mark.exhaustive)]
        if flexfa.config.triton_interpret
        else []
    ),
)
def test_broadcast_kv_under_compile(backend):
    """K/V of batch 1 against q of batch 2 (read with batch stride 0) gives eager's results."""
    torch.manual_seed(4)
    q = torch.randn(2, 4, 23, 16, requires_grad=True)
    k, v = (torch.randn(1, 4, 31, 16, requires_grad=True) for _ in range(2))

    def f(q, k, v):
        return flexfa.attention(
            q, k, v, score_mod=rel_bias, block_mask=flexfa.masks.causal, backend=backend
        )

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    ref = f(q, k, v)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(got, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_no_recompile_over_training_steps():
    """Optimizer steps change the parameter's values, not anything the graph depends on."""
    torch.manual_seed(1)
    model = Attention()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(1, 4, 24, 16)
    for _ in range(4):
        opt.zero_grad()
        compiled(x).square().sum().backward()
        opt.step()
    assert counter.frame_count == 1
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "score_mod",
    [rel_bias, flexfa.mods.alibi, flexfa.mods.softcap(20.0)],
    ids=["rel_bias", "alibi", "softcap"],
)
def test_dynamic_sequence_lengths_one_graph(score_mod):
    def f(q, k, v):
        return flexfa.attention(q, k, v, score_mod=score_mod, block_mask=flexfa.masks.causal)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for length in (40, 57, 130):
        q, k, v = (torch.randn(1, 4, length, 16, requires_grad=True) for _ in range(3))
        out = compiled(q, k, v)
        out.sum().backward()
        dq = q.grad
        q.grad = None
        ref = f(q, k, v)
        ref.sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dq, q.grad, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1


def test_return_lse_and_torch_block_mask_under_compile():
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    torch_mask = create_block_mask(causal, None, None, 64, 64, device="cpu")
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))

    def f(q, k, v):
        return flexfa.attention(q, k, v, block_mask=torch_mask, return_lse=True)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    out, lse = torch.compile(f, fullgraph=True, backend=counter)(q, k, v)
    ref_out, ref_lse = flexfa.attention(q, k, v, block_mask=causal, return_lse=True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_triton_backend_compiled_on_cuda(mode):
    """A training step with flexfa inside a compiled function, also under CUDA graphs.

    Under `mode="reduce-overhead"` every gradient the compiled backward produces lives in the
    graph's memory pool, and a later replay writes over it: a `.grad` kept from one step and
    accumulated into at the next is "a tensor output of CUDAGraphs overwritten by a subsequent
    run" (torch's limitation, pytorch issue #169545, flexfa's or not). So each step sets every
    `.grad` it will read to None first, the inputs' as well as the table's, as a training loop
    with `zero_grad(set_to_none=True)` over all its leaves does. An earlier version kept q.grad
    across steps and failed that way on an H200."""
    torch.manual_seed(2)
    table = torch.nn.Parameter(torch.randn(8, 257, device="cuda") * 0.1)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(q_idx - kv_idx, -128, 128) + 128]

    def f(q, k, v):
        return flexfa.attention(q, k, v, score_mod=bias, block_mask=flexfa.masks.causal)

    if mode == "default":
        counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
        compiled = torch.compile(f, fullgraph=True, backend=counter)
    else:  # a counting backend cannot take `mode`; recompiles raise below instead
        counter = None
        compiled = torch.compile(f, fullgraph=True, mode=mode)
    q, k, v = (
        torch.randn(2, 8, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    opt = torch.optim.SGD([table], lr=0.1)
    for step in range(3):  # cudagraph trees warm up, record, then replay
        opt.zero_grad()
        q.grad = k.grad = v.grad = None
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            out = compiled(q, k, v)
        out.float().square().sum().backward()
        opt.step()
    opt.zero_grad()
    q.grad = k.grad = v.grad = None
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = compiled(q, k, v)
    out.float().square().sum().backward()
    got = (out.detach().clone(), table.grad.clone(), q.grad.clone())
    opt.zero_grad()
    q.grad = None
    ref = f(q, k, v)
    ref.float().square().sum().backward()
    assert counter is None or counter.frame_count == 1
    torch.testing.assert_close(got[0], ref.detach(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1], table.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[2], q.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_steps_under_cuda_graphs():
    """A serving loop's decode step (Lq=1, the split-KV decode path) under CUDA graphs: the
    BlockMask and decode lists flexfa caches are built outside the graph pool (Note [Caches under
    CUDA graphs]); every replay equals the eager call."""
    torch.manual_seed(5)
    k, v = (torch.randn(2, 2, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def window(b, h, q_idx, kv_idx):  # the last 1024 positions of the cache
        return kv_idx >= 4096 - 1024

    def step(q):
        return flexfa.attention(q, k, v, score_mod=flexfa.mods.alibi, block_mask=window,
                                enable_gqa=True)  # fmt: skip

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    for i in range(4):  # warm-up, record, replays
        q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(q).clone()
        torch.testing.assert_close(got, step(q), rtol=2e-2, atol=2e-2, msg=f"step {i}")


class RelBias(torch.nn.Module):
    """A score_mod that is a module of the model: its table is the module's parameter."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(heads, 65) * 0.1)

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.table[h, torch.clamp(q_idx - kv_idx, -32, 32) + 32]


def test_a_module_as_score_mod_under_compile_gets_its_gradient():
    torch.manual_seed(3)
    bias = RelBias()
    x = torch.randn(1, 4, 40, 16, requires_grad=True)

    def f(x):
        return flexfa.attention(x, x, x, score_mod=bias, block_mask=flexfa.masks.causal)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    out = torch.compile(f, fullgraph=True, backend=counter)(x)
    out.sum().backward()
    got = bias.table.grad.clone()
    bias.table.grad = None
    f(x).sum().backward()
    torch.testing.assert_close(got, bias.table.grad, rtol=1e-5, atol=1e-6)
    assert got.abs().sum() > 0 and counter.frame_count == 1


def test_describe_carries_exactly_torchs_constant_mark():
    # Note [Marked constant without Dynamo]: the attribute flexfa sets is the one torch's public
    # decorator sets, so Dynamo treats `_describe` as a constant-result function.
    from flexfa import compiled

    def marked():
        return None

    torch.compiler.assume_constant_result(marked)
    assert vars(marked), "torch's decorator no longer marks the function by an attribute"
    assert {k: getattr(compiled._describe, k, None) for k in vars(marked)} == vars(marked)


def test_import_leaves_dynamo_unimported():
    import subprocess
    import sys

    code = "import sys, flexfa; print('torch._dynamo' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "False", "import flexfa imported torch._dynamo"


def test_the_ops_fake_output_has_the_real_strides():
    """Under torch.compile the op's fake output stands for the real one: both follow q's stride
    order (Note [Output layout]), or Inductor's stride assertions would fail on a permuted q."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flexfa.compiled import compiled_attention

    q = torch.randn(1, 9, 2, 16).transpose(1, 2)  # (B, H, L, E) over a (B, L, H, E) buffer
    k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 8)
    kw = dict(scale=None, enable_gqa=False, backend="tiled", kernel_options=None,
              deterministic=False)  # fmt: skip
    real = compiled_attention(q, k, v, rel_bias, flexfa.masks.causal, **kw)[0]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = compiled_attention(fq, fk, fv, rel_bias, flexfa.masks.causal, **kw)[0]
    assert real.transpose(1, 2).is_contiguous()
    assert fake.shape == real.shape and fake.stride() == real.stride()


def test_triton_start_up_is_asked_for_eagerly_and_never_traced(monkeypatch):
    """An eager triton call on CUDA starts Triton's start-up (Note [Triton's start-up]); under
    torch.compile the call must not trace it: the compile pool's lock is a graph break, an error
    with fullgraph=True. The device test is stood in for, so this runs on a CPU."""
    import flexfa.api as api

    asked = []
    monkeypatch.setattr(api, "_on_cuda", lambda q: True)
    monkeypatch.setattr(api, "_triton_level", 0)

    def start(q, k, v):
        asked.append(api._needs_grad(q, k, v))
        api._triton_level = 2 if asked[-1] else 1

    monkeypatch.setattr(api, "_start_triton", start)
    q, k, v = (torch.randn(1, 2, 33, 16, requires_grad=True) for _ in range(3))
    flexfa.attention(q, k, v, block_mask=flexfa.masks.causal, backend="triton")
    assert asked == [True], asked  # gradients wanted: the compile workers too
    monkeypatch.setattr(api, "_triton_level", 0)
    asked.clear()
    counter = torch._dynamo.testing.CompileCounter()
    f = lambda q, k, v: flexfa.attention(q, k, v, block_mask=flexfa.masks.causal)
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    out = compiled(q, k, v)
    assert asked == [] and counter.frame_count == 1, (asked, counter.frame_count)
    torch.testing.assert_close(out, f(q, k, v))
    # An eager call raises the level; the graph must not depend on it (an H200 run recompiled a
    # decode step under CUDA graphs when the check read the level first).
    monkeypatch.setattr(api, "_triton_level", 2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(q, k, v)
    assert counter.frame_count == 1


def test_gradients_of_a_transposed_q_under_compile():
    """q, k and v as model code makes them, (B, L, H, E) transposed to (B, H, L, E): the backward
    op returns their gradients in their layout, as its fake implementation says, so the compiled
    backward can view them back (it failed with "view size is not compatible" when the backend
    returned dout's contiguous layout)."""

    def f(x):
        q = x.view(2, 21, 4, 8).transpose(1, 2)
        out = flexfa.attention(q, q, q, score_mod=rel_bias, block_mask=flexfa.masks.causal)
        return out.transpose(1, 2).reshape(2, 21, 32)

    x = torch.randn(2, 21, 32, requires_grad=True)
    TABLE.grad = None
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    out.square().sum().backward()
    got = (out.detach(), x.grad.clone(), TABLE.grad.clone())
    x.grad = TABLE.grad = None
    ref = f(x)
    ref.square().sum().backward()
    torch.testing.assert_close(got[0], ref.detach())
    torch.testing.assert_close(got[1], x.grad)
    torch.testing.assert_close(got[2], TABLE.grad)


def test_gradients_have_the_strides_of_their_inputs():
    """K and V as views of a projection's (B, L, H, E) output, as attention modules make them: the
    graph views dK/dV's transposes back, which needs the strides the backward op's fake promises."""

    def f(xq, xkv):
        q = xq.view(1, 24, 4, 16).transpose(1, 2)
        k = xkv[..., :32].reshape(1, 24, 2, 16).transpose(1, 2) * 1.0
        v = xkv[..., 32:].reshape(1, 24, 2, 16).transpose(1, 2)
        out = flexfa.attention(
            q, k, v, block_mask=flexfa.masks.causal, enable_gqa=True, backend="tiled"
        )
        return out.transpose(1, 2).reshape(1, 24, 64)

    torch.manual_seed(5)
    xq, xkv = (torch.randn(1, 24, 64, requires_grad=True) for _ in range(2))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(xq, xkv).square().sum(), (xq, xkv))
    want = torch.autograd.grad(f(xq, xkv).square().sum(), (xq, xkv))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


_STATE = {"shift": torch.tensor([0])}


def _before_shift(score, b, h, q_idx, kv_idx):
    # `_STATE["shift"][0]` is a tensor the mod computes itself: torch.compile cannot reach it.
    return torch.where(kv_idx < _STATE["shift"][0], score, score - 2.0)


def _shifted_attention(q, k, v):
    return flexfa.attention(q, k, v, score_mod=_before_shift, backend="tiled")


def test_a_tensor_computed_in_a_mod_made_outside_is_an_error_not_a_constant():
    """Note [Captured tensors torch.compile cannot reach]: the graph used to freeze `shift[0]` at
    trace time, so a new `shift` at each step went unseen (wrong results from the second)."""
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    compiled = torch.compile(_shifted_attention, fullgraph=True, backend="eager")
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        compiled(q, k, v)
    message = str(info.value)
    assert "flexfa: the score_mod '_before_shift' reads a tensor" in message, message
    assert "would freeze its value" in message and "capture the result" in message, message
    # Without fullgraph, the same message as flexfa's own RuntimeError.
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="would freeze its value") as info:
        torch.compile(_shifted_attention, backend="eager")(q, k, v)
    assert not isinstance(info.value, torch._dynamo.exc.TorchDynamoException), info.value


def _branchy(score, b, h, q_idx, kv_idx):
    if q_idx > kv_idx:  # a Python `if` on a traced value: flexfa cannot trace it
        return score
    return score * 2


def test_an_untraceable_mod_made_outside_gives_flexfas_error_under_fullgraph():
    def f(q):
        return flexfa.attention(q, q, q, score_mod=_branchy, backend="tiled")

    q = torch.randn(1, 2, 9, 16)
    with pytest.raises(flexfa.ModTraceError) as eager:
        f(q)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(f, fullgraph=True, backend="eager")(q)
    message = str(info.value)
    assert str(eager.value) in message, message  # the mod's name and the fix, as in eager
    assert "InternalTorchDynamoError" not in message, message
    # Without fullgraph, eager's own error (not wrapped as an internal Dynamo error).
    torch._dynamo.reset()
    with pytest.raises(flexfa.ModTraceError) as info:
        torch.compile(f, backend="eager")(q)
    assert str(info.value) == str(eager.value)


def _window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) if q_idx - kv_idx < 4 else False  # Python `if` on a traced value


def test_an_untraceable_mask_mod_made_outside_gives_flexfas_error_under_fullgraph():
    def f(q):
        return flexfa.attention(q, q, q, block_mask=_window, backend="tiled")

    q = torch.randn(1, 2, 9, 16)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"mask_mod '_window'"):
        torch.compile(f, fullgraph=True, backend="eager")(q)
