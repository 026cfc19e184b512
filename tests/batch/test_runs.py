"""`edgevl batch` on the demo model: folders and tables in, JSONL/Parquet out, bad rows, resume
after a real SIGKILL, local worker processes and a local Ray on the loopback interface."""

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import edgevl
from edgevl import cli
from edgevl.batch import Sink, empty_row
from edgevl.demo.scenes import make_scene
from support.common import ROOT
from support.files import read_jsonl

PROMPT = "Describe the image."
N = 30


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """30 generated scenes in two folders (ids are relative paths, listed recursively)."""
    d = tmp_path_factory.mktemp("scenes")
    paths = {}
    for i in range(N):
        rel = f"{'b' if i % 3 == 0 else 'a'}/scene_{i:02d}.png"
        (d / rel).parent.mkdir(exist_ok=True)
        make_scene(9000 + i).image.save(d / rel)
        paths[rel] = d / rel
    return d, dict(sorted(paths.items()))


@pytest.fixture(scope="module")
def reference(model, scenes):
    """What edgevl.generate answers for each image, id -> answer."""
    return {rel: edgevl.generate(model, PROMPT, image=str(p)) for rel, p in scenes[1].items()}


def run_cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "edgevl", "batch", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def assert_complete(rows, reference):
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate rows"
    assert ids == sorted(reference), "one row per input, in input order"
    for r in rows:
        assert r["error"] is None, r
        assert r["answer"] == reference[r["id"]], r["id"]


def test_folder_of_30_scenes_gives_rows_equal_to_generate(pkg, scenes, reference, tmp_path):
    folder, _ = scenes
    out = tmp_path / "out.jsonl"
    p = run_cli(pkg, "--input", folder, "--prompt", PROMPT, "--output", out, "--threads", 1)
    assert p.returncode == 0, p.stderr
    rows = read_jsonl(out)
    assert_complete(rows, reference)
    r = rows[0]
    assert list(r) == ["id", "image", "video", "prompt", "answer", "reasoning", "json", "boxes", "tokens_in",
                       "tokens_out", "finish_reason", "seconds", "error", "made_with"]
    assert r["image"] == r["id"] and r["prompt"] == PROMPT and r["boxes"] == [] and r["finish_reason"] == "stop"
    assert r["reasoning"] is None  # the demo model does not think
    assert r["tokens_in"] > 16 and r["tokens_out"] >= 2 and r["seconds"] > 0  # 16 image tokens + the text
    assert re.search(r"batch: \d+% \(\d+/30\) [0-9.e+]+ rows/s eta \d+s", p.stderr), p.stderr  # progress
    assert f"batch: 30 of 30 rows in {out}; 30 new in" in p.stderr
    assert not (tmp_path / "out.jsonl.lock").exists()

    again = run_cli(pkg, "--input", folder, "--prompt", PROMPT, "--output", out)  # all done: nothing to run
    assert again.returncode == 0 and "30 already done" in again.stderr
    assert read_jsonl(out) == rows


def test_rows_in_one_process_decode_together_and_answer_as_alone(model, scenes, reference, monkeypatch):
    """--parallel (the default 4): several rows share each decoder forward, over one copy of the
    weights, and every row's answer is the one it gets alone."""
    from edgevl.engine import Engine

    folder, _ = scenes
    widths, real = [], Engine._step

    def step(self, streams):
        widths.append(len(streams))
        return real(self, streams)

    monkeypatch.setattr(Engine, "_step", step)
    rows = list(edgevl.batch(model, folder, PROMPT, parallel=4))
    assert_complete(rows, reference)
    assert max(widths) == 4 and sum(widths) > 2 * len(widths)
    widths.clear()
    assert [r["answer"] for r in edgevl.batch(model, folder, PROMPT, parallel=1)] == [r["answer"] for r in rows]
    assert widths == []      # one row at a time: the model's own loop


def test_a_slow_row_does_not_hold_the_other_slots(model, scenes, monkeypatch):
    """Rows in one process: when a row ends the next one starts, though a row before it is still
    running (real answers differ in length); rows still come out in input order."""
    import importlib
    import threading

    batch_mod = importlib.import_module("edgevl.batch")
    folder, paths = scenes
    first = sorted(str(p) for p in paths.values())[0]
    later = threading.Event()
    started, waited, real = [], [], batch_mod.process_row

    def process_row(model, item, options):
        started.append(str(item["source"]))
        if str(item["source"]) == first:
            # the first row runs until a row two slots further has started
            waited.append(later.wait(30))
        elif len(started) >= 4:
            later.set()
        return real(model, item, options)

    monkeypatch.setattr(batch_mod, "process_row", process_row)
    rows = list(edgevl.batch(model, folder, PROMPT, parallel=2))
    assert waited == [True]
    assert [r["image"] for r in rows] == sorted(r["image"] for r in rows) and all(r["error"] is None for r in rows)


