"""A Hugging Face transformers Llama on flexfa: generation and a training step, beside SDPA.

    python examples/transformers_llama.py                    # tiny random model, CPU-sized
    python examples/transformers_llama.py --size 1b          # Llama-3.2-1B shape, bf16 on a GPU
    python examples/transformers_llama.py --checkpoint PATH  # your own checkpoint

One line turns flexfa on: `flexfa.integrations.transformers.register()`, then
`attn_implementation="flexfa"`. The model is random-initialised (no download) unless a checkpoint
path is given; tokens/s are printed for flexfa and for transformers' `sdpa`.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

import flexfa.integrations.transformers as flexfa_hf

SIZES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    ),
    "1b": dict(  # Llama-3.2-1B's shape
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def load(args, implementation: str, device, dtype):
    if args.checkpoint:
        return transformers.AutoModelForCausalLM.from_pretrained(
            args.checkpoint, attn_implementation=implementation, dtype=dtype
        ).to(device)
    config = transformers.LlamaConfig(**SIZES[args.size], max_position_embeddings=131072)
    torch.manual_seed(0)  # the same random weights for every implementation
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=implementation, dtype=dtype
    )
    return model.to(device)


def generate(model, prompt, new_tokens: int, device) -> tuple[torch.Tensor, float]:
    model.eval()
    # A batch of unpadded prompts: every position is real, and padding uses token 0.
    common = dict(attention_mask=torch.ones_like(prompt), pad_token_id=0, do_sample=False)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, **common)
    model.generate(prompt, max_new_tokens=2, **common)  # warm-up (compiles kernels)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(prompt, **kwargs)
    _sync(device)
    return out, prompt.shape[0] * new_tokens / (time.perf_counter() - start)


def train_step(model, batch, device) -> tuple[float, float]:
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    for _ in range(2):  # the first compiles kernels
        _sync(device)
        start = time.perf_counter()
        loss = model(batch, labels=batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        elapsed = time.perf_counter() - start
    return loss.item(), batch.numel() / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default=None)
    parser.add_argument("--checkpoint", default=None, help="a local or Hub model path")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--train-len", type=int, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    args.size = args.size or ("1b" if cuda else "tiny")
    big = args.size != "tiny" or args.checkpoint
    batch = args.batch or (4 if big else 2)
    prompt_len = args.prompt_len or (4096 if big else 32)
    new_tokens = args.new_tokens or (64 if big else 8)
    train_len = args.train_len or (4096 if big else 64)

    name = flexfa_hf.register()  # the one line: attn_implementation="flexfa" from here on
    if args.checkpoint:
        vocab = transformers.AutoConfig.from_pretrained(args.checkpoint).vocab_size
    else:
        vocab = SIZES[args.size]["vocab_size"]
    prompt = torch.randint(0, vocab, (batch, prompt_len), device=device)
    tokens = {}
    print(f"{args.checkpoint or args.size} on {device}, {dtype}")
    for implementation in (name, "sdpa"):
        model = load(args, implementation, device, dtype)
        tokens[implementation], rate = generate(model, prompt, new_tokens, device)
        print(
            f"{implementation:>7} generate: {rate:10.1f} tokens/s (batch {batch}, prompt {prompt_len})"
        )
        loss, train_rate = train_step(model, prompt[:, :train_len], device)
        print(f"{implementation:>7} training step: {train_rate:10.1f} tokens/s (loss {loss:.3f})")
        del model
    same = torch.equal(tokens[name], tokens["sdpa"])
    print(f"greedy tokens equal to sdpa's: {same}")


if __name__ == "__main__":
    main()
