"""Mods defined inside a compiled forward (Note [Local mods under torch.compile] in
flexfa/local_mods.py): closures over parameters, floats, inputs and intermediates of the forward,
and over other closures, under `torch.compile(fullgraph=True)`.

CPU tests run the tiled backend under the `aot_eager` backend, as tests/e2e/test_compile.py does;
the GPU tests run the Triton backend under Inductor, also with CUDA graphs.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch._dynamo.testing

import flexfa
from flexfa.reference import reference_attention
from tests.tolerance import ThreeWay


def reference(dtype: torch.dtype):
    """`flexfa.attention`'s stand-in for the eager and float64 runs of a Block."""

    def attend(q, k, v, score_mod=None, block_mask=None, backend=None):
        return reference_attention(q, k, v, score_mod, block_mask, dtype=dtype)[0]

    return attend


class Block(torch.nn.Module):
    """Attention as model code writes it: both mods are defined in `forward`. The score_mod closes
    over a float (softcap), a parameter and an intermediate that depends on another parameter; the
    mask_mod is composed by `and_masks` from `causal` and two closures, over an input (padding of
    keys: left padding gives fully masked rows) and document ids: an intermediate (computed from
    `starts`), or with `documents_computed=False` the input itself (CUDA graphs need that: Note
    [Local mods under CUDA graphs])."""

    def __init__(
        self, attend=flexfa.attention, heads: int = 4, dim: int = 16, documents_computed=True
    ) -> None:
        super().__init__()
        self.documents_computed = documents_computed
        self.proj = torch.nn.Linear(dim, dim)
        self.bias = torch.nn.Parameter(torch.randn(heads, 32) * 0.5)
        self.decay = torch.nn.Parameter(torch.rand(heads) * 0.1)
        self.softcap = 5.0
        self.attend = attend
        self.backend = "auto"

    def forward(self, x, keep, starts):
        q = self.proj(x)
        bias, softcap = self.bias, self.softcap
        positions = torch.arange(x.shape[2], device=x.device, dtype=x.dtype)
        distance_bias = self.decay[:, None] * positions  # an intermediate that needs a gradient

        def rel(score, b, h, q_idx, kv_idx):
            score = softcap * torch.tanh(score / softcap)
            d = (q_idx - kv_idx).abs()
            return score + bias[h, d.clamp(0, 31)] - distance_bias[h, d]

        documents = starts.cumsum(-1) if self.documents_computed else starts

        def same_document(b, h, q_idx, kv_idx):
            return documents[b, q_idx] == documents[b, kv_idx]

        def kept(b, h, q_idx, kv_idx):
            return keep[b, kv_idx] > 0

        mask = flexfa.masks.and_masks(flexfa.masks.causal, same_document, kept)
        return self.attend(q, x, x, score_mod=rel, block_mask=mask, backend=self.backend)


