#!/usr/bin/env python3
"""Build the tiny random-weight Llama and its tokenizer locally: no model hub needed.

    build/.venv-hf/bin/python scripts/make_tiny_model.py [--out DIR --head-dim 64|16]

Without arguments it builds both models the engine tests use (~4 s each, ~1.3 MB):

- `build/tiny-llama`      head size 64 (hidden 128, 2 heads): vLLM and transformers serve.
- `build/tiny-llama-h16`  head size 16 (hidden 64, 4 heads): vLLM's CPU attention rejects it
  at the first inference, after `/health` already says 200 (a real "cannot serve" fault).

A directory holding `.complete` with this recipe's version is reused as it is; the model is
written to a temporary directory first and renamed, so an interrupted build leaves nothing
half-made. Needs torch, tokenizers and transformers (the transformers serve venv has them).

The tokenizer has one token per printable ASCII character (and newline), plus five special
tokens: every token decodes to clean ASCII, every text has exactly one tokenization (so a
stream continued from its text sees the very tokens it generated, and the tokens of a text
are its characters), and the 6 KB canary is ~6,000 tokens. The chat template is ChatML-like,
so vLLM's `continue_final_message` finds the final assistant text verbatim.
`generation_config.do_sample` is true so that a request's temperature, top_p and seed take
effect in transformers serve (which never switches sampling on by itself); temperature 0
is greedy on both engines.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "tiny-llama v3"  # bump when the recipe changes: cached models are then rebuilt
MARKER = ".complete"
DEFAULTS = ((ROOT / "build" / "tiny-llama", 64), (ROOT / "build" / "tiny-llama-h16", 16))

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # printable ASCII and newline
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def complete(out: Path) -> bool:
    marker = out / MARKER
    return marker.is_file() and marker.read_text().strip() == RECIPE


def build(out: Path, head_dim: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # One token per character, no merges: every text has exactly one tokenization, so
    # decode -> encode is the identity. A trained BPE is not: greedy output of a random
    # model is full of non-canonical splits ("t" + "he" where BPE says "the"), 800 generated
    # tokens re-encoded to 812 different ones, and a stream continued from its text (vLLM's
    # continue_final_message) took another path at the seam.
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # concatenate: token texts are the characters themselves
    tok.add_special_tokens(SPECIALS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )
    hf_tok.save_pretrained(tmp)

    torch.manual_seed(0)
    heads = {64: 2, 16: 4}[head_dim]
    cfg = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=head_dim * heads,  # 128 for head size 64, 64 for head size 16
        intermediate_size=2 * head_dim * heads,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        tie_word_embeddings=True,
        # Weights ~N(0, 0.3), not 0.02: with the usual small init, greedy decoding repeats one
        # token forever ("gamma gamma gamma ..."); with 0.3 it wanders over the vocabulary,
        # so a stream resumed at the wrong place, or with a token lost or doubled, shows.
        initializer_range=0.3,
        dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # Special tokens (ids 0-4) get all-zero embeddings, so their logits are 0 while the
        # best ordinary token's is several units above: greedy decoding never picks one.
        # Otherwise greedy chat answers came out empty (special tokens are skipped when
        # decoding) and never reached max_tokens; now every greedy answer is visible text
        # of exactly max_tokens tokens. Sampling can still, rarely, pick EOS.
        model.model.embed_tokens.weight[: len(SPECIALS)] = 0.0
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        do_sample=True,
    )
    model.save_pretrained(tmp)
    (tmp / MARKER).write_text(RECIPE + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="one model into this directory")
    p.add_argument("--head-dim", type=int, choices=(64, 16), default=64)
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = p.parse_args(argv)
    jobs = [(args.out, args.head_dim)] if args.out else list(DEFAULTS)
    for out, head_dim in jobs:
        if complete(out) and not args.force:
            print(f"{out}: cached")
            continue
        build(out, head_dim)
        print(f"{out}: built (head size {head_dim})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
