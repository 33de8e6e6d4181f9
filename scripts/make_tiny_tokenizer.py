"""Write the tiny Llama's tokenizer (tokenizer.json, tokenizer_config.json) into the packaged assets.

A word-level vocabulary of exactly 512 entries (the tiny model's vocab_size): special tokens, digits,
letters, punctuation, two-letter syllables and filler words `w0`, `w1`, ... It exists so that vLLM's
OpenAI server can run the tiny dummy-weight model with text prompts and a chat template in tests and
demos on a machine without network access. Deterministic: re-running it rewrites identical files.

    .venv/bin/python scripts/make_tiny_tokenizer.py [OUT_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

VOCAB_SIZE = 512
SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def vocabulary() -> dict[str, int]:
    words = [*SPECIAL, *(str(d) for d in range(10)), *(chr(c) for c in range(97, 123))]
    words += [".", ",", "!", "?", "'", "-", ":"]
    words += [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"]
    filler = 0
    while len(words) < VOCAB_SIZE:
        words.append(f"w{filler}")
        filler += 1
    return {w: i for i, w in enumerate(words[:VOCAB_SIZE])}


def main() -> None:
    default = Path(__file__).resolve().parents[1] / "kvguard/engine_adapter/vllm/assets/tiny-llama"
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    print(f"wrote {out}/tokenizer.json and tokenizer_config.json ({VOCAB_SIZE} tokens)")


if __name__ == "__main__":
    main()