def _inputs(length: int, device="cpu", dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, length, 16, generator=g, dtype=torch.float64)
    keep = torch.ones(2, length, dtype=torch.int32)
    keep[1, :3] = 0  # left padding: rows 0..2 of batch 1 see no key
    starts = torch.zeros(2, length, dtype=torch.int64)
    starts[0, length // 3] = starts[1, length // 2] = 1
    cot = torch.randn(2, 4, length, 16, generator=g, dtype=torch.float64)
    return x.to(device, dtype), keep.to(device), starts.to(device), cot.to(device, dtype)


def _run(model, x, keep, starts, cot) -> list[torch.Tensor]:
    """out, dx and the gradients of every parameter the attention reads."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = model(x, keep, starts)
    out.backward(cot)
    module = getattr(model, "_orig_mod", model)
    grads = [module.bias.grad, module.decay.grad, module.proj.weight.grad]
    return [out.detach(), x.grad, *(g.clone() for g in grads)]


def test_local_mods_forward_backward_three_way():
    """Compiled with fullgraph=True: one graph; the output and the gradients of x and of every
    parameter (through the op's captured inputs, also through an intermediate) pass the three-way
    rule against eager float32 and the float64 reference."""
    torch.manual_seed(0)
    block = Block()
    eager = copy.deepcopy(block)
    eager.attend = reference(torch.float32)
    truth = copy.deepcopy(block).double()
    truth.attend = reference(torch.float64)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter)

    x, keep, starts, cot = _inputs(37)
    got = _run(compiled, x, keep, starts, cot)
    want = _run(eager, x, keep, starts, cot)
    true = _run(truth, x.double(), keep, starts, cot.double())
    check = ThreeWay(torch.float32, context="Block, L=37, fully masked rows")
    for name, g, e, t in zip(("out", "dx", "d_bias", "d_decay", "d_proj"), got, want, true):
        check(name, g, e, t)
    check.assert_ok()
    assert counter.frame_count == 1
    assert got[2].abs().sum() > 0 and got[3].abs().sum() > 0  # both parameters got gradients
    assert torch.all(got[0][1, :, :3] == 0)  # fully masked rows give 0


def test_local_mods_gqa_and_other_lengths_three_way():
    """Lq != Lkv (odd both) and GQA: local mods over a parameter and an input, against eager
    float32 and the float64 reference (three-way rule), gradients of q, k, v and the parameter."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, 13, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 29, 16, generator=g, dtype=torch.float64) for _ in range(2))
    table = torch.randn(4, 29, generator=g, dtype=torch.float64) * 0.5
    offset = torch.tensor(16, dtype=torch.int32)  # the queries are the last 13 positions

    def attend(attention, q, k, v, table):
        def bias(score, b, h, q_idx, kv_idx):
            return score + table[h, kv_idx]

        def causal_from_offset(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        return attention(q, k, v, bias, causal_from_offset)

    def flexfa_attention(q, k, v, score_mod, mask_mod):
        return flexfa.attention(q, k, v, score_mod=score_mod, block_mask=mask_mod, enable_gqa=True)

    def reference_in(dtype):
        def run(q, k, v, score_mod, mask_mod):
            out, _ = reference_attention(q, k, v, score_mod, mask_mod, enable_gqa=True, dtype=dtype)
            return out

        return run

    def grads(fn, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v, table)]
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), leaves)]

    compiled = torch.compile(
        functools.partial(attend, flexfa_attention), fullgraph=True, backend="aot_eager"
    )
    got = grads(compiled, torch.float32)
    want = grads(functools.partial(attend, reference_in(torch.float32)), torch.float32)
    true = grads(functools.partial(attend, reference_in(torch.float64)), torch.float64)
    check = ThreeWay(torch.float32, context="GQA 4/2, Lq=13, Lkv=29")
    for name, a, e, t in zip(("out", "dq", "dk", "dv", "d_table"), got, want, true):
        check(name, a, e, t)
    check.assert_ok()


def test_local_mods_no_recompile_over_optimizer_steps():
    """The inner functions are new objects at every call and the optimizer changes the parameters'
    values: neither retraces nor recompiles."""
    torch.manual_seed(1)
    block = Block()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    opt = torch.optim.SGD(block.parameters(), lr=0.5)
    x, keep, starts, cot = _inputs(29, seed=1)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            compiled(x, keep, starts).backward(cot)
        opt.step()
    assert counter.frame_count == 1
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, keep, starts), block(x, keep, starts))


