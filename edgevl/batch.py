"""Batch jobs: a prompt (or one prompt per row) over many images, resumable, on one machine or Ray.

    edgevl batch [MODEL] --input photos/ --prompt "Describe the image." --output captions.jsonl

Input: a folder of images (recursive, sorted; ids are the relative paths) or a JSONL / CSV /
Parquet file with an image column (a path, relative to the file's folder) and optionally a prompt
and an id column. Output (by extension): JSONL or Parquet, one row per input with the fields of
``FIELDS``; ``error`` is null when the row went well.

Resume: the output is the job's state. Every finished row is appended with one write and an
fsync (Parquet: to a JSONL journal beside it, turned into the Parquet file when the job ends), and
rows whose id is already there are skipped on the next run; a torn last line (a kill during a
write) is cut off before appending. A SIGKILL therefore loses only the rows in flight.

Engines: in this process (``workers=1``), ``workers`` local processes that each load the package
once, or a Ray Data actor pool (``ray=True`` or an address) whose actors load the package once,
read the images themselves and append their rows to per-actor shard files that the driver merges.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Iterable, Iterator

from .errors import EdgevlError

FIELDS = ("id", "image", "prompt", "answer", "boxes", "tokens_in", "tokens_out", "finish_reason", "seconds",
          "error")
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
TABLE_EXTS = (".jsonl", ".ndjson", ".csv", ".parquet")
OUTPUT_EXTS = (".jsonl", ".parquet")
INSTALL_PARQUET = "Parquet needs pyarrow: pip install 'edgevl[parquet]'"
INSTALL_RAY = "--ray needs Ray Data: pip install 'edgevl[ray]'"


# ---------------------------------------------------------------------------------------------
# One row: the only place that calls the model


def extract_boxes(answer: str, event=None) -> list[dict]:
    """Structured boxes of an answer, ``[{"box": [x1, y1, x2, y2], "label": str | None}]`` in
    original-image pixels.

    The one place that knows where boxes come from: the generation's own (Box tuples on the last
    event, where generation provides them), else the ``<box>`` tokens of the text."""
    boxes = getattr(event, "boxes", None)
    if boxes is not None:
        return [{"box": [int(v) for v in b.xyxy], "label": b.label} for b in boxes]
    from .boxes import parse_boxes

    return [{"box": [int(v) for v in b["box"]], "label": b["label"]} for b in parse_boxes(answer)]


def empty_row(item: dict) -> dict:
    row = dict.fromkeys(FIELDS)
    row.update(id=item["id"], image=item.get("image"), prompt=item.get("prompt"), error=item.get("error"))
    return row


def process_row(model, item: dict, options: dict) -> dict:
    """Answer one input row; any failure becomes the row's ``error`` instead of stopping the job."""
    from .generate import stream_events

    row = empty_row(item)
    t0 = time.perf_counter()
    if row["error"] is None:
        try:
            text, last = [], None
            # reuse_cache=False: an answer must not depend on which row the worker ran before
            for ev in stream_events(model, item["prompt"], image=item["source"], reuse_cache=False, **options):
                text.append(ev.text)
                last = ev
            answer = "".join(text)
            row.update(answer=answer, boxes=extract_boxes(answer, last), tokens_in=last.prompt_tokens,
                       tokens_out=last.generation_tokens, finish_reason=last.finish_reason)
        except EdgevlError as e:
            row["error"] = str(e)
        except Exception as e:  # noqa: BLE001 - one bad row must not stop the others
            row["error"] = f"{type(e).__name__}: {e}"
    row["seconds"] = round(time.perf_counter() - t0, 4)
    return row


# ---------------------------------------------------------------------------------------------
# Input: a folder, a table file, or (API) an iterable of paths / PIL images / dicts


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise EdgevlError(INSTALL_PARQUET) from None
    return pa, pq


