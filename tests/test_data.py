"""simple_grpo/task/problems.py: the same problems from JSONL, JSON, Parquet, CSV and the hub; errors
that name file and row."""
import csv
import json
import os
import time

import pytest

from simple_grpo.task.problems import SYSTEM_PROMPT, load_jsonl, load_problems, make_prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = [  # custom field names: the loader maps "problem"/"solution" onto "question"/"answer"
    {"id": "a", "problem": "Tom has 3 pens and buys 4. How many?", "solution": "3+4=<<3+4=7>>7\n#### 7"},
    {"id": "b", "problem": "Eva has 10 apples, eats 2. How many?", "solution": "10-2=8\n#### 8"},
    {"id": "c", "problem": "What is 1,000 + 5?", "solution": "1000+5=1005\n#### 1,005"},
]
CANONICAL = [{"id": r["id"], "question": r["problem"], "answer": r["solution"]} for r in ROWS]
FIELDS = {"question_field": "problem", "answer_field": "solution"}


def write(path, rows):
    """Write rows in the format that the file's extension names."""
    path = str(path)
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.endswith(".csv"):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.endswith(".json"):
        with open(path, "w") as f:
            json.dump(rows, f)
    else:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


@pytest.mark.parametrize("name", ["p.jsonl", "p.json", "p.parquet", "p.csv"])
def test_every_file_type_gives_the_same_canonical_problems(tmp_path, name):
    assert load_problems(write(tmp_path / name, ROWS), **FIELDS) == CANONICAL


def test_a_json_file_may_also_hold_json_lines(tmp_path):
    path = write(tmp_path / "p.jsonl", ROWS)
    os.rename(path, tmp_path / "p.json")
    assert load_problems(tmp_path / "p.json", **FIELDS) == CANONICAL


def test_gsm8k_fields_are_the_default_and_load_jsonl_agrees():
    path = os.path.join(ROOT, "data", "toy_math", "dev.jsonl")
    problems = load_problems(path)
    assert problems == load_jsonl(path) and len(problems) == 500
    assert set(problems[0]) == {"question", "answer"} and "####" in problems[0]["answer"]


@pytest.mark.parametrize("name", ["p.jsonl", "p.json", "p.csv"])
def test_an_empty_file_is_an_error_naming_it(tmp_path, name):
    path = tmp_path / name
    path.write_text("[]" if name.endswith(".json") else "")
    with pytest.raises(ValueError, match=f"{path}: no problems"):
        load_problems(path)


@pytest.mark.parametrize("name", ["p.jsonl", "p.parquet", "p.csv"])
def test_an_unknown_field_names_the_file_and_the_fields_present(tmp_path, name):
    path = write(tmp_path / name, ROWS)
    with pytest.raises(ValueError, match="no field 'question'") as error:
        load_problems(path)  # the default fields, but this file has problem/solution
    assert path in str(error.value) and "['id', 'problem', 'solution']" in str(error.value)


@pytest.mark.parametrize("name, where", [("p.jsonl", "line 2"), ("p.json", "row 2"), ("p.csv", "row 2")])
def test_a_missing_answer_names_the_file_and_row(tmp_path, name, where):
    rows = [dict(r) for r in ROWS]
    rows[1]["solution"] = ""
    path = write(tmp_path / name, rows)
    with pytest.raises(ValueError, match=f"{where}: field 'solution' must be non-empty text"):
        load_problems(path, **FIELDS)


@pytest.mark.parametrize("bad, message", [(42, "must be non-empty text, got 42"), ("the answer is 8", "####")])
def test_answers_must_be_gsm8k_text(tmp_path, bad, message):
    rows = [dict(r) for r in ROWS]
    rows[2]["solution"] = bad
    with pytest.raises(ValueError, match=message) as error:
        load_problems(write(tmp_path / "p.jsonl", rows), **FIELDS)
    assert "p.jsonl, line 3" in str(error.value)


def test_a_bad_json_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"p\.jsonl, line 3: not valid JSON"):
        load_problems(path, **FIELDS)


def test_a_missing_file_is_not_taken_for_a_hub_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl not found"):
        load_problems(tmp_path / "nope.jsonl")


def test_a_hub_dataset_that_cannot_be_loaded_fails_fast_and_names_it():
    # a name not on the hub, so this holds with or without network (here: none, and the hub
    # client alone would retry for ~25 s)
    start = time.monotonic()
    with pytest.raises(OSError, match="could not load dataset 'simple-grpo/no-such-set'.*Hugging Face hub"):
        load_problems("simple-grpo/no-such-set", config="main", split="train")
    assert time.monotonic() - start < 30


def test_raw_prompt_is_plain_text_and_chat_prompt_uses_the_template():
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "models", "tiny-math"))
    question = "What is 2+2?"
    raw = make_prompt(tokenizer, question, "raw")
    chat = make_prompt(tokenizer, question, "chat")
    assert raw == f"{SYSTEM_PROMPT}\nUser: {question}\nAssistant:"
    assert chat == tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        tokenize=False, add_generation_prompt=True)
    assert chat != raw and question in chat and make_prompt(tokenizer, question) == chat
    with pytest.raises(ValueError, match="unknown prompt_format 'xml'"):
        make_prompt(tokenizer, question, "xml")