def _wait_lines(path, n, proc, timeout=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.002)
    raise AssertionError(f"{path} did not reach {n} rows")


def _children(pid):
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids


def _workers():
    """This process's live worker processes (multiprocessing's spawned children)."""
    out = []
    for p in _children(os.getpid()):
        with contextlib.suppress(OSError):   # a child may be gone between the listing and this read
            if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(p)
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_sigkill_half_way_then_rerun_gives_exactly_30_rows(pkg, scenes, reference, tmp_path, workers):
    """A real SIGKILL of the job half-way; the rerun skips what is done. With 2 workers the worker
    processes must die with the job, and answers equal generate's as with 1."""
    folder, _ = scenes
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "edgevl", "batch", str(pkg), "--input", str(folder),
                             "--prompt", PROMPT, "--output", str(out), "--workers", str(workers), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        _wait_lines(out, N // 2 - 3, proc)
        os.kill(proc.pid, signal.SIGSTOP)  # freeze it mid-row, then kill it there
        workers_pids = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    # the workers (and multiprocessing's resource tracker) must die with the job
    assert len(workers_pids) >= (workers if workers > 1 else 0)
    t0 = time.monotonic()
    while any(Path(f"/proc/{w}").exists() and "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]
              for w in workers_pids):
        assert time.monotonic() - t0 < 10, "worker processes outlived the killed job"
        time.sleep(0.05)

    first = read_jsonl(out)
    assert N // 2 - 3 <= len(first) < N and len({r["id"] for r in first}) == len(first)

    p = run_cli(pkg, "--input", folder, "--prompt", PROMPT, "--output", out, "--workers", workers,
                "--threads", 1)
    assert p.returncode == 0, p.stderr
    assert f"{len(first)} already done" in p.stderr and f"{N - len(first)} new" in p.stderr
    rows = read_jsonl(out)
    assert len(rows) == N
    assert_complete(rows, reference)
    by_id = {r["id"]: r for r in rows}
    assert all(by_id[f["id"]] == f for f in first)  # kept as they were (seconds too), not redone


def test_torn_last_line_is_cut_and_the_row_redone(pkg, scenes, reference, tmp_path):
    folder, paths = scenes
    out = tmp_path / "out.jsonl"
    gen = edgevl.batch(pkg, folder, PROMPT, output=out, threads=1)
    done = [next(gen) for _ in range(5)]
    gen.close()  # the API stops cleanly: the 5 finished rows stay
    assert [r["id"] for r in read_jsonl(out)] == [r["id"] for r in done]
    torn = b'{"id": "a/scene_99.png", "image": "a/sce'
    with open(out, "ab") as f:  # what a kill during a write would leave
        f.write(torn)
    p = run_cli(pkg, "--input", folder, "--prompt", PROMPT, "--output", out, "--threads", 1)
    assert p.returncode == 0, p.stderr
    assert f"cut a torn last line ({len(torn)} bytes)" in p.stderr and "5 already done" in p.stderr
    assert_complete(read_jsonl(out), reference)


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["id", "image", "prompt"])
        w.writeheader()
        w.writerows(rows)


