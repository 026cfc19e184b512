"""Batch jobs: a prompt (or one prompt per row) over many images, resumable, on one machine or Ray.

    edgevl batch [MODEL] --input photos/ --prompt "Describe the image." --output captions.jsonl

Input: a folder of images (recursive, sorted; ids are the relative paths, a file name that is
not UTF-8 written with backslash escapes such as ``\\xff.png``) or a JSONL / CSV / Parquet file
with an image column (a path, relative to the file's folder, or an http(s) URL that the row's
worker fetches; in Parquet also the image file's bytes, or Hugging Face datasets' {bytes, path},
read a row group at a time as rows run) and optionally a prompt and an id column. Output (by
extension): JSONL or Parquet, one row per input with the fields of ``FIELDS``; ``error`` is null
when the row went well.

Thinking models: the thinking goes to ``reasoning`` (null for a model that did not think), never
into ``answer``; ``thinking`` (CLI: ``--thinking/--no-thinking``) and ``chat_template_kwargs`` reach
the template.
A row whose token limit ran out inside the thinking, before any answer, is not a success: it has
``finish_reason`` "length", the thinking so far, an empty answer and the error ``THOUGHT_CUT``
(raise --max-new-tokens or pass --no-thinking, then --retry-errors), so it counts as failed.

Resume: the output is the job's state. Every finished row is appended with one write and an
fsync (Parquet: to a JSONL journal beside it, turned into the Parquet file when the job ends), and
rows whose id is already there are skipped on the next run; a torn last line (a kill during a
write: one that does not parse) is cut off before appending, and a whole last row that lost only
its newline is kept. A SIGKILL therefore loses only the rows in flight. Outputs
written before a field was added (e.g. ``reasoning``) resume as they are.

The output is only ever an edgevl batch output: one that is the input (after symlinks and hard
links), or an existing file whose rows lack the result fields of ``RESULT_FIELDS``, is refused
with or without ``overwrite`` (an empty file is taken over). A symlinked output is written through
(the link stays a link) and locked as the file it points to; the output's inode is locked too, so
a hard link to it cannot start a second job. A line of the output that is not a result row stops
the job with the error offering ``repair``: it appends such lines, as they were (one per line),
to ``OUT.rejected`` and keeps every good row.

Engines: in this process (``workers=1``: ``parallel`` rows decode together over one copy of the
weights, through ``edgevl.engine``), ``workers`` local processes that each load the package
once, or a Ray Data actor pool (``ray=True`` or an address) whose actors load the package once,
read the images themselves and append their rows to per-actor shard files that the driver merges.
Local workers each hold a copy of the model: more of them than the available memory holds (one
worker: the package's files plus ``WORKER_MARGIN``) is refused before any starts.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import json
import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from multiprocessing.connection import wait as mp_wait
from pathlib import Path

from . import structured
from .errors import EdgevlError, os_error_line
from .package import signals_deferred

# What every edgevl batch output row has had from the start: an existing output whose rows lack
# one of these is not a batch output (an input file, someone else's table) and is never touched.
RESULT_FIELDS = ("id", "image", "prompt", "answer", "boxes", "tokens_in", "tokens_out", "finish_reason",
                 "seconds", "error")
FIELDS = ("id", "image", "video", "prompt", "answer", "reasoning", "json", "boxes", "tokens_in", "tokens_out",
          "finish_reason", "seconds", "error", "made_with")
VIDEO_COLUMN = "video"   # a table's video path column (models that take video)
JSON_CUT = ("the token limit cut the answer before its JSON ended; raise --max-new-tokens (max_new_tokens), then "
            "--retry-errors")
THOUGHT_CUT = ("the token limit ran out inside the thinking, before any answer; raise --max-new-tokens or pass "
               "--no-thinking, then --retry-errors")
WORKER_MARGIN = 512 << 20  # a worker beyond its weights: interpreter, ncnn, image and KV buffers
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
VIDEO_FILE_EXTS = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v")   # named, never read, by a folder input
TABLE_EXTS = (".jsonl", ".ndjson", ".csv", ".parquet")
OUTPUT_EXTS = (".jsonl", ".parquet")
INSTALL_PARQUET = "Parquet needs pyarrow: pip install 'edgevl[parquet]'"
INSTALL_RAY = "--ray needs Ray Data: pip install 'edgevl[ray]'"
CSV_FIELD_LIMIT = 2**31 - 1  # the largest the csv module takes everywhere (a C long)
# an image URL of a table: fetched by the worker that runs its row, within these bounds
FETCH_TIMEOUT = 30.0         # seconds without a byte (connecting, or between reads)
FETCH_DEADLINE = 120.0       # seconds for the whole image, however it trickles in
FETCH_MAX_BYTES = 64 << 20   # larger answers are no image this tool could use on a CPU anyway
FETCH_TRIES = 3              # on a dropped connection, a timeout, 429 or 5xx
FETCH_BACKOFF = 1.0          # seconds before the second try, twice that before the third


# ---------------------------------------------------------------------------------------------
# One row: the only place that calls the model


def extract_boxes(event) -> list[dict]:
    """Structured boxes of an answer, ``[{"box": [x1, y1, x2, y2], "label": str | None}]`` in
    original-image pixels: the ones generation found (its last event's Box tuples; only a model
    with an output processor, e.g. one that reads grounding coordinates, finds any)."""
    return [{"box": [int(v) for v in b.xyxy], "label": b.label} for b in (getattr(event, "boxes", None) or [])]


def empty_row(item: dict) -> dict:
    row = dict.fromkeys(FIELDS)
    row.update(id=item["id"], image=item.get("image"), video=item.get("video"), prompt=item.get("prompt"),
               error=item.get("error"), made_with=item.get("made_with"))
    return row


def _described(x):
    """A setting JSON cannot hold, by its content (a compiled structure's fields), never by a
    repr that holds a memory address."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    return type(x).__name__


def made_with(job: str, source) -> str:
    """A row's fingerprint: the job's (the model's files and the generation settings) with its
    image or video file's size (a folder of frames: its files' names and sizes), where it is
    local. A rerun that resumes a row by its id tells by it whether the row was made by another
    model, other settings or another image."""
    size = None
    if isinstance(source, (str, os.PathLike)) and not _is_url(str(source)):
        try:
            if os.path.isdir(source):     # a folder of frames: its files' names and sizes
                size = sorted((e.name, e.stat().st_size) for e in os.scandir(source) if e.is_file())
            else:
                size = os.stat(source).st_size
        except (OSError, ValueError):
            pass
    return hashlib.sha256(f"{job}:{size}".encode()).hexdigest()[:16]


def process_row(model, item: dict, options: dict) -> dict:
    """Answer one input row; any failure becomes the row's ``error`` instead of stopping the job."""
    from .generate import stream_events

    row = empty_row(item)
    t0 = time.perf_counter()
    if row["error"] is None:
        try:
            text, thought, last = [], [], None
            # reuse_cache=False: an answer must not depend on which row the worker ran before
            source = item["source"]
            if isinstance(source, ParquetImage):
                source = source.load()
            elif isinstance(source, str) and _is_url(source):
                source = fetch_image(source)
            for ev in stream_events(model, item["prompt"], image=source, video=item.get("video_source"),
                                    reuse_cache=False, **options):   # response_format: constrained answers
                text.append(ev.text)
                thought.append(ev.reasoning)
                last = ev
            answer, reasoning = "".join(text), "".join(thought)
            row.update(answer=answer, reasoning=reasoning or None, boxes=extract_boxes(last),
                       tokens_in=last.prompt_tokens, tokens_out=last.generation_tokens,
                       finish_reason=last.finish_reason)
            if last.finish_reason == "length" and reasoning and not answer.strip():
                row["error"] = THOUGHT_CUT  # an empty answer here is no answer, not a success
            elif _wants_json(options.get("response_format")):
                if last.finish_reason != "stop":
                    row["error"] = JSON_CUT    # never half an object
                else:
                    row["json"] = json.loads(answer)
        except EdgevlError as e:
            row["error"] = str(e)
        except Exception as e:  # noqa: BLE001 - one bad row must not stop the others
            row["error"] = f"{type(e).__name__}: {e}"
    row["seconds"] = round(time.perf_counter() - t0, 4)
    return _clean(row)  # e.g. an error naming a file whose name is not UTF-8


def _is_url(s: str) -> bool:
    return s.lower().startswith(("http://", "https://"))


def fetch_image(url: str) -> bytes:
    """An image URL's bytes: bounded in time (``FETCH_TIMEOUT`` without a byte, ``FETCH_DEADLINE``
    in all) and size (``FETCH_MAX_BYTES``), tried ``FETCH_TRIES`` times where trying again may
    help (a dropped connection, a timeout, 429, 5xx); every failure is one line naming the URL."""
    import urllib.error
    import urllib.request

    from . import __version__

    why = ""
    for attempt in range(FETCH_TRIES):
        if attempt:
            time.sleep(attempt * FETCH_BACKOFF)
        req = urllib.request.Request(url, headers={"User-Agent": f"edgevl/{__version__} (batch)"})
        try:
            with urllib.request.urlopen(req, timeout=FETCH_TIMEOUT) as r:
                size = r.headers.get("Content-Length")
                if size and size.isdigit() and int(size) > FETCH_MAX_BYTES:
                    raise EdgevlError(f"{url} is {int(size)} bytes, over the {FETCH_MAX_BYTES >> 20} MB an image "
                                      "may have here; download and downscale it")
                data, t0 = b"", time.monotonic()
                # read1: what has arrived, so that the deadline is looked at between arrivals
                while len(data) <= FETCH_MAX_BYTES and (part := r.read1(min(1 << 20, FETCH_MAX_BYTES + 1 - len(data)))):
                    data += part
                    if time.monotonic() - t0 > FETCH_DEADLINE:  # a server that trickles bytes forever
                        raise EdgevlError(f"{url} took over {FETCH_DEADLINE:g} s to download; download it yourself "
                                          "and give its path")
            if len(data) > FETCH_MAX_BYTES:
                raise EdgevlError(f"{url} is over the {FETCH_MAX_BYTES >> 20} MB an image may have here; download "
                                  "and downscale it")
            return data
        except urllib.error.HTTPError as e:
            why = f"HTTP {e.code} {e.reason}"
            if e.code != 429 and e.code < 500:
                break
        except urllib.error.URLError as e:
            why = str(getattr(e.reason, "strerror", None) or e.reason)
        except (TimeoutError, OSError) as e:   # a read that timed out, a connection reset mid-way
            why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        except ValueError as e:                # e.g. a URL with no host
            raise EdgevlError(f"cannot fetch {url}: {e}") from None
    tries = f" ({FETCH_TRIES} tries)" if attempt else ""
    raise EdgevlError(f"cannot fetch {url}: {why}{tries}; check the URL, or download the image and give its path")


def _wants_json(response_format) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") in ("json_object", "json_schema")


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
               id_column: str = "id", notes: dict | None = None) -> list[dict]:
    """The job's rows: ``{"id", "image" (as given), "source" (a path, a PIL image, image bytes or a
    ``ParquetImage``), "prompt", "error"}``. ``notes`` (a dict) hears what a folder input skipped:
    ``notes["videos"]``, its video files."""
    if prompt is not None and _text(prompt) != prompt:
        raise EdgevlError("--prompt is not valid UTF-8 text (it has a lone surrogate or undecodable bytes); "
                          "pass it as UTF-8")
    if prompt is not None and not prompt.strip():
        raise EdgevlError("--prompt is empty; pass some text")
    if isinstance(src, (str, os.PathLike)):
        path = Path(src).expanduser()
        if not path.exists():
            raise EdgevlError(f"--input {src} does not exist; pass a folder of images or a "
                              f".jsonl/.csv/.parquet file")
        if path.is_dir():
            return _folder_rows(path, prompt, notes if notes is not None else {})
        ext = path.suffix.lower()
        if ext in IMAGE_EXTS:
            raise EdgevlError(f"--input {src} is one image; use `edgevl run` for one image, or pass its folder")
        if ext in VIDEO_FILE_EXTS:
            raise EdgevlError(f"--input {src} is one video; use `edgevl run --video` for one, or list videos in a "
                              "table's video column (a JSONL line {\"video\": \"clip.mp4\"})")
        if ext not in TABLE_EXTS:
            raise EdgevlError(f"--input {src}: unknown kind of file; use a folder of images or a "
                              f"{', '.join(TABLE_EXTS)} file")
        records = {".csv": _csv_records, ".parquet": _parquet_records}.get(ext, _jsonl_records)(
            path, (image_column, prompt_column, id_column, VIDEO_COLUMN))
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


