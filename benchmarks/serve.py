"""Concurrent streams: aggregate tokens/s, time to first token and time per token (p50/p95) at 1, 2,
4 and 8 streams, through the engine that `edgevl serve` uses, optionally through `edgevl serve`
itself over HTTP and through llama.cpp's `llama-server -np N` on the same checkpoint, against one
stream of the plain API.

    python benchmarks/serve.py PKG [--streams 1 2 4 8] [--tokens 64] [--prompt 40] [--threads 2]
        [--speculative none|mtp] [--plain] [--forced P] [--http] [--llama-server BIN --gguf FILE
        [--llama-draft K]] [--json OUT.json] [--plot OUT.png]

Every stream gets its own prompt, random words as one user message in the chat template,
``--prompt`` tokens (or just over), and decodes ``--tokens`` tokens (greedy, no early stop);
streams start together. Every system computes the same tokens: the API, the engine and
llama-server (``/completion``, streamed) get the templated token ids, and ``--http`` sends the
words as the message to ``edgevl serve``'s chat completions (streamed; its first chunk marks the
first token, its last the end). Each server is started once with ``max(--streams)`` slots.
Rounds run interleaved (API, then each system at each count of streams) so that a machine's
drift touches all of them alike.
``--plain`` adds the engine with drafting off on the same loaded model (drafting on against off at
each count of streams); ``--forced P`` makes the verifier in this process accept each draft with
probability P (random checkpoints' blocks draft at no realistic rate). llama-server: built as
docs/benchmarks.md says, GGUF from ``edgevl bench``'s converter (``--compare llamacpp``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

import edgevl
from edgevl.engine import Engine
from edgevl.generate import prepare

# words for the prompts: text that every system gets alike (the server as a chat message, the
# others as the token ids of that message in the chat template)
WORDS = ("the a small red blue green old new cat dog bird tree house river road car boat window door "
         "table chair book lamp cup sun moon star rain snow wind light shadow morning evening city field "
         "near under over behind beside sits runs sleeps looks waits stands falls grows shines").split()


def make_prompts(model, n: int, length: int, seed: int) -> list:
    """``n`` prompts as (text, ids): random words, and the ids of that text as the one user
    message of the chat template, ``length`` tokens or just over."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words: list = []
        while True:
            words.append(str(rng.choice(WORDS)))
            text = " ".join(words)
            ids = prepare(model, [{"role": "user", "content": text}]).input_ids
            if len(ids) >= length:
                break
        out.append((text, [int(t) for t in ids]))
    return out


def one_round(model, engine, n: int, tokens: int, prompt: int, seed: int) -> dict:
    prompts = [ids for _, ids in make_prompts(model, n, prompt, seed)]
    marks = [[] for _ in range(n)]
    t0 = time.perf_counter()

    def run(i):
        gen = (engine or model).generate_tokens(prompts[i], tokens, ignore_eos=True, reuse_cache=False)
        for _ in gen:
            marks[i].append(time.perf_counter())

    return together(run, n, t0, marks, [0] * n)


def together(run, n: int, t0: float, marks: list, counts: list) -> dict:
    """``run(i)`` for each stream on its own thread, all at once; ``marks[i]``: the times stream
    i got a chunk (the first with its first token), ``counts[i]``: its tokens (0: one per mark)."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    got = [c or len(m) for c, m in zip(counts, marks)]
    ttft = [m[0] - t0 for m in marks if m]
    # chunks may carry several tokens: time per token over the tokens after the first chunk
    tpot = [(m[-1] - m[0]) / max(1, g - 1) for m, g in zip(marks, got) if len(m) > 1]
    return {"streams": n, "tokens": sum(got), "wall_s": wall, "aggregate_tps": sum(got) / wall,
            "ttft_s": ttft, "tpot_s": tpot}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list, url: str, what: str) -> subprocess.Popen:
    """``cmd`` started, once ``url``/health answers. Its log goes to a file, not a pipe: nobody
    reads the pipe while the benchmark runs, and a server blocks once its log fills it."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    for _ in range(1200):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-2000:]
                raise SystemExit(f"{what} exited: {tail}") from None
            time.sleep(0.25)
    proc.terminate()
    raise SystemExit(f"{what} did not start")


