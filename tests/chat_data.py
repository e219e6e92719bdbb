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
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", "<image>"]


def plain(template: str) -> str:
    """The template without its {% generation %} markers (as most published templates are)."""
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


CHATML_PLAIN = plain(CHATML)

# The three templates of the end-of-turn rule's test, with markers around each assistant
# message and its end-of-turn token (what follows the token is outside them), written as
# their models' published templates write the turns.
CHATML_TURN = CHATML.replace("'<|im_end|>\\n' }}{% endgeneration %}",
                             "'<|im_end|>' }}{% endgeneration %}{{ '\\n' }}")
LLAMA3 = (  # Llama 3 Instruct: <|eot_id|> ends a turn, <|end_of_text|> the text
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<pad>"]
GEMMA = (  # Gemma: the system message opens the first user turn, the assistant is `model`
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] | trim + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') }}"
    "{% if role == 'model' %}"
    "{% generation %}{{ message['content'] | trim + '<end_of_turn>' }}{% endgeneration %}"
    "{{ '\\n' }}{% else %}{{ message['content'] | trim + '<end_of_turn>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]

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
                   vocab_size: int = 600, special: list[str] = SPECIAL,
                   tokens: dict[str, str] | None = None) -> Path:
    """A byte-level BPE tokenizer.json trained on `texts`, with tokenizer_config.json beside it
    (the chat template, EOS and PAD, or `tokens`: the special tokens by name) as transformers
    saves one; returns the tokenizer.json."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
        **(tokens or {"eos_token": "<|im_end|>", "pad_token": "<pad>"}),
        "model_max_length": 1 << 20}))
    return folder / "tokenizer.json"


def write_jsonl(path: Path, convs: list[Any], field: str = "messages") -> None:
    with open(path, "w", encoding="utf-8") as f:
        for k, c in enumerate(convs):
            f.write(json.dumps({"id": k, field: c}, ensure_ascii=k % 2 == 0) + "\n")


def corpus_texts(convs: list[list[dict[str, str]]]) -> list[str]:
    return [m["content"] for c in convs for m in c]


IGNORE = -100


def hf_reference(tokenizer: Path, convs: list[Any]) -> list[tuple[list[int], list[int]]]:
    """Each conversation's ids and assistant mask from transformers' apply_chat_template on
    the tokenizer folder's template (skips the test without transformers)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer.parent))
    out = []
    for c in convs:
        enc = hf.apply_chat_template(c, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        out.append((list(enc["input_ids"]), list(enc["assistant_masks"])))
    return out


def want_labels(ids: list[int], mask: list[int]) -> list[int]:
    """stoker's labels from transformers' mask: the next token where that token is trained."""
    return [ids[t + 1] if mask[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]
