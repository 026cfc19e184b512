"""Speculative decoding with the MTP block: decode speed with and without it, against llama.cpp.

    python benchmarks/speculative.py PKG [PKG ...] --hf HF_DIR [--llama-server BIN]
        [--threads 2] [--prompt-tokens 64] [--gen-tokens 48] [--repeats 5]
        [--accept 0,0.6,0.8,0.9] [--draft-tokens 1,auto] [--forced-draft-tokens auto] [--draft-vocab N]
        [--json OUT] [--markdown OUT]

Every system runs in its own process, one after another, round after round (interleaved, so the
shared machine's drift hits them alike); the table gives the median (min-max) of each.

- ``edgevl``: a package without drafting (``speculative="none"``), and with the MTP block
  (``natural``: its own drafts, as decoding goes).
- ``edgevl forced p``: the verifier accepts each draft with probability p whatever the model says
  (else it takes another token): the speed at a given acceptance, on any checkpoint. Benchmark
  only — the output is then not the model's.
- ``llama.cpp``: ``llama-server`` built from llama-cpp-python's vendored source (see
  docs/benchmarks.md), plain and with ``--spec-type draft-mtp --spec-draft-n-max K``, on the GGUF
  of ``--hf`` converted with its MTP block; greedy, the same prompt token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np


def worker(a: dict) -> dict:
    """One edgevl run (``edgevl.bench``'s worker), with the forced acceptance if asked."""
    from edgevl import bench
    from edgevl.sample import Sampler

    p = a.pop("forced", None)
    if p is not None:
        rng = np.random.default_rng(1234)
        real = Sampler.check

        def check(self, logits, history, draft):
            if rng.random() < p:
                return int(draft)
            t = real(self, logits, history, draft)
            return t if t != draft else (t + 1) % len(logits)
        Sampler.check = check
    out = bench.worker_edgevl(a)
    out["speculative"] = (out.get("runtime") or {}).get("speculative")
    return out


def run_edgevl(args: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, "worker", json.dumps(args)], capture_output=True, text=True,
                       timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"edgevl worker failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_llamacpp(server: str, gguf: Path, ids: list, gen: int, threads: int, draft: int = 0) -> dict:
    """llama-server on a free port: one greedy completion of ``gen`` tokens after ``ids``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [server, "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-c", str(len(ids) + gen + 64), "-np", "1", "--no-webui"]
    if draft:
        cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(draft)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            raise SystemExit("llama-server did not start")
        body = {"prompt": ids, "n_predict": gen, "temperature": 0, "top_k": 1, "cache_prompt": False,
                "ignore_eos": True}
        req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            res = json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait(30)
    t = res["timings"]
    out = {"decode_tok_s": t["predicted_per_second"], "prefill_tok_s": t["prompt_per_second"],
           "tokens": res.get("tokens") or []}
    if "draft_n" in t:
        out["speculative"] = {"drafted": t["draft_n"], "accepted": t["draft_n_accepted"]}
    return out


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list:
    from edgevl.bench import _prompt_ids

    return _prompt_ids(n, vocab, seed)


def median_range(xs) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def _parse_k(x: str):
    return None if x == "auto" else int(x)


def _k(k) -> str:
    return "k=auto" if k is None else f"k={k}"


def _k_options(k) -> dict:
    # auto: the default (up to DEFAULT_DRAFT_TOKENS drafts, as many as pay)
    return {} if k is None else {"draft_tokens": k}


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("packages", nargs="+")
    ap.add_argument("--hf", help="the checkpoint the packages come from (llama.cpp's GGUF is converted from it)")
    ap.add_argument("--llama-server", help="llama-server binary (built from llama-cpp-python's vendored source)")
    ap.add_argument("--gguf-types", default="bf16", help="comma-separated GGUF types, one per package (bf16, q8_0)")
    ap.add_argument("--work", default="bench-work", help="where GGUF files are kept")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--accept", default="0,0.6,0.8,0.9", help="forced acceptance rates (empty: none)")
    ap.add_argument("--draft-tokens", default="1,auto", help="edgevl's draft tokens per pass (auto: the default)")
    ap.add_argument("--forced-draft-tokens", default="auto", help="the --draft-tokens values run at forced acceptance")
    ap.add_argument("--llama-drafts", default="1,2,3", help="llama.cpp's --spec-draft-n-max values")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="also run edgevl drafting among the first N vocabulary rows (0: all)")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    a = ap.parse_args(argv)
    if a.llama_server and not a.hf:
        ap.error("--llama-server needs --hf (the checkpoint its GGUF is converted from)")
    if a.llama_server and not shutil.which(a.llama_server):
        ap.error(f"--llama-server {a.llama_server}: no such program (build llama.cpp's llama-server first)")

    from edgevl.progress import Progress

    systems = {}
    ks = [_parse_k(k) for k in a.draft_tokens.split(",") if k]
    accepts = [float(x) for x in a.accept.split(",") if x]
    types = a.gguf_types.split(",")
    base = {"threads": a.threads, "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens}
    dtypes = [json.loads((Path(pkg) / "manifest.json").read_text())["dtype"] for pkg in a.packages]
    for i, pkg in enumerate(a.packages):
        dtype = dtypes[i]
        # two packages of one precision are told apart by their folder (one key each, none dropped)
        tag = f"edgevl {dtype}" + (f" ({Path(pkg).resolve().name})" if dtypes.count(dtype) > 1 else "")
        systems[f"{tag}"] = ("edgevl", dict(base, model=pkg, options={"speculative": "none"}))
        for k in ks:
            systems[f"{tag} MTP {_k(k)}"] = ("edgevl", dict(base, model=pkg, options=_k_options(k)))
        for k in [_parse_k(x) for x in a.forced_draft_tokens.split(",") if x]:
            for p in accepts:
                systems[f"{tag} MTP {_k(k)} forced {p:g}"] = (
                    "edgevl", dict(base, model=pkg, options=_k_options(k), forced=p))
        if a.draft_vocab is not None:
            systems[f"{tag} MTP {_k(ks[0])} draft vocab {a.draft_vocab or 'all'}"] = (
                "edgevl", dict(base, model=pkg, options={**_k_options(ks[0]), "draft_vocab": a.draft_vocab}))
        if a.llama_server and a.hf:
            from edgevl import models
            from edgevl.bench import gguf_for
            from edgevl.weights import Checkpoint

            t = types[min(i, len(types) - 1)]
            work = Path(a.work)
            work.mkdir(parents=True, exist_ok=True)
            profile = models.resolve(Checkpoint(a.hf).config).bench
            gguf = gguf_for(Path(a.hf), work, t, profile)
            vocab = int(json.loads((Path(pkg) / "manifest.json").read_text())["embedding"]["rows"])
            ids = prompt_ids(a.prompt_tokens, vocab)
            systems[f"llama.cpp {t}"] = ("llamacpp", dict(gguf=str(gguf), ids=ids, draft=0))
            for d in [int(x) for x in a.llama_drafts.split(",") if x]:
                systems[f"llama.cpp {t} MTP n={d}"] = ("llamacpp", dict(gguf=str(gguf), ids=ids, draft=d))

    runs = {name: [] for name in systems}
    bar = Progress(a.repeats * len(systems), desc="speculative bench", unit="runs")
    for _ in range(a.repeats):
        for name, (kind, args) in systems.items():
            bar.update(0, name)
            if kind == "edgevl":
                r = run_edgevl(dict(args))
            else:
                r = run_llamacpp(a.llama_server, Path(args["gguf"]), args["ids"], a.gen_tokens, a.threads,
                                 args["draft"])
            runs[name].append(r)
            bar.update(1, name)
    bar.close()

    lines = ["| system | decode tok/s | vs edgevl without MTP | vs llama.cpp without MTP | drafts accepted |",
             "|---|---|---|---|---|"]
    plain = {}
    for name, rs in runs.items():
        if " MTP" not in name and "forced" not in name and "vocab" not in name:
            plain[name] = statistics.median(r["decode_tok_s"] for r in rs)
    # the llama.cpp run of each package (types given in package order)
    tags = [k for k in plain if k.startswith("edgevl ")]
    llama = [k for k in plain if k.startswith("llama.cpp ")]
    for name, rs in runs.items():
        d = [r["decode_tok_s"] for r in rs]
        ref = next((v for k, v in plain.items() if name.startswith(k) and k != name), None)
        mine = next((i for i, k in enumerate(tags) if name.startswith(k)), None)
        lref = plain[llama[mine]] if mine is not None and mine < len(llama) and name.startswith("edgevl") else None
        spec = [r.get("speculative") for r in rs if r.get("speculative")]
        acc = (f"{sum(s['accepted'] for s in spec)} / {sum(s['drafted'] for s in spec)}" if spec else "—")
        ratio = f"{statistics.median(d) / ref:.2f}×" if ref else "—"
        lratio = f"{statistics.median(d) / lref:.2f}×" if lref else "—"
        lines.append(f"| {name} | {median_range(d)} | {ratio} | {lratio} | {acc} |")
    table = "\n".join(lines)
    print(table)
    if a.markdown:
        Path(a.markdown).write_text(
            f"# Speculative decoding ({a.threads} threads, {a.prompt_tokens}-token prompt, {a.gen_tokens} greedy "
            f"tokens, {a.repeats} interleaved rounds; median (min–max))\n\n{table}\n")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "runs": runs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
