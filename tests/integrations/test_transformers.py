"""flexfa as a transformers attention implementation (flexfa/integrations/transformers.py and
transformers_masks.py).

Tiny random models (hidden 64, 2 layers, vocab 128) of five families run with
`attn_implementation="flexfa"` against the same weights with `"eager"`, in float32 on the CPU:
logits, padded batches, greedy generation, packed sequences and training gradients; six more
families for logits and generation.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flexfa.integrations.transformers as flexfa_hf  # noqa: E402
import flexfa.integrations.transformers_masks as hf_masks  # noqa: E402

NAME = flexfa_hf.register()
VOCAB = 128
# Errors of float32 attention against float32 eager attention after two layers: a few units in the
# last place of logits of magnitude ~1 (tests/tolerance.py's atol for float32 results).
ATOL, RTOL = 2e-5, 1e-4


_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    head_dim=16,
)


def _config(family: str):
    common = _COMMON
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "mistral":  # every layer slides
        return transformers.MistralConfig(**common, sliding_window=9)
    if family == "gemma2":  # softcapping, one sliding and one full layer
        return transformers.Gemma2Config(
            **common,
            sliding_window=9,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    if family == "gpt_oss":  # attention sinks, sliding and full layers
        return transformers.GptOssConfig(
            **{k: v for k, v in common.items() if k != "intermediate_size"},
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=9,
            layer_types=["sliding_attention", "full_attention"],
        )
    raise ValueError(family)


FAMILIES = ["llama", "qwen2", "mistral", "gemma2", "gpt_oss"]
_models: dict[str, tuple] = {}


def _pair(family: str):
    """(eager model, flexfa model) with the same random weights, in eval mode."""
    if family not in _models:
        torch.manual_seed(0)
        config = _config(family)
        eager = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation="eager"
        )
        if family == "gpt_oss":  # random sinks, so that they matter
            for layer in eager.model.layers:
                torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
        ours = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=NAME
        )
        ours.load_state_dict(eager.state_dict())
        assert ours.config._attn_implementation == NAME
        assert eager.config._attn_implementation == "eager"
        _models[family] = (eager.eval(), ours.eval())
    return _models[family]


def _more_configs(family: str):
    """Other families' tiny configs: masks and layers the five above do not have (Gemma3's and
    Cohere2's layer types, Llama4's chunked attention read as transformers wrote it, encoders'
    bidirectional and local-window masks)."""
    if family == "qwen3":
        return transformers.Qwen3Config(**_COMMON)
    if family == "gemma3_text":
        return transformers.Gemma3TextConfig(
            **_COMMON, sliding_window=9, layer_types=["sliding_attention", "full_attention"]
        )
    if family == "cohere2":
        return transformers.Cohere2Config(
            **_COMMON, sliding_window=9, layer_types=["sliding_attention", "full_attention"]
        )
    if family == "llama4_text":
        return transformers.Llama4TextConfig(
            **_COMMON, attention_chunk_size=8, num_local_experts=2, intermediate_size_mlp=128,
            no_rope_layers=[1, 0], moe_layers=[],
        )  # fmt: skip
    encoder = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=256)  # fmt: skip
    if family == "bert":
        return transformers.BertConfig(**encoder)
    if family == "modernbert":
        return transformers.ModernBertConfig(
            **encoder, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0,
            eos_token_id=1, bos_token_id=2, cls_token_id=2, sep_token_id=1,
        )  # fmt: skip
    raise ValueError(family)


@pytest.mark.parametrize(
    "family", ["qwen3", "gemma3_text", "cohere2", "llama4_text", "bert", "modernbert"]
)
def test_more_families_match_eager(family):
    """Logits with and without left padding, and greedy generation for the decoders."""
    torch.manual_seed(0)
    config = _more_configs(family)
    auto = transformers.AutoModel if family in ("bert", "modernbert") else None
    auto = auto or transformers.AutoModelForCausalLM
    eager = auto.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ours = auto.from_config(copy.deepcopy(config), attn_implementation=NAME).eval()
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(1, VOCAB, (3, 23), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 23, dtype=torch.long)
    mask[0, :7], mask[2, :5] = 0, 0

    def output(model, **kwargs):
        out = model(ids, **kwargs)
        return out.logits if auto is transformers.AutoModelForCausalLM else out.last_hidden_state

    with torch.no_grad():
        _close(output(ours), output(eager), f"{family} logits")
        real = mask.bool()
        want = output(eager, attention_mask=mask)[real]
        _close(output(ours, attention_mask=mask)[real], want, f"{family} padded logits")
    if auto is transformers.AutoModelForCausalLM:
        kwargs = dict(attention_mask=mask[:, :11], max_new_tokens=12, do_sample=False,
                      pad_token_id=0)  # fmt: skip
        got, want = ours.generate(ids[:, :11], **kwargs), eager.generate(ids[:, :11], **kwargs)
        assert torch.equal(got, want), f"{family}: {got.tolist()} != {want.tolist()}"


def _close(got, want, what):
    err = (got - want).abs().max().item()
    bound = ATOL + RTOL * want.abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager(family):
    eager, ours = _pair(family)
    ids = torch.randint(0, VOCAB, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _close(ours(ids).logits, eager(ids).logits, f"{family} logits")


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_eager_on_real_tokens(family, side):
    eager, ours = _pair(family)
    ids = torch.randint(0, VOCAB, (3, 23), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 23, dtype=torch.long)
    if side == "left":
        mask[0, :7], mask[2, :15] = 0, 0
    else:
        mask[0, -7:], mask[2, -15:] = 0, 0
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()  # padded positions' outputs are not defined alike (eager averages them)
    _close(got[real], want[real], f"{family} {side}-padded logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_token_for_token(family):
    eager, ours = _pair(family)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding, as batched generation pads
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = eager.generate(ids, **kwargs)
    got = ours.generate(ids, **kwargs)
    assert torch.equal(got, want), f"{family}: {got.tolist()} != {want.tolist()}"


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_static_cache_generation_token_for_token(family, monkeypatch):
    """Full-attention layers decode from the static cache read as a page pool (Note [Static
    caches as page pools]); the tokens are eager's."""
    eager, ours = _pair(family)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=10, do_sample=False, cache_implementation="static")
    paged = []
    attention = flexfa_hf.flexfa.attention

    def counting(*args, **kw):
        paged.append(kw.get("kv_lens") is not None)
        return attention(*args, **kw)

    monkeypatch.setattr(flexfa_hf.flexfa, "attention", counting)
    assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))
    layers = ours.config.num_hidden_layers
    full = sum(t == "full_attention" for t in getattr(ours.config, "layer_types", None) or [])
    assert sum(paged) == 9 * (full or layers)  # every decode step's full-attention layers