def read_input(src, prompt: str | None = None, image_column: str = "image", prompt_column: str = "prompt",
               id_column: str = "id") -> list[dict]:
    """The job's rows: ``{"id", "image" (as given), "source" (path or PIL image), "prompt", "error"}``."""
    if isinstance(src, (str, os.PathLike)):
        path = Path(src).expanduser()
        if not path.exists():
            raise EdgevlError(f"--input {src} does not exist; pass a folder of images or a "
                              f".jsonl/.csv/.parquet file")
        if path.is_dir():
            return _folder_rows(path, prompt)
        ext = path.suffix.lower()
        if ext in IMAGE_EXTS:
            raise EdgevlError(f"--input {src} is one image; use `edgevl run` for one image, or pass its folder")
        if ext not in TABLE_EXTS:
            raise EdgevlError(f"--input {src}: unknown kind of file; use a folder of images or a "
                              f"{', '.join(TABLE_EXTS)} file")
        records = {".csv": _csv_records, ".parquet": _parquet_records}.get(ext, _jsonl_records)(
            path, (image_column, prompt_column, id_column))
        where = "row" if ext in (".csv", ".parquet") else "line"
        return _table_rows(records, path.parent, str(src), where, prompt, image_column, prompt_column, id_column)
    from PIL import Image

    records = []
    for r in src:
        if isinstance(r, dict):
            records.append((len(records) + 1, r))
        elif isinstance(r, (str, os.PathLike, Image.Image)):
            records.append((len(records) + 1, {image_column: r}))
        else:
            raise EdgevlError(f"batch rows must be image paths, PIL images or dicts with an {image_column!r} "
                              f"key, got {type(r).__name__}")
    return _table_rows(records, None, "the rows", "row", prompt, image_column, prompt_column, id_column)


def _folder_rows(root: Path, prompt: str | None) -> list[dict]:
    if not prompt:
        raise EdgevlError("--prompt is required for a folder of images")
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        for f in files:
            if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTS:
                p = Path(d) / f
                found.append((p.relative_to(root).as_posix(), p))
    if not found:
        raise EdgevlError(f"no images ({', '.join(IMAGE_EXTS)}) found under {root}")
    found.sort()
    return [{"id": rel, "image": rel, "source": str(p), "prompt": prompt, "error": None} for rel, p in found]


def _jsonl_records(path: Path, _cols) -> list:
    out = []
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError as e:
                raise EdgevlError(f"{path} line {n} is not JSON ({e}); each line must be an object like "
                                  '{"image": "a.jpg"}') from None
            if not isinstance(r, dict):
                raise EdgevlError(f"{path} line {n} is not a JSON object; each line must be like "
                                  '{"image": "a.jpg"}')
            out.append((n, r))
    return out


def _csv_records(path: Path, _cols) -> list:
    with open(path, newline="", encoding="utf-8-sig") as f:
        try:
            return list(enumerate(csv.DictReader(f), 1))
        except (csv.Error, UnicodeDecodeError) as e:
            raise EdgevlError(f"{path} is not a readable UTF-8 CSV file ({e})") from None


def _parquet_records(path: Path, cols) -> list:
    _, pq = _pyarrow()
    try:
        names = pq.read_schema(path).names
        table = pq.read_table(path, columns=[c for c in cols if c in names])  # not a big image-bytes column
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise EdgevlError(f"{path} is not a readable Parquet file ({e})") from None
    return list(enumerate(table.to_pylist(), 1))


