"""`edgevl batch` never takes the wrong file for its output, never loses or duplicates rows, and
says in one line what is wrong: an output that is the input (by any spelling), files that are not
batch outputs, outputs spelled through symlinks and hard links, corrupt lines, thinking models
whose token limit ran out inside the thinking, file names and inputs that are not UTF-8, long CSV
fields, bad --max-image-patches and more workers than the memory holds."""

import csv
import json
import os

import pytest

import edgevl
from edgevl.batch import FIELDS, RESULT_FIELDS, THOUGHT_CUT, BatchJob, Sink, empty_row
from edgevl.demo.scenes import make_scene
from edgevl.errors import EdgevlError
from support.cli import cli, one_line_error
from support.files import read_jsonl
from support.qwen import make_qwen3_5

PROMPT = "Describe the image."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("scenes")
    for i in range(3):
        make_scene(7000 + i).image.save(d / f"s{i}.png")
    return d


def batch(capsys, pkg, *args):
    return cli(capsys, "batch", pkg, "--prompt", PROMPT, "--threads", 1, "--quiet", *args)


def input_jsonl(path, folder):
    """An input table with a column of its own, as users keep them."""
    path.write_text("".join(json.dumps({"id": f"q{i}", "image": str(folder / f"s{i}.png"), "prompt": PROMPT,
                                        "note": "mine"}) + "\n" for i in range(3)))
    return path.read_bytes()


# ---------------------------------------------------------------------------------------------
# the output is only ever a batch output


def test_an_output_that_is_the_input_is_refused_by_any_spelling(pkg, folder, tmp_path, capsys):
    q = tmp_path / "q.jsonl"
    before = input_jsonl(q, folder)
    (tmp_path / "link.jsonl").symlink_to(q)
    os.link(q, tmp_path / "hard.jsonl")
    (tmp_path / "sub").mkdir()
    for out in (q, tmp_path / "link.jsonl", tmp_path / "hard.jsonl", tmp_path / "sub" / ".." / "q.jsonl"):
        for extra in ([], ["--overwrite"]):
            code, _, err = batch(capsys, pkg, "--input", q, "--output", out, *extra)
            one_line_error(code, err, "is the input file", "choose another --output")
            assert q.read_bytes() == before
    # a Parquet output's journal is a JSONL file beside it: it must not be the input either
    journal = tmp_path / "r.parquet.partial.jsonl"
    input_jsonl(journal, folder)
    code, _, err = batch(capsys, pkg, "--input", journal, "--output", tmp_path / "r.parquet", "--overwrite")
    one_line_error(code, err, "is the input file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.jsonl", "link.jsonl", "q.jsonl",
                                                          "r.parquet.partial.jsonl", "sub"]


def test_an_existing_file_that_is_not_a_batch_output_is_never_taken(pkg, folder, tmp_path, capsys):
    q = tmp_path / "q.jsonl"
    input_jsonl(q, folder)
    other = tmp_path / "other.jsonl"
    theirs = {
        "input-like rows": input_jsonl(other, folder),
        "text": b"hello\n",
        "one line without its newline": b'{"image": "a.png"}',  # was cut off as a "torn" row
        # begins as a row line does, but no finished row is there to resume: not cut either
        "one id line without its newline": b'{"id": "mine", "label": "cat", "score": 0.93}'[:-1],
    }
    for what, data in theirs.items():
        other.write_bytes(data)
        for extra in ([], ["--overwrite"], ["--repair"]):
            code, _, err = batch(capsys, pkg, "--input", q, "--output", other, *extra)
            one_line_error(code, err, "may not be a batch output" if "id line" in what else
                           "not an edgevl batch output", "choose another --output")
            assert other.read_bytes() == data, (what, extra)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.jsonl", "q.jsonl"]  # no lock, no journal

    other.write_bytes(b"")  # an empty file is taken over
    code, _, err = batch(capsys, pkg, "--input", q, "--output", other)
    assert code == 0, err
    assert [r["id"] for r in read_jsonl(other)] == ["q0", "q1", "q2"]