def test_csv_per_row_prompts_and_bad_rows(pkg, scenes, model, tmp_path):
    folder, paths = scenes
    rels = list(paths)
    seed = lambda rel: 9000 + int(rel[-6:-4])  # noqa: E731 - as the scenes fixture made them
    where_rel, where_q = next((r, q) for r in rels for q, _ in make_scene(seed(r)).qa() if q.startswith("Where"))
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    table = [
        {"id": "count", "image": str(paths[rels[0]]), "prompt": "How many shapes are there?"},
        {"id": "where", "image": str(paths[where_rel]), "prompt": where_q},
        {"id": "default", "image": str(paths[rels[2]]), "prompt": ""},           # falls back to --prompt
        {"id": "corrupt", "image": "corrupt.png", "prompt": "How many shapes are there?"},  # relative path
        {"id": "missing", "image": "nowhere/missing.png", "prompt": ""},
        {"id": "too-long", "image": str(paths[rels[3]]), "prompt": "red " * 3000},
        {"id": "same-image", "image": str(paths[rels[0]]), "prompt": "Describe the image."},
    ]
    src, out = tmp_path / "rows.csv", tmp_path / "out.jsonl"
    _write_csv(src, table)
    p = run_cli(pkg, "--input", src, "--prompt", PROMPT, "--output", out, "--threads", 1)
    assert p.returncode == 1, p.stderr
    assert "3 failed (see their 'error' field" in p.stderr.splitlines()[-1]
    rows = {r["id"]: r for r in read_jsonl(out)}
    assert list(rows) == [t["id"] for t in table]
    assert "Not a readable image file" in rows["corrupt"]["error"] and rows["corrupt"]["answer"] is None
    assert "not found" in rows["missing"]["error"] and "missing.png" in rows["missing"]["error"]
    assert "context length is 2048" in rows["too-long"]["error"]
    for t in table:
        r = rows[t["id"]]
        if r["error"] is None:
            prompt = t["prompt"] or PROMPT
            assert r["prompt"] == prompt
            assert r["answer"] == edgevl.generate(model, prompt, image=t["image"]), t["id"]
    # grounding answers come with structured boxes, the numbers of the <box> tokens
    nums = [int(v) for v in re.findall(r"<[xy]_(\d+)>", rows["where"]["answer"])]
    assert len(nums) == 4 and rows["where"]["boxes"] == [
        {"box": [min(nums[0], nums[2]), min(nums[1], nums[3]), max(nums[0], nums[2]), max(nums[1], nums[3])],
         "label": None}]

    # fix the corrupt image: --retry-errors runs the failed rows again, the others stay
    make_scene(4).image.save(tmp_path / "corrupt.png")
    p = run_cli(pkg, "--input", src, "--prompt", PROMPT, "--output", out, "--retry-errors", "--threads", 1)
    assert p.returncode == 1 and "3 new" in p.stderr and "4 already done" in p.stderr and "2 failed" in p.stderr
    again = {r["id"]: r for r in read_jsonl(out)}
    assert list(again) == list(rows) and again["corrupt"]["error"] is None
    assert again["corrupt"]["answer"] == edgevl.generate(model, "How many shapes are there?",
                                                         image=str(tmp_path / "corrupt.png"))
    p = run_cli(pkg, "--input", src, "--prompt", PROMPT, "--output", out, "--overwrite", "--threads", 1)
    assert "7 new" in p.stderr and len(read_jsonl(out)) == 7


def test_a_log_reader_that_goes_away_does_not_stop_the_job(pkg, scenes, reference, tmp_path):
    """`edgevl batch ... 2>&1 | head -1`: once stderr's reader is gone, the progress lines cannot be
    written; the rows still all get done (the job stopped at its first progress line)."""
    folder, _ = scenes
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "edgevl", "batch", str(pkg), "--input", str(folder), "--prompt", PROMPT,
                          "--output", str(out), "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env=env)
    assert p.stderr.readline().startswith(b"batch: 30 rows")
    p.stderr.close()
    p.wait(timeout=300)
    assert_complete(read_jsonl(out), reference)


def test_a_hand_written_csv_with_spaces_after_the_commas(tmp_path):
    from edgevl.batch import read_input

    src = tmp_path / "rows.csv"
    src.write_text('id , image, prompt\nfirst, a.png, "What is it, then?"\nsecond, b.png,\n')
    rows = read_input(src, prompt="Describe it.")
    assert [(r["id"], r["image"], r["prompt"], r["error"]) for r in rows] == [
        ("first", "a.png", "What is it, then?", None), ("second", "b.png", "Describe it.", None)]


def test_a_folder_follows_linked_subfolders_once_each(tmp_path, monkeypatch):
    """A dataset folder linked into the input folder is read (it used to be skipped without a
    word); a link back up the tree is not followed round; hidden folders stay out."""
    from edgevl.batch import read_input

    root, data = tmp_path / "in", tmp_path / "elsewhere"
    (root / "own").mkdir(parents=True)
    (root / ".cache").mkdir()
    data.mkdir()
    for p in (root / "own" / "a.png", data / "b.jpg", root / ".cache" / "c.png"):
        p.write_bytes(b"not read here")
    (root / "linked").symlink_to(data, target_is_directory=True)
    (root / "own" / "up").symlink_to(root, target_is_directory=True)   # a loop
    rows = read_input(root, prompt="Describe it.")
    assert [r["id"] for r in rows] == ["linked/b.jpg", "own/a.png"]
    # a link to a folder of the tree itself (walked before it, by name or depth) leaves its ids
    # as they were: read at its own path, not twice and not under the link's name
    (root / "archive").symlink_to(root / "own", target_is_directory=True)
    (root / "a").mkdir()
    (root / "a" / "again").symlink_to(root / "own", target_is_directory=True)
    walk = os.walk
    for reverse in (False, True):       # whichever order the file system lists folders in

        def ordered(top, reverse=reverse, **kw):
            for d, dirs, files in walk(top, **kw):
                dirs.sort(reverse=reverse)      # in place: the walk goes on into this list
                yield d, dirs, files
        monkeypatch.setattr(os, "walk", ordered)
        rows = read_input(root, prompt="Describe it.")
        assert [r["id"] for r in rows] == ["linked/b.jpg", "own/a.png"], reverse