def _table_rows(records, base: Path | None, name: str, where: str, prompt, image_column, prompt_column,
                id_column) -> list[dict]:
    if not records:
        raise EdgevlError(f"{name} has no rows")
    if not any(image_column in r for _, r in records):
        cols = sorted({k for _, r in records for k in r})
        raise EdgevlError(f"{name} has no {image_column!r} column (columns: {', '.join(map(str, cols))}); "
                          "name it so or pass --image-column")
    if not prompt and not any(prompt_column in r for _, r in records):
        raise EdgevlError(f"--prompt is required: {name} has no {prompt_column!r} column")
    from PIL import Image

    rows, seen = [], {}
    for n, r in records:
        img, err, shown, source = r.get(image_column), None, None, None
        if isinstance(img, Image.Image):
            source = img
        elif isinstance(img, (str, os.PathLike)) and str(img).strip():
            shown = str(img).strip()
            if shown.startswith(("http://", "https://")):
                err = "remote image URLs are not fetched; download the images and give local paths"
            else:
                p = Path(shown).expanduser()
                source = str(p if p.is_absolute() or base is None else base / p)
        elif img is None or isinstance(img, str):  # missing or blank
            err = f"no image in the {image_column!r} column"
        else:
            err = f"the {image_column!r} value is a {type(img).__name__}, not an image path"
        rid = r.get(id_column)
        rid = str(rid) if rid is not None and str(rid) != "" else shown if shown else f"{where} {n}"
        p = r.get(prompt_column)
        p = str(p) if p is not None and str(p).strip() else prompt
        if p is None and err is None:
            err = f"no prompt: fill the {prompt_column!r} column or give --prompt"
        if rid in seen:
            raise EdgevlError(f"id {rid!r} appears twice in {name} ({where}s {seen[rid]} and {n}); ids must be "
                              f"unique — add an {id_column!r} column")
        seen[rid] = n
        rows.append({"id": rid, "image": shown, "source": source, "prompt": p, "error": err})
    return rows


# ---------------------------------------------------------------------------------------------
# Output: the job's state (what is done), written so that a kill never leaves a torn row


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _append(fd: int, data: bytes) -> None:
    """Append and fsync; on failure (disk full) cut the partial line so no torn row stays behind."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise


def _line(row: dict) -> bytes:
    return (json.dumps(row, ensure_ascii=False, separators=(", ", ": ")) + "\n").encode()


def _read_rows_jsonl(path: Path, strict: bool) -> tuple[list[dict], int]:
    """(complete rows, bytes of complete lines). A torn last line is left out; with ``strict`` any
    other bad line is an error (not our file), else it is skipped (a shard cut by a kill)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    end = data.rfind(b"\n") + 1
    rows = []
    for n, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            ok = isinstance(r, dict) and "id" in r
        except ValueError:
            ok = False
        if ok:
            r["id"] = str(r["id"])
            rows.append(r)
        elif strict:
            raise EdgevlError(f"{path} line {n} is not a batch result row; choose another --output, or "
                              "pass --overwrite to replace the file")
    return rows, end


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(path.parent)


def _row_schema(pa):
    box = pa.struct([("box", pa.list_(pa.int64())), ("label", pa.string())])
    return pa.schema([("id", pa.string()), ("image", pa.string()), ("prompt", pa.string()),
                      ("answer", pa.string()), ("boxes", pa.list_(box)), ("tokens_in", pa.int64()),
                      ("tokens_out", pa.int64()), ("finish_reason", pa.string()), ("seconds", pa.float64()),
                      ("error", pa.string())])