def test_local_mods_dynamic_lengths_one_graph():
    """dynamic=True: the captured intermediates have symbolic sizes; two lengths, one graph."""
    torch.manual_seed(2)
    block = Block()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for length in (23, 41):
        x, keep, starts, cot = _inputs(length, seed=length)
        got = _run(compiled, x, keep, starts, cot)
        want = _run(block, x, keep, starts, cot)  # flexfa eager: the same kernels
        for name, g, w in zip(("out", "dx", "d_bias", "d_decay", "d_proj"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{name}, L={length}")
    assert counter.frame_count == 1


def test_changed_float_recompiles_and_is_used():
    """A float the mod closes over is guarded by value: changing it compiles again, and the new
    value is the one used."""
    torch.manual_seed(3)
    block = Block()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    x, keep, starts, _ = _inputs(19, seed=3)
    with torch.no_grad():
        before = compiled(x, keep, starts)
        block.softcap = 0.5
        after = compiled(x, keep, starts)
        torch.testing.assert_close(after, block(x, keep, starts))
    assert counter.frame_count == 2
    assert (after - before).abs().max() > 1e-2


class SelfBias(torch.nn.Module):
    """A mask_mod alone, and a score_mod that reads `self` (a module from outside) and calls a
    helper closure."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(2, 16) * 0.5)

    def forward(self, x, window: int):
        def distance(q_idx, kv_idx):
            return (q_idx - kv_idx).clamp(0, 15)

        def rel(score, b, h, q_idx, kv_idx):
            return score + self.table[h, distance(q_idx, kv_idx)]

        def local(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        return flexfa.attention(x, x, x, score_mod=rel, block_mask=local)


def test_closures_over_self_helpers_and_an_int():
    torch.manual_seed(4)
    model = SelfBias()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    x = torch.randn(1, 2, 21, 16, requires_grad=True)
    out = compiled(x, 5)
    out.sum().backward()
    got = (out.detach(), x.grad.clone(), model.table.grad.clone())
    x.grad = model.table.grad = None
    ref = model(x, 5)
    ref.sum().backward()
    torch.testing.assert_close(got[0], ref.detach())
    torch.testing.assert_close(got[1], x.grad)
    torch.testing.assert_close(got[2], model.table.grad)
    assert got[2].abs().sum() > 0 and counter.frame_count == 1


class Scale:
    def __init__(self, value: float) -> None:
        self.value = value


def _uncapturable(q):
    scale = Scale(2.0)  # made inside the compiled region: nothing outside holds it

    def scaled(score, b, h, q_idx, kv_idx):
        return score * scale.value

    return flexfa.attention(q, q, q, score_mod=scaled)


def test_an_uncapturable_closure_says_what_and_how_to_fix():
    q = torch.randn(1, 2, 9, 16)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(_uncapturable, fullgraph=True, backend="aot_eager")(q)
    message = str(info.value)
    assert "flexfa: the score_mod 'scaled'" in message, message
    assert "closes over 'scale', a Scale created inside the compiled region" in message, message
    assert "outside the compiled function" in message, message  # the fix
    # Without fullgraph the call is a graph break and runs eagerly, with the same result.
    out = torch.compile(_uncapturable, backend="aot_eager")(q)
    torch.testing.assert_close(out, _uncapturable(q))


def test_a_tensor_computed_inside_the_mod_says_what_and_how_to_fix():
    """`table * 2` inside the mod is a torch operation on the captured tensor itself, outside the
    values flexfa traces: eagerly a constant of the call, under torch.compile it has no value."""
    table = torch.randn(2, 9)

    def f(q):
        t = table + 1  # an intermediate: the mod's root

        def doubled(score, b, h, q_idx, kv_idx):
            return score + (t * 2)[h, kv_idx]

        return flexfa.attention(q, q, q, score_mod=doubled)

    with pytest.raises(torch._dynamo.exc.Unsupported, match="Compute that tensor before"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(torch.randn(1, 2, 9, 16))


def test_mods_that_reach_each_other_are_rebuilt_once_each():
    """Helpers a local mod calls, which call each other through their closures, and a 0-dim
    intermediate that gets its gradient."""
    weight = torch.randn(3, requires_grad=True)

    def f(q):
        shift = weight[0] * 2

        def even(n):
            return n == 0 or odd(n - 1)

        def odd(n):
            return n != 0 and even(n - 1)

        def shifted(x):
            return x + shift if even(4) else x

        def mod(score, b, h, q_idx, kv_idx):
            return shifted(score) * 0.5 + shifted(score)

        return flexfa.attention(q, q, q, score_mod=mod)

    q = torch.randn(1, 2, 9, 16)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q)
    (got,) = torch.autograd.grad(out.sum(), weight)
    ref = f(q)
    (want,) = torch.autograd.grad(ref.sum(), weight)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(got, want)
    assert got.abs().sum() > 0


TABLE = torch.nn.Parameter(torch.randn(2, 16) * 0.5)


def scaled_bias(score, b, h, q_idx, kv_idx, table, scale):
    return score * scale + table[h, (q_idx - kv_idx).clamp(0, 15)]


OUTSIDE = functools.partial(scaled_bias, table=TABLE, scale=0.5)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_functools_partial_mods_get_their_gradients(where):
    """A functools.partial is rebuilt like a local mod, made outside the compiled function (Dynamo
    cannot pass it as a constant either) or inside; its tensor arguments are op inputs."""

    def f(q):
        if where == "outside":
            return flexfa.attention(q, q, q, score_mod=OUTSIDE)
        table = TABLE * 1  # an intermediate
        mod = functools.partial(scaled_bias, table=table, scale=0.25)
        return flexfa.attention(q, q, q, score_mod=mod)

    q = torch.randn(1, 2, 19, 16)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q)
    (got,) = torch.autograd.grad(out.square().sum(), TABLE)
    ref = f(q)
    (want,) = torch.autograd.grad(ref.square().sum(), TABLE)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(got, want)
    assert got.abs().sum() > 0


def test_a_local_mod_flexfa_cannot_trace_says_why():
    """flexfa's own message (flexfa.ModTraceError) reaches the user as Dynamo's graph break error,
    not as an internal Dynamo error."""

    def f(q):
        cap = 2.0

        def branchy(score, b, h, q_idx, kv_idx):
            return score if score < cap else score * cap  # a Python branch on a traced value

        return flexfa.attention(q, q, q, score_mod=branchy)

    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"score_mod 'branchy'.*torch\.where"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(torch.randn(1, 2, 9, 16))


def test_a_dynamic_size_in_a_closure_is_specialized_with_a_warning():
    def f(q):
        half = q.shape[2] // 2  # a size: symbolic under dynamic=True

        def prefix(b, h, q_idx, kv_idx):
            return (kv_idx < half) | (q_idx >= kv_idx)

        return flexfa.attention(q, q, q, block_mask=prefix)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    q = torch.randn(1, 2, 26, 16)
    with pytest.warns(UserWarning, match="closes over 'half', a number torch.compile treats"):
        out = compiled(q)
    torch.testing.assert_close(out, f(q))


def test_a_mask_computed_in_the_graph_is_refused_under_cuda_graphs(monkeypatch):
    """Note [Local mods under CUDA graphs]: while a CUDA graph is recorded (stood in for here, so
    that this runs on a CPU), a BlockMask built from a tensor the graph computes would read memory
    not yet written: the op raises, naming the capture; from inputs it builds as usual."""
    import flexfa.compiled

    x, keep, starts, _ = _inputs(17, seed=6)
    monkeypatch.setattr(flexfa.compiled, "_capturing", lambda q: True)
    computed = torch.compile(Block(), fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="reads documents, computed inside the compiled graph"):
        computed(x, keep, starts)
    block = Block(documents_computed=False)
    from_inputs = torch.compile(block, fullgraph=True, backend="aot_eager")
    documents = starts.cumsum(-1)
    torch.testing.assert_close(from_inputs(x, keep, documents), block(x, keep, documents))


def test_a_mask_computed_in_the_graph_is_not_kept():
    """Note [Local mods under CUDA graphs]: a BlockMask built from a tensor the graph computes is
    built for its call alone; no cache keeps it (nor, through it, the graph's tensor)."""
    from flexfa.blockmask import bind

    x, keep, starts, _ = _inputs(17, seed=6)
    block = Block()
    want = block(x, keep, starts)  # eager calls cache their masks as usual
    bind.clear_cache()
    computed = torch.compile(block, fullgraph=True, backend="aot_eager")
    outs = [computed(x, keep, starts) for _ in range(2)]
    assert not bind._cache and not bind._by_tiles, (list(bind._cache), list(bind._by_tiles))
    for out in outs:
        torch.testing.assert_close(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_local_mods_compiled_on_cuda(mode):
    """The Block's training step under Inductor on the Triton backend, also under CUDA graphs:
    three steps without a recompile, then one compared with the eager call. Every `.grad` read is
    set to None each step (CUDA graph outputs are overwritten by the next replay; see
    test_triton_backend_compiled_on_cuda in tests/e2e/test_compile.py). The mask's tensors keep
    their values across replays, as CUDA graphs require (Note [flexfa under torch.compile])."""
    torch.manual_seed(5)
    block = Block(documents_computed=mode == "default").cuda()
    block.backend = "triton"
    if mode == "default":
        counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
        compiled = torch.compile(block, fullgraph=True, backend=counter)
    else:  # a counting backend cannot take `mode`; recompiles raise below instead
        counter = None
        compiled = torch.compile(block, fullgraph=True, mode=mode)
    x, keep, starts, cot = _inputs(1000, device="cuda", seed=5)
    if not block.documents_computed:
        starts = starts.cumsum(-1)  # the document ids, as an input
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    for step in range(3):  # cudagraph trees warm up, record, then replay
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            _run(compiled, x, keep, starts, cot)  # sets every grad to None first
        opt.step()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _run(compiled, x, keep, starts, cot)
    want = _run(block, x, keep, starts, cot)
    assert counter is None or counter.frame_count == 1
    for name, g, w in zip(("out", "dx", "d_bias", "d_decay", "d_proj"), got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_mask_computed_in_the_graph_under_cuda_graphs_raises_on_cuda():
    """The real case of the CPU test above: recording the graph raises instead of replaying a
    BlockMask built from memory the graph had not written yet."""
    block = Block().cuda()
    block.backend = "triton"
    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    x, keep, starts, _ = _inputs(300, device="cuda", seed=7)
    with pytest.raises(RuntimeError, match="computed inside the compiled graph"):
        for _ in range(3):  # warm-up, then recording
            with torch.no_grad():
                compiled(x, keep, starts)


@pytest.mark.slow  # about 8 s of compiling on 2 CPU cores
def test_transformers_flex_attention_forward_under_compile(monkeypatch):
    """Hugging Face transformers' own FlexAttention forward, which defines its score_mod inside
    the function (closing over the softcap float, a slice of the attention mask and a position
    bias), with its call of torch's flex_attention pointed at flexfa: compiled with fullgraph, the
    output and the gradients of q, k, v and the position bias equal the eager call's."""
    hf_flex = pytest.importorskip("transformers.integrations.flex_attention")

    def via_flexfa(query, key, value, score_mod=None, block_mask=None, enable_gqa=False,
                   scale=None, kernel_options=None, training=False, **lse):  # fmt: skip
        return flexfa.attention(query, key, value, score_mod=score_mod, block_mask=block_mask,
                                scale=scale, enable_gqa=enable_gqa)  # fmt: skip

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", via_flexfa)
    module = torch.nn.Module()
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 4, 19, 16, generator=g, requires_grad=True) for _ in range(3))
    padding = torch.zeros(2, 1, 19, 24)
    padding[1, ..., :5] = -1e4
    position_bias = (torch.randn(2, 4, 19, 19, generator=g) * 0.3).requires_grad_(True)

    def attend(q, k, v, position_bias):
        out, _ = hf_flex.flex_attention_forward(
            module, q, k, v, padding, softcap=8.0, position_bias=position_bias
        )
        return out

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    inputs = (q, k, v, position_bias)
    out = torch.compile(attend, fullgraph=True, backend=counter)(*inputs)
    got = (out, *torch.autograd.grad(out.square().sum(), inputs))
    ref = attend(*inputs)
    want = (ref, *torch.autograd.grad(ref.square().sum(), inputs))
    for name, a, b in zip(("out", "dq", "dk", "dv", "d_position_bias"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert counter.frame_count == 1 and want[4].abs().sum() > 0
