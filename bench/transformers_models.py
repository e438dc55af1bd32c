"""transformers models on flexfa against sdpa, flex_attention and eager, in one process (GPU).

    python bench/transformers_models.py                       # everything (sized for about 8 minutes on an H200; not yet timed)
    python bench/transformers_models.py --parts prefill,generate --systems flexfa,sdpa
    python bench/transformers_models.py --model gemma2 --parts train
    python bench/transformers_models.py --smoke             # tiny models, any device: checks the script

Random-initialised models in bf16 (no download): Llama-3.2-1B's shape, and a Gemma2 shape of the
same size (logit softcapping, sliding and full layers alternating). Parts:
  prefill   tokens/s of one forward at --prefill-lens (4k, 32k), batch 1;
  generate  greedy generate() tokens/s of decoding for --generate-cases (batch 1 and 16 with 4k of
            prompt, batch 16 with 32k):
            a dynamic cache in eager mode, a static cache in eager mode (flexfa reads it as a page
            pool), and a static cache with the forward torch.compile'd (transformers' compiled
            generation, mode "reduce-overhead"); static caches at 4k of context only;
  train     one forward+backward on --train-len tokens packed from documents of mixed lengths
            (position_ids restart per document, so masks are per document).
Each system's failure is printed and the run goes on; ratios are against sdpa.
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
import traceback

import torch
import transformers

import flexfa.integrations.transformers as flexfa_hf

DEVICE = "cuda"
DTYPE = torch.bfloat16
SLIDING_WINDOW = 4096  # Gemma2's sliding layers
SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
)


def config(model: str):
    if model == "llama":
        return transformers.LlamaConfig(**SHAPE, rope_theta=500000.0)
    if model == "gemma2":
        return transformers.Gemma2Config(
            **SHAPE,
            sliding_window=SLIDING_WINDOW,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=64,
            layer_types=["sliding_attention", "full_attention"] * (SHAPE["num_hidden_layers"] // 2),
        )
    raise ValueError(f"unknown model {model!r}")


def load(model: str, system: str):
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config(model)), attn_implementation=system, dtype=DTYPE
    )
    return m.to(DEVICE).eval()


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeat: int = 3) -> float:
    """Best wall time of `repeat` runs after one warm-up, seconds."""
    fn()
    _sync()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - start)
    return best


def prefill(m, length: int) -> float:
    ids = torch.randint(0, SHAPE["vocab_size"], (1, length), device=DEVICE)

    def run():
        with torch.no_grad():
            m(ids, use_cache=False, logits_to_keep=1)

    return length / timed(run)


#: How generate() keeps its cache: "dynamic" (eager), "static" (eager: flexfa reads it as a page
#: pool), "static+compile" (transformers compiles the forward, mode "reduce-overhead").
CACHES = ("dynamic", "static", "static+compile")


def generate(m, batch: int, context: int, new: int, cache: str) -> float:
    ids = torch.randint(0, SHAPE["vocab_size"], (batch, context), device=DEVICE)
    setup = {}
    if cache != "dynamic":
        setup["cache_implementation"] = "static"
    if cache == "static":
        setup["disable_compile"] = True
    if cache == "static+compile":
        setup["compile_config"] = transformers.CompileConfig(fullgraph=False)
    # As a tokenizer hands a batch of equal-length prompts: a mask of ones (no padding).
    setup.update(attention_mask=torch.ones_like(ids), pad_token_id=0)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, **setup)
    # Prefill is in the time: measure it alone (one new token) and take it out, so that tokens/s
    # is decoding's. Best of two runs each, after a warm-up (which also compiles).
    first = timed(lambda: m.generate(ids, max_new_tokens=1, do_sample=False, **setup), 2)
    total = timed(lambda: m.generate(ids, **kwargs), 2)
    if total <= first:
        raise RuntimeError(
            f"generate({new} tokens) took {total:.4f} s, prefill alone {first:.4f} s"
        )
    return batch * (new - 1) / (total - first)


def packed_batch(total: int, seed: int = 0):
    """ids (1, total) and position_ids restarting at each document (lengths 128..total/4, or
    total/8..total/4 for short totals)."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    low = min(128, max(1, total // 8))
    while left > 0:
        n = min(left, int(torch.randint(low, max(low + 1, total // 4), (1,), generator=g)))
        lengths.append(n)
        left -= n
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, total), device=DEVICE)
    return ids, positions, len(lengths)


def train(m, total: int) -> float:
    ids, positions, _ = packed_batch(total)
    m.train()

    def run():
        out = m(ids, position_ids=positions, labels=ids, use_cache=False)
        out.loss.backward()
        m.zero_grad(set_to_none=True)

    try:
        return total / timed(run)
    finally:
        m.eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama,gemma2")
    p.add_argument("--systems", default="flexfa,sdpa,flex_attention,eager")
    p.add_argument("--parts", default="prefill,generate,train")
    p.add_argument("--prefill-lens", default="4096,32768")
    p.add_argument(
        "--generate-cases",
        default="1x4096,16x4096,16x32768",
        help="batch x context, comma-separated",
    )
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--train-len", type=int, default=16384)
    p.add_argument("--caches", default=",".join(CACHES), help=f"among {', '.join(CACHES)}")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models and lengths on any device (the CPU too): checks that every part runs",
    )
    args = p.parse_args()
    global DEVICE, DTYPE, SLIDING_WINDOW
    if args.smoke:
        SLIDING_WINDOW = 32
        SHAPE.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)  # fmt: skip
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
        args.prefill_lens, args.generate_cases = "64", "2x48"
        args.new_tokens, args.train_len = 4, 256
    elif not torch.cuda.is_available():
        raise SystemExit(
            "this benchmark needs a CUDA GPU (--smoke runs tiny models on the CPU; "
            "examples/transformers_llama.py too)"
        )
    flexfa_hf.register("flexfa")
    ints = lambda s: [int(x) for x in s.split(",") if x]
    parts = set(args.parts.split(","))
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, transformers {transformers.__version__}")
    for model in args.model.split(","):
        rows: dict[str, dict[str, float]] = {}
        for system in args.systems.split(","):
            rows[system] = {}
            try:
                m = load(model, system)
            except Exception as e:
                print(f"{model} {system}: cannot load: {e}")
                continue
            cases = []
            if "prefill" in parts:
                for n in ints(args.prefill_lens):
                    if system == "eager" and n > 8192:
                        continue  # the dense score matrix of 32k does not fit
                    cases.append((f"prefill {n}", lambda mm, n=n: prefill(mm, n)))
            if "generate" in parts:
                for case in args.generate_cases.split(","):
                    b, ctx = (int(x) for x in case.split("x"))
                    if system == "eager" and b * ctx > 16384:
                        continue
                    for cache in args.caches.split(","):
                        if cache not in CACHES:
                            raise SystemExit(f"--caches: {cache!r} is not one of {CACHES}")
                        if cache != "dynamic" and ctx > 4096:
                            continue  # static caches at 4k of context only: a shorter run
                        cases.append(
                            (f"generate b{b} ctx{ctx} {cache}",
                             lambda mm, b=b, c=ctx, k=cache: generate(mm, b, c, args.new_tokens, k))
                        )  # fmt: skip
            if "train" in parts and system != "eager":
                cases.append(
                    (f"train packed {args.train_len}", lambda mm: train(mm, args.train_len))
                )
            for name, fn in cases:
                try:
                    rows[system][name] = fn(m)
                    print(f"{model:>6} {system:>14} {name:<34} {rows[system][name]:12.1f} tok/s",
                          flush=True)  # fmt: skip
                except Exception as e:
                    print(f"{model:>6} {system:>14} {name:<34} FAILED: {type(e).__name__}: {e}")
                    traceback.print_exc(limit=2)
                torch._dynamo.reset()
            del m
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        base = rows.get("sdpa", {})
        print(f"\n{model}: tokens/s (ratio to sdpa)")
        names = sorted({n for r in rows.values() for n in r})
        for name in names:
            cells = []
            for system, r in rows.items():
                if name in r:
                    ratio = f" ({r[name] / base[name]:.2f}x)" if name in base else ""
                    cells.append(f"{system} {r[name]:.1f}{ratio}")
            print(f"  {name:<34} " + ", ".join(cells))
        print()


if __name__ == "__main__":
    main()
