"""format: chat: conversations rendered, masked and packed on the server, checked against
transformers' apply_chat_template(return_assistant_tokens_mask=True), in this process and
from real servers (bad records, workers, elastic resume)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from chat_data import (
    CHATML_PLAIN,
    CHATML_TURN,
    IGNORE,
    conversations,
    corpus_texts,
    hf_reference,
    make_tokenizer,
    want_labels,
    write_jsonl,
)

from stoker.client import RemoteError, RemoteLoader
from stoker.server import Config, load_config, write_config
from stoker.server.formats import open_dataset
from stoker.server.tools.check import check

pytestmark = pytest.mark.timeout(180)
N = 500


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("chat")
    convs = conversations(N, seed=3)
    tok = make_tokenizer(root / "tok", corpus_texts(convs))
    plain = make_tokenizer(root / "plain", corpus_texts(convs), template=CHATML_PLAIN)
    turn = make_tokenizer(root / "turn", corpus_texts(convs), template=CHATML_TURN)
    (root / "data").mkdir()
    write_jsonl(root / "data" / "a.jsonl", convs[:300])
    write_jsonl(root / "data" / "b.jsonl", convs[300:])
    return {"root": root, "convs": convs, "tok": tok, "plain": plain, "turn": turn,
            "source": str(root / "data")}


def open_chat(chats: dict[str, Any], cache: Path, **cfg: Any) -> Any:
    block = {"format": "chat", "source": chats["source"], "tokenizer": str(chats["tok"]),
             "seq_len": 2048, **cfg}
    config = Config.model_validate({"cache": {"dir": str(cache)}, "datasets": {"c": block}})
    return open_dataset("c", config)


# -- against transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("template", ["markers", "prefix rule"])
def test_unpacked_rows_equal_transformers_apply_chat_template(chats, tmp_path: Path,
                                                              template: str) -> None:
    tok = chats["tok"] if template == "markers" else chats["plain"]
    # the marked template's masks; without markers, the turn ends at <|im_end|> (its EOS): the
    # masks of markers around the assistant's message and <|im_end|>, not the newline after
    reference = hf_reference(chats["tok" if template == "markers" else "turn"], chats["convs"])
    ds = open_chat(chats, tmp_path, tokenizer=str(tok), pack=False)
    assert ds.template.markers == (template == "markers")
    assert len(ds) == N
    trained = 0
    for i, (ids, mask) in enumerate(reference):
        row = ds[i]  # unpacked, unshuffled: row i is conversation i
        n = len(ids)
        assert n <= 2048 and row["input_ids"][:n].tolist() == ids, i
        assert row["labels"][:n].tolist() == want_labels(ids, mask), i
        assert (row["labels"][n:] == IGNORE).all() and (row["input_ids"][n:] == ds.pad_id).all()
        assert row["attention_mask"].tolist() == [1] * n + [0] * (2048 - n)
        assert row["position_ids"][:n].tolist() == list(range(n))
        assert (row["document_ids"][:n] == 0).all() and (row["document_ids"][n:] == -1).all()
        trained += sum(mask)
    assert trained > 0
    # the corpus has what the reference needs to mean something
    assert any(m["content"] == "" for c in chats["convs"] for m in c)
    assert any(m["role"] == "system" for c in chats["convs"] for m in c)


def test_loss_on_last_assistant_and_all(chats, tmp_path: Path) -> None:
    reference = hf_reference(chats["tok"], chats["convs"][:50])
    last = open_chat(chats, tmp_path / "l", pack=False, loss_on="last_assistant")
    every = open_chat(chats, tmp_path / "a", pack=False, loss_on="all")
    for i, (ids, mask) in enumerate(reference):
        runs = np.flatnonzero(np.diff([0, *mask]) == 1)  # where each assistant span starts
        only_last = [m if t >= runs[-1] else 0 for t, m in enumerate(mask)]
        assert last[i]["labels"][: len(ids)].tolist() == want_labels(ids, only_last)
        assert every[i]["labels"][: len(ids)].tolist() == want_labels(ids, [1] * len(ids))


# -- packing ----------------------------------------------------------------------------------
def segments(row: dict[str, np.ndarray]) -> list[tuple[list[int], list[int]]]:
    out = []
    for s in range(int(row["document_ids"].max()) + 1):
        at = np.flatnonzero(row["document_ids"] == s)
        assert (np.diff(at) == 1).all() and row["position_ids"][at].tolist() == list(range(len(at)))
        out.append((row["input_ids"][at].tolist(), row["labels"][at].tolist()))
    return out


def test_packed_rows_hold_every_conversation_once(chats, tmp_path: Path) -> None:
    reference = hf_reference(chats["tok"], chats["convs"])
    ds = open_chat(chats, tmp_path)
    assert ds.packing_efficiency >= 0.95
    got = sorted(seg for i in range(len(ds)) for seg in segments(ds[i]))
    want = sorted((ids, want_labels(ids, mask)) for ids, mask in reference)
    assert got == want  # every token once, and each segment's last label is -100
    real = sum(len(ids) for ids, _ in reference)
    assert ds.total_tokens == real and real / (len(ds) * 2048) == ds.packing_efficiency
    assert len(ds) < N / 4
    lengths = ds.sample_lengths()
    assert lengths.tolist() == [int(ds[i]["attention_mask"].sum()) for i in range(len(ds))]


@pytest.mark.parametrize("long", ["truncate", "drop", "split"])
def test_long_conversations(chats, tmp_path: Path, long: str) -> None:
    seq = 96
    ref = [ids for ids, _ in hf_reference(chats["tok"], chats["convs"][:300])]
    ds = open_chat(chats, tmp_path, source=str(Path(chats["source"]) / "a.jsonl"),
                   seq_len=seq, long=long)
    got = sorted(ids for i in range(len(ds)) for ids, _ in segments(ds[i]))
    if long == "truncate":
        want = [ids[:seq] for ids in ref]
    elif long == "drop":
        want = [ids for ids in ref if len(ids) <= seq]
    else:
        want = [ids[k : k + seq] for ids in ref for k in range(0, len(ids), seq)]
    assert got == sorted(want)
    assert ds.long_conversations == sum(len(ids) > seq for ids in ref) > 0


# -- bad records and templates ----------------------------------------------------------------
BAD = [
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
    '{"messages": "just a string"}',
    '{"messages": [{"role": "tool", "content": "42"}]}',
    "{not json",
    '{"other": 1}',
]


def bad_source(root: Path) -> str:
    (root / "bad").mkdir()
    (root / "bad" / "a.jsonl").write_text("\n".join(BAD) + "\n")
    return str(root / "bad")


def test_bad_records_fail_their_own_rows_naming_the_record(chats, tmp_path: Path) -> None:
    ds = open_chat(chats, tmp_path, source=bad_source(tmp_path))
    path = tmp_path / "bad" / "a.jsonl"
    assert len(ds) == 5 and ds.packed_rows == 1
    assert ds[0]["attention_mask"].sum() > 0
    errors = []
    for i in range(1, 5):
        with pytest.raises(ValueError) as info:
            ds[i]
        errors.append(str(info.value))
    assert errors == [
        f"{path} line 2: expected a non-empty list of messages, got str",
        f"{path} line 3: chat_template: TemplateError: unknown role: tool",
        f"{path} line 4: not valid JSON: Expecting property name enclosed in double quotes "
        "at column 2",
        f"{path} line 5: field 'messages': no 'messages' in the record"]
    skip = open_chat(chats, tmp_path / "s", source=str(tmp_path / "bad"), on_error="skip")
    assert len(skip) == 1 and len(skip.errors) == 4


def test_a_template_that_does_not_compile_stops_the_open(chats, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"chat_template line 1: .*endfor"):
        open_chat(chats, tmp_path, chat_template="{% for m in messages %}{{ m }}")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "tokenizer.json").write_bytes(chats["tok"].read_bytes())
    with pytest.raises(ValueError, match="no chat_template; set `chat_template:`"):
        open_chat(chats, tmp_path, tokenizer=str(tmp_path / "t" / "tokenizer.json"))
    ds = open_chat(chats, tmp_path / "c2", tokenizer=str(tmp_path / "t" / "tokenizer.json"),
                   chat_template=CHATML_PLAIN, pack=False)
    assert ds.template.markers is False and ds.pad_id == 0  # no tokenizer_config: PAD 0


def test_served_bad_record_is_data_loss_and_the_server_serves_on(chats, tmp_path: Path,
                                                                 start_server) -> None:
    source = bad_source(tmp_path)
    block = {"format": "chat", "source": source, "tokenizer": str(chats["tok"]),
             "seq_len": 256}
    good = {"format": "chat", "source": chats["source"], "tokenizer": str(chats["tok"]),
            "seq_len": 2048}
    server = start_server({"bad": block, "good": good}, workers=2)
    said = []
    for row in (1, 2):  # the good conversation is row 0, the bad records rows 1 to 4
        with RemoteLoader(server.address, "bad", batch_size=1, shuffle=False, output="numpy",
                          timeout=60) as ld:
            with pytest.raises(RemoteError) as info:
                ld.batch_at(0, row)
        assert info.value.code == grpc.StatusCode.DATA_LOSS
        said.append(str(info.value).split("DATA_LOSS: ")[1])
    assert said == [
        "batch 1: dataset 'bad': sample 1: ValueError: a.jsonl line 2: expected a non-empty "
        "list of messages, got str",
        "batch 2: dataset 'bad': sample 2: ValueError: a.jsonl line 3: chat_template: "
        "TemplateError: unknown role: tool"]
    for dataset in ("good", "bad"):  # the next clients are served
        with RemoteLoader(server.address, dataset, batch_size=1, shuffle=False,
                          output="numpy", timeout=60) as ld:
            assert ld.batch_at(0, 0)["input_ids"].shape[1] in (256, 2048)


# -- served: workers and elastic resume --------------------------------------------------------
def read_epoch(address: str, **kw: Any) -> dict[str, np.ndarray]:
    with RemoteLoader(address, "chat", batch_size=4, seed=5, shuffle=True, drop_last=False,
                      output="numpy", timeout=60, **kw) as ld:
        ld.set_epoch(1)
        batches = list(ld)
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def conversations_of(rows: dict[str, np.ndarray]) -> list[tuple[int, ...]]:
    """Each conversation a batch's rows hold, as its token ids."""
    return [tuple(row[d == s].tolist()) for row, d in zip(rows["input_ids"],
                                                          rows["document_ids"], strict=True)
            for s in range(int(d.max()) + 1)]


