"""`diffspec serve` under concurrent load (issue 8): with and without the drafter, in one run.

    python benchmarks/serve_load.py --model smollm2-135m-instruct --configs auto none \
        --concurrency 1 4 8 --requests 20 --max-tokens 128 --max-queue 32 --seed 0 \
        --out benchmarks/results/issue8_serve_load

For each drafter configuration (`auto` = the default drafter for the model, `none` = plain
decoding through the same engine) a `diffspec serve` subprocess is started on 127.0.0.1 with a
free port (`--port 0`, the URL is read from its startup line), /health is polled until it
answers, one warm-up request is sent (not counted), then for each concurrency level N the same
list of `--requests` requests is run by N client workers that each pull the next request from a
shared list until all are done. Requests are streaming chat completions (httpx, SSE) with
temperature 0, `max_tokens`, and `stream_options.include_usage`. Prompts: a seeded, fixed mix of
HumanEval prompts and MT-Bench first turns (diffspec.datasets), the same for every level and
configuration. /metrics is scraped once at the end of each configuration, then the server is
stopped (SIGINT, graceful).

Per request (results.jsonl): latency = send -> last SSE event ([DONE]); TTFT = send -> first
chunk with non-empty content (includes the time spent waiting in the server's FIFO queue, since
one engine serves one request at a time); completion tokens from `usage`; HTTP status / error;
the server's `speculative` object; the text. Per (config, concurrency) (summary.json / .md):
throughput = total completion tokens / wall time of that level (first send -> last finish),
p50/p95 latency and TTFT (linear interpolation between order statistics), errors (non-2xx or an
error event; 429s counted apart), mean accepted length (mean of the per-request values). Greedy
must be lossless: each request's text with every drafter configuration is compared with the
`none` text for the same request and level; mismatches are counted (and the script exits 1).
`--max-queue` must be at least the largest concurrency - 1 so that no request is refused with 429.

The machine is shared: before each level the script waits (up to `--wait-quiet` s) until other
processes use < 0.2 core, and records the CPU seconds other processes used during each level
("other CPU s"; near 0 = undisturbed). `--rebuild` recomputes summary.json / summary.md in
`--out` from results.jsonl without running anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

URL_RE = re.compile(r"diffspec serve: (http://\S+?)/v1 ")


# --- pure helpers (tested in tests/test_serve_load.py) ----------------------------------------
def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_level(rows: Sequence[dict], wall_s: float) -> dict:
    """Summary of one (config, concurrency) level from its per-request rows."""
    ok = [r for r in rows if r["ok"]]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    spec = [r for r in ok if r.get("speculative")]
    mal = [r["speculative"]["mean_accepted_length"] for r in spec]
    rounds = sum(r["speculative"]["rounds"] for r in spec)
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return {
        "requests": len(rows),
        "ok": len(ok),
        "errors": sum(1 for r in rows if not r["ok"] and r["status"] != 429),
        "http_429": sum(1 for r in rows if r["status"] == 429),
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "throughput_tok_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "latency_p50_s": r3(percentile(lat, 50)),
        "latency_p95_s": r3(percentile(lat, 95)),
        "ttft_p50_s": r3(percentile(ttft, 50)),
        "ttft_p95_s": r3(percentile(ttft, 95)),
        "mean_accepted_length": round(sum(mal) / len(mal), 3) if mal else None,
        # tokens per round over all requests (the server's diffspec_mean_accepted_length); a request cut
        # by a stop string counts its returned tokens only (no stop strings are sent here)
        "pooled_accepted_length": round(sum(r["completion_tokens"] or 0 for r in spec) / rounds, 3) if rounds else None,
    }


def lossless_mismatches(rows: Sequence[dict], baseline: str = "none") -> list:
    """(config, concurrency, index) of every request whose text differs from the baseline config's
    text for the same (concurrency, index); requests that failed in either are skipped."""
    base = {(r["concurrency"], r["index"]): r for r in rows if r["config"] == baseline and r["ok"]}
    out = []
    for r in rows:
        if r["config"] == baseline or not r["ok"]:
            continue
        b = base.get((r["concurrency"], r["index"]))
        if b is not None and b["text"] != r["text"]:
            out.append((r["config"], r["concurrency"], r["index"]))
    return out


def markdown_table(summary: Sequence[dict]) -> str:
    head = ("| drafter | clients | requests | errors | 429s | tokens | wall s | throughput tok/s | "
            "p50 latency s | p95 latency s | p50 TTFT s | p95 TTFT s | accepted length: mean | pooled | other CPU s |")
    lines = [head, "|" + "---|" * 15]
    f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    for s in summary:
        lines.append(f"| {s['config']} | {s['concurrency']} | {s['requests']} | {s['errors']} | {s['http_429']} | "
                     f"{s['completion_tokens']} | {f(s['wall_s'], 1)} | {f(s['throughput_tok_s'])} | "
                     f"{f(s['latency_p50_s'])} | {f(s['latency_p95_s'])} | {f(s['ttft_p50_s'])} | "
                     f"{f(s['ttft_p95_s'])} | {f(s['mean_accepted_length'])} | "
                     f"{f(s.get('pooled_accepted_length'))} | {f(s.get('other_cpu_s'), 1)} |")
    return "\n".join(lines)


# --- prompts ------------------------------------------------------------------------------------
def build_requests(n: int, seed: int) -> list:
    """n prompts, half HumanEval and half MT-Bench first turns (HumanEval gets the odd one), drawn
    and shuffled with `seed`."""
    from diffspec.datasets import load_prompts

    rng = random.Random(seed)
    he = [p for p in load_prompts("humaneval") if p[1].strip()]
    mt = [p for p in load_prompts("mtbench") if p[1].strip()]
    n_he = (n + 1) // 2
    picked = [("humaneval",) + p for p in rng.sample(he, n_he)] + [("mtbench",) + p for p in rng.sample(mt, n - n_he)]
    rng.shuffle(picked)
    return [{"index": i, "dataset": d, "prompt_id": pid, "prompt": text} for i, (d, pid, text) in enumerate(picked)]


# --- other work on the machine ---------------------------------------------------------------------
CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_cpu_s() -> Optional[float]:
    """CPU seconds all processes spent busy since boot (/proc/stat), None where unavailable."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(v[:3]) + sum(v[5:8])) / CLK  # user nice system (not idle iowait) irq softirq steal


