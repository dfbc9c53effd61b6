"""relax_core.data (loading, cursor, templates) and the shipped datasets under datasets/."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax_core.data import (
    TEMPLATES,
    DatasetCursor,
    DatasetError,
    PromptSampler,
    check_dataset_path,
    load_prompts,
    render_prompt,
)
from tests import needs

REPO = Path(__file__).resolve().parents[2]


def _load_script(name: str):
    # datasets/ is a directory of scripts, not a package (the name would clash with HF `datasets`).
    spec = importlib.util.spec_from_file_location(
        f"_relax_{name}", REPO / "datasets" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------- loading


def test_jsonl_rows_are_normalised(tmp_path):
    path = _write_lines(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "12+34=", "answer": 46}),
            "",  # blank lines are not rows
            json.dumps({"prompt": "half?", "answer": 0.5, "meta": {"level": 2}, "extra": 1}),
            json.dumps({"prompt": "pick", "answer": "B", "choices": ["x", "y"]}),
            json.dumps(
                {"prompt": "look", "answer": 46.0, "media": [{"kind": "image", "uri": "a"}]}
            ),
        ],
    )
    rows = load_prompts(path)
    assert rows == [
        {"prompt": "12+34=", "answer": "46", "meta": {}},
        {"prompt": "half?", "answer": "0.5", "meta": {"level": 2}},
        {"prompt": "pick", "answer": "B", "meta": {}, "choices": ["x", "y"]},
        # An integral float (as Parquet/pandas often store ints) must match the answer "46".
        # Media paths are relative to the dataset's folder, and travel resolved.
        {
            "prompt": "look",
            "answer": "46",
            "meta": {},
            "media": [{"kind": "image", "uri": str(tmp_path / "a")}],
        },
    ]


def test_parquet_rows_load_like_jsonl(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.table(
        {
            "prompt": ["1+1=", "capital?"],
            "answer": [2, 7],
            "meta": [json.dumps({"src": "a"}), None],
            "choices": [None, ["Paris", "Rome"]],
        }
    )
    pq.write_table(table, path)
    assert load_prompts(str(path)) == [
        {"prompt": "1+1=", "answer": "2", "meta": {"src": "a"}},
        {"prompt": "capital?", "answer": "7", "meta": {}, "choices": ["Paris", "Rome"]},
    ]


def test_parquet_missing_field_names_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", None]}), path)
    with pytest.raises(DatasetError, match=r"d\.parquet: row 2: missing field 'answer'"):
        load_prompts(str(path))


def test_corrupt_parquet_is_reported(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        load_prompts(str(path))


def test_missing_relative_path_names_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        load_prompts("data/train.jsonl")
    assert "'data/train.jsonl'" in str(err.value)
    assert str(tmp_path) in str(err.value)


def test_missing_absolute_path_named(tmp_path):
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        check_dataset_path(missing)


def test_check_dataset_path_accepts_existing_file(tmp_path):
    path = _write_lines(tmp_path / "ok.jsonl", ['{"prompt": "p", "answer": "a"}'])
    check_dataset_path(path)  # raises on failure


def test_bad_json_names_file_and_line(tmp_path):
    path = _write_lines(tmp_path / "d.jsonl", ['{"prompt": "p", "answer": "a"}', '{"prompt": '])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: invalid JSON"):
        load_prompts(path)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"answer": "1"}, "missing field 'prompt'"),
        ({"prompt": "  ", "answer": "1"}, "field 'prompt' must be a non-empty string"),
        ({"prompt": "p"}, "missing field 'answer'"),
        ({"prompt": "p", "answer": ""}, "field 'answer' is empty"),
        ({"prompt": "p", "answer": True}, "field 'answer' must be a string or number"),
        ({"prompt": "p", "answer": "1", "meta": [1]}, "field 'meta' must be an object"),
        ({"prompt": "p", "answer": "1", "choices": "AB"}, "field 'choices' must be a list"),
        ({"prompt": "p", "answer": "1", "media": [{"kind": "image"}]}, "field 'media' item 0"),
        (
            {"prompt": "p", "answer": "1", "media": [{"kind": "img", "uri": "a.png"}]},
            "field 'media' item 0 has kind 'img'; kinds are image, audio, video",
        ),
    ],
)
def test_bad_field_names_file_line_and_field(tmp_path, record, message):
    path = _write_lines(
        tmp_path / "d.jsonl", ['{"prompt": "ok", "answer": "1"}', json.dumps(record)]
    )
    with pytest.raises(DatasetError, match=re.escape(f"d.jsonl:2: {message}")):
        load_prompts(path)


def test_unknown_extension_lists_supported(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=r"\.jsonl, \.parquet"):
        load_prompts(str(path))


def test_empty_dataset_is_an_error(tmp_path):
    path = _write_lines(tmp_path / "d.jsonl", ["", "  "])
    with pytest.raises(DatasetError, match="has no rows"):
        load_prompts(path)


# ---------------------------------------------------------------- cursor


def test_resume_from_serialised_cursor_continues_exactly():
    sampler = PromptSampler(num_prompts=7, seed=3)
    # 5 batches of 4 = 20 prompts = 2 epochs of 7 plus 6, so the run crosses two epoch ends.
    straight, cursor = [], DatasetCursor()
    for _ in range(5):
        batch, cursor = sampler.take(cursor, 4)
        straight.extend(batch)

    first, cursor = [], DatasetCursor()
    for _ in range(2):
        batch, cursor = sampler.take(cursor, 4)
        first.extend(batch)
    saved = json.dumps(cursor.to_dict())
    resumed = PromptSampler(num_prompts=7, seed=3)  # a fresh process after restart
    cursor = DatasetCursor.from_dict(json.loads(saved))
    for _ in range(3):
        batch, cursor = resumed.take(cursor, 4)
        first.extend(batch)
    assert first == straight
    assert cursor == DatasetCursor(epoch=2, index=6)  # 20 = 2 * 7 + 6


def test_batch_wraps_into_next_epoch():
    sampler = PromptSampler(num_prompts=5, seed=0)
    pairs, cursor = sampler.take(DatasetCursor(epoch=0, index=3), 4)
    # 2 left in epoch 0 (positions 3, 4), then the first 2 of epoch 1.
    assert [e for e, _ in pairs] == [0, 0, 1, 1]
    assert [i for _, i in pairs] == [*sampler.order(0)[3:], *sampler.order(1)[:2]]
    assert cursor == DatasetCursor(epoch=1, index=2)


def test_each_epoch_is_a_fresh_permutation_of_all_prompts():
    sampler = PromptSampler(num_prompts=50, seed=11)
    pairs, cursor = sampler.take(DatasetCursor(), 100)
    epoch0 = [i for e, i in pairs if e == 0]
    epoch1 = [i for e, i in pairs if e == 1]
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert epoch0 != epoch1 and epoch0 != list(range(50))
    assert cursor == DatasetCursor(epoch=2, index=0)  # an epoch end rolls over


def test_order_depends_on_seed_and_shuffle_flag():
    a, _ = PromptSampler(50, seed=1).take(DatasetCursor(), 50)
    same, _ = PromptSampler(50, seed=1).take(DatasetCursor(), 50)
    other, _ = PromptSampler(50, seed=2).take(DatasetCursor(), 50)
    assert a == same and a != other
    plain, _ = PromptSampler(4, seed=1, shuffle=False).take(DatasetCursor(), 6)
    assert plain == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]


def test_cursor_past_dataset_end_is_rejected():
    with pytest.raises(ValueError, match="dataset changed"):
        PromptSampler(num_prompts=5, seed=0).take(DatasetCursor(epoch=0, index=5), 1)


def test_cursor_from_bad_dict_is_rejected():
    with pytest.raises(ValueError, match="missing"):
        DatasetCursor.from_dict({"epoch": 1})
    with pytest.raises(ValueError, match="index must be an int >= 0"):
        DatasetCursor.from_dict({"epoch": 1, "index": -1})


# ---------------------------------------------------------------- templates


def _chat_tokenizer(with_template: bool = True):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    if with_template:
        tok.chat_template = (
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
    return tok


def test_plain_template_returns_prompt_unchanged():
    assert TEMPLATES == ("plain", "chat")
    assert render_prompt("12+34=", "plain") == "12+34="
    with pytest.raises(ValueError, match="only used by the 'chat' template"):
        render_prompt("12+34=", "plain", system_prompt="be brief")


def test_chat_template_wraps_system_user_and_opens_assistant_turn():
    tok = _chat_tokenizer()
    assert render_prompt("12+34=", "chat", tok) == "<|user|>12+34=\n<|assistant|>"
    assert (
        render_prompt("12+34=", "chat", tok, system_prompt="be brief")
        == "<|system|>be brief\n<|user|>12+34=\n<|assistant|>"
    )


def test_chat_template_errors():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        render_prompt("p", "chat")
    with pytest.raises(ValueError, match="has no chat template"):
        render_prompt("p", "chat", _chat_tokenizer(with_template=False))
    with pytest.raises(ValueError, match=r"choose one of \('plain', 'chat'\)"):
        render_prompt("p", "jinja")


# ---------------------------------------------------------------- shipped datasets


def test_arithmetic_split_is_disjoint_complete_and_correct():
    arithmetic = _load_script("arithmetic")
    train, eval_ = arithmetic.generate()
    assert (len(train), len(eval_)) == (9744, 256)  # 100 * 100 pairs - 256 held out
    prompts = [r["prompt"] for r in train + eval_]
    assert len(set(prompts)) == 10000  # disjoint and every pair present once
    for row in train + eval_:
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", row["prompt"]).groups())
        assert 0 <= a <= 99 and 0 <= b <= 99 and row["answer"] == str(a + b)
    _, other_eval = arithmetic.generate(seed=1)
    assert other_eval != eval_  # the seed picks the held-out pairs


def test_shipped_arithmetic_files_match_generator(tmp_path):
    arithmetic = _load_script("arithmetic")
    arithmetic.main(["--out", str(tmp_path)])
    for split in ("train", "eval"):
        shipped = REPO / "datasets" / "arithmetic" / f"{split}.jsonl"
        assert shipped.read_bytes() == (tmp_path / f"{split}.jsonl").read_bytes(), split
        assert len(load_prompts(str(shipped))) == {"train": 9744, "eval": 256}[split]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_shipped_gsm_files_are_disjoint_numeric_and_instructed():
    train = load_prompts(str(REPO / "datasets" / "gsm" / "train.jsonl"))
    eval_ = load_prompts(str(REPO / "datasets" / "gsm" / "eval.jsonl"))
    assert (len(train), len(eval_)) == (2000, 128)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}
    for row in train + eval_:
        assert re.fullmatch(r"\d+(\.\d+)?", row["answer"]), row["answer"]
        assert row["prompt"].endswith('"Answer: <number>", giving only the number, without units.')


def test_shipped_gsm_files_match_generator():
    needs.module("reasoning_gym", "pip install -e . (reasoning-gym is a dependency)")
    train, eval_ = _load_script("gsm").generate()
    for split, rows in (("train", train), ("eval", eval_)):
        shipped = (REPO / "datasets" / "gsm" / f"{split}.jsonl").read_text(encoding="utf-8")
        assert [json.loads(line) for line in shipped.splitlines()] == rows, split