def test_jsonl_input_paths_relative_to_the_file(pkg, scenes, model, tmp_path):
    folder, paths = scenes
    src = folder / "rows.jsonl"  # inside the scene folder: paths relative to it
    rels = list(paths)[:3]
    src.write_text("".join(json.dumps({"image": r}) + "\n" for r in rels) + "\n")
    try:
        rows = list(edgevl.batch(model, src, "How many shapes are there?"))
    finally:
        src.unlink()
    assert [r["id"] for r in rows] == rels and [r["image"] for r in rows] == rels
    assert [r["answer"] for r in rows] == [edgevl.generate(model, "How many shapes are there?",
                                                           image=str(paths[r])) for r in rels]


def test_parquet_input_and_output_resume(pkg, scenes, reference, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder, paths = scenes
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.table({"id": list(paths), "image": [str(p) for p in paths.values()],
                             "pixels": [b"\0" * 10] * N}), src)  # other columns are not read
    gen = edgevl.batch(pkg, src, PROMPT, output=out, threads=1)
    first = [next(gen) for _ in range(12)]
    gen.close()
    assert [r["id"] for r in pq.read_table(out).to_pylist()] == [r["id"] for r in first]
    p = run_cli(pkg, "--input", src, "--prompt", PROMPT, "--output", out, "--threads", 1)
    assert p.returncode == 0, p.stderr
    assert "12 already done" in p.stderr and "18 new" in p.stderr
    table = pq.read_table(out)
    assert table.schema.field("boxes").type == pa.list_(pa.struct([("box", pa.list_(pa.int64())),
                                                                   ("label", pa.string())]))
    assert_complete(table.to_pylist(), reference)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["in.parquet", "out.parquet"]  # no journal, no lock
    mtime = out.stat().st_mtime_ns
    assert list(edgevl.batch(pkg, src, PROMPT, output=out)) == []  # all done: nothing run or rewritten
    assert out.stat().st_mtime_ns == mtime and len(list(tmp_path.iterdir())) == 2


def test_parquet_image_bytes_hugging_face_layout_and_a_bytes_column(pkg, scenes, reference, tmp_path):
    """Images stored in the table (Hugging Face datasets' {bytes, path} struct, or a plain bytes
    column) answer as the same files do; they are read a row group at a time as rows run, so a
    worker gets a few small fields per row, never the image."""
    import pickle

    import pyarrow as pa
    import pyarrow.parquet as pq

    from edgevl.batch import read_input

    _, paths = scenes
    ids = list(paths)[:6]
    data = [paths[i].read_bytes() for i in ids]
    hf = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    src = tmp_path / "hf.parquet"
    cells = [{"bytes": d, "path": f"{i}"} for i, d in zip(ids, data)] + [None, {"bytes": b"junk", "path": "j.png"},
                                                                           {"bytes": None, "path": str(paths[ids[1]])}]
    pq.write_table(pa.table({"image": pa.array(cells, type=hf), "prompt": [PROMPT] * len(cells)}), src,
                   row_group_size=3)
    items = read_input(src)
    assert all(len(pickle.dumps(it["source"])) < 400 for it in items)      # not the image
    rows = list(edgevl.batch(pkg, src, output=tmp_path / "hf.jsonl", threads=1))
    assert [r["id"] for r in rows] == [f"row {n}" for n in range(1, 10)]    # stored names may repeat: not ids
    assert [r["image"] for r in rows] == ids + [None, "j.png", str(paths[ids[1]])]
    # a name without bytes is a file, as Hugging Face writes local images
    assert [r["answer"] for r in rows[:6] + rows[8:]] == [reference[i] for i in ids] + [reference[ids[1]]]
    assert rows[6]["error"] == "no image in the 'image' column"
    assert rows[7]["error"].startswith("Not a readable image file: 4 bytes of image data")

    plain = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"id": ids, "pixels": data}), plain, row_group_size=4)
    p = run_cli(pkg, "--input", plain, "--image-column", "pixels", "--prompt", PROMPT, "--output",
                tmp_path / "bytes.jsonl", "--workers", 2, "--threads", 1)
    assert p.returncode == 0, p.stderr
    assert {r["id"]: r["answer"] for r in read_jsonl(tmp_path / "bytes.jsonl")} == {i: reference[i] for i in ids}