def _packed_inputs():
    """Three documents (7, 12, 5 tokens) in one row, told apart by position_ids."""
    lengths = [7, 12, 5]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, positions, lengths


@pytest.fixture(params=["mask", "packed_call"])
def packed_row_as(request, monkeypatch):
    """A packed row as a document mask (the CPU's way) or as flexfa's packed call (the GPU's,
    Note [Packed sequences as a packed call]), both on this device."""
    if request.param == "packed_call":
        monkeypatch.setattr(hf_masks, "PACKED_CALL_DEVICES", frozenset({"cpu", "cuda"}))
    return request.param


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_packed_sequences_are_independent(family, packed_row_as):
    """Each packed document's logits equal its logits alone (by eager), and eager's packed run."""
    eager, ours = _pair(family)
    ids, positions, lengths = _packed_inputs()
    with torch.no_grad():
        got = ours(ids, position_ids=positions, use_cache=False).logits
        want = eager(ids, position_ids=positions, use_cache=False).logits
        _close(got, want, f"{family} packed logits")
        start = 0
        for n in lengths:
            alone = eager(ids[:, start : start + n]).logits
            _close(got[:, start : start + n], alone, f"{family} document at {start}")
            start += n


def test_a_packed_row_is_a_packed_call(monkeypatch):
    """Note [Packed sequences as a packed call]: every layer passes the documents' offsets (on the
    host) and the causal mask inside them; no BlockMask of the whole row is built."""
    monkeypatch.setattr(hf_masks, "PACKED_CALL_DEVICES", frozenset({"cpu"}))
    _, ours = _pair("gemma2")  # a sliding and a full layer
    ids, positions, lengths = _packed_inputs()
    calls, built = [], []
    attention, create = flexfa_hf.flexfa.attention, flexfa_hf.flexfa.create_block_mask

    def recording(q, k, v, **kwargs):
        calls.append(kwargs)
        return attention(q, k, v, **kwargs)

    def counting(*args, **kwargs):
        built.append(args[3:5])
        return create(*args, **kwargs)

    monkeypatch.setattr(flexfa_hf.flexfa, "attention", recording)
    monkeypatch.setattr(flexfa_hf.flexfa, "create_block_mask", counting)
    with torch.no_grad():
        ours(ids, position_ids=positions, use_cache=False)
    assert len(calls) == 2 and not built
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    for kwargs in calls:
        cu = kwargs["cu_seqlens_q"]
        assert cu is kwargs["cu_seqlens_kv"] and cu.device.type == "cpu"
        assert torch.equal(cu, offsets), cu
        assert (
            kwargs["block_mask"].structure.causal and not kwargs["block_mask"].structure.documents
        )
    windows = sorted(str(kw["block_mask"].structure.window) for kw in calls)
    assert windows == ["9", "None"]  # the sliding layer's window, inside each document

    # Batches of several packed rows keep the document mask (no packed call), as do devices
    # outside PACKED_CALL_DEVICES.
    for batch, devices in ((2, {"cpu"}), (1, {"cuda"})):
        monkeypatch.setattr(hf_masks, "PACKED_CALL_DEVICES", frozenset(devices))
        calls.clear()
        with torch.no_grad():
            ours(ids.expand(batch, -1), position_ids=positions.expand(batch, -1), use_cache=False)
        assert calls and all("cu_seqlens_q" not in kw for kw in calls)