def test_served_rows_do_not_depend_on_workers_and_resume_4_to_3(chats, tmp_path: Path,
                                                                 start_server) -> None:
    block = {"format": "chat", "source": chats["source"], "tokenizer": str(chats["tok"]),
             "seq_len": 2048}
    one = start_server({"chat": block}, workers=1)
    two = start_server({"chat": block}, workers=2)
    a, b = read_epoch(one.address), read_epoch(two.address)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    rows = len(a["sample_index"])
    every = conversations_of(a)
    assert len(every) == len(set(every)) == N  # an epoch: each conversation once
    # 4 ranks read 2 batches of 3 each, then 3 ranks the rest of the epoch, on the other server
    used, got, state = [], [], None
    for rank in range(4):
        with RemoteLoader(one.address, "chat", batch_size=3, rank=rank, world_size=4, seed=9,
                          shuffle=True, output="numpy", timeout=60) as ld:
            ld.set_epoch(1)
            for n, batch in enumerate(ld, 1):
                used += batch["sample_index"].tolist()
                got += conversations_of(batch)
                if n == 2:
                    break
            state = ld.state_dict()
    for rank in range(3):
        with RemoteLoader(two.address, "chat", batch_size=3, rank=rank, world_size=3, seed=9,
                          shuffle=True, output="numpy", timeout=60) as ld:
            ld.load_state_dict(state)
            for batch in ld:
                used += batch["sample_index"].tolist()
                got += conversations_of(batch)
    assert len(got) == len(set(got))  # no conversation read twice
    rest = rows - 24
    tail = rest % 9  # the documented tail: less than one step of 3 ranks x 3 rows
    assert len(used) == len(set(used)) == 24 + rest - tail and 0 < tail < 9
    missed = set(every) - set(got)  # exactly the conversations of the tail's rows
    with RemoteLoader(one.address, "chat", batch_size=1, shuffle=False, output="numpy",
                      timeout=60) as ld:
        tail_rows = sorted(set(range(rows)) - set(used))
        assert missed == {c for r in tail_rows
                          for c in conversations_of(ld.batch_at(0, r))}  # unshuffled: row r