def test_image_urls_are_fetched_by_the_rows_worker_within_bounds(model, scenes, reference, tmp_path, monkeypatch):
    """A table of image URLs (a local web server here): each row fetches its image, answers as the
    file does; a 503 is tried again, a 404 is not; a server that stalls or refuses is a row error
    after a few tries, and an answer over the size bound is refused."""
    import http.server
    import threading

    batch_mod = sys.modules["edgevl.batch"]     # edgevl.batch is also the function's name

    _, paths = scenes
    ids = list(paths)[:3]
    seen = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen[self.path] = seen.get(self.path, 0) + 1
            name = self.path.lstrip("/")
            if name == "flaky.png" and seen[self.path] == 1:
                self.send_error(503)
                return
            if name == "slow.png":
                time.sleep(1.5)
            if name == "trickle.png":    # a byte every 0.2 s: never silent for FETCH_TIMEOUT
                self.send_response(200)
                self.end_headers()
                for _ in range(20):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
                return
            path = paths.get(name.split("?")[0])
            path = path or (paths[ids[0]] if name in ("flaky.png", "slow.png") else None)
            if path is None:
                self.send_error(404)
                return
            data = path.read_bytes()
            self.send_response(200)
            if "nolength" not in self.path:     # else the body ends where the connection does
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{web.server_address[1]}"
    monkeypatch.setattr(batch_mod, "FETCH_TIMEOUT", 0.5)
    monkeypatch.setattr(batch_mod, "FETCH_BACKOFF", 0.01)
    try:
        urls = [f"{base}/{i}" for i in ids] + [f"{base}/flaky.png", f"{base}/nope.png", f"{base}/slow.png",
                                                "http://127.0.0.1:1/refused.png"]
        src = tmp_path / "urls.csv"
        src.write_text("image\n" + "\n".join(urls) + "\n")
        rows = {r["id"]: r for r in edgevl.batch(model, src, PROMPT, output=tmp_path / "out.jsonl")}
        for i in ids:
            assert rows[f"{base}/{i}"]["answer"] == reference[i] and rows[f"{base}/{i}"]["image"] == f"{base}/{i}"
        assert rows[f"{base}/flaky.png"]["answer"] == reference[ids[0]] and seen["/flaky.png"] == 2
        assert rows[f"{base}/nope.png"]["error"] == (f"cannot fetch {base}/nope.png: HTTP 404 Not Found; check the "
                                                     "URL, or download the image and give its path")
        assert seen["/nope.png"] == 1                                          # a 404 is not tried again
        assert rows[f"{base}/slow.png"]["error"].startswith(f"cannot fetch {base}/slow.png: timed out (3 tries)")
        assert "(3 tries)" in rows["http://127.0.0.1:1/refused.png"]["error"]
        monkeypatch.setattr(batch_mod, "FETCH_MAX_BYTES", 100)
        with pytest.raises(edgevl.EdgevlError, match=r"bytes, over the 0 MB an image may have here"):
            batch_mod.fetch_image(f"{base}/{ids[0]}")
        with pytest.raises(edgevl.EdgevlError, match=r"is over the 0 MB an image may have here"):
            batch_mod.fetch_image(f"{base}/{ids[0]}?nolength")
        monkeypatch.setattr(batch_mod, "FETCH_DEADLINE", 1.0)
        t0 = time.monotonic()
        with pytest.raises(edgevl.EdgevlError, match=r"trickle.png took over 1 s to download"):
            batch_mod.fetch_image(f"{base}/trickle.png")
        assert time.monotonic() - t0 < 3
    finally:
        web.shutdown()