class Sink:
    """The output file as the job's state: ``rows`` (id -> row) is what is done.

    JSONL: the output itself is an append-only journal. Parquet: rows go to ``OUT.partial.jsonl``
    and ``finish`` writes the Parquet file (by rename) and removes the journal. A lock file keeps
    two jobs from writing one output; Ray actors leave shards in ``OUT.ray-shards/``, merged here.
    """

    def __init__(self, path, overwrite: bool = False, retry_errors: bool = False):
        self.path = Path(path).expanduser()
        ext = self.path.suffix.lower()
        if ext not in OUTPUT_EXTS:
            raise EdgevlError(f"--output {path}: the name must end in .jsonl or .parquet (that picks the format)")
        self.parquet = ext == ".parquet"
        if self.parquet:
            _pyarrow()
        if self.path.is_dir():
            raise EdgevlError(f"--output {path} is a folder; give a .jsonl or .parquet file name")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.journal = self.path.with_name(self.path.name + ".partial.jsonl") if self.parquet else self.path
        self.shard_dir = self.path.with_name(self.path.name + ".ray-shards")
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        import fcntl  # POSIX; imported here so that `import edgevl` works everywhere

        self._lock = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise EdgevlError(f"{path} is being written by another edgevl batch job; wait for it or choose "
                              "another --output") from None
        self.fd = None
        try:
            self._open(overwrite, retry_errors)
        except BaseException:
            self.close()
            raise

    def _open(self, overwrite, retry_errors):
        if overwrite:
            for p in (self.path, self.journal):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            shutil.rmtree(self.shard_dir, ignore_errors=True)
        self.rows: dict[str, dict] = {}
        if self.parquet and self.path.exists():
            self.rows.update((r["id"], r) for r in read_parquet_rows(self.path))
        self._dirty = self.journal.exists()  # Parquet: rows not yet in the Parquet file
        journal_rows, end = _read_rows_jsonl(self.journal, strict=True)
        self.torn_bytes = (self.journal.stat().st_size - end) if self.journal.exists() else 0
        self._file_order = [r["id"] for r in journal_rows]
        for r in journal_rows:
            self.rows[r["id"]] = r
        self.fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self.torn_bytes:
            os.ftruncate(self.fd, end)  # a kill during a write: drop the partial line
            os.fsync(self.fd)
        self.recovered = self.merge_shards()
        if retry_errors:
            bad = [k for k, r in self.rows.items() if r.get("error")]
            for k in bad:
                del self.rows[k]
            self._dirty |= bool(bad)
            if bad and not self.parquet:
                self._rewrite(list(self.rows))

    def write(self, row: dict) -> bool:
        """Append one finished row durably; False if its id is already done."""
        return self.write_many([row]) == 1

    def write_many(self, rows: Iterable[dict]) -> int:
        new = []
        for r in rows:
            if r["id"] not in self.rows:
                self.rows[r["id"]] = r
                new.append(r)
        if new:
            _append(self.fd, b"".join(_line(r) for r in new))
            self._file_order += [r["id"] for r in new]
            self._dirty = True
        return len(new)

    def merge_shards(self) -> int:
        """Rows that Ray actors finished (possibly in a killed run) but that are not here yet."""
        if not self.shard_dir.is_dir():
            return 0
        rows = []
        for f in sorted(self.shard_dir.glob("*.jsonl")):
            rows += _read_rows_jsonl(f, strict=False)[0]
        n = self.write_many(rows)
        shutil.rmtree(self.shard_dir, ignore_errors=True)
        return n

    def _ordered(self, order: list[str]) -> list[str]:
        ids = [k for k in order if k in self.rows]
        seen = set(ids)
        return ids + [k for k in self.rows if k not in seen]

    def _rewrite(self, ids: list[str]) -> None:
        _write_atomic(self.journal, lambda f: f.writelines(_line(self.rows[k]) for k in ids))
        os.close(self.fd)
        self.fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND)
        self._file_order = list(ids)

    def finish(self, order: list[str]) -> None:
        """Input order for the final file: JSONL rewritten by rename when needed, Parquet written."""
        ids = self._ordered(order)
        if self.parquet:
            if self._dirty or not self.path.exists():
                pa, pq = _pyarrow()
                table = pa.Table.from_pylist([self.rows[k] for k in ids], schema=_row_schema(pa))
                _write_atomic(self.path, lambda f: pq.write_table(table, f))
            with contextlib.suppress(FileNotFoundError):
                self.journal.unlink()
            _fsync_dir(self.path.parent)
        elif ids != self._file_order:
            self._rewrite(ids)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._lock is not None:
            with contextlib.suppress(OSError):
                self._lock_path.unlink()
            os.close(self._lock)  # closing releases the flock
            self._lock = None


class MemorySink:
    """No output file (API): nothing is skipped or kept; Ray shards go to a temporary folder."""

    def __init__(self):
        self.rows, self.torn_bytes, self.recovered = {}, 0, 0
        self.shard_dir = Path(tempfile.mkdtemp(prefix="edgevl-batch-")) / "shards"

    def write(self, row):
        if row["id"] in self.rows:
            return False
        self.rows[row["id"]] = row
        return True

    def merge_shards(self):
        return 0

    def finish(self, order):
        pass

    def close(self):
        shutil.rmtree(self.shard_dir.parent, ignore_errors=True)