def http_round(url: str, bodies: list, path: str) -> dict:
    """Streams ``bodies`` together (one thread each), each chunk with text or a token a mark."""
    n = len(bodies)
    marks = [[] for _ in range(n)]
    counts = [0] * n
    t0 = time.perf_counter()

    def run(i):
        req = urllib.request.Request(url + path, json.dumps(bodies[i]).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                ev = json.loads(line[5:])
                if "choices" in ev:     # OpenAI chunks (edgevl serve): the first is sent with the first
                    # token (after the prompt); text may be held back (whitespace, a possible stop
                    # string), so the tokens are counted from the usage and timed to the last chunk
                    if ev.get("usage"):
                        counts[i] = ev["usage"]["completion_tokens"]
                    elif not marks[i] or any(c.get("finish_reason") for c in ev["choices"]):
                        marks[i].append(time.perf_counter())
                else:                   # llama-server /completion: one event per token
                    if ev.get("tokens") or ev.get("content"):
                        marks[i].append(time.perf_counter())
                    if ev.get("stop"):
                        counts[i] = ev.get("tokens_predicted", len(marks[i]))

    return together(run, n, t0, marks, counts)


def check_llama(ap, server, gguf) -> None:
    """llama-server's arguments, refused in one line before any work (the scripts share it)."""
    if bool(server) != bool(gguf):
        ap.error("--llama-server and --gguf go together (the binary and the checkpoint as GGUF)")
    if server and not shutil.which(server):
        ap.error(f"--llama-server {server}: no such program (build llama.cpp's llama-server first)")
    if gguf and not os.path.isfile(gguf):
        ap.error(f"--gguf {gguf}: no such file")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("package")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--speculative", default=None)
    ap.add_argument("--http", action="store_true", help="also through `edgevl serve` (chat completions)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary: also through it (-np N)")
    ap.add_argument("--gguf", default=None, help="the checkpoint as GGUF, for --llama-server")
    ap.add_argument("--llama-draft", type=int, default=0, help="llama-server drafts K tokens with the MTP block")
    ap.add_argument("--forced", type=float, default=None,
                    help="in this process, accept each draft with this probability (benchmarks/structured.py)")
    ap.add_argument("--plain", action="store_true",
                    help="also the engine with drafting off (plain batched steps), on the same loaded model")
    ap.add_argument("--label", default=None, help="the package's name in the table and plot")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    check_llama(ap, a.llama_server, a.gguf)
    if a.forced is not None and (a.http or a.llama_server):
        ap.error("--forced changes the verifier in this process only; it cannot apply to --http or --llama-server")
    if a.forced is not None:
        from structured import force_acceptance

        force_acceptance(a.forced)
    opts = {} if a.speculative is None else {"speculative": a.speculative}
    model = edgevl.load(a.package, threads=a.threads, **opts)
    engine = Engine(model, parallel=max(a.streams))
    one_round(model, engine, 2, 8, a.prompt, 0)     # warm-up: first-use allocations
    engines = {"engine": engine}
    if a.plain:
        plain = engines["engine, no drafting"] = Engine(model, parallel=max(a.streams))
        plain._cycle = plain._step
        plain._choose = lambda decoding, **_: plain._run(plain._step, decoding)
    top = max(a.streams)
    servers, procs = {}, []
    try:
        if a.http:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "edgevl", "serve", a.package, "--port", str(port), "--threads",
                   str(a.threads), "--parallel", str(top), "--max-queue", str(top)]
            if a.speculative:
                cmd += ["--speculative", a.speculative]
            procs.append(start_server(cmd, url, "edgevl serve"))
            def chat(prompt, tokens=a.tokens):
                return {"messages": [{"role": "user", "content": prompt[0]}], "max_tokens": tokens,
                        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            servers["edgevl serve"] = (url, "/v1/chat/completions", chat)
        if a.llama_server:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [a.llama_server, "-m", a.gguf, "--port", str(port), "-t", str(a.threads), "-tb",
                   str(a.threads), "-np", str(top), "-c", str(top * (a.prompt + a.tokens + 64)), "--no-webui"]
            if a.llama_draft:
                cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(a.llama_draft)]
            procs.append(start_server(cmd, url, "llama-server"))

            def completion(prompt, tokens=a.tokens):
                return {"prompt": prompt[1], "n_predict": tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
                        "cache_prompt": False, "stream": True}
            servers["llama-server"] = (url, "/completion", completion)

        def prompts(n, seed):
            return make_prompts(model, n, a.prompt, seed)

        for url, path, body in servers.values():     # warm-up
            http_round(url, [body(p, 8) for p in prompts(2, 0)], path)
        rows: dict = {"api": []}
        rows.update({(name, n): [] for name in [*engines, *servers] for n in a.streams})
        for r in range(a.rounds):
            rows["api"].append(one_round(model, None, 1, a.tokens, a.prompt, 100 + r))
            for n in a.streams:
                # every system gets the same prompts in a run, and no run repeats an earlier run's:
                # edgevl serve keeps finished prompts for prefix reuse (the engine rows and
                # llama-server are asked not to), so a repeated prompt would be computed only there
                seed = 1000 * (r + 1) + n
                for name, e in engines.items():
                    rows[(name, n)].append(one_round(model, e, n, a.tokens, a.prompt, seed))
                for name, (url, path, body) in servers.items():
                    rows[(name, n)].append(http_round(url, [body(p) for p in prompts(n, seed)], path))
    finally:
        for e in engines.values():
            e.close()
        for p in procs:
            p.terminate()
            p.wait(30)

    def summary(runs):
        ttft = np.concatenate([x["ttft_s"] for x in runs])
        tpot = np.concatenate([x["tpot_s"] for x in runs])
        ms = {f"{k}_p{q}_ms": float(np.percentile(v, q) * 1e3) for k, v in (("ttft", ttft), ("tpot", tpot))
              for q in (50, 95)}
        return {"aggregate_tps": float(np.median([x["aggregate_tps"] for x in runs])), **ms}

    systems = [*engines, *servers]
    out = {"package": a.package, "threads": a.threads, "tokens": a.tokens, "prompt": a.prompt,
           "speculative": model.speculative, "rounds": a.rounds, "llama_draft": a.llama_draft, "forced": a.forced,
           "api_one_stream": summary(rows["api"]),
           "systems": {s: {str(n): summary(rows[(s, n)]) for n in a.streams} for s in systems}}
    out["engine"] = out["systems"]["engine"]
    print(f"API, one stream: {out['api_one_stream']['aggregate_tps']:.1f} tok/s")
    print("system               streams  aggregate tok/s  x one stream  TTFT p50/p95 ms  TPOT p50/p95 ms")
    for name in systems:
        one = out["systems"][name][str(a.streams[0])]["aggregate_tps"]
        for n in a.streams:
            s = out["systems"][name][str(n)]
            print(f"{name:20s} {n:7d}  {s['aggregate_tps']:15.1f}  {s['aggregate_tps'] / one:12.2f}  "
                  f"{s['ttft_p50_ms']:6.0f}/{s['ttft_p95_ms']:<6.0f}   {s['tpot_p50_ms']:6.1f}/{s['tpot_p95_ms']:.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.plot:
        plot(out, a.plot, a.label or os.path.basename(a.package.rstrip("/")))


def plot(out: dict, path: str, title: str) -> None:
    """Aggregate tokens/s against concurrent streams, one line per system, the API's one stream
    as a reference."""
    from lineplot import line_plot

    streams = sorted(int(n) for n in out["engine"])
    lines = {name: [out["systems"][name][str(n)]["aggregate_tps"] for n in streams] for name in out["systems"]}
    line_plot(path, f"{title}, {out['threads']} threads: aggregate tokens/s", streams, lines, "concurrent streams",
              ref=(out["api_one_stream"]["aggregate_tps"], "API, one stream"))

if __name__ == "__main__":
    main()