def _folder_files(root: Path) -> tuple[list, list]:
    """(relative name, path) of the folder's images and of its video files, hidden ones left out.
    Symlinked subfolders are followed (datasets are often linked in), each real folder once: a
    link back up the tree would otherwise loop. A folder inside the tree is read at its own path,
    never through a link to it (a link added later would rename its rows' ids)."""
    inside = set()      # the folders of the tree itself (links not followed)
    for d, dirs, _ in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        inside.add(_inode(d))
    found, videos, visited = [], [], set()
    for d, dirs, files in os.walk(root, followlinks=True):
        k = _inode(d)
        if k in visited:
            dirs[:] = []
            continue
        visited.add(k)
        dirs[:] = [x for x in dirs if not x.startswith(".") and not (
            os.path.islink(os.path.join(d, x)) and _inode(os.path.join(d, x)) in inside)]
        for f in files:
            ext = os.path.splitext(f)[1].lower()
            if not f.startswith(".") and ext in IMAGE_EXTS + VIDEO_FILE_EXTS:
                p = Path(d) / f
                (found if ext in IMAGE_EXTS else videos).append((p.relative_to(root).as_posix(), p))
    return found, videos


def _inode(path) -> tuple | None:
    """(device, inode) of what ``path`` leads to; None for a dangling link."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _folder_rows(root: Path, prompt: str | None, notes: dict) -> list[dict]:
    if not prompt:
        raise EdgevlError("--prompt is required for a folder of images")
    found, videos = _folder_files(root)
    notes["videos"] = len(videos)   # a folder gives image rows only: batch says it skipped these
    if not found:
        raise EdgevlError(f"no images ({', '.join(IMAGE_EXTS)}) found under {root}" + (
            f"; its {len(videos)} video file(s) go in a table's video column (a JSONL line "
            f"{{\"video\": \"clip.mp4\"}})" if videos else ""))
    found.sort()
    rows, seen = [], {}
    for rel, p in found:
        # A name that is not UTF-8 (kept by Python as surrogates, which no JSON or Parquet file can
        # hold) gets an id with backslash escapes (b"\xff.png" -> "\\xff.png"); the path opens as is.
        rid = os.fsencode(rel).decode("utf-8", "backslashreplace")
        if rid in seen:
            raise EdgevlError(f"{seen[rid]!r} and {rid!r} under {root} get the same id {rid!r} (a file name "
                              "that is not UTF-8 is written with backslash escapes); rename one of them")
        seen[rid] = rel
        rows.append({"id": rid, "image": rid, "source": str(p), "prompt": prompt, "error": None})
    return rows


def _jsonl_records(path: Path, _cols) -> list:
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise EdgevlError(f"{path} line {n} is not UTF-8 text (byte {e.start + 1} of the line); save the "
                                  "file as UTF-8") from None
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
    # csv refuses fields over 131072 characters by default: a long prompt is a row like any other
    old = csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            try:
                # Excel in many locales saves "CSV" with semicolons: a header with a semicolon and no
                # comma is read so
                head = f.readline()
                f.seek(0)
                delimiter = ";" if ";" in head and "," not in head else ","
                # written by hand as "a.png, What is it?": the space after a comma separates, as a reader means
                reader = csv.DictReader(f, skipinitialspace=True, delimiter=delimiter)
                if reader.fieldnames:   # and "image , prompt" names the columns "image" and "prompt"
                    reader.fieldnames = [h.strip() for h in reader.fieldnames]
                return list(enumerate(reader, 1))
            except UnicodeDecodeError as e:
                raise EdgevlError(f"{path} is not UTF-8 text (byte {e.start}); save it as \"CSV UTF-8\" (Excel) or "
                                  "convert it to UTF-8") from None
            except csv.Error as e:
                raise EdgevlError(f"{path} is not a readable UTF-8 CSV file ({e})") from None
    finally:
        csv.field_size_limit(old)


def _parquet_records(path: Path, cols) -> list:
    _, pq = _pyarrow()
    try:
        schema = pq.read_schema(path)
        if cols[0] not in schema.names and VIDEO_COLUMN not in schema.names:    # listed from the whole table
            raise _no_image_column(str(path), cols[0], schema.names)
        image = cols[0] if cols[0] in schema.names else None
        kind = _image_bytes_kind(schema.field(image).type) if image is not None else None
        # an image-bytes column is read row group by row group as the rows run (ParquetImage); only
        # its file names (Hugging Face's {bytes, path}) are read now
        wanted = [c for c in cols if c in schema.names and not (c == image and kind)]
        if kind == "struct_path":
            wanted.append(f"{image}.path")   # Arrow's nested field reference
        table = pq.read_table(path, columns=wanted)  # not the other columns (e.g. a big image-bytes one)
        if kind == "struct_path":   # the nested field comes back as the last column, named "path"
            table = table.rename_columns(table.column_names[:-1] + [_NAMES])
        groups = []
        if kind:    # where each row's image lies: its row group and its place there
            meta = pq.ParquetFile(path).metadata
            groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    except EdgevlError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise EdgevlError(f"{path} is not a readable Parquet file ({e})") from None
    records = table.to_pylist()
    if kind:
        at = 0
        for g, n in enumerate(groups):
            for i in range(n):
                r = records[at + i]
                r[image] = ParquetImage(str(path), image, g, i, r.pop(_NAMES, None))
            at += n
    return list(enumerate(records, 1))


_NAMES = "\0image file names"     # no column's name: where _parquet_records keeps them for a moment


def _image_bytes_kind(t) -> str | None:
    """How a Parquet column holds images, if it holds their bytes: "binary" (a column of
    bytes), "struct" / "struct_path" (Hugging Face datasets' ``Image`` feature: {bytes, path})."""
    pa, _ = _pyarrow()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "binary"
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        b = t.field(t.get_field_index("bytes")).type
        if pa.types.is_binary(b) or pa.types.is_large_binary(b):
            p = t.get_field_index("path")
            return "struct_path" if p >= 0 and pa.types.is_string(t.field(p).type) else "struct"
    return None


class ParquetImage:
    """An image stored in a Parquet file (bytes, or Hugging Face's {bytes, path}), read when its
    row runs: a job holds a row group's images at a time (two at most), not the file's, and a
    worker process gets a few small fields, not the image. ``path``: the file name Hugging Face
    stored beside the bytes (shown in the output's ``image`` field), if any; a cell with a name
    and no bytes names a file (relative to the table's folder), as Hugging Face writes local ones."""

    __slots__ = ("file", "column", "group", "index", "path")

    def __init__(self, file: str, column: str, group: int, index: int, path: str | None):
        self.file, self.column, self.group, self.index, self.path = file, column, group, index, path

    def __reduce__(self):
        return ParquetImage, (self.file, self.column, self.group, self.index, self.path)

    def load(self) -> bytes | str:
        """The image file's bytes, or its path (EdgevlError: none in the cell, or the file changed)."""
        _, pq = _pyarrow()
        key = (self.file, self.column, self.group)
        with _GROUP_LOCK:
            column = _GROUPS.pop(key, None)
            if column is None:
                try:
                    column = pq.ParquetFile(self.file).read_row_group(self.group, columns=[self.column]).column(0)
                except Exception as e:  # noqa: BLE001 - the file went away or changed under the job
                    raise EdgevlError(f"cannot read the images of {self.file} again ({type(e).__name__}: {e}); "
                                      "was it changed while the job ran?") from None
            _GROUPS[key] = column           # the newest last
            while len(_GROUPS) > 2:
                _GROUPS.pop(next(iter(_GROUPS)))
        if self.index >= len(column):
            raise EdgevlError(f"{self.file} has fewer rows than when the job started; run the job again")
        v = column[self.index].as_py()
        if isinstance(v, dict):
            v = v.get("bytes") or (v.get("path") and str(Path(self.file).parent / Path(v["path"]).expanduser()))
        if not v:
            raise EdgevlError(f"no image in the {self.column!r} column")
        return v


# the row groups of images ParquetImage.load read last, in this process: two, as the rows in
# flight together (an engine's slots) may straddle a row group's end
_GROUPS: dict = {}
_GROUP_LOCK = threading.Lock()


def _no_image_column(name: str, image_column: str, cols) -> EdgevlError:
    return EdgevlError(f"{name} has no {image_column!r} column, nor a {VIDEO_COLUMN!r} one (columns: "
                       f"{', '.join(map(str, cols))}); name it so or pass --image-column")


def _table_rows(records, base: Path | None, name: str, where: str, prompt, image_column, prompt_column,
                id_column) -> list[dict]:
    if not records:
        raise EdgevlError(f"{name} has no rows")
    cols = sorted({str(k) for _, r in records for k in r})
    if not any(image_column in r or VIDEO_COLUMN in r for _, r in records):
        raise _no_image_column(name, image_column, cols)
    for flag, col, default in (("--prompt-column", prompt_column, "prompt"), ("--id-column", id_column, "id")):
        if col != default and col not in cols:    # a column asked for by name (a typo would go unseen)
            raise EdgevlError(f"{name} has no {col!r} column ({flag}; columns: {', '.join(cols)})")
    with_video = any(VIDEO_COLUMN in r for _, r in records)
    if not prompt and not any(prompt_column in r for _, r in records):
        raise EdgevlError(f"--prompt is required: {name} has no {prompt_column!r} column")
    from PIL import Image

    rows, seen = [], {}
    for n, r in records:
        img, err, shown, source = r.get(image_column), None, None, None
        if isinstance(img, dict) and "bytes" in img:  # Hugging Face datasets' Image: {bytes, path}
            img = img["bytes"] or img.get("path")
        if isinstance(img, (Image.Image, ParquetImage, bytes, bytearray)):
            source = img
            shown = img.path if isinstance(img, ParquetImage) else None
        elif isinstance(img, (str, os.PathLike)) and str(img).strip():
            shown = str(img).strip()
            if _is_url(shown):
                source = shown      # fetched when its row runs (fetch_image), by the worker that runs it
            else:
                p = Path(shown).expanduser()
                source = str(p if p.is_absolute() or base is None else base / p)
        elif (img is None or isinstance(img, str)) and not with_video:  # missing or blank
            err = f"no image in the {image_column!r} column"
        elif img is not None and not isinstance(img, str):
            err = f"the {image_column!r} value is a {type(img).__name__}, not an image path"
        video, vsource = r.get(VIDEO_COLUMN), None
        if isinstance(video, (str, os.PathLike)) and str(video).strip():
            video = str(video).strip()
            if video.startswith(("http://", "https://")):
                err = err or "remote video URLs are not fetched; download the videos and give local paths"
            else:
                v = Path(video).expanduser()
                vsource = str(v if v.is_absolute() or base is None else base / v)
        elif video is not None and not isinstance(video, str):
            err = err or f"the {VIDEO_COLUMN!r} value is a {type(video).__name__}, not a video path"
            video = None
        else:
            video = None
        if source is None and vsource is None and err is None:
            err = f"no image or video in the {image_column!r} and {VIDEO_COLUMN!r} columns"
        rid = r.get(id_column)
        if isinstance(rid, (list, dict, bool)):   # str() would make an id of its Python spelling
            raise EdgevlError(f"{name} {where} {n}: its {id_column!r} is a {type(rid).__name__}, not text or a "
                              "number; ids must be text or numbers")
        if rid is None or str(rid) == "":   # file names stored beside image bytes may repeat: not ids
            rid = f"{where} {n}" if isinstance(source, (ParquetImage, bytes, bytearray)) else \
                shown or video or f"{where} {n}"
        rid = _text(str(rid))
        p = r.get(prompt_column)
        if isinstance(p, (list, dict, bool)) and err is None:   # not asked as its Python spelling
            err = f"the {prompt_column!r} value is a {type(p).__name__}, not text; give the prompt as text"
            p = None
        p = str(p) if p is not None and str(p).strip() else prompt
        if p is None and err is None:
            err = f"no prompt: fill the {prompt_column!r} column or give --prompt"
        if rid in seen:
            fix = (f"make the {id_column!r} values unique (an id is its text: 1 and \"1\" are one id)"
                   if r.get(id_column) not in (None, "") else f"add an {id_column!r} column")
            raise EdgevlError(f"id {rid!r} appears twice in {name} ({where}s {seen[rid]} and {n}); ids must be "
                              f"unique — {fix}")
        seen[rid] = n
        rows.append({"id": rid, "image": shown, "source": source, "prompt": p, "error": err}
                    | ({"video": video, "video_source": vsource} if with_video else {}))
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


def _text(s: str) -> str:
    """``s`` as valid Unicode: lone surrogates (from a ``\\ud800`` escape in a JSON input, or an
    error message naming a file whose name is not UTF-8) become backslash escapes, since JSON
    lines and Parquet strings must be UTF-8."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        pass
    try:  # bytes that were not UTF-8 (a file name, kept by surrogateescape): shown as \xff
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _clean(v):
    if isinstance(v, str):
        return _text(v)
    if isinstance(v, list):
        return [_clean(x) for x in v]
    if isinstance(v, dict):
        return {_clean(k): _clean(x) for k, x in v.items()}
    return v


def _line(row: dict) -> bytes:
    return (json.dumps(row, ensure_ascii=False, separators=(", ", ": ")) + "\n").encode()


ROW_START = b'{"id": '  # how every row line written here begins (FIELDS starts with id)


def _is_result(r) -> bool:
    return isinstance(r, dict) and all(k in r for k in RESULT_FIELDS)


def _parse_row(line: bytes):
    try:
        r = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, absurd nesting
        return None
    if _is_result(r):
        r["id"] = str(r["id"])
        return r
    return None


def _scan_jsonl(data: bytes) -> tuple[list[dict], int, list[tuple[int, bytes]], int]:
    """(result rows, bytes up to the end of the last complete line, bad lines as (line number,
    bytes), bytes of a torn last row). A last line without its newline that is a whole result row
    is kept (only its newline was lost, and a sampled answer cannot be redone the same); one that
    does not parse is a torn write (a kill during an append) when it begins as a row line does;
    anything else there is a bad line."""
    end = data.rfind(b"\n") + 1
    lines = data[:end].split(b"\n")[:-1]
    rows, bad = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        r = _parse_row(line)
        if r is not None:
            rows.append(r)
        else:
            bad.append((n, line + b"\n"))
    tail, torn = data[end:], 0
    if not tail.strip():
        pass
    elif (r := _parse_row(tail)) is not None:
        rows.append(r)
        end = len(data)
    elif tail.startswith(ROW_START) or ROW_START.startswith(tail):
        torn = len(tail)
    else:
        bad.append((len(lines) + 1, tail))
    return rows, end, bad, torn


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


def _parquet_row(row: dict) -> dict:
    v = row.get("json")
    return row if v is None or isinstance(v, str) else {**row, "json": json.dumps(v, ensure_ascii=False)}


def _row_schema(pa):
    box = pa.struct([("box", pa.list_(pa.int64())), ("label", pa.string())])
    return pa.schema([("id", pa.string()), ("image", pa.string()), ("video", pa.string()), ("prompt", pa.string()),
                      ("answer", pa.string()), ("reasoning", pa.string()),
                      ("json", pa.string()),   # the parsed answer as JSON text: its shape varies by schema
                      ("boxes", pa.list_(box)),
                      ("tokens_in", pa.int64()), ("tokens_out", pa.int64()), ("finish_reason", pa.string()),
                      ("seconds", pa.float64()), ("error", pa.string()), ("made_with", pa.string())])


NOT_OURS = "choose another --output, or move the file away yourself (--overwrite replaces only batch outputs)"


class Sink:
    """The output file as the job's state: ``rows`` (id -> row) is what is done.

    JSONL: the output itself is an append-only journal. Parquet: rows go to ``OUT.partial.jsonl``
    and ``finish`` writes the Parquet file (by rename) and removes the journal. Locks keep two jobs
    from writing one output, however it is spelled: a lock file beside the real file (after
    symlinks) and a lock on the output's own inode (hard links). Ray actors leave shards in
    ``OUT.ray-shards/``, merged here. ``repair`` moves lines that are not result rows to
    ``OUT.rejected`` instead of refusing the file.
    """

    @staticmethod
    def check_name(path) -> None:
        """What the output's name alone refuses (checked again when the job opens it)."""
        given = Path(path).expanduser()
        if given.suffix.lower() not in OUTPUT_EXTS:
            raise EdgevlError(f"--output {path}: the name must end in .jsonl or .parquet (that picks the format)")
        if given.suffix.lower() == ".parquet":
            _pyarrow()
        if given.is_dir():
            raise EdgevlError(f"--output {path} is a folder; give a .jsonl or .parquet file name")
        if given.exists() and not given.is_file():
            raise EdgevlError(f"--output {path} is not a regular file; give a .jsonl or .parquet file name")

    def __init__(self, path, overwrite: bool = False, retry_errors: bool = False, repair: bool = False):
        given = Path(path).expanduser()
        self.shown = str(path)
        self.check_name(path)
        self.parquet = given.suffix.lower() == ".parquet"
        # Written through symlinks (a link stays a link) and named after the real file, so that
        # every spelling of one output shares its lock, journal and shards.
        self.path = Path(os.path.realpath(given))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.journal = self.path.with_name(self.path.name + ".partial.jsonl") if self.parquet else self.path
        self.shard_dir = self.path.with_name(self.path.name + ".ray-shards")
        self.rejected = self.path.with_name(self.path.name + ".rejected")
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self.fd = self._inode_lock = None
        self.torn_bytes = self.recovered = self.repaired = 0
        self._lock = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._take(self._lock)
        except EdgevlError:
            os.close(self._lock)  # not ours: the lock file stays for the job that holds it
            self._lock = None
            raise
        created = not self.journal.exists()
        try:
            if self.parquet and self.path.exists():  # a hard link to it shares this inode
                self._inode_lock = os.open(self.path, os.O_RDONLY)
                self._take(self._inode_lock)
            self.fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._take(self.fd)  # the journal's inode: a hard link to it shares it
            self._open(overwrite, retry_errors, repair, created)
        except BaseException:
            if created and self.fd is not None and os.fstat(self.fd).st_size == 0:
                with contextlib.suppress(OSError):
                    self.journal.unlink()
            self.close()
            raise

    def _take(self, fd: int) -> None:
        import fcntl  # POSIX; imported here so that `import edgevl` works everywhere

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EdgevlError(f"{self.shown} is being written by another edgevl batch job; wait for it or "
                              "choose another --output") from None

    def _open(self, overwrite, retry_errors, repair, created):
        # Read and judge everything before anything is changed: a file that is not a batch
        # output is refused even with --overwrite.
        old = read_parquet_rows(self.path, self.shown) if self.parquet and self.path.exists() else []
        data = self.journal.read_bytes()
        rows, end, bad, torn = _scan_jsonl(data)
        name = self.shown if not self.parquet else f"{self.shown}'s journal {self.journal.name}"
        if bad and not rows:
            raise EdgevlError(f"--output {name} is not an edgevl batch output (line {bad[0][0]} is not a result "
                              f"row); {NOT_OURS}")
        if torn and not rows and not old:   # nothing of ours to resume: it may be another file's one line
            raise EdgevlError(f"--output {name} holds one unfinished line ({torn} bytes) and no result row, so it "
                              f"may not be a batch output; {NOT_OURS} (a run killed in its first row leaves such "
                              "a file: delete it then)")
        if overwrite:
            os.ftruncate(self.fd, 0)  # in place: the inode and its lock stay
            os.fsync(self.fd)
            if self.parquet:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            shutil.rmtree(self.shard_dir, ignore_errors=True)
            old, rows, bad, torn, data, end = [], [], [], 0, b"", 0
        if bad and not repair:
            raise EdgevlError(f"{name} line {bad[0][0]} is not a batch result row ({len(bad)} such line(s)); "
                              f"--repair moves them to {self.rejected.name} and keeps the {len(rows)} good rows "
                              "(--overwrite starts over)")
        self.rows: dict[str, dict] = {r["id"]: r for r in old}
        self._dirty = not created  # Parquet: rows not yet in the Parquet file
        self._file_order = [r["id"] for r in rows]
        for r in rows:
            self.rows[r["id"]] = r
        self.torn_bytes = torn
        if bad:
            # the bad lines first, so that a kill in between duplicates them rather than losing them
            fd = os.open(self.rejected, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                _append(fd, b"".join(line if line.endswith(b"\n") else line + b"\n" for _, line in bad))
            finally:
                os.close(fd)
            self._rewrite(list(dict.fromkeys(self._file_order)))
            self.repaired = len(bad)
        elif torn:
            os.ftruncate(self.fd, end)  # a kill during a write: drop the partial line
            os.fsync(self.fd)
        elif data[end - 1:end] not in (b"", b"\n"):  # a whole last row that lost its newline
            _append(self.fd, b"\n")
        self.recovered = self.merge_shards()
        if retry_errors:
            bad_rows = [k for k, r in self.rows.items() if r.get("error")]
            for k in bad_rows:
                del self.rows[k]
            self._dirty |= bool(bad_rows)
            if bad_rows and not self.parquet:
                self._rewrite(list(self.rows))

    def write(self, row: dict) -> bool:
        """Append one finished row durably; False if its id is already done."""
        return self.write_many([row]) == 1

    def write_many(self, rows: Iterable[dict]) -> int:
        new = []
        for r in rows:
            if r["id"] not in self.rows:
                r = _clean(r)
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
            rows += _scan_jsonl(f.read_bytes())[0]  # a shard cut by a kill: its complete rows
        n = self.write_many(rows)
        shutil.rmtree(self.shard_dir, ignore_errors=True)
        return n

    def _ordered(self, order: list[str]) -> list[str]:
        ids = [k for k in order if k in self.rows]
        seen = set(ids)
        return ids + [k for k in self.rows if k not in seen]

    def _rewrite(self, ids: list[str]) -> None:
        _write_atomic(self.journal, lambda f: f.writelines(_line(self.rows[k]) for k in ids))
        old, self.fd = self.fd, os.open(self.journal, os.O_WRONLY | os.O_APPEND)
        os.close(old)
        self._take(self.fd)  # the new inode is the output now
        self._file_order = list(ids)

    def finish(self, order: list[str]) -> None:
        """Input order for the final file: JSONL rewritten by rename when needed, Parquet written."""
        ids = self._ordered(order)
        if self.parquet:
            if self._dirty or not self.path.exists():
                pa, pq = _pyarrow()
                table = pa.Table.from_pylist([_parquet_row(self.rows[k]) for k in ids], schema=_row_schema(pa))
                _write_atomic(self.path, lambda f: pq.write_table(table, f))
            with contextlib.suppress(FileNotFoundError):
                self.journal.unlink()
            _fsync_dir(self.path.parent)
        elif ids != self._file_order:
            self._rewrite(ids)

    def close(self) -> None:
        for name in ("fd", "_inode_lock"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
        if self._lock is not None:
            with contextlib.suppress(OSError):
                self._lock_path.unlink()
            os.close(self._lock)  # closing releases the flock
            self._lock = None


class MemorySink:
    """No output file (API): nothing is skipped or kept; Ray shards go to a temporary folder."""

    def __init__(self):
        self.rows, self.torn_bytes, self.recovered, self.repaired = {}, 0, 0, 0
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


def read_parquet_rows(path, shown=None) -> list[dict]:
    """The rows of a batch output in Parquet; anything else at ``path`` is refused (an empty file
    is taken over)."""
    _, pq = _pyarrow()
    shown = shown or str(path)
    if os.path.getsize(path) == 0:
        return []
    try:
        names = pq.read_schema(path).names
        missing = [k for k in RESULT_FIELDS if k not in names]
        rows = [] if missing else pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise EdgevlError(f"--output {shown} is not a readable Parquet file ({e}); {NOT_OURS}") from None
    if missing:
        raise EdgevlError(f"--output {shown} is not an edgevl batch output (no {', '.join(missing)} column); "
                          f"{NOT_OURS}")
    for r in rows:
        r["id"] = str(r["id"])
    return rows


# ---------------------------------------------------------------------------------------------
# Engines: each yields one result row per item


def _physical_cores() -> int:
    """The physical cores this process may use (its affinity and CPU quota too)."""
    from .runtime import usable_cores

    return usable_cores()


AHEAD = 4


def _run_inline(settings: dict, model, todo: list[dict]) -> Iterator[dict]:
    if model is None:
        from .model import load

        model = load(settings["model"], threads=settings["threads"], low_memory=settings["low_memory"],
                     options=settings.get("model_options"))
    parallel = min(int(settings.get("parallel") or 1), len(todo))
    if parallel <= 1 or model.low_memory:
        for item in todo:
            yield process_row(model, item, settings["options"])
        return
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    from .engine import Engine

    # ``parallel`` rows in flight, their decode steps sharing forwards; when one ends the next
    # starts (a short answer does not wait for a long one to free its slot), and rows come out
    # in input order: up to AHEAD x parallel finished rows wait for a slow one before it
    engine = Engine(model, parallel)
    pool = ThreadPoolExecutor(parallel, thread_name_prefix="edgevl-batch")
    options = {**settings["options"], "engine": engine}
    running: dict = {}
    done: dict = {}
    nxt = 0

    def start(out: int) -> None:
        nonlocal nxt
        while nxt < len(todo) and len(running) < parallel and nxt - out < AHEAD * parallel:
            running[pool.submit(process_row, model, todo[nxt], options)] = nxt
            nxt += 1
    try:
        for out in range(len(todo)):
            start(out)
            while out not in done:
                for f in wait(list(running), return_when=FIRST_COMPLETED)[0]:
                    done[running.pop(f)] = f.result()
                start(out)
            yield done.pop(out)
    finally:   # stopped early (Ctrl-C, a closed generator): the rows in flight end now, unwritten
        engine.close()
        pool.shutdown(wait=True, cancel_futures=True)


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
    depth = 2 if all(isinstance(it["source"], (str, type(None), ParquetImage)) for it in todo) else 1

    def start():
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_pool_worker, args=(child, settings, os.getpid()), daemon=True,
                        name="edgevl-batch-worker")
        p.start()
        child.close()  # so the parent sees EOF when the worker dies
        return {"proc": p, "conn": parent, "items": deque(), "ready": False, "broken": False}

    queue = deque(todo)
    slots = [start() for _ in range(min(workers, len(todo)))]
    loaded = False  # some worker of this job has loaded the model: it loads, a death was a one-off
    try:
        while queue or any(s["items"] for s in slots):
            for s in slots:
                while s["ready"] and not s["broken"] and len(s["items"]) < depth and queue:
                    try:
                        s["conn"].send(queue[0])
                    except OSError:  # it died since its last answer: its EOF, read below, reports that
                        s["broken"] = True
                        break
                    s["items"].append(queue.popleft())
            by_conn = {id(s["conn"]): s for s in slots}
            for conn in mp_wait([s["conn"] for s in slots]):
                s = by_conn[id(conn)]
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    s["proc"].join(5)
                    why = _exit_text(s["proc"].exitcode)
                    if not s["ready"]:
                        # Killed while loading: start it again if the model has loaded in this job (a
                        # one-off kill, even if every worker is a replacement still loading now),
                        # fail the job if loading itself keeps failing.
                        s["load_deaths"] = s.get("load_deaths", 0) + 1
                        if s["load_deaths"] > 2 or not loaded:
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
                    s["ready"] = loaded = True
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
        import ray.data  # Ray Data is a separate part of Ray
    except ImportError:
        raise EdgevlError(INSTALL_RAY) from None
    return ray


def _run_ray(settings: dict, todo: list[dict], workers: int, address: str | None, sink) -> Iterator[dict]:
    local = address in (None, "", "local")
    ray = _import_ray()
    for it in todo:
        if not isinstance(it["source"], str) and it["error"] is None:
            raise EdgevlError("with Ray, images must be file paths (the actors read them), not PIL images or "
                              "image bytes; run without --ray (--workers N for several processes)")
    # Ray Data holds the rows as Arrow text, which must be UTF-8: a path that is not (a file name
    # that is not UTF-8) fails its own row here instead of the whole job.
    unsent = [it for it in todo if _clean(it) != it]
    for it in unsent:
        row = empty_row(it)
        row["error"] = row["error"] or ("with --ray, image paths and prompts must be UTF-8 text (Ray keeps them as "
                                        "UTF-8); rename the file, or run this row without --ray")
        yield _clean(row)
    todo = [it for it in todo if _clean(it) == it]
    if not todo:
        return
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


def _refuse_output_is_input(src, output) -> None:
    """An output that is the input file (by any spelling: symlinks, hard links) would be read as
    results, or deleted by --overwrite."""
    if not isinstance(src, (str, os.PathLike)):
        return
    try:
        st_in = os.stat(Path(src).expanduser())
    except OSError:
        return  # read_input says what is wrong with it
    out = Path(output).expanduser()
    real = Path(os.path.realpath(out))
    for o in (out, real.with_name(real.name + ".partial.jsonl")) if out.suffix.lower() == ".parquet" else (out,):
        try:
            st = os.stat(o)
            same = (st.st_dev, st.st_ino) == (st_in.st_dev, st_in.st_ino)
        except OSError:  # not there yet: the same path once symlinks are resolved
            same = os.path.realpath(o) == os.path.realpath(Path(src).expanduser())
        if same:
            raise EdgevlError(f"--output {output} is the input file {src}; results go to a file of their own: "
                              "choose another --output")


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _check_worker_memory(path: Path, workers: int, started: int) -> None:
    """Each local worker loads its own copy of the model: refuse more than the memory holds now,
    before any starts (they would swap the machine to a halt or be killed one by one).
    ``started``: the workers that would start (no more than there are rows)."""
    from .package import read_manifest
    from .runtime import available_memory

    free = available_memory()
    if free is None:
        return
    one = sum(int(meta.get("bytes", 0)) for meta in read_manifest(path).get("files", {}).values()) + WORKER_MARGIN
    if started * one > free:
        fit = free // one
        fix = f"use --workers {fit} or fewer" if fit >= 1 else "use --workers 1 with --low-memory"
        raise EdgevlError(f"--workers {workers} would start {started} workers, about {_gb(started * one)} (each "
                          f"worker loads the model: ~{_gb(one)}), but {_gb(free)} is available; {fix}")


class BatchJob:
    """Read the input, skip what ``output`` already holds, run the rest, write each row as it ends.

    ``run()`` yields the rows finished in this run; counts for a summary are attributes."""

    def __init__(self, model, rows, prompt: str | None = None, output=None, *, workers: int = 1,
                 parallel: int = 4, threads: int | None = None, ray=None, overwrite: bool = False,
                 retry_errors: bool = False,
                 image_column: str = "image", prompt_column: str = "prompt", id_column: str = "id",
                 max_image_patches: int | None = None, low_memory: bool = False, progress: bool = False,
                 model_options: dict | None = None, chat_template_kwargs: dict | None = None,
                 thinking: bool | None = None, allow_special_in_content: bool = False, repair: bool = False,
                 response_format=None, json_schema=None, **sampling):
        from .generate import check_generation_options, template_kwargs
        from .model import Model
        from .sample import Sampler

        # what goes to every row's generation: a misspelt option fails once here, not in each row
        check_generation_options(sampling, "batch")
        if workers is None or int(workers) < 1:
            raise EdgevlError(f"workers must be >= 1, got {workers}")
        self.workers = int(workers)
        if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= 256:
            raise EdgevlError(f"parallel must be between 1 and 256, got {parallel!r:.40}")
        self.parallel = parallel
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
                given("repetition_penalty", 1.0), min_p=given("min_p", 0.0))  # a bad value fails now, not on every row
        if json_schema is not None:
            if response_format is not None:
                raise EdgevlError("give either json_schema or response_format, not both")
            response_format = {"type": "json_schema", "json_schema": {"schema": structured.json_schema(
                json_schema).schema}}     # a plain dict: it travels to worker processes and Ray actors
        structure = structured.parse(response_format)   # a bad one fails now, not on every row
        if structure is not None:
            if self.loaded is not None:
                structured.compiled(self.loaded, structure)
            else:   # the workers load the model: what no tokenizer is needed to refuse, refused here
                structured.check(structure)
        self.settings = {"model": str(path.resolve()), "threads": self.threads, "low_memory": low_memory,
                         "parallel": parallel,
                         "options": dict(sampling, max_image_patches=max_image_patches,
                                         chat_template_kwargs=template_kwargs(chat_template_kwargs),
                                         thinking=thinking, allow_special_in_content=allow_special_in_content,
                                         response_format=response_format),
                         "model_options": dict(model_options or {})}   # the architecture's load-time options
        if output is not None:   # before the job's first line: a usage error is all it prints
            Sink.check_name(output)
            _refuse_output_is_input(rows, output)
        notes: dict = {}
        self.items = read_input(rows, prompt, image_column, prompt_column, id_column, notes)
        self.skipped_videos = notes.get("videos", 0)
        from .package import read_manifest

        # the package's content (its files' digests), not where or when it was converted
        files = (self.loaded.manifest if self.loaded else read_manifest(path)).get("files")
        job = json.dumps([files, self.settings["options"]], sort_keys=True, default=_described)
        for it in self.items:
            it["made_with"] = made_with(job, it.get("source") or it.get("video_source"))
        # a model without video (or without a vision tower, for images) would fail every such row
        videos = any(it.get("video") for it in self.items)
        images = any(it.get("source") is not None for it in self.items)
        if videos or images:
            from .model import check_load_options

            check_load_options(path, video=videos, images=images)
        if self.ray is None and not low_memory and min(self.workers, len(self.items)) > 1:
            _check_worker_memory(path, self.workers, min(self.workers, len(self.items)))
        self.output, self.overwrite, self.retry_errors, self.repair = output, overwrite, retry_errors, repair
        self.progress = progress
        self.new = self.failed_new = self.skipped = self.failed = self.done = self.cut_in_thinking = 0
        self.seconds = 0.0
        self.torn_bytes = self.recovered = self.repaired = 0
        self.asked_otherwise = self.made_otherwise = 0
        self.foreign = 0   # rows in the output whose id this job's input has not (another job's)

    def oversubscribed(self) -> bool:
        return self.ray is None and self.workers * self.threads > _physical_cores()

    def run(self) -> Iterator[dict]:
        from .progress import Progress

        sink = (Sink(self.output, self.overwrite, self.retry_errors, self.repair) if self.output is not None
                else MemorySink())
        self.torn_bytes, self.recovered, self.repaired = sink.torn_bytes, sink.recovered, sink.repaired
        self.rejected = getattr(sink, "rejected", None)
        bar = None
        try:
            todo = [it for it in self.items if it["id"] not in sink.rows]
            self.skipped = len(self.items) - len(todo)
            # rows resumed by id whose answer was to another prompt (the job was changed): said, not redone
            self.asked_otherwise = sum(1 for it in self.items if it["id"] in sink.rows
                                       and sink.rows[it["id"]].get("prompt") not in (None, it["prompt"]))
            # and those made with another model, other settings or another version of their image
            self.made_otherwise = sum(1 for it in self.items if it["id"] in sink.rows
                                      and sink.rows[it["id"]].get("made_with") not in (None, it["made_with"]))
            ids = {it["id"] for it in self.items}
            self.foreign = sum(1 for i in sink.rows if i not in ids)
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
                with signals_deferred():   # a second Ctrl-C must not leave the output unwritten
                    self.recovered += sink.merge_shards()
                    sink.finish([it["id"] for it in self.items])
            finally:
                sink.close()
            done = [sink.rows[it["id"]] for it in self.items if it["id"] in sink.rows]
            self.done, self.failed = len(done), sum(1 for r in done if r.get("error"))
            self.cut_in_thinking = sum(1 for r in done if r.get("error") == THOUGHT_CUT)

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
        if self.cut_in_thinking:
            parts.append(f"{self.cut_in_thinking} of them ran out of tokens while thinking (raise --max-new-tokens "
                         "or pass --no-thinking)")
        return "; ".join(parts)


def batch(model, rows, prompt: str | None = None, output=None, **kwargs) -> Iterator[dict]:
    """Run ``prompt`` (or each row's own prompt) over many images; yields one result dict per row.

    ``model``: a package folder (or a loaded model when ``workers=1``); ``rows``: a folder of images,
    a .jsonl/.csv/.parquet file, or an iterable of image paths / PIL images / dicts with ``image``
    (and optionally ``prompt``, ``id``). With ``output`` (.jsonl/.parquet) every row is written as
    it finishes and rows already there are skipped (not yielded). Options: ``workers``,
    ``threads``, ``ray`` (True or an address), ``overwrite``, ``retry_errors``, ``repair``,
    ``progress``, ``max_image_patches``, ``thinking`` (False: a direct answer from a model that can
    think first), ``chat_template_kwargs``, ``allow_special_in_content``, ``response_format`` /
    ``json_schema`` (constrained answers; JSON ones parsed into each row's ``json`` field, a row the
    token limit cut is an error) and the sampling options of ``generate``.
    """
    yield from BatchJob(model, rows, prompt, output, **kwargs).run()


def batch_cli(a, model_path: str, sampling: dict, model_options: dict | None = None) -> int:
    """``edgevl batch``: exit 0 when every row has an answer, 1 when some rows failed (summary line).
    ``model_options``: the architecture's load-time options (e.g. expert_cache_mb)."""
    if a.ray not in (None, "local") and (Path(a.ray) / "manifest.json").is_file():
        raise EdgevlError(f"--ray took {a.ray!r} as the Ray address; put MODEL before --ray or write --ray=ADDRESS")
    job = BatchJob(model_path, a.input, a.prompt, a.output, workers=a.workers, parallel=a.parallel,
                   threads=a.threads, ray=a.ray,
                   overwrite=a.overwrite, retry_errors=a.retry_errors, repair=a.repair, image_column=a.image_column,
                   prompt_column=a.prompt_column, id_column=a.id_column, max_image_patches=a.max_image_patches,
                   low_memory=a.low_memory, progress=not a.quiet, model_options=model_options,
                   thinking=a.thinking, allow_special_in_content=a.allow_special_in_content,
                   response_format=structured.cli_format(a.json_schema, a.json), **sampling)
    where = f"Ray ({'local' if job.ray == 'local' else job.ray})" if job.ray else "local"
    # local workers start no more than there are rows (one row runs in this process)
    count = job.workers if job.ray else max(1, min(job.workers, len(job.items)))
    inline = "" if count > 1 or job.ray else f", {job.parallel} rows at a time"
    print(f"batch: {len(job.items)} rows; {count} {'actor' if job.ray else 'worker'}(s) x {job.threads} "
          f"thread(s), {where}{inline}", file=sys.stderr)
    if job.oversubscribed():
        print(f"warning: {job.workers} workers x {job.threads} threads > {_physical_cores()} cores; ncnn slows "
              "down badly when oversubscribed", file=sys.stderr)
    if job.skipped_videos:
        print(f"batch: skipped {job.skipped_videos} video file(s) under {a.input}: a folder gives image rows; list "
              "videos in a table's video column", file=sys.stderr)
    try:
        for _ in job.run():
            pass
    except BrokenPipeError:
        raise
    except OSError as e:
        if a.output is None:
            raise
        # a full disk, a file size limit: the rows written before it are whole, and a rerun resumes
        raise EdgevlError(f"{os_error_line(e)}; the job stopped, and the rows done so far are kept in "
                          f"{' '.join(str(a.output).splitlines())}: rerun the same command to resume") from None
    if job.torn_bytes:
        print(f"batch: cut a torn last line ({job.torn_bytes} bytes) left by a killed run", file=sys.stderr)
    if job.repaired:
        print(f"batch: moved {job.repaired} line(s) that were not result rows to {job.rejected}", file=sys.stderr)
    if job.asked_otherwise:
        print(f"batch: warning: {job.asked_otherwise} row(s) already done were asked another prompt than this run's; "
              "they are kept as they are (--overwrite asks every row again)", file=sys.stderr)
    if job.made_otherwise:
        print(f"batch: warning: {job.made_otherwise} row(s) already done were made by another model, other "
              "settings or another version of their image file than this run's; they are kept as they are "
              "(--overwrite asks every row again)", file=sys.stderr)
    if job.foreign:
        print(f"batch: warning: {job.foreign} row(s) in {a.output} are not rows of this input (another job's?); "
              "they are kept as they are (--overwrite starts the file again)", file=sys.stderr)
    if job.recovered:
        print(f"batch: merged {job.recovered} rows that Ray actors had finished before the last stop",
              file=sys.stderr)
    print(job.summary(), file=sys.stderr)
    return 1 if job.failed else 0