def test_batch_tokens_and_seek(chats, start_server) -> None:
    block = {"format": "chat", "source": chats["source"], "tokenizer": str(chats["tok"]),
             "seq_len": 2048, "pack": False}
    server = start_server({"chat": block}, workers=2)
    with RemoteLoader(server.address, "chat", batch_tokens=4096, seed=2, shuffle=True,
                      output="numpy", timeout=60) as ld:
        batches = list(ld)
        assert all(int(b["attention_mask"].sum()) <= 4096 for b in batches)
        seen = np.concatenate([b["sample_index"] for b in batches])
        assert len(seen) == len(set(seen.tolist())) >= N - 1  # the tail: < 1 conversation
        assert np.mean([len(b["sample_index"]) for b in batches]) > 4
        ld.seek(5)
        after = next(iter(ld))
        assert np.array_equal(after["input_ids"], batches[5]["input_ids"])
        assert np.array_equal(ld.batch_at(0, 7)["labels"], batches[7]["labels"])


def test_stoker_check_shows_the_masked_rendering(chats, tmp_path: Path, capsys) -> None:
    config = write_config(tmp_path / "c.yaml", {"cache": {"dir": str(tmp_path / "cache")},
                                                "datasets": {"sft": {
        "format": "chat", "source": chats["source"], "tokenizer": str(chats["tok"]),
        "seq_len": 2048}}})
    assert load_config(config).datasets["sft"].loss_on == "assistant"
    assert check(config) == 0
    out = capsys.readouterr().out
    assert "ok    sft  chat:" in out
    first = chats["convs"][0]
    line = next(x for x in out.splitlines() if "a.jsonl line 1:" in x)
    shown = json.loads(line[line.index('"'):])
    answer = next(m["content"] for m in first if m["role"] == "assistant")
    assert f"<|im_start|>assistant\n[[{answer}<|im_end|>\n]]" in shown


@pytest.mark.timeout(300)
def test_quick_chat_benchmark_checks_its_rows(tmp_path: Path) -> None:
    """The `chat` scenario runs: every row once, the server's rows equal the DataLoader's."""
    pytest.importorskip("transformers")
    out = tmp_path / "chat.json"
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "chat.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads(out.read_text())
    assert res["check_problems"] == [] and res["server_exit_code"] == 0
    assert res["compared_rows"] > 0 and res["corpus"]["packing_efficiency"] > 0.95
    assert res["ratio_rows_per_s"] > 0 and res["ratio_cpu_per_row"] > 0