def read_parquet_rows(path) -> list[dict]:
    _, pq = _pyarrow()
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001
        raise EdgevlError(f"{path} is not a readable Parquet file ({e}); pass --overwrite to replace it") from None
    if rows and "id" not in rows[0]:
        raise EdgevlError(f"{path} has no 'id' column, so it is not a batch output; choose another --output "
                          "or pass --overwrite")
    for r in rows:
        r["id"] = str(r["id"])
    return rows


# ---------------------------------------------------------------------------------------------
# Engines: each yields one result row per item


def _physical_cores() -> int:
    import ncnn

    try:
        n = int(ncnn.get_physical_cpu_count())
    except Exception:  # noqa: BLE001 - very old wheels
        n = 0
    return max(1, n or os.cpu_count() or 1)


def _run_inline(settings: dict, model, todo: list[dict]) -> Iterator[dict]:
    if model is None:
        from .model import load

        model = load(settings["model"], threads=settings["threads"], low_memory=settings["low_memory"],
                     options=settings.get("model_options"))
    for item in todo:
        yield process_row(model, item, settings["options"])


def _die_with_parent(parent_pid: int) -> None:
    """A worker must not outlive a killed job (it would keep cores and a model's memory)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _pool_worker(conn, settings: dict, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        from .model import load

        model = load(settings["model"], threads=settings["threads"], low_memory=settings["low_memory"],
                     options=settings.get("model_options"))
    except Exception as e:  # noqa: BLE001 - reported by the parent as one line
        conn.send(("fatal", str(e) if isinstance(e, EdgevlError) else f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            item = conn.recv()
            if item is None:
                return
            conn.send(("row", process_row(model, item, settings["options"])))
        except (EOFError, OSError):  # the parent is gone
            return


def _exit_text(code) -> str:
    if code is None:
        return "unknown exit status"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _run_pool(settings: dict, todo: list[dict], workers: int) -> Iterator[dict]:
    """Local worker processes, each loading the package once; a crashed worker fails only its row."""
    ctx = mp.get_context("spawn")  # never fork a process that has ncnn/OpenMP threads
    # Two rows in flight per worker, so a worker never waits for this process to hand it the next
    # one (it may be slow to get a core on a busy machine). Not with PIL images: a big pickled image
    # and a big answer could fill both directions of the pipe at once.
    depth = 2 if all(isinstance(it["source"], (str, type(None))) for it in todo) else 1

    def start():
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_pool_worker, args=(child, settings, os.getpid()), daemon=True,
                        name="edgevl-batch-worker")
        p.start()
        child.close()  # so the parent sees EOF when the worker dies
        return {"proc": p, "conn": parent, "items": deque(), "ready": False}

    queue = deque(todo)
    slots = [start() for _ in range(min(workers, len(todo)))]
    try:
        while queue or any(s["items"] for s in slots):
            for s in slots:
                while s["ready"] and len(s["items"]) < depth and queue:
                    s["items"].append(queue.popleft())
                    s["conn"].send(s["items"][-1])
            by_conn = {id(s["conn"]): s for s in slots}
            for conn in mp_wait([s["conn"] for s in slots]):
                s = by_conn[id(conn)]
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    s["proc"].join(5)
                    why = _exit_text(s["proc"].exitcode)
                    if not s["ready"]:
                        # Killed while loading: start it again if the model loads elsewhere (a
                        # one-off kill), fail the job if loading itself keeps failing.
                        s["load_deaths"] = s.get("load_deaths", 0) + 1
                        if s["load_deaths"] > 2 or not any(o["ready"] for o in slots if o is not s):
                            raise EdgevlError(f"a batch worker process died while loading the model ({why})") from None
                        conn.close()
                        s.update(start())
                        continue
                    if s["items"]:
                        row = empty_row(s["items"].popleft())
                        row["error"] = f"the worker process died on this row ({why})"
                        queue.extendleft(reversed(s["items"]))  # sent but not started: run elsewhere
                        yield row
                    conn.close()
                    s.update(start())
                    continue
                if kind == "fatal":
                    raise EdgevlError(payload)
                if kind == "ready":
                    s["ready"] = True
                else:
                    s["items"].popleft()
                    yield payload
    finally:
        for s in slots:
            with contextlib.suppress(OSError):
                s["conn"].send(None)
        deadline = time.monotonic() + 3
        for s in slots:
            s["proc"].join(max(0.0, deadline - time.monotonic()))
            if s["proc"].is_alive():  # busy on a row while the job was interrupted
                s["proc"].kill()
                s["proc"].join(1)
            s["conn"].close()


class RayWorker:
    """A Ray Data actor: loads the package once, answers blocks of rows, reads their images itself
    and appends each row (with fsync) to its own shard file, so a killed job keeps finished rows."""

    settings: dict = {}

    def __init__(self):
        from .model import load

        s = self.settings
        self.model = load(s["model"], threads=s["threads"], low_memory=s["low_memory"], options=s.get("model_options"))
        self.shard = None
        self.shard_failed = False

    def _keep(self, lines: bytes) -> None:
        if self.shard_failed:
            return
        try:
            if self.shard is None:
                d = Path(self.settings["shard_dir"])
                d.mkdir(parents=True, exist_ok=True)
                name = f"{os.uname().nodename}-{os.getpid()}-{os.urandom(4).hex()}.jsonl"
                self.shard = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            _append(self.shard, lines)
        except OSError:  # no shared folder here: the driver still gets and writes the rows
            self.shard_failed = True

    def __call__(self, batch):
        import pyarrow as pa

        out = []
        for item in batch.to_pylist():
            line = _line(process_row(self.model, item, self.settings["options"]))
            self._keep(line)
            out.append(line.decode())
        return pa.table({"row": pa.array(out, pa.string())})


@contextlib.contextmanager
def _loopback_only():
    """A Ray that edgevl starts itself serves this machine only: its servers bind to 127.0.0.1.

    Ray on Linux swaps 127.0.0.1 for the machine's address unless clusters are switched off, the
    setting it uses on laptops (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0). Switched off only while the
    local Ray starts, so that the same process can still join a real cluster later."""
    try:
        from ray._private import ray_constants as consts
    except ImportError:  # another Ray layout: the environment variable alone
        consts = None
    old_env = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    old_const = getattr(consts, "ENABLE_RAY_CLUSTER", None)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if consts is not None:
        consts.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = old_env
        if consts is not None:
            consts.ENABLE_RAY_CLUSTER = old_const


def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise EdgevlError(INSTALL_RAY) from None
    return ray


def _run_ray(settings: dict, todo: list[dict], workers: int, address: str | None, sink) -> Iterator[dict]:
    local = address in (None, "", "local")
    ray = _import_ray()
    for it in todo:
        if not isinstance(it["source"], str) and it["error"] is None:
            raise EdgevlError("with Ray, images must be file paths (the actors read them), not PIL images")
    started = False
    if not ray.is_initialized():
        try:
            if local:
                with _loopback_only():
                    ray.init(address="local", num_cpus=max(_physical_cores(), workers * settings["threads"]),
                             include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                             logging_level=logging.ERROR)
            else:
                ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        except Exception as e:  # noqa: BLE001 - connection, address and version errors alike
            where = "a local Ray" if local else f"Ray at {address}"
            raise EdgevlError(f"could not start or reach {where} ({type(e).__name__}: {e})") from None
        started = True
    try:
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        data_ctx = ray.data.DataContext.get_current()
        data_ctx.enable_progress_bars = False  # edgevl's own bar counts the rows
        sink.shard_dir.mkdir(parents=True, exist_ok=True)
        # Settings travel with the class, not as constructor arguments in the object store.
        worker_cls = type("EdgevlBatchWorker", (RayWorker,),
                          {"settings": dict(settings, shard_dir=str(sink.shard_dir.resolve()))})
        # Small blocks: a block is what an actor takes at once and what the driver sees at once.
        rows_per_block = max(1, min(16, len(todo) // (4 * workers)))
        ds = ray.data.from_items(todo, override_num_blocks=math.ceil(len(todo) / rows_per_block))
        ds = ds.map_batches(worker_cls, batch_size=None, batch_format="pyarrow", num_cpus=settings["threads"],
                            compute=ray.data.ActorPoolStrategy(size=workers))
        for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for line in b.column("row").to_pylist():
                yield json.loads(line)
    except EdgevlError:
        raise
    except Exception as e:  # noqa: BLE001 - Ray wraps task failures in many types
        raise EdgevlError(f"the Ray job failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                          ) from None
    finally:
        if started:
            ray.shutdown()


# ---------------------------------------------------------------------------------------------
# The job


class BatchJob:
    """Read the input, skip what ``output`` already holds, run the rest, write each row as it ends.

    ``run()`` yields the rows finished in this run; counts for a summary are attributes."""

    def __init__(self, model, rows, prompt: str | None = None, output=None, *, workers: int = 1,
                 threads: int | None = None, ray=None, overwrite: bool = False, retry_errors: bool = False,
                 image_column: str = "image", prompt_column: str = "prompt", id_column: str = "id",
                 max_image_patches: int | None = None, low_memory: bool = False, progress: bool = False,
                 model_options: dict | None = None, **sampling):
        from .model import Model
        from .sample import Sampler

        if workers is None or int(workers) < 1:
            raise EdgevlError(f"workers must be >= 1, got {workers}")
        self.workers = int(workers)
        self.ray = None if ray in (None, False) else "local" if ray is True else str(ray)
        self.loaded = model if isinstance(model, Model) else None
        path = Path(model.path if self.loaded else model).expanduser()
        if self.loaded is None:
            from .package import read_manifest, verify_files

            verify_files(path, read_manifest(path))  # once here, not once per worker
        env_threads = os.environ.get("EDGEVL_THREADS")
        if threads is None:
            from .runtime import default_threads

            threads = default_threads() if env_threads else max(1, _physical_cores() // self.workers)
        if int(threads) < 1:
            raise EdgevlError(f"threads must be >= 1, got {threads}")
        self.threads = int(threads)
        given = lambda k, default: default if sampling.get(k) is None else sampling[k]  # noqa: E731 - None: default
        Sampler(given("temperature", 0.0), given("top_k", 0), given("top_p", 1.0),
                given("repetition_penalty", 1.0))  # a bad value fails now, not on every row
        self.settings = {"model": str(path.resolve()), "threads": self.threads, "low_memory": low_memory,
                         "options": dict(sampling, max_image_patches=max_image_patches),
                         "model_options": dict(model_options or {})}   # the architecture's load-time options
        self.items = read_input(rows, prompt, image_column, prompt_column, id_column)
        self.output, self.overwrite, self.retry_errors = output, overwrite, retry_errors
        self.progress = progress
        self.new = self.failed_new = self.skipped = self.failed = self.done = 0
        self.seconds = 0.0
        self.torn_bytes = self.recovered = 0

    def oversubscribed(self) -> bool:
        return self.ray is None and self.workers * self.threads > _physical_cores()

    def run(self) -> Iterator[dict]:
        from .progress import Progress

        sink = Sink(self.output, self.overwrite, self.retry_errors) if self.output is not None else MemorySink()
        self.torn_bytes, self.recovered = sink.torn_bytes, sink.recovered
        bar = None
        try:
            todo = [it for it in self.items if it["id"] not in sink.rows]
            self.skipped = len(self.items) - len(todo)
            if not todo:
                return
            bar = Progress(len(todo), desc="batch", unit="rows", enabled=self.progress)
            if self.ray is not None:
                engine = _run_ray(self.settings, todo, self.workers, self.ray, sink)
            elif self.workers > 1 and len(todo) > 1:
                engine = _run_pool(self.settings, todo, self.workers)
            else:
                engine = _run_inline(self.settings, self.loaded, todo)
            t0 = time.monotonic()
            with contextlib.closing(engine):
                for row in engine:
                    if not sink.write(row):
                        continue
                    self.new += 1
                    self.failed_new += bool(row["error"])
                    self.seconds = time.monotonic() - t0
                    bar.update(1, note=row["id"])
                    yield row
        finally:
            if bar is not None:
                bar.close()
            try:
                self.recovered += sink.merge_shards()
                sink.finish([it["id"] for it in self.items])
            finally:
                sink.close()
            done = [sink.rows[it["id"]] for it in self.items if it["id"] in sink.rows]
            self.done, self.failed = len(done), sum(1 for r in done if r.get("error"))

    def summary(self) -> str:
        n = len(self.items)
        where = f" in {self.output}" if self.output is not None else ""
        parts = [f"batch: {self.done} of {n} rows{where}"]
        if self.new:
            parts.append(f"{self.new} new in {self.seconds:.1f} s ({self.new / max(self.seconds, 1e-9):.3g} rows/s)")
        if self.skipped:
            parts.append(f"{self.skipped} already done")
        if self.failed:
            parts.append(f"{self.failed} failed (see their 'error' field; --retry-errors runs them again)")
        return "; ".join(parts)


def batch(model, rows, prompt: str | None = None, output=None, **kwargs) -> Iterator[dict]:
    """Run ``prompt`` (or each row's own prompt) over many images; yields one result dict per row.

    ``model``: a package folder (or a loaded model when ``workers=1``); ``rows``: a folder of images,
    a .jsonl/.csv/.parquet file, or an iterable of image paths / PIL images / dicts with ``image``
    (and optionally ``prompt``, ``id``). With ``output`` (.jsonl/.parquet) every row is written as
    it finishes and rows already there are skipped (not yielded). Options: ``workers``,
    ``threads``, ``ray`` (True or an address), ``overwrite``, ``retry_errors``, ``progress``,
    ``max_image_patches`` and the sampling options of ``generate``.
    """
    yield from BatchJob(model, rows, prompt, output, **kwargs).run()


def batch_cli(a, model_path: str, sampling: dict, model_options: dict | None = None) -> int:
    """``edgevl batch``: exit 0 when every row has an answer, 1 when some rows failed (summary line).
    ``model_options``: the architecture's load-time options (e.g. expert_cache_mb)."""
    if a.ray not in (None, "local") and (Path(a.ray) / "manifest.json").is_file():
        raise EdgevlError(f"--ray took {a.ray!r} as the Ray address; put MODEL before --ray or write --ray=ADDRESS")
    job = BatchJob(model_path, a.input, a.prompt, a.output, workers=a.workers, threads=a.threads, ray=a.ray,
                   overwrite=a.overwrite, retry_errors=a.retry_errors, image_column=a.image_column,
                   prompt_column=a.prompt_column, id_column=a.id_column, max_image_patches=a.max_image_patches,
                   low_memory=a.low_memory, progress=not a.quiet, model_options=model_options, **sampling)
    where = f"Ray ({'local' if job.ray == 'local' else job.ray})" if job.ray else "local"
    print(f"batch: {len(job.items)} rows; {job.workers} {'actor' if job.ray else 'worker'}(s) x {job.threads} "
          f"thread(s), {where}", file=sys.stderr)
    if job.oversubscribed():
        print(f"warning: {job.workers} workers x {job.threads} threads > {_physical_cores()} cores; ncnn slows "
              "down badly when oversubscribed", file=sys.stderr)
    for _ in job.run():
        pass
    if job.torn_bytes:
        print(f"batch: cut a torn last line ({job.torn_bytes} bytes) left by a killed run", file=sys.stderr)
    if job.recovered:
        print(f"batch: merged {job.recovered} rows that Ray actors had finished before the last stop",
              file=sys.stderr)
    print(job.summary(), file=sys.stderr)
    return 1 if job.failed else 0