def proc_cpu_s(pid: int) -> float:
    """CPU seconds used by one process (user + system, its threads included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK
    except (OSError, ValueError, IndexError):
        return 0.0


class ForeignCpu:
    """CPU seconds spent by processes other than this one and the server between start() and stop():
    the measurement is only clean when this is near 0 (a 2-core machine shared with other work)."""

    def __init__(self, server_pid: int):
        self.pid = server_pid

    def _mark(self):
        t = os.times()
        return busy_cpu_s(), proc_cpu_s(self.pid) + t.user + t.system

    def start(self) -> "ForeignCpu":
        self._t0, self._b0 = time.perf_counter(), self._mark()
        return self

    def stop(self) -> Optional[float]:
        b1 = self._mark()
        if b1[0] is None or self._b0[0] is None:
            return None
        return max(0.0, (b1[0] - self._b0[0]) - (b1[1] - self._b0[1]))


def wait_quiet(server_pid: int, max_wait_s: float, threshold: float = 0.2, window_s: float = 5.0) -> float:
    """Wait (up to max_wait_s) until other processes use < threshold of one core over window_s; returns
    the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s:
        probe = ForeignCpu(server_pid).start()
        time.sleep(window_s)
        used = probe.stop()
        if used is None or used / window_s < threshold:
            break
    return time.perf_counter() - t0


