"""Conversations and a tiny ChatML tokenizer for `format: chat` tests and the `chat` benchmark:
made locally with the `tokenizers` library (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# ChatML with {% generation %} markers around what the assistant writes (its content and
# <|im_end|>), as Hugging Face's chat-template docs write it.
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}"
    "{% endgeneration %}"
    "{% elif message['role'] in ['system', 'user'] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML_PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", "<image>"]

WORDS = ["the", "data", "server", "packs", "tokens", "into", "rows", "of", "text", "héllo",
         "日本語", "a", "GPU", "never", "waits", "why?", "sure!", "😀", "naïve", "Ω", "\n",
         "<|im_end|>", "code:", "`x = 1`", "42"]


def sentence(rng: np.random.Generator, mean: float) -> str:
    n = int(rng.lognormal(np.log(mean), 0.8))
    return " ".join(rng.choice(WORDS, n)).replace(" \n ", "\n")


def conversations(n: int, seed: int = 0, mean_words: float = 25) -> list[list[dict[str, str]]]:
    """n conversations: an optional system message, 1 to 5 user/assistant turns, unicode,
    some empty contents (a user's or an assistant's)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        msgs = []
        if rng.random() < 0.4:
            msgs.append({"role": "system", "content": sentence(rng, 8)})
        for _turn in range(int(rng.integers(1, 6))):
            for role in ("user", "assistant"):
                content = "" if rng.random() < 0.05 else sentence(rng, mean_words)
                msgs.append({"role": role, "content": content})
        out.append(msgs)
    return out


def make_tokenizer(folder: Path, texts: list[str], template: str = CHATML,
                   vocab_size: int = 600) -> Path:
    """A byte-level BPE tokenizer.json trained on `texts`, with tokenizer_config.json beside it
    (the chat template, EOS and PAD) as transformers saves one; returns the tokenizer.json."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
        "eos_token": "<|im_end|>", "pad_token": "<pad>", "model_max_length": 1 << 20}))
    return folder / "tokenizer.json"


def write_jsonl(path: Path, convs: list[Any], field: str = "messages") -> None:
    with open(path, "w", encoding="utf-8") as f:
        for k, c in enumerate(convs):
            f.write(json.dumps({"id": k, field: c}, ensure_ascii=k % 2 == 0) + "\n")


def corpus_texts(convs: list[list[dict[str, str]]]) -> list[str]:
    return [m["content"] for c in convs for m in c]
