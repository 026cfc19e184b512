"""Shared pieces of the hostile-input tests (tests/test_hostile_*.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from helpers import make_youtu

# the smallest Youtu-LLM that still has every block (q_lora off, one layer): converts in ~30 ms
TINY = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, num_hidden_layers=1, max_position_embeddings=64)


def tiny_checkpoint(folder, seed: int = 1) -> Path:
    return make_youtu(folder, seed=seed, **TINY)


def cli(capsys, *args) -> tuple[int, str, str]:
    """``edgevl ARGS`` in this process (exit code, stdout, stderr)."""
    from edgevl.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *needles: str) -> str:
    """Exit 2 and exactly one ``error: ...`` line (the last), naming every needle."""
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), err
    assert sum(line.startswith("error: ") for line in lines) == 1, err
    for n in needles:
        assert n in lines[-1], (n, lines[-1])
    return lines[-1]


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
    for k in ("created", "source"):
        m.pop(k, None)
    out["manifest.json"] = json.dumps(m, sort_keys=True)
    return out


def edit_json(path, fn) -> None:
    path = Path(path)
    data = json.loads(path.read_text())
    new = fn(data)  # edits in place (returns None) or returns the replacement
    path.write_text(json.dumps(data if new is None else new))


def png_bomb(path, width: int, height: int, rgb=(200, 30, 30), rows_per_block: int = 64) -> Path:
    """A valid RGB PNG of one colour, width x height, written in well under a second however big:
    identical row blocks compress to identical bytes after a full flush, so one block is
    compressed and its output repeated (the Adler-32 trailer is computed over the real data)."""
    import struct
    import zlib

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

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                           + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return Path(path)