# --- the server subprocess ----------------------------------------------------------------------
class Server:
    """`diffspec serve` in a subprocess; stderr/stdout go to a log file, the URL is read from it."""

    def __init__(self, args, drafter: str, log_path: Path):
        cmd = [sys.executable, "-m", "diffspec", "serve", "--model", args.model, "--drafter", drafter,
               "--host", "127.0.0.1", "--port", "0", "--max-queue", str(args.max_queue),
               "--log-level", "warning"] + list(args.serve_args)
        self.cmd = cmd
        self.log_path = log_path
        self.announce: Optional[str] = None
        self.url: Optional[str] = None
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self._found = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            m = URL_RE.search(line)
            if m and self.url is None:
                self.url, self.announce = m.group(1), line.strip()
                self._found.set()
        self._found.set()

    def wait_ready(self, timeout: float) -> str:
        import httpx

        deadline = time.monotonic() + timeout
        self._found.wait(timeout)
        if self.url is None:
            raise RuntimeError(f"the server did not print its URL; see {self.log_path}")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"/health did not answer in {timeout} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        self._log.close()


# --- the client ---------------------------------------------------------------------------------
async def one_request(client, url: str, model: str, req: dict, max_tokens: int, timeout: float) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": req["prompt"]}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    out = {"status": None, "ok": False, "error": None, "ttft_s": None, "latency_s": None, "completion_tokens": None,
           "prompt_tokens": None, "finish_reason": None, "speculative": None, "text": None}
    parts = []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as resp:
            out["status"] = resp.status_code
            out["headers_s"] = round(time.perf_counter() - t0, 4)
            if resp.status_code // 100 != 2:
                raw = await resp.aread()
                out["error"] = raw.decode(errors="replace")[:500]
                out["latency_s"] = time.perf_counter() - t0
                return out
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    out["error"] = json.dumps(obj["error"])[:500]
                    continue
                for ch in obj.get("choices") or []:
                    content = (ch.get("delta") or {}).get("content")
                    if content:
                        if out["ttft_s"] is None:
                            out["ttft_s"] = time.perf_counter() - t0
                        parts.append(content)
                    if ch.get("finish_reason"):
                        out["finish_reason"] = ch["finish_reason"]
                if obj.get("usage"):
                    out["completion_tokens"] = obj["usage"].get("completion_tokens")
                    out["prompt_tokens"] = obj["usage"].get("prompt_tokens")
                if obj.get("speculative"):
                    out["speculative"] = obj["speculative"]
            out["latency_s"] = time.perf_counter() - t0
            if not done and out["error"] is None:
                out["error"] = "the stream ended without [DONE]"
    except Exception as e:  # noqa: BLE001 - counted as an error, reported per request
        out["latency_s"] = time.perf_counter() - t0
        out["error"] = f"{type(e).__name__}: {e}"
    out["text"] = "".join(parts)
    out["ok"] = out["error"] is None and out["status"] is not None and out["status"] // 100 == 2
    return out


async def run_level(url: str, model: str, requests: list, concurrency: int, max_tokens: int,
                    timeout: float) -> tuple:
    """All requests by `concurrency` workers pulling from one shared list; (rows, wall seconds)."""
    import httpx

    pending = list(requests)
    rows = []
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        t_level = time.perf_counter()

        async def worker(wid: int):
            while pending:
                req = pending.pop(0)
                start = time.perf_counter() - t_level
                res = await one_request(client, url, model, req, max_tokens, timeout)
                res.update(index=req["index"], dataset=req["dataset"], prompt_id=req["prompt_id"], worker=wid,
                           start_s=round(start, 4), end_s=round(time.perf_counter() - t_level, 4))
                rows.append(res)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - t_level
    rows.sort(key=lambda r: r["index"])
    return rows, wall


def scrape(url: str) -> str:
    import httpx

    return httpx.get(url + "/metrics", timeout=30).text


