"""format: chat without {% generation %} markers: an assistant span ends right after the
end-of-turn token (the tokenizer config's eos_token, or `end_of_turn`), as transformers' masks
end with markers around each assistant message and its end-of-turn token; a template whose
turns have no end-of-turn token keeps the prefix rule; `stoker check` says which rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from chat_data import (
    CHATML,
    CHATML_TURN,
    GEMMA,
    GEMMA_SPECIAL,
    IGNORE,
    LLAMA3,
    LLAMA3_SPECIAL,
    conversations,
    corpus_texts,
    hf_reference,
    make_tokenizer,
    plain,
    want_labels,
    write_jsonl,
)

from stoker.server import Config, write_config
from stoker.server.formats import open_dataset
from stoker.server.tools.check import check

pytestmark = pytest.mark.timeout(240)
N = 500
SEQ = 2048

# style: (the template with markers, its special tokens, the tokenizer config's special
# tokens, the dataset's end_of_turn: None, a token's text, or "id" for that token's id)
STYLES: dict[str, tuple[str, list[str] | None, dict[str, str] | None, str | None]] = {
    "chatml": (CHATML_TURN, None, None, None),  # <|im_end|> is the EOS
    "llama3": (LLAMA3, LLAMA3_SPECIAL, {"bos_token": "<|begin_of_text|>",
                                        "eos_token": "<|end_of_text|>", "pad_token": "<pad>"},
               "<|eot_id|>"),
    "gemma": (GEMMA, GEMMA_SPECIAL, {"bos_token": "<bos>", "eos_token": "<eos>",
                                     "pad_token": "<pad>"}, "id"),
}


@pytest.fixture(scope="module")
def convs() -> list[list[dict[str, str]]]:
    return conversations(N, seed=11)


def folder_of(root: Path, convs: list[Any]) -> Path:
    data = root / "data"
    if not data.exists():
        data.mkdir()
        write_jsonl(data / "a.jsonl", convs)
    return data


def open_chat(root: Path, tokenizer: Path, **cfg: Any) -> Any:
    block = {"format": "chat", "source": str(root / "data"), "tokenizer": str(tokenizer),
             "seq_len": SEQ, **cfg}
    config = Config.model_validate({"cache": {"dir": str(root / "cache")},
                                    "datasets": {"c": block}})
    return open_dataset("c", config)


def tokenizers_for(root: Path, convs: list[Any], style: str) -> tuple[Path, Path, Any]:
    """(the tokenizer with the marked template, the one with the plain template, the
    dataset's end_of_turn for the plain one)."""
    marked, special, tokens, eot = STYLES[style]
    kw: dict[str, Any] = {"tokens": tokens} if tokens else {}
    if special:
        kw["special"] = special
    texts = corpus_texts(convs)
    ref = make_tokenizer(root / style / "marked", texts, template=marked, **kw)
    tok = make_tokenizer(root / style / "plain", texts, template=plain(marked), **kw)
    if eot == "id":
        import tokenizers

        eot = tokenizers.Tokenizer.from_file(str(tok)).token_to_id("<end_of_turn>")
    return ref, tok, eot


@pytest.mark.parametrize("style", list(STYLES))
def test_labels_without_markers_equal_transformers_with_markers_around_the_turn(
        convs, tmp_path: Path, style: str) -> None:
    folder_of(tmp_path, convs)
    ref, tok, eot = tokenizers_for(tmp_path, convs, style)
    reference = hf_reference(ref, convs)
    cfg = {"end_of_turn": eot} if eot is not None else {}
    ds = open_chat(tmp_path, tok, pack=False, **cfg)
    assert not ds.template.markers and ds.template.rule.value == "end of turn"
    assert len(ds) == N
    trained = 0
    for i, (ids, mask) in enumerate(reference):
        row = ds[i]
        n = len(ids)
        assert n <= SEQ and row["input_ids"][:n].tolist() == ids, i
        assert row["labels"][:n].tolist() == want_labels(ids, mask), i
        assert (row["labels"][n:] == IGNORE).all()
        trained += sum(mask)
    assert trained > 0
    packed = open_chat(tmp_path, tok, **cfg)
    assert packed.packing_efficiency >= 0.95


def test_the_eos_the_template_does_not_write_keeps_the_prefix_rule(convs, tmp_path: Path
                                                                   ) -> None:
    """ChatML with <|endoftext|> as EOS: its turns have no end-of-turn token, so the span is
    all the turn adds (the newline too), as markers around the message and the newline."""
    folder_of(tmp_path, convs)
    texts = corpus_texts(convs)
    tokens = {"eos_token": "<|endoftext|>", "pad_token": "<pad>"}
    ref = make_tokenizer(tmp_path / "ref", texts, template=CHATML, tokens=tokens)
    tok = make_tokenizer(tmp_path / "plain", texts, template=plain(CHATML), tokens=tokens)
    ds = open_chat(tmp_path, tok, pack=False)
    assert ds.template.rule.value == "prefix"
    for i, (ids, mask) in enumerate(hf_reference(ref, convs[:100])):
        assert ds[i]["labels"][: len(ids)].tolist() == want_labels(ids, mask), i
    # naming the end of turn turns the rule on
    turn = open_chat(tmp_path, tok, pack=False, end_of_turn="<|im_end|>")
    assert turn.template.rule.value == "end of turn"


def test_end_of_turn_errors_name_the_field(convs, tmp_path: Path) -> None:
    folder_of(tmp_path, convs)
    tok = make_tokenizer(tmp_path / "tok", corpus_texts(convs), template=plain(CHATML))
    with pytest.raises(ValueError, match=r"end_of_turn: '<\|eot_id\|>' is not a token"):
        open_chat(tmp_path, tok, end_of_turn="<|eot_id|>")
    with pytest.raises(ValueError, match="end_of_turn: 100000 is not a token id"):
        open_chat(tmp_path, tok, end_of_turn=100000)
    with pytest.raises(ValueError, match="end_of_turn: the chat template does not write "
                       "'<pad>' in an assistant turn"):
        open_chat(tmp_path, tok, end_of_turn="<pad>")


@pytest.mark.parametrize("eos, rule", [("<|im_end|>", "end-of-turn rule"),
                                       ("<|endoftext|>", "prefix rule")])
def test_stoker_check_says_the_rule_and_shows_a_masked_conversation(
        convs, tmp_path: Path, capsys, eos: str, rule: str) -> None:
    folder_of(tmp_path, convs[:3])
    tok = make_tokenizer(tmp_path / "tok", corpus_texts(convs), template=plain(CHATML),
                         tokens={"eos_token": eos, "pad_token": "<pad>"})
    config = write_config(tmp_path / "c.yaml", {"cache": {"dir": str(tmp_path / "cache")},
                                                "datasets": {"sft": {
        "format": "chat", "source": str(tmp_path / "data"), "tokenizer": str(tok),
        "seq_len": SEQ}}})
    assert check(config) == 0
    out = capsys.readouterr().out
    assert f"masks: {rule}" in out
    line = next(x for x in out.splitlines() if "a.jsonl line 1:" in x)
    shown = json.loads(line[line.index('"'):])
    answer = next(m["content"] for m in convs[0] if m["role"] == "assistant")
    after = "\n]]" if rule == "prefix rule" else "]]\n"
    assert f"<|im_start|>assistant\n[[{answer}<|im_end|>{after}" in shown