def test_a_foreign_parquet_file_at_the_output_is_refused_up_front(pkg, folder, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    q = tmp_path / "q.jsonl"
    input_jsonl(q, folder)
    out = tmp_path / "table.parquet"
    pq.write_table(pa.table({"id": ["q1", "zz"], "score": [0.5, 0.7]}), out)  # q1 would count as done
    data = out.read_bytes()
    for extra in ([], ["--overwrite"]):
        code, _, err = batch(capsys, pkg, "--input", q, "--output", out, *extra)
        one_line_error(code, err, "not an edgevl batch output", "answer", "choose another --output")
        assert out.read_bytes() == data
    out.write_bytes(b"PAR1 not really")
    for extra in ([], ["--overwrite"]):
        code, _, err = batch(capsys, pkg, "--input", q, "--output", out, *extra)
        one_line_error(code, err, "not a readable Parquet file")
        assert out.read_bytes() == b"PAR1 not really"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.jsonl", "table.parquet"]  # nothing stranded


# ---------------------------------------------------------------------------------------------
# one output, however it is spelled


def test_symlinks_and_hard_links_to_a_busy_output_are_refused(pkg, folder, tmp_path, capsys):
    real = tmp_path / "real.jsonl"
    held = Sink(real)  # another job writes real.jsonl
    try:
        (tmp_path / "link.jsonl").symlink_to(real)
        os.link(real, tmp_path / "hard.jsonl")
        (tmp_path / "d").symlink_to(tmp_path, target_is_directory=True)
        for out in ("link.jsonl", "hard.jsonl", "d/real.jsonl"):
            code, _, err = batch(capsys, pkg, "--input", folder, "--output", tmp_path / out)
            one_line_error(code, err, "being written by another edgevl batch job")
    finally:
        held.close()
    assert real.read_bytes() == b""

    # and the other way round: the job through the link holds the real file
    held = Sink(tmp_path / "link.jsonl")
    try:
        code, _, err = batch(capsys, pkg, "--input", folder, "--output", real)
        one_line_error(code, err, "being written by another edgevl batch job")
    finally:
        held.close()

    # Parquet: a hard link to a finished output while a job appends to it
    code, _, err = batch(capsys, pkg, "--input", folder, "--output", tmp_path / "p.parquet")
    assert code == 0, err
    os.link(tmp_path / "p.parquet", tmp_path / "p2.parquet")
    held = Sink(tmp_path / "p.parquet")
    try:
        code, _, err = batch(capsys, pkg, "--input", folder, "--output", tmp_path / "p2.parquet", "--overwrite")
        one_line_error(code, err, "being written by another edgevl batch job")
    finally:
        held.close()


@pytest.mark.parametrize("ext", [".jsonl", ".parquet"])
def test_an_output_that_is_a_symlink_stays_a_symlink(pkg, folder, model, tmp_path, capsys, ext):
    src = tmp_path / "rows.csv"
    with open(src, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["id", "image"])
        w.writeheader()
        w.writerows([{"id": "a", "image": str(folder / "s0.png")}, {"id": "gone", "image": "nowhere.png"},
                     {"id": "b", "image": str(folder / "s1.png")}])
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / f"results{ext}"
    link = tmp_path / f"out{ext}"
    link.symlink_to(target)  # dangling until the job writes its target

    def rows():
        if ext == ".jsonl":
            return read_jsonl(target)
        import pyarrow.parquet as pq

        return pq.read_table(target).to_pylist()

    code, _, err = batch(capsys, pkg, "--input", src, "--output", link)
    assert code == 1 and "1 failed" in err, err
    (tmp_path / "nowhere.png").symlink_to(folder / "s2.png")
    # --retry-errors rewrites the whole output (by rename): through the link, not over it
    code, _, err = batch(capsys, pkg, "--input", src, "--output", link, "--retry-errors")
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    got = rows()
    assert [r["id"] for r in got] == ["a", "gone", "b"] and all(r["error"] is None for r in got)
    assert got[1]["answer"] == edgevl.generate(model, PROMPT, image=str(folder / "s2.png"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "nowhere.png", f"out{ext}", "rows.csv"]
    assert [p.name for p in (tmp_path / "data").iterdir()] == [f"results{ext}"]  # no lock or journal left


# ---------------------------------------------------------------------------------------------
# a corrupt line costs nothing but itself


def test_repair_moves_bad_lines_aside_and_keeps_the_good_rows(pkg, folder, model, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    code, _, err = batch(capsys, pkg, "--input", folder, "--output", out)
    assert code == 0, err
    lines = out.read_bytes().splitlines(keepends=True)
    bad = b'{"id": "s1.png", "image": "s1.png", "pro\x00\xff garbage\n'  # a flipped block on disk
    out.write_bytes(lines[0] + bad + lines[2])
    before = out.read_bytes()
    code, _, err = batch(capsys, pkg, "--input", folder, "--output", out)
    one_line_error(code, err, "line 2 is not a batch result row", "--repair", "out.jsonl.rejected", "2 good rows")
    assert out.read_bytes() == before

    code, _, err = batch(capsys, pkg, "--input", folder, "--output", out, "--repair")
    assert code == 0, err
    assert "moved 1 line(s) that were not result rows" in err
    assert "1 new" in err and "2 already done" in err
    assert (tmp_path / "out.jsonl.rejected").read_bytes() == bad  # byte for byte
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == ["s0.png", "s1.png", "s2.png"]
    assert rows[0] == json.loads(lines[0]) and rows[2] == json.loads(lines[2])  # kept, not redone
    assert rows[1]["answer"] == edgevl.generate(model, PROMPT, image=str(folder / "s1.png"))


@pytest.mark.parametrize("ext", [".jsonl", ".parquet"])
def test_a_whole_last_row_without_its_newline_is_kept(pkg, folder, tmp_path, capsys, ext):
    import pyarrow.parquet as pq

    first = tmp_path / "first.jsonl"
    code, _, err = batch(capsys, pkg, "--input", folder, "--output", first)
    assert code == 0, err
    lines = first.read_bytes().splitlines(keepends=True)
    sampled = dict(json.loads(lines[1]), answer="a sampled answer that a rerun would not give again")
    whole = json.dumps(sampled).encode()  # the last write landed but for its newline
    out = tmp_path / f"out{ext}"
    journal = tmp_path / "out.parquet.partial.jsonl" if ext == ".parquet" else out
    journal.write_bytes(lines[0] + whole)
    code, _, err = batch(capsys, pkg, "--input", folder, "--output", out)
    assert code == 0, err
    assert "torn" not in err and "2 already done" in err and "1 new" in err, err
    if ext == ".parquet":
        rows = pq.read_table(out).to_pylist()
    else:
        assert out.read_bytes().startswith(lines[0] + whole + b"\n")  # kept as it was, newline added
        rows = read_jsonl(out)
    assert [r["id"] for r in rows] == ["s0.png", "s1.png", "s2.png"]
    assert rows[1] == sampled


def test_only_a_last_line_that_does_not_parse_is_torn(tmp_path):
    row = dict(empty_row({"id": "r1"}), answer="kept")
    out = tmp_path / "out.jsonl"
    for tail, torn in ((b'{"id": "r2", "image": "r2.p', 27), (json.dumps(dict(row, id="r2")).encode(), 0)):
        out.write_bytes(json.dumps(row).encode() + b"\n" + tail)
        sink = Sink(out)
        try:
            assert sink.torn_bytes == torn and set(sink.rows) == ({"r1"} if torn else {"r1", "r2"})
        finally:
            sink.close()
        assert out.read_bytes().endswith(b"\n") and all(json.loads(x) for x in out.read_bytes().splitlines())


# ---------------------------------------------------------------------------------------------
# thinking models


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A tiny random Qwen3.5 (its template opens a think block: the output is all thinking)."""
    root = tmp_path_factory.mktemp("thinker")
    ck = make_qwen3_5(root / "ck", seed=3)
    return edgevl.convert(ck, root / "pk", dtype="fp32", progress=False)


def test_a_thinking_model_whose_limit_ran_out_in_the_thinking_fails_its_rows(thinker, folder, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    args = ("--input", folder, "--output", out, "--max-new-tokens", 4, "--temperature", 0)
    code, _, err = cli(capsys, "batch", thinker, "--prompt", "hi", "--threads", 1, "--quiet", *args)
    assert code == 1, err
    assert "3 failed" in err and "3 of them ran out of tokens while thinking" in err
    model = edgevl.load(thinker, threads=1)
    rows = read_jsonl(out)
    for r in rows:
        assert list(r) == list(FIELDS)
        done = edgevl.complete(model, "hi", image=str(folder / r["id"]), max_new_tokens=4, temperature=0)
        assert done.reasoning and done.text == "" and done.finish_reason == "length"
        assert r["reasoning"] == done.reasoning and r["answer"] == "" and r["finish_reason"] == "length"
        assert r["error"] == THOUGHT_CUT and "--max-new-tokens" in THOUGHT_CUT and "--no-thinking" in THOUGHT_CUT

    code, _, err = cli(capsys, "batch", thinker, "--prompt", "hi", "--threads", 1, "--quiet", *args,
                       "--no-thinking", "--retry-errors")
    assert code == 0 and "3 new" in err, err
    for r in read_jsonl(out):
        off = edgevl.complete(model, "hi", image=str(folder / r["id"]), max_new_tokens=4, temperature=0,
                              chat_template_kwargs={"enable_thinking": False})
        assert r["error"] is None and r["reasoning"] is None and r["answer"] == off.text and off.text


def test_outputs_written_before_the_reasoning_field_resume(pkg, folder, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    old = {"id": "s1.png", "image": "s1.png", "prompt": PROMPT, "answer": "Red.", "boxes": [], "tokens_in": 38,
           "tokens_out": 3, "finish_reason": "stop", "seconds": 0.01, "error": None}
    assert list(old) == list(RESULT_FIELDS)
    (tmp_path / "old.jsonl").write_text(json.dumps(old) + "\n")
    pq.write_table(pa.Table.from_pylist([old]), tmp_path / "old.parquet")
    for name in ("old.jsonl", "old.parquet"):
        code, _, err = batch(capsys, pkg, "--input", folder, "--output", tmp_path / name)
        assert code == 0 and "1 already done" in err and "2 new" in err, err
    rows = read_jsonl(tmp_path / "old.jsonl")
    assert [r["id"] for r in rows] == ["s0.png", "s1.png", "s2.png"] and rows[1] == old
    table = pq.read_table(tmp_path / "old.parquet")
    assert table.column_names == list(FIELDS)
    assert table.to_pylist()[1] == dict(old, reasoning=None, video=None, json=None, made_with=None)


# ---------------------------------------------------------------------------------------------
# inputs


def test_a_file_name_that_is_not_utf8_is_a_row(pkg, folder, model, tmp_path, capsys):
    import pyarrow.parquet as pq

    d = tmp_path / "imgs"
    d.mkdir()
    make_scene(7000).image.save(d / "a.png")
    with open(os.path.join(os.fsencode(d), b"\xffx.png"), "wb") as f:
        make_scene(7001).image.save(f, format="PNG")
    weird = os.fsdecode(os.path.join(os.fsencode(d), b"\xffx.png"))
    for out in (tmp_path / "out.jsonl", tmp_path / "out.parquet"):
        for _ in range(2):  # the rerun resumes
            code, _, err = batch(capsys, pkg, "--input", d, "--output", out)
            assert code == 0, err
        assert "2 already done" in err
        rows = read_jsonl(out) if out.suffix == ".jsonl" else pq.read_table(out).to_pylist()
        assert [r["id"] for r in rows] == ["a.png", "\\xffx.png"] and rows[1]["image"] == "\\xffx.png"
        assert rows[1]["error"] is None and rows[1]["answer"] == edgevl.generate(model, PROMPT, image=weird)
    # an error message that names such a file is written too
    with open(os.path.join(os.fsencode(d), b"\xfebad.png"), "wb") as f:
        f.write(b"not an image")
    rows = list(edgevl.batch(pkg, d, PROMPT, output=tmp_path / "bad.jsonl", threads=1))
    assert [r["id"] for r in rows] == ["a.png", "\\xfebad.png", "\\xffx.png"]
    assert "Not a readable image file" in rows[1]["error"] and read_jsonl(tmp_path / "bad.jsonl") == rows
    os.unlink(os.path.join(os.fsencode(d), b"\xfebad.png"))
    # Ray Data keeps rows as UTF-8 text: the row fails, not the job (Ray is not even started here)
    (d / "a.png").unlink()
    rows = list(edgevl.batch(pkg, d, PROMPT, output=tmp_path / "ray.jsonl", ray=True, workers=1))
    assert [r["id"] for r in rows] == ["\\xffx.png"] and "must be UTF-8" in rows[0]["error"]
    assert read_jsonl(tmp_path / "ray.jsonl") == rows


def test_jsonl_input_that_is_not_utf8_names_the_line(pkg, folder, tmp_path, capsys):
    src = tmp_path / "rows.jsonl"
    src.write_bytes(b'{"image": "a.png"}\n{"image": "caf\xe9.png"}\n')  # Latin-1
    code, _, err = batch(capsys, pkg, "--input", src, "--output", tmp_path / "o.jsonl")
    one_line_error(code, err, str(src), "line 2 is not UTF-8")


def test_lone_surrogates_in_a_jsonl_input_are_rows_not_a_crash(pkg, folder, tmp_path, capsys):
    """JSON allows "\\ud800" escapes, which no UTF-8 output can hold: written escaped, resumable."""
    src, out = tmp_path / "rows.jsonl", tmp_path / "o.parquet"
    src.write_text('{"id": "a\\ud800", "image": "s0.png", "prompt": "x\\udcff"}\n'
                   '{"id": "b", "image": "s1.png\\udcff"}\n')
    (tmp_path / "s0.png").symlink_to(folder / "s0.png")
    for _ in range(2):
        code, _, err = batch(capsys, pkg, "--input", src, "--output", out)
        assert code == 1 and "2 failed" in err, err
    assert "2 already done" in err
    import pyarrow.parquet as pq

    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == ["a\\ud800", "b"] and rows[0]["prompt"] == "x\\xff"
    assert "invalid Unicode" in rows[0]["error"] and "not found" in rows[1]["error"]


def test_csv_fields_over_131072_characters(pkg, folder, model, tmp_path, capsys):
    src = tmp_path / "rows.csv"
    long_prompt = "red " * 40000
    with open(src, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["id", "image", "prompt", "notes"])
        w.writeheader()
        w.writerow({"id": "notes", "image": str(folder / "s0.png"), "prompt": "", "notes": "x" * 200000})
        w.writerow({"id": "long", "image": str(folder / "s1.png"), "prompt": long_prompt, "notes": ""})
    out = tmp_path / "o.jsonl"
    code, _, err = batch(capsys, pkg, "--input", src, "--output", out)
    assert code == 1 and "1 failed" in err, err
    rows = {r["id"]: r for r in read_jsonl(out)}
    assert rows["notes"]["answer"] == edgevl.generate(model, PROMPT, image=str(folder / "s0.png"))
    assert rows["long"]["prompt"] == long_prompt and "context length is 2048" in rows["long"]["error"]


# ---------------------------------------------------------------------------------------------
# settings


def test_max_image_patches_out_of_range_is_a_usage_error(pkg, folder, tmp_path, capsys, monkeypatch):
    for n in ("0", "3", "1000000000"):
        code, _, err = batch(capsys, pkg, "--input", folder, "--output", tmp_path / "o.jsonl",
                             "--max-image-patches", n)
        one_line_error(code, err, "--max-image-patches must be between 4 and")
    assert not list(tmp_path.iterdir())  # refused before the output was even opened
    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "cache"))
    code, _, err = cli(capsys, "batch", "--input", folder, "--prompt", PROMPT, "--output", tmp_path / "o.jsonl",
                       "--max-image-patches", "0")
    one_line_error(code, err, "--max-image-patches must be between 4 and")
    assert not list(tmp_path.iterdir())  # nor was the demo model converted


def test_more_workers_than_the_memory_holds_are_refused(pkg, folder, tmp_path, capsys, monkeypatch):
    from edgevl import runtime

    monkeypatch.setattr(runtime, "available_memory", lambda: 1 << 30)  # 1 GiB
    code, _, err = batch(capsys, pkg, "--input", folder, "--output", tmp_path / "o.jsonl", "--workers", 3)
    line = one_line_error(code, err, "--workers 3", "1.0 GiB is available", "use --workers 1 or fewer")
    assert "each worker loads the model" in line
    assert not list(tmp_path.iterdir())
    with pytest.raises(EdgevlError, match="--workers 24"):
        BatchJob(pkg, folder, PROMPT, workers=24)
    BatchJob(pkg, folder, PROMPT, workers=1)                    # runs in this process: no check
    BatchJob(pkg, folder, PROMPT, workers=24, low_memory=True)  # weights are not kept resident
    monkeypatch.setattr(runtime, "available_memory", lambda: 64 << 30)
    BatchJob(pkg, folder, PROMPT, workers=24)


def test_the_start_line_counts_the_workers_that_start(pkg, folder, tmp_path, capsys):
    """`--workers 3` over one row starts none: the row runs in this process, and the first line
    says so rather than promising three workers."""
    one = tmp_path / "one"
    one.mkdir()
    (one / "s0.png").write_bytes((folder / "s0.png").read_bytes())
    code, _, err = batch(capsys, pkg, "--input", one, "--output", tmp_path / "o.jsonl", "--workers", 3,
                         "--max-new-tokens", 2)
    assert code == 0, err
    assert "batch: 1 rows; 1 worker(s) x 1 thread(s), local, 4 rows at a time" in err, err


def test_a_rerun_with_another_prompt_says_the_done_rows_were_asked_otherwise(pkg, folder, tmp_path, capsys):
    """Rows resume by id: a rerun with a changed prompt keeps the old answers, and says so."""
    out = tmp_path / "o.jsonl"
    code, _, err = batch(capsys, pkg, "--input", folder, "--output", out, "--max-new-tokens", 2)
    assert code == 0 and "asked another prompt" not in err, err
    before = out.read_bytes()
    code, _, err = cli(capsys, "batch", pkg, "--prompt", "Count the shapes.", "--threads", 1, "--quiet",
                       "--input", folder, "--output", out, "--max-new-tokens", 2)
    assert code == 0 and "warning: 3 row(s) already done were asked another prompt" in err, err
    assert out.read_bytes() == before


def test_a_rerun_made_otherwise_says_the_done_rows_were_made_otherwise(pkg, folder, tmp_path, capsys):
    """Rows resume by id: a rerun with another model, another schema or sampling, or new images
    under the same names kept the old rows without a word (a nightly job writing into one file
    shipped yesterday's answers). The rows still stay; the rerun says how many."""
    import shutil

    images = tmp_path / "images"
    shutil.copytree(folder, images)
    out = tmp_path / "o.jsonl"
    code, _, err = batch(capsys, pkg, "--input", images, "--output", out, "--max-new-tokens", 2)
    assert code == 0, err
    first = out.read_bytes()
    assert len({json.loads(line)["made_with"] for line in first.splitlines()}) == 3     # per image file
    code, _, err = batch(capsys, pkg, "--input", images, "--output", out, "--max-new-tokens", 2)
    assert code == 0 and "made by another" not in err, err            # the same job: nothing to say
    other = tmp_path / "other-pkg"
    shutil.copytree(pkg, other)      # the same package moved: the same model
    code, _, err = batch(capsys, other, "--input", images, "--output", out, "--max-new-tokens", 2)
    assert code == 0 and "made by another" not in err, err
    from edgevl.demo import demo_checkpoint

    again = edgevl.convert(demo_checkpoint(), tmp_path / "again", dtype=json.loads(
        (pkg / "manifest.json").read_text())["dtype"], progress=False)     # converted again: the same files
    code, _, err = batch(capsys, again, "--input", images, "--output", out, "--max-new-tokens", 2)
    assert code == 0 and "made by another" not in err, err
    # a compiled structure from the API is told by its content, not by an address that differs
    # from process to process
    import importlib

    from edgevl import structured

    batch_module = importlib.import_module("edgevl.batch")     # the package exports a function of that name
    compiled = structured.compiled(edgevl.load(pkg), structured.parse({"type": "json_object"}))
    assert " at 0x" in repr(compiled)                    # what would make the fingerprint differ
    told = json.dumps(compiled, default=batch_module._described)
    assert " at 0x" not in told and '"json_object"' in told
    for change in (["--max-new-tokens", 3], ["--temperature", 0.5, "--seed", 1], ["--json"]):
        code, _, err = batch(capsys, pkg, "--input", images, "--output", out, "--max-new-tokens", 2, *change)
        assert "warning: 3 row(s) already done were made by another model, other settings or another version of " \
               "their image file" in err, (change, err)
    make_scene(9001).image.save(images / "s1.png")       # a new picture under an old name
    code, _, err = batch(capsys, pkg, "--input", images, "--output", out, "--max-new-tokens", 2)
    assert "warning: 1 row(s) already done were made by another" in err, err
    assert out.read_bytes() == first


def test_rows_of_another_input_in_the_output_are_said(pkg, folder, tmp_path, capsys):
    """An output file reused for another input keeps that input's rows: said, so a script does
    not ship a mixed file unknowingly."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.png").write_bytes((folder / "s0.png").read_bytes())
    out = tmp_path / "o.jsonl"
    code, _, err = batch(capsys, pkg, "--input", other, "--output", out, "--max-new-tokens", 2)
    assert code == 0 and "not rows of this input" not in err, err
    code, _, err = batch(capsys, pkg, "--input", folder, "--output", out, "--max-new-tokens", 2)
    assert code == 0 and f"warning: 1 row(s) in {out} are not rows of this input" in err, err


def test_a_full_disk_or_a_file_size_limit_says_the_rows_are_kept_and_the_rerun_resumes(pkg, folder, tmp_path):
    """A write that fails mid-job (ENOSPC, a ulimit -f) ended with the error alone, exit 2, which
    the docs keep for usage errors where nothing ran; "File too large" named nothing to do."""
    import resource
    import subprocess
    import sys

    from support.common import ROOT

    def run(out, limit=None):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        limited = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))) if limit else None
        return subprocess.run([sys.executable, "-m", "edgevl", "batch", str(pkg), "--input", str(folder), "--prompt",
                               PROMPT, "--output", str(out), "--threads", "1", "--quiet", "--max-new-tokens", "2",
                               "--parallel", "1"], capture_output=True, text=True, env=env, preexec_fn=limited,
                              timeout=300)
    whole = tmp_path / "whole.jsonl"
    assert run(whole).returncode == 0
    first = len(whole.read_bytes().splitlines(keepends=True)[0])
    out = tmp_path / "o.jsonl"
    p = run(out, limit=first + 8)          # room for one row
    assert p.returncode == 2, p.stderr
    one_line_error(2, p.stderr, "File too large; a file grew past the largest size allowed here (ulimit -f",
                   f"the rows done so far are kept in {out}: rerun the same command to resume")
    assert len(read_jsonl(out)) == 1
    p = run(out)
    assert p.returncode == 0 and "1 already done" in p.stderr, p.stderr
    assert [r["id"] for r in read_jsonl(out)] == [r["id"] for r in read_jsonl(whole)]


def test_a_closed_pipe_mid_job_is_no_full_disk(pkg, folder, tmp_path, capsys, monkeypatch):
    """`edgevl batch ... 2>&1 | head -1`: a broken pipe while rows ran (the progress line) was
    taken for a full disk, and writing that message raised again (a traceback, exit 1)."""
    import importlib

    def run(self):
        raise BrokenPipeError(32, "Broken pipe")
        yield
    monkeypatch.setattr(importlib.import_module("edgevl.batch").BatchJob, "run", run)
    code, _, err = batch(capsys, pkg, "--input", folder, "--output", tmp_path / "o.jsonl")
    assert code == 0 and "error" not in err, err


def test_the_fingerprint_of_a_folder_of_frames_follows_its_files(tmp_path):
    """A video row given as a folder of frames: the folder's own size never changes (4096), so
    frames replaced between runs went unnoticed."""
    from edgevl.batch import made_with

    (tmp_path / "clip").mkdir()
    for i in range(4):
        (tmp_path / "clip" / f"{i}.png").write_bytes(b"x" * 10)
    first = made_with("job", str(tmp_path / "clip"))
    assert made_with("job", str(tmp_path / "clip")) == first
    (tmp_path / "clip" / "3.png").write_bytes(b"x" * 11)
    assert made_with("job", str(tmp_path / "clip")) != first