# --- main ---------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--configs", nargs="+", default=["auto", "none"],
                   help="drafter per server run; the one named 'none' is the lossless baseline")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--requests", type=int, default=20, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-queue", type=int, default=32, help="passed to serve; must be >= max concurrency - 1")
    p.add_argument("--seed", type=int, default=0, help="prompt sample and order")
    p.add_argument("--timeout", type=float, default=900.0, help="per request, seconds")
    p.add_argument("--wait-quiet", type=float, default=900.0,
                   help="before each level, wait up to this many seconds until other processes use < 0.2 core "
                        "(0 = do not wait); their CPU time during each level is recorded either way")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="extra arguments for diffspec serve (must come last)")
    p.add_argument("--out", default="benchmarks/results/issue8_serve_load")
    p.add_argument("--rebuild", action="store_true",
                   help="run nothing: recompute summary.json / summary.md in --out from its results.jsonl")
    args = p.parse_args(argv)
    if args.rebuild:
        return rebuild(Path(args.out))
    if args.max_queue < max(args.concurrency) - 1:
        p.error(f"--max-queue {args.max_queue} would refuse requests at {max(args.concurrency)} clients")

    from diffspec.bench.run import machine_info

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = build_requests(args.requests, args.seed)
    warmup = {"index": -1, "dataset": "warmup", "prompt_id": "warmup",
              "prompt": "Write a Python function that returns the sum of a list of numbers."}
    command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + (sys.argv[1:] if argv is None else list(argv)))
    t_run = time.perf_counter()
    rows, summary, servers = [], [], {}
    results_path = out / "results.jsonl"
    with open(results_path, "w") as fres:
        for config in args.configs:
            server = Server(args, config, out / f"server_{config}.log")
            try:
                t_start = time.perf_counter()
                url = server.wait_ready(args.startup_timeout)
                startup_s = time.perf_counter() - t_start
                print(f"[{config}] {server.announce} (ready in {startup_s:.1f} s)", file=sys.stderr, flush=True)
                w_rows, w_wall = asyncio.run(run_level(url, args.model, [warmup], 1, args.max_tokens, args.timeout))
                if not w_rows[0]["ok"]:
                    raise RuntimeError(f"warm-up request failed: {w_rows[0]['error']}")
                print(f"[{config}] warm-up {w_wall:.1f} s", file=sys.stderr, flush=True)
                for conc in args.concurrency:
                    waited = wait_quiet(server.proc.pid, args.wait_quiet) if args.wait_quiet > 0 else 0.0
                    if waited > 6:
                        print(f"[{config}] waited {waited:.0f} s for other work to stop", file=sys.stderr, flush=True)
                    foreign = ForeignCpu(server.proc.pid).start()
                    level_rows, wall = asyncio.run(run_level(url, args.model, requests, conc, args.max_tokens,
                                                             args.timeout))
                    other_cpu = foreign.stop()
                    for r in level_rows:
                        r.update(config=config, concurrency=conc)
                        fres.write(json.dumps(r, ensure_ascii=False) + "\n")
                    fres.flush()
                    rows.extend(level_rows)
                    s = {"config": config, "concurrency": conc, **summarize_level(level_rows, wall),
                         "other_cpu_s": None if other_cpu is None else round(other_cpu, 1),
                         "waited_for_quiet_s": round(waited, 1)}
                    summary.append(s)
                    print(f"[{config}] {conc} clients: {s['requests']} requests, {s['errors']} errors, "
                          f"{s['http_429']} 429s, {s['throughput_tok_s']} tok/s, p50/p95 latency "
                          f"{s['latency_p50_s']}/{s['latency_p95_s']} s, p50/p95 TTFT {s['ttft_p50_s']}/"
                          f"{s['ttft_p95_s']} s, mean accepted length {s['mean_accepted_length']}, "
                          f"other processes' CPU {s['other_cpu_s']} s", 
                          file=sys.stderr, flush=True)
                metrics_text = scrape(url)
                (out / f"metrics_{config}.txt").write_text(metrics_text)
                servers[config] = {"command": server.cmd[1:], "announce": server.announce,
                                   "startup_s": round(startup_s, 2), "warmup_s": round(w_wall, 2)}
            finally:
                server.stop()
    wall_total = time.perf_counter() - t_run
    meta = {
        "command": command, "model": args.model, "configs": args.configs, "concurrency": args.concurrency,
        "requests_per_level": args.requests, "max_tokens": args.max_tokens, "max_queue": args.max_queue,
        "seed": args.seed, "prompts": [{k: r[k] for k in ("index", "dataset", "prompt_id")} for r in requests],
        "servers": servers, "machine": machine_info(), "wall_s": round(wall_total, 1),
    }
    return write_reports(out, meta, rows, summary)


