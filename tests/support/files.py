"""Files tests compare, damage or make up: digests of a folder and of a package, a JSON file
edited in place, a huge PNG written fast, the rows of a JSONL output."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path


def tree_digest(folder) -> dict:
    """name -> sha256 of every file under ``folder`` (to prove files are untouched)."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def package_digest(folder) -> dict:
    """Every file's bytes, the manifest compared without what legitimately differs between two
    conversions of equal weights (creation time, the source path and the source file hashes)."""
    folder = Path(folder)
    out = tree_digest(folder)
    m = json.loads((folder / "manifest.json").read_text())
    for k in ("created", "source", "manifest_sha256"):
        m.pop(k, None)
    out["manifest.json"] = json.dumps(m, sort_keys=True)
    return out


def edit_json(path, fn, restamp: bool = True) -> None:
    """Edit a JSON file. An edited manifest gets its own digest again (``restamp``), as a converter
    that wrote those values would have: tests of what the runtime makes of a value are not
    stopped by the digest (tests/convert/test_damaged_packages.py checks the digest itself)."""
    from edgevl.package import manifest_digest

    path = Path(path)
    data = json.loads(path.read_text())
    new = fn(data)  # edits in place (returns None) or returns the replacement
    out = data if new is None else new
    if restamp and path.name == "manifest.json" and isinstance(out, dict) and "manifest_sha256" in out:
        out["manifest_sha256"] = manifest_digest(out)
    path.write_text(json.dumps(out))


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data and CRC."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(path, width: int, height: int, rgb=(200, 30, 30), rows_per_block: int = 64) -> Path:
    """A valid RGB PNG of one colour, width x height, written in well under a second however big:
    identical row blocks compress to identical bytes after a full flush, so one block is
    compressed and its output repeated (the Adler-32 trailer is computed over the real data)."""
    row = b"\x00" + bytes(rgb) * width
    block = row * rows_per_block
    c = zlib.compressobj(9)
    first = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    n_blocks, rest = divmod(height, rows_per_block)
    tail = c.compress(row * rest) + c.flush() if rest else c.flush()
    adler = 1
    for _ in range(n_blocks):
        adler = zlib.adler32(block, adler)
    adler = zlib.adler32(row * rest, adler)
    idat = first + again * (n_blocks - 1) + tail[:-4] + struct.pack(">I", adler)

    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n"
                           + png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                           + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b""))
    return Path(path)


def read_jsonl(path):
    """Rows of a JSONL output; every line must be complete JSON (no torn lines)."""
    data = Path(path).read_bytes()
    assert data == b"" or data.endswith(b"\n"), "torn last line"
    return [json.loads(line) for line in data.decode().splitlines()]