def _listening_ports_of(pids):
    """(address, port) of every listening TCP socket owned by ``pids`` (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                addr, port = f[1].split(":")
                found.append((addr, int(port, 16)))
    return found


def _is_loopback(hex_addr):
    if len(hex_addr) == 8:
        return hex_addr == "0100007F"                            # 127.0.0.1
    return hex_addr in ("00000000000000000000000001000000",     # ::1
                        "0000000000000000FFFF00000100007F")     # ::ffff:127.0.0.1


def _descendants(pid):
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def test_ray_local_on_loopback_gives_the_same_answers(pkg, scenes, reference, tmp_path):
    import ray

    folder, _ = scenes
    out = tmp_path / "out.parquet"
    # one actor: the two-actor run is the next test's; this one is about the Ray that edgevl starts
    gen = edgevl.batch(pkg, folder, PROMPT, output=out, ray=True, workers=1, threads=1)
    rows = [next(gen)]
    assert ray.is_initialized()
    ports = _listening_ports_of(_descendants(os.getpid()) + [os.getpid()])
    assert len(ports) >= 3 and all(_is_loopback(a) for a, _ in ports), ports  # gcs, raylet, workers
    rows += list(gen)
    assert not ray.is_initialized()  # the Ray it started is shut down
    assert len(rows) == N
    import pyarrow.parquet as pq

    assert_complete(pq.read_table(out).to_pylist(), reference)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.parquet"]  # shards merged and removed


def test_ray_shards_of_a_killed_run_are_merged_once(tmp_path):
    out = tmp_path / "out.jsonl"
    row = lambda i: dict(empty_row({"id": f"r{i}"}), answer=str(i))  # noqa: E731
    out.write_text(json.dumps(row(1)) + "\n")
    shards = tmp_path / "out.jsonl.ray-shards"
    shards.mkdir()
    (shards / "node-1.jsonl").write_text(json.dumps(row(1)) + "\n" + json.dumps(row(2)) + "\n" + '{"id": "r3"')
    (shards / "node-2.jsonl").write_text(json.dumps(row(4)) + "\n")
    sink = Sink(out)
    try:
        assert sink.recovered == 2 and set(sink.rows) == {"r1", "r2", "r4"}
    finally:
        sink.close()
    assert not shards.exists()
    assert [r["id"] for r in read_jsonl(out)] == ["r1", "r2", "r4"]


def _one_line_error(capsys, argv, *needles):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "Traceback" not in "\n".join(err), err
    for n in needles:
        assert n in err[-1], err[-1]


def test_user_errors_are_one_line(pkg, scenes, tmp_path, capsys, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder, paths = scenes
    base = ["batch", str(pkg), "--prompt", PROMPT]
    _one_line_error(capsys, base + ["--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o.jsonl")],
                    "does not exist")
    for out in ("o.txt", "."):   # the output's name: refused before the job's first line
        assert cli.main(base + ["--input", str(folder), "--output", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --output") and (".jsonl or .parquet" in err[0]), err
    _one_line_error(capsys, ["batch", str(pkg), "--input", str(folder), "--output", str(tmp_path / "o.jsonl")],
                    "--prompt is required")
    _one_line_error(capsys, base + ["--input", str(folder), "--output", str(tmp_path / "o.jsonl"), "--workers", "0"],
                    "workers must be >= 1")
    src = tmp_path / "dup.csv"
    _write_csv(src, [{"id": "", "image": "a.png", "prompt": "x"}, {"id": "", "image": "a.png", "prompt": "y"}])
    _one_line_error(capsys, base + ["--input", str(src), "--output", str(tmp_path / "o.jsonl")],
                    "appears twice", "add an 'id' column")
    same = tmp_path / "same.jsonl"   # an id is its text: 1 and "1" are one id, and the table has the column
    same.write_text('{"id": 1, "image": "a.png"}\n{"id": "1", "image": "b.png"}\n')
    _one_line_error(capsys, base + ["--input", str(same), "--output", str(tmp_path / "o.jsonl")],
                    "appears twice", "make the 'id' values unique")
    _one_line_error(capsys, base + ["--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                                    "--image-column", "path"], "no 'path' column")
    # a column asked for by name that the table lacks (a typo) is refused, not read as empty
    _one_line_error(capsys, base + ["--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                                    "--prompt-column", "questoin"], "no 'questoin' column (--prompt-column",
                    "columns: id, image, prompt")
    _one_line_error(capsys, base + ["--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                                    "--id-column", "key"], "no 'key' column (--id-column")
    # a schema the grammar engine cannot use fails before any row runs
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "nonsense"}')
    _one_line_error(capsys, base + ["--input", str(folder), "--output", str(tmp_path / "o.jsonl"),
                                    "--json-schema", str(schema)], "cannot be used", "nonsense")
    assert not (tmp_path / "o.jsonl").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"image": "a.png"}\n[1, 2]\n')
    _one_line_error(capsys, base + ["--input", str(bad), "--output", str(tmp_path / "o.jsonl")], "line 2")
    _one_line_error(capsys, ["batch", "--input", str(folder), "--ray", str(pkg), "--prompt", PROMPT,
                             "--output", str(tmp_path / "o.jsonl")], "put MODEL before --ray")
    not_ours = tmp_path / "notes.jsonl"
    not_ours.write_text("hello\n")
    _one_line_error(capsys, base + ["--input", str(folder), "--output", str(not_ours)], "not an edgevl batch output")

    held = Sink(tmp_path / "busy.jsonl")  # another job holds this output
    try:
        _one_line_error(capsys, base + ["--input", str(folder), "--output", str(tmp_path / "busy.jsonl")],
                        "another edgevl batch job")
    finally:
        held.close()

    # without the optional extras: one line that says what to install
    monkeypatch.setitem(sys.modules, "ray", None)
    _one_line_error(capsys, base + ["--input", str(folder), "--output", str(tmp_path / "o.jsonl"), "--ray"],
                    "pip install 'edgevl[ray]'")
    table = tmp_path / "t.parquet"     # the missing image column's message lists the whole table's columns
    pq.write_table(pa.table({"img": ["a.png"], "question": ["q"]}), table)
    _one_line_error(capsys, base + ["--input", str(table), "--output", str(tmp_path / "o.jsonl")],
                    "no 'image' column", "columns: img, question")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    _one_line_error(capsys, base + ["--input", str(folder), "--output", str(tmp_path / "o.parquet")],
                    "pip install 'edgevl[parquet]'")


def test_default_threads_keep_threads_times_workers_within_the_cores(pkg, scenes, monkeypatch):
    from edgevl.batch import BatchJob, _physical_cores

    monkeypatch.delenv("EDGEVL_THREADS", raising=False)
    cores = _physical_cores()
    for workers in (1, 2, cores, cores + 1):
        job = BatchJob(pkg, scenes[0], PROMPT, workers=workers)
        assert job.threads == max(1, cores // workers)
        assert job.oversubscribed() == (workers > cores)  # the CLI then prints a warning
    assert BatchJob(pkg, scenes[0], PROMPT, workers=1, threads=cores + 1).oversubscribed()
    monkeypatch.setenv("EDGEVL_THREADS", "3")
    assert BatchJob(pkg, scenes[0], PROMPT, workers=2).threads == 3  # the user's own setting wins


def test_a_crashed_worker_fails_only_its_row(pkg, scenes, reference, tmp_path):
    folder, _ = scenes
    out = tmp_path / "out.jsonl"
    gen = edgevl.batch(pkg, folder, PROMPT, output=out, workers=2, threads=1)
    rows = [next(gen)]
    spawned = _workers()
    assert len(spawned) == 2
    os.kill(spawned[0], signal.SIGKILL)
    rows += list(gen)  # the job goes on with a replacement worker
    assert len(rows) == N and len({r["id"] for r in rows}) == N
    died = [r for r in rows if r["error"]]
    assert len(died) <= 1 and all("worker process died on this row (killed by signal 9)" in r["error"] for r in died)
    assert all(r["answer"] == reference[r["id"]] for r in rows if not r["error"])
    list(edgevl.batch(pkg, folder, PROMPT, output=out, workers=2, threads=1, retry_errors=True))
    assert_complete(read_jsonl(out), reference)


def _killed(pid):
    os.kill(pid, signal.SIGKILL)
    for _ in range(500):  # until it is a zombie: its end of the pipe is closed
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                return
        time.sleep(0.01)


def test_workers_that_died_between_rows_are_replaced(pkg, scenes, reference, tmp_path):
    """Both workers die while the job is between two rows: the next row handed to either must not
    raise a broken pipe; their rows in flight fail alone and the job goes on with new workers."""
    folder, _ = scenes
    gen = edgevl.batch(pkg, folder, PROMPT, output=tmp_path / "out.jsonl", workers=2, threads=1)
    rows = [next(gen)]
    spawned = _workers()
    assert len(spawned) == 2
    for pid in spawned:
        _killed(pid)
    rows += list(gen)
    assert len(rows) == N and len({r["id"] for r in rows}) == N
    died = [r for r in rows if r["error"]]  # none if both had answered all they were sent
    assert len(died) <= 2 and all("worker process died on this row (killed by signal 9)" in r["error"]
                                  for r in died)
    assert all(r["answer"] == reference[r["id"]] for r in rows if not r["error"])


def test_workers_killed_while_loading_are_replaced_once_the_model_has_loaded(pkg, scenes, reference, tmp_path):
    """After a row shows the model loads, both workers die and so do both their replacements while
    loading (no worker is ready then): a one-off kill, so the job starts them again and finishes."""
    import threading

    folder, _ = scenes
    gen = edgevl.batch(pkg, folder, PROMPT, output=tmp_path / "out.jsonl", workers=2, threads=1)
    rows = [next(gen)]

    first = set(_workers())
    assert len(first) == 2
    killed, stop = [], threading.Event()

    def kill_replacements():  # each new worker as it appears, still loading, until two are gone
        while len(killed) < 2 and not stop.is_set():
            for pid in sorted(set(_workers()) - first - set(killed))[:2 - len(killed)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(pid)
            time.sleep(0.005)

    for pid in first:
        _killed(pid)
    watcher = threading.Thread(target=kill_replacements, daemon=True)
    watcher.start()
    try:
        rows += list(gen)
    finally:
        stop.set()
        watcher.join()
    assert len(killed) == 2
    assert len(rows) == N and len({r["id"] for r in rows}) == N
    died = [r for r in rows if r["error"]]  # none if both had answered all they were sent
    assert len(died) <= 2 and all("worker process died on this row (killed by signal 9)" in r["error"]
                                  for r in died)
    assert all(r["answer"] == reference[r["id"]] for r in rows if not r["error"])


def test_ray_address_of_a_running_cluster(pkg, scenes, reference, tmp_path):
    """`--ray ADDRESS` joins a Ray the test started itself (loopback only) and leaves it running."""
    folder, _ = scenes
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # Ray's own switch for a loopback-only node
               RAY_AUTH_MODE="token")  # the head's token (~/.ray/auth_token) lets the driver in
    head = subprocess.Popen(
        [sys.executable, "-c", "import ray, sys; ray.init(address='local', num_cpus=2, include_dashboard=False, "
         "_node_ip_address='127.0.0.1', logging_level='ERROR'); "
         "print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        address = head.stdout.readline().strip()
        assert address.startswith("127.0.0.1:"), address
        out = tmp_path / "out.jsonl"
        p = subprocess.run([sys.executable, "-m", "edgevl", "batch", str(pkg), "--input", str(folder), "--prompt",
                            PROMPT, "--output", str(out), "--ray", address, "--workers", "2", "--threads", "1"],
                           capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr
        assert f"2 actor(s) x 1 thread(s), Ray ({address})" in p.stderr
        assert_complete(read_jsonl(out), reference)
        assert head.poll() is None  # a cluster it did not start is left alone
    finally:
        head.stdin.close()
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


def test_videos_in_a_folder_input_are_named_not_dropped_silently(pkg, tmp_path, capsys):
    """A folder gives image rows: its video files are skipped with a line saying where videos go;
    a folder of videos only, or one video as --input, is refused with that hint."""
    from support.cli import cli as run
    from support.cli import one_line_error

    folder, only = tmp_path / "mixed", tmp_path / "clips"
    folder.mkdir()
    only.mkdir()
    make_scene(3).image.save(folder / "a.png")
    for f in (folder / "clip.mp4", only / "clip.mov"):
        f.write_bytes(b"\x00" * 64)
    base = ("--prompt", PROMPT, "--threads", "1", "--quiet", "--max-new-tokens", "2")
    code, _, err = run(capsys, "batch", pkg, "--input", folder, "--output", tmp_path / "o.jsonl", *base)
    assert code == 0 and "skipped 1 video file(s)" in err and "video column" in err, err
    one_line_error(*run(capsys, "batch", pkg, "--input", only, "--output", tmp_path / "p.jsonl", *base)[::2],
                   "its 1 video file(s) go in a table's video column")
    one_line_error(*run(capsys, "batch", pkg, "--input", only / "clip.mov", "--output", tmp_path / "q.jsonl",
                        *base)[::2], "is one video; use `edgevl run --video`")


def test_a_misspelt_option_fails_once_before_any_row(pkg, tmp_path):
    """`edgevl.batch(..., max_tokens=5)` (OpenAI's name): one error naming the right option, not a
    TypeError written into every row of the job."""
    from edgevl.errors import EdgevlError

    folder = tmp_path / "imgs"
    folder.mkdir()
    make_scene(3).image.save(folder / "a.png")
    out = tmp_path / "o.jsonl"
    with pytest.raises(EdgevlError, match="batch has no option 'max_tokens'; did you mean max_new_tokens"):
        list(edgevl.batch(pkg, folder, PROMPT, out, max_tokens=5))
    assert not out.exists()
    rows = list(edgevl.batch(pkg, folder, PROMPT, max_new_tokens=2, threads=1))   # the right name runs
    assert rows[0]["error"] is None and rows[0]["tokens_out"] <= 2


def test_csv_as_excel_saves_it(tmp_path):
    """Excel in many locales saves semicolons (and a BOM); a cp1252 file gets the fix in one line."""
    from edgevl.batch import read_input
    from edgevl.errors import EdgevlError

    src = tmp_path / "rows.csv"
    src.write_bytes("\ufeffid;image;prompt\nfirst;a.png;What is it, then?\n".encode())
    rows = read_input(src, prompt="Describe it.")
    assert [(r["id"], r["image"], r["prompt"]) for r in rows] == [("first", "a.png", "What is it, then?")]
    src.write_bytes("id,image,prompt\nfirst,a.png,Caf\u00e9 ou th\u00e9?\n".encode("cp1252"))
    with pytest.raises(EdgevlError, match='save it as "CSV UTF-8"'):
        read_input(src)


def test_table_values_that_are_not_text_are_not_asked_as_their_python_spelling(tmp_path):
    from edgevl.batch import read_input
    from edgevl.errors import EdgevlError

    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"id": "a", "image": "a.png", "prompt": ["What", "is it?"]}) + "\n")
    (row,) = read_input(src, prompt="Describe it.")
    assert row["error"] == "the 'prompt' value is a list, not text; give the prompt as text", row
    src.write_text(json.dumps({"id": {"n": 1}, "image": "a.png"}) + "\n")
    with pytest.raises(EdgevlError, match="its 'id' is a dict, not text or a number"):
        read_input(src, prompt="Describe it.")


def test_images_for_a_model_without_a_vision_tower_are_refused_up_front(scenes, tmp_path):
    """As videos for a model without video: one line before anything runs, not every row failing
    with a --retry-errors hint that can never help."""
    from edgevl.errors import EdgevlError
    from support.youtu import tiny_checkpoint

    pkg = edgevl.convert(tiny_checkpoint(tmp_path / "ck"), tmp_path / "pk", dtype="fp32", progress=False)
    folder, _ = scenes
    with pytest.raises(EdgevlError, match="this model has no vision tower; it cannot take images"):
        list(edgevl.batch(pkg, folder, PROMPT, output=tmp_path / "out.jsonl"))
    assert not (tmp_path / "out.jsonl").exists()