def write_reports(out: Path, meta: dict, rows: list, summary: list) -> int:
    """summary.json and summary.md from the run's metadata, per-request rows and level summaries;
    returns the exit status (1 on a lossless mismatch or an error)."""
    configs = meta["configs"]
    baseline = "none" if "none" in configs else None
    mismatches = lossless_mismatches(rows, baseline) if baseline else []
    compared = sum(1 for r in rows if baseline and r["config"] != baseline and r["ok"])
    # greedy answers must also not depend on how many clients were waiting
    by_req = {}
    for r in rows:
        if r["ok"]:
            by_req.setdefault((r["config"], r["index"]), set()).add(r["text"])
    across_levels = sorted(k for k, texts in by_req.items() if len(texts) > 1)
    machine, servers, wall_total = meta["machine"], meta["servers"], meta["wall_s"]
    result = {**meta, "summary": summary,
              "lossless": {"baseline": baseline, "compared": compared, "mismatches": mismatches},
              "texts_differing_across_levels": across_levels}
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")

    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in machine["cpu_flags"].items())
    md = [f"# `diffspec serve` under load: {meta['model']}, drafter {' vs '.join(configs)}", "",
          f"    {meta['command']}", "",
          f"{meta['requests_per_level']} streaming chat requests per level (temperature 0, max_tokens "
          f"{meta['max_tokens']}, seeded mix of HumanEval / MT-Bench first turns), N clients pulling from one shared "
          f"list; --max-queue {meta['max_queue']} (>= clients - 1, so no 429 is expected). Latency = send -> [DONE]; "
          f"TTFT = send -> first content chunk (includes waiting in the server's FIFO queue); "
          f"throughput = completion tokens / wall time of the level; accepted length: mean of the per-request "
          f"values, and pooled = all tokens / all rounds; other CPU s = CPU time used by processes "
          f"other than the server and this client during the level (near 0 = an undisturbed measurement).", "",
          markdown_table(summary), ""]
    for c, info in servers.items():
        md.append(f"- `{c}`: {info['announce']}")
    md += ["",
           f"Lossless (greedy): {compared} drafter responses compared with `{baseline}`, "
           f"{len(mismatches)} mismatches" + (f": {mismatches}" if mismatches else "") + "; "
           f"responses whose text differed between concurrency levels: {len(across_levels)}.",
           f"Total wall time {wall_total / 60:.1f} min. Machine: {machine['cpu']} ({machine['cpus']} CPUs, "
           f"torch threads {machine['threads']}; {flags}), torch {machine['torch']}, transformers "
           f"{machine['transformers']}, Python {machine['python']}, commit {machine['commit']}.",
           "Per request: results.jsonl; /metrics at the end of each server run (the warm-up request included): "
           "metrics_<drafter>.txt; server logs: server_<drafter>.log.", ""]
    (out / "summary.md").write_text("\n".join(md))
    print("\n".join(md), flush=True)
    errors = sum(s["errors"] + s["http_429"] for s in summary)
    return 1 if mismatches or errors else 0


def rebuild(out: Path) -> int:
    """Recompute summary.json / summary.md from results.jsonl and the run facts kept in summary.json
    (level wall times, other processes' CPU, machine, servers), e.g. after the summary code changed."""
    old = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in open(out / "results.jsonl") if line.strip()]
    summary = []
    for s in old["summary"]:
        level = [r for r in rows if r["config"] == s["config"] and r["concurrency"] == s["concurrency"]]
        kept = {k: s[k] for k in ("other_cpu_s", "waited_for_quiet_s") if k in s}
        summary.append({"config": s["config"], "concurrency": s["concurrency"],
                        **summarize_level(level, s["wall_s"]), **kept})
    meta = {k: v for k, v in old.items() if k not in ("summary", "lossless", "texts_differing_across_levels")}
    return write_reports(out, meta, rows, summary)


if __name__ == "__main__":
    sys.exit(main())