def test_document_ids_in_several_runs_keep_the_document_mask(monkeypatch):
    """Ids that are not one run of tokens each are not documents for a packed call: the layers
    keep the document mask (Note [Packed sequences as a packed call])."""
    monkeypatch.setattr(hf_masks, "PACKED_CALL_DEVICES", frozenset({"cpu"}))
    mu = transformers.masking_utils
    docs = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 2, 2, 2, 2]])
    fn = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(docs))
    mask = flexfa_hf.build_mask(1, 11, 11, mask_function=fn)
    assert mask.packed is not None and mask.packed.cu_seqlens is None
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 11, 16, generator=gen) for _ in range(3))
    got = flexfa_hf.attention_forward(torch.nn.Module(), q, k, v, mask)[0].transpose(1, 2)
    i = torch.arange(11)
    allowed = (i[:, None] >= i[None, :]) & (docs[0][:, None] == docs[0][None, :])
    scores = (q @ k.transpose(-1, -2) / 4).masked_fill(~allowed, -float("inf"))
    _close(got, scores.softmax(-1) @ v, "ids in several runs")


def _grads(model, ids, positions):
    model.zero_grad(set_to_none=True)
    logits = model(ids, position_ids=positions, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    named = model.named_parameters()
    return {n.removeprefix("_orig_mod."): p.grad for n, p in named if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_training_step_gradients_match_eager(family, packed_row_as):
    eager, ours = _pair(family)
    ids, positions, _ = _packed_inputs()
    eager.train(), ours.train()
    try:
        want = _grads(eager, ids, positions)
        got = _grads(ours, ids, positions)
    finally:
        eager.eval(), ours.eval()
    assert want.keys() == got.keys()
    if family == "gpt_oss":
        assert got["model.layers.0.self_attn.sinks"].abs().sum() > 0  # sinks get gradients
    for name in want:
        _close(got[name], want[name], f"{family} grad of {name}")


def test_dropout_is_refused_in_training():
    _, ours = _pair("llama")
    config = copy.deepcopy(ours.config)
    config.attention_dropout = 0.1
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME).train()
    with pytest.raises(ValueError, match="dropout"):
        model(torch.randint(0, VOCAB, (1, 8)))


def test_masks_are_built_once_per_kind_and_forward(monkeypatch):
    """Gemma2 has a sliding and a full layer: one mask each per forward, whatever the depth."""
    _, ours = _pair("gemma2")
    built = []
    create = flexfa_hf.flexfa.create_block_mask

    def counting(*args, **kwargs):
        built.append(args[3:5])
        return create(*args, **kwargs)

    monkeypatch.setattr(flexfa_hf.flexfa, "create_block_mask", counting)
    hf_masks._block_mask_cache.clear()
    with torch.no_grad():
        ours(torch.randint(0, VOCAB, (1, 300)))
        assert len(built) == 2  # sliding and full
        ours(torch.randint(0, VOCAB, (1, 300)))
        assert len(built) == 2  # reused across forwards: they read no tensor


def test_decode_step_without_padding_needs_no_mask():
    parts_fn = transformers.masking_utils.causal_mask_function
    mask = flexfa_hf.build_mask(2, 1, 40, q_offset=39, kv_offset=0, mask_function=parts_fn)
    assert mask.mask_mod is None and mask.block_mask is None
    sliding = transformers.masking_utils.sliding_window_causal_mask_function(9)
    mask = flexfa_hf.build_mask(2, 1, 9, q_offset=39, kv_offset=31, mask_function=sliding)
    assert mask.mask_mod is None
    mask = flexfa_hf.build_mask(2, 1, 40, q_offset=39, kv_offset=0, mask_function=sliding)
    assert mask.mask_mod is not None  # a full-length cache: the window excludes old keys


def test_padded_decode_steps_are_traced_once(monkeypatch):
    """Each step brings new padding and offset tensors; the mask is traced once, through its twin,
    and the layers of one step share one traced mod (Note [Mask tensors rebound, not retraced])."""
    import importlib

    trace_module = importlib.import_module("flexfa.frontend.trace")  # the package's is a function
    traced = []
    real_trace = trace_module._trace

    def counting(fn, kind, *args, **kwargs):
        traced.append(kind)
        return real_trace(fn, kind, *args, **kwargs)

    monkeypatch.setattr(trace_module, "_trace", counting)
    causal = transformers.masking_utils.causal_mask_function
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        kv_len = 30 + step
        padding = torch.ones(2, kv_len, dtype=torch.long)
        padding[1, : 6 + step] = 0
        mask = flexfa_hf.build_mask(
            2, 1, kv_len, q_offset=kv_len - 1, mask_function=causal, attention_mask=padding
        )
        # Note [Short queries' padding as a score_mod]: no BlockMask for a padding-only step.
        assert mask.block_mask is None and not mask.mask_mod.relative
        q = torch.randn(2, 4, 1, 16, generator=gen)
        k, v = (torch.randn(2, 2, kv_len, 16, generator=gen) for _ in range(2))
        outs = [flexfa_hf.attention_forward(torch.nn.Module(), q, k, v, mask)[0] for _ in range(2)]
        mods = [trace_module.trace_score_mod(mask.mask_mod.as_score_mod()) for _ in range(2)]
        assert mods[0] is mods[1]
        assert mods[0].tensors == (mask.mask_mod.padding,)
        allowed = padding.bool()[:, None, None, :]
        kr, vr = (t.repeat_interleave(2, dim=1) for t in (k, v))
        scores = (q @ kr.transpose(-1, -2) / 4).masked_fill(~allowed, -float("inf"))
        want = (scores.softmax(-1) @ vr).transpose(1, 2)
        for out in outs:
            _close(out, want, f"padded decode step {step}")
    assert traced == [
        "score_mod"
    ]  # the twin's one trace: the BlockMask-free steps need no mask_mod

    del traced[:]
    for step in range(3):  # a static cache's steps: shifted causal, a BlockMask per step
        padding = torch.ones(2, 40, dtype=torch.long)
        padding[0, :3] = 0
        offset = torch.tensor([20 + step])
        mask = flexfa_hf.build_mask(
            2, 1, 40, q_offset=offset, mask_function=causal, attention_mask=padding
        )
        assert mask.block_mask is not None and mask.mask_mod.relative
    assert traced.count("mask_mod") == 1


def test_unknown_mask_functions_are_kept_whole():
    """A composition flexfa does not recognise is called as transformers wrote it."""
    mu = transformers.masking_utils

    def every_other(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 0

    fn = mu.or_masks(mu.causal_mask_function, every_other)
    mask = flexfa_hf.build_mask(1, 17, 17, mask_function=fn)
    q = k = v = torch.randn(1, 2, 17, 16)
    got = flexfa_hf.attention_forward(torch.nn.Module(), q, k, v, mask)[0].transpose(1, 2)
    i = torch.arange(17)
    allowed = (i[:, None] >= i[None, :]) | (i[None, :] % 2 == 0)
    scores = (q @ k.transpose(-1, -2) / 4).masked_fill(~allowed, -float("inf"))
    _close(got, scores.softmax(-1) @ v, "or_masks")


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_dense_4d_mask_is_read_per_pair(kind):
    """A ready 4-D mask (which transformers passes through untouched) applies, with a warning."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 9, 16, generator=g)
    k, v = (torch.randn(2, 2, 13, 16, generator=g) for _ in range(2))
    allowed = torch.rand(2, 1, 9, 13, generator=g) < 0.7
    allowed[..., 0] = True  # no empty row
    bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    mask = allowed if kind == "bool" else bias
    flexfa_hf._dense_warned = False
    with pytest.warns(UserWarning, match="dense 4-D attention mask"):
        got = flexfa_hf.attention_forward(torch.nn.Module(), q, k, v, mask, scaling=0.3)[0]
    kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v))
    want = ((q @ kk.transpose(-1, -2)) * 0.3 + bias).softmax(-1) @ vv
    _close(got.transpose(1, 2), want, f"{kind} 4-D mask")


def test_wrong_mask_type_is_a_clear_error():
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(TypeError, match="mask builder"):
        flexfa_hf.attention_forward(torch.nn.Module(), q, q, q, attention_mask="causal")


@pytest.mark.parametrize("family", ["llama", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_whole_model_under_torch_compile(family):
    """Logits and a training step's gradients of the compiled model match eager attention."""
    torch._dynamo.reset()
    eager, ours = _pair(family)
    compiled = torch.compile(ours, backend="aot_eager")
    ids, positions, _ = _packed_inputs()
    with torch.no_grad():
        _close(compiled(ids).logits, eager(ids).logits, f"{family} compiled logits")
        padded = torch.ones(1, ids.shape[1], dtype=torch.long)
        padded[0, :5] = 0
        real = padded[0].bool()
        want = eager(ids, attention_mask=padded).logits[0, real]
        _close(compiled(ids, attention_mask=padded).logits[0, real], want, "compiled padded")
    eager.train(), ours.train()
    try:
        want = _grads(eager, ids, positions)
        got = _grads(compiled, ids, positions)
    finally:
        eager.eval(), ours.eval()
    for name in want:
        _close(got[name], want[name], f"{family} compiled grad of {name}")


@pytest.mark.slow
def test_static_cache_decode_under_torch_compile():
    """Decode steps of a compiled model take the score-mod mask (Note [Masks under torch.compile
    and CUDA graphs]) and give eager's tokens."""
    torch._dynamo.reset()
    eager, ours = _pair("llama")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    kwargs = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    ours.forward = torch.compile(ours.forward, backend="aot_eager")
    try:
        got = ours.generate(ids, **kwargs)
    finally:
        del ours.forward
    assert torch.equal(got, eager.generate(ids, **kwargs))


@pytest.mark.slow
def test_padded_generation_under_torch_compile():
    """Gemma2's sliding and full layers have the same conditions at a padded decode step (only the
    padding) but keys of their own lengths: each keeps its own mask object and tensors."""
    torch._dynamo.reset()
    eager, ours = _pair("gemma2")
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours.forward = torch.compile(ours.forward, backend="aot_eager")
    try:
        got = ours.generate(ids, **kwargs)
    finally:
        del ours.forward
    want = eager.generate(ids, **kwargs)
    assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_prefill_and_generation_on_gpu(family):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    eager, ours = _pair(family)
    eager, ours = copy.deepcopy(eager).cuda(), copy.deepcopy(ours).cuda()
    ids = torch.randint(0, VOCAB, (4, 300), device="cuda")
    with torch.no_grad():
        want = eager(ids).logits
        got = ours(ids).logits
    # float32 on the GPU: either side may multiply in TF32 (10-bit mantissas), hence the bound.
    err = (got - want).abs().max().item()
    assert err <= 2e-3 * want.abs().max().item() + 1e-4, f"{family} logits on the GPU: {err:.3g}"
    kwargs = dict(max_new_tokens=16, do_sample=False)
    assert torch.equal(ours.generate(ids[:, :64], **kwargs), eager.generate(ids[:, :64], **kwargs))
    padding = torch.ones(4, 64, dtype=torch.long, device="cuda")
    padding[1, :9], padding[3, :40] = 0, 0  # left padding: its decode steps' mask as a score_mod
    kwargs.update(attention_mask=padding, pad_token_id=0)
    got, want = ours.generate(ids[:, :64], **kwargs), eager.generate(ids[:, :64], **kwargs)
    assert torch.equal(got, want), f"{family} padded generation on the GPU"


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_training_step_on_gpu(family):
    """A packed row on the GPU (Note [Packed sequences as a packed call]): logits and gradients
    against eager attention on the same packed row."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    eager, ours = _pair(family)
    eager, ours = copy.deepcopy(eager).cuda().train(), copy.deepcopy(ours).cuda().train()
    lengths = [70, 129, 5, 300, 64]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), device="cuda")
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    want, got = _grads(eager, ids, positions), _grads(ours, ids, positions)
    assert want.keys() == got.keys()
    for name in want:  # float32 with TF32 matmuls on either side, as in the test above
        err = (got[name] - want[name]).abs().max().item()
        bound = 2e-3 * want[name].abs().max().item() + 1e-4
        assert err <= bound, f"{family} packed grad of {name} on the GPU: {err:.3g} > {bound:.3g}"
