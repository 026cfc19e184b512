"""Structured answers on the command line: run --json-schema / --json, chat's /schema, and batch
--json-schema writing each row's parsed object (a row the token limit cut is a row error)."""

import io
import json

import jsonschema
import pytest

from edgevl.chat import chat_loop
from support.cli import cli, one_line_error
from support.common import smooth_image
from support.schemas import SCHEMAS


@pytest.fixture(scope="module")
def schema_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("schemas") / "meter.json"
    p.write_text(json.dumps(SCHEMAS["meter"]))
    return p


def test_run_json_schema_and_json(qwen_package, schema_file, capsys):
    code, out, err = cli(capsys, "run", qwen_package, "--prompt", "Read the meter.", "--no-thinking",
                         "--json-schema", schema_file, "--temperature", "1", "--seed", "3")
    assert code == 0, err
    jsonschema.validate(json.loads(out), SCHEMAS["meter"])
    code, out, err = cli(capsys, "run", qwen_package, "--prompt", "Read the meter.", "--no-thinking", "--json",
                         "--temperature", "0.7", "--seed", "4", "--max-new-tokens", "300")   # a seed whose answer ends
    assert code == 0, err
    assert isinstance(json.loads(out), dict)


def test_run_refuses_bad_schema_files_before_loading(qwen_package, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    one_line_error(*cli(capsys, "run", qwen_package, "--prompt", "x", "--json-schema", tmp_path / "missing.json")[::2],
                   "--json-schema", "no such file")
    one_line_error(*cli(capsys, "run", qwen_package, "--prompt", "x", "--json-schema", bad)[::2], "not valid JSON")
    bad.write_text('{"type": "object", "if": {}}')
    one_line_error(*cli(capsys, "run", qwen_package, "--prompt", "x", "--json-schema", bad)[::2], "does not support")
    one_line_error(*cli(capsys, "run", qwen_package, "--prompt", "x", "--json", "--json-schema", bad)[::2], "not both")
    code, out, err = cli(capsys, "run", qwen_package, "--prompt", "x", "--no-thinking", "--json-schema",
                         schema_file_for(tmp_path), "--max-new-tokens", "3")
    one_line_error(code, err, "cut by the token limit", "--max-new-tokens")
    code, out, err = cli(capsys, "run", qwen_package, "--prompt", "x", "--json-schema", schema_file_for(tmp_path),
                         "--max-new-tokens", "3")
    one_line_error(code, err, "ran out inside the thinking", "--no-thinking")


def schema_file_for(tmp_path):
    p = tmp_path / "receipt.json"
    p.write_text(json.dumps(SCHEMAS["receipt"]))
    return p


def test_chat_schema_command(qwen, schema_file):
    lines = iter(["/schema " + str(schema_file), "Read the meter.", "/schema off", "Hello", "/schema /no/such.json",
                  "/quit"])
    out = io.StringIO()
    chat_loop(qwen, input_fn=lambda _: next(lines), out=out, thinking=False, temperature=1.0, seed=5,
              max_new_tokens=40)
    text = out.getvalue()
    assert f"[answers follow the JSON schema in {schema_file}]" in text and "[answers are free text again]" in text
    answer = text.split(f"{schema_file}]\n", 1)[1].splitlines()[0]
    jsonschema.validate(json.loads(answer), SCHEMAS["meter"])
    assert "error: /schema /no/such.json: no such file" in text and "cut this answer" not in text
    lines = iter(["/schema " + str(schema_file), "Read the meter.", "/quit"])   # an answer the limit cuts
    out = io.StringIO()
    chat_loop(qwen, input_fn=lambda _: next(lines), out=out, thinking=False, max_new_tokens=3)
    assert "[the token limit cut this answer before its JSON was complete; raise --max-new-tokens]" in out.getvalue()


def test_batch_json_schema_writes_parsed_rows(qwen_vl_package, schema_file, tmp_path, capsys):
    rows = tmp_path / "in.jsonl"
    for i in range(3):
        smooth_image(64, 48, seed=i).save(tmp_path / f"m{i}.png")
    rows.write_text("".join(json.dumps({"id": f"r{i}", "image": f"m{i}.png", "prompt": "Read the meter."}) + "\n"
                            for i in range(3)))
    out = tmp_path / "out.jsonl"
    code, _, err = cli(capsys, "batch", qwen_vl_package, "--input", rows, "--output", out, "--json-schema", schema_file,
                       "--no-thinking", "--temperature", "1", "--seed", "1", "--quiet")
    assert code == 0, err
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == 3
    for r in got:
        jsonschema.validate(r["json"], SCHEMAS["meter"])
        assert json.loads(r["answer"]) == r["json"] and r["error"] is None
    cut = tmp_path / "cut.jsonl"
    code, _, err = cli(capsys, "batch", qwen_vl_package, "--input", rows, "--output", cut, "--json-schema", schema_file,
                       "--no-thinking", "--max-new-tokens", "2", "--quiet")
    assert code == 1
    for r in (json.loads(line) for line in cut.read_text().splitlines()):
        assert r["json"] is None and "cut the answer before its JSON ended" in r["error"]
