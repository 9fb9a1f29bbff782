#!/usr/bin/env python3
"""Client overhead of kvcap's load generator, side by side with a bare stdlib client and guidellm, against the
deterministic fake server.

Each (tool, streams) pair is one fresh client process against one fresh fake server
(``python -m kvcap.testing.server --ttft 50ms --itl 20ms``), closed loop at fixed concurrency, 128 in / 128 out.
Because the server's timing is known exactly, the client's view of it can be scored:

* **client CPU s per 1k tokens, steady** — CPU of the client's whole process tree (every descendant's
  utime+stime from /proc, sampled every 0.25 s) over the tool's own measurement window, divided by the output
  tokens the client received inside that window (counted from the tool's per-request records: kvcap's per-token
  ITL list, guidellm's first/last token times spread evenly over its token count).
* **client CPU s per 1k tokens, whole run** — ``getrusage(RUSAGE_CHILDREN)`` around the client subprocess
  (start-up, imports, warm-up, drain and report writing included) over every token the server sent in that run
  (the server's ``/stats`` ``completion_tokens_total``). **fixed CPU s** = whole-run CPU − steady rate × tokens:
  start-up (imports, worker processes), ramp, drain and report writing.
* **tokens/s** — tokens received inside the window / window length; the ceiling is
  ``streams × L / (TTFT + (L−1)·ITL)``.
* **timing error** — ``|TTFT − 50 ms|`` per request (p50), ``|ITL − 20 ms|`` per inter-token gap (p50, p99;
  kvcap only: guidellm keeps no per-gap times), and ``|mean ITL of a request − 20 ms|`` (p50, p99; both tools).
* **server cores** — the fake server's own CPU over the same window (it shares the machine with the client).
* **softirq** — the machine's irq+softirq time over the window: mostly the loopback TCP stack working for
  client and server, charged by the kernel to neither.
* **kvcap vs bare** — ``benchmarks/bare_client.py`` (stdlib asyncio, one keep-alive connection per stream, SSE
  lines timestamped as read, no JSON) is the yardstick: what any client on this machine sees of this server. Its
  table gives, per level, the server's configured TTFT and its timer lateness (the share of timed sends it woke
  more than 1 ms late, from ``/stats``: its own TTFT holds only while that stays near 0), both clients' TTFT p50,
  their difference, both TPOT p50 and CPU s per 1k tokens, and the CPU ratio. With ``--rounds N`` each level
  alternates the tools N times; the table takes the median over rounds.
* **other load** — every other process's CPU on the machine over the window (/proc/stat user+system minus client
  and server). On a shared machine other load skews the latency columns (not much the CPU columns);
  ``--wait-quiet`` (default 300 s) waits before each run until it is under ``--quiet-cores``.

    .venv/bin/python benchmarks/client_overhead.py                      # kvcap, bare, guidellm: 32,256,1024
    .venv/bin/python benchmarks/client_overhead.py --quick              # shorter, 32 and 256 only
    .venv/bin/python benchmarks/client_overhead.py --tools kvcap,bare --rounds 3   # kvcap vs bare, alternated
    .venv/bin/python benchmarks/client_overhead.py --tools kvcap        # kvcap only
    .venv/bin/python benchmarks/client_overhead.py --setup-guidellm     # make benchmarks/.venv-guidellm first

guidellm is looked for in ``--guidellm-venv`` (default ``$GUIDELLM_VENV`` or ``benchmarks/.venv-guidellm``); it needs a
local Hugging Face tokenizer, which this script builds (a whitespace WordLevel tokenizer over Faker's lorem words, so
one token = one word, the fake server's own count). Every client run is bounded in time and killed (its process group)
if it overruns; every server binds 127.0.0.1 and is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import itertools
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from kvcap import procs  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
GUIDELLM_VERSION = "0.8.1"
SAMPLE_EVERY_S = 0.25
TOKENIZER_TAG = "wordlevel-lorem-numbers-2"

TOKENIZER_SCRIPT = r'''
import sys
from faker.providers.lorem.en_US import Provider
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

words = set()
for w in Provider.word_list:
    for v in (w, w.capitalize()):
        words.update((v, v + "."))
# guidellm prefixes each synthetic prompt with "{row} {sample} m{turn} ": give those words tokens too
words.update(str(i) for i in range(100_000))
words.update(f"m{i}" for i in range(100))
vocab = {"[UNK]": 0, "[PAD]": 1}
for w in sorted(words):
    vocab[w] = len(vocab)
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with single spaces
# [UNK] is deliberately not a special token: decode(skip_special_tokens=True) keeps it, so a prompt of N tokens
# is always N words, the fake server's count
PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", model_max_length=1 << 20).save_pretrained(sys.argv[1])
print(len(vocab))
'''


# ------------------------------------------------------------------------------------------------ /proc sampling

def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime+stime+cutime+cstime in ticks) of one process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2:].split()
    return int(rest[1]), int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and every live descendant (reaped children are in their parent's cutime/cstime)."""
    stats: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = _stat(int(name))
            if s is not None:
                stats[int(name)] = s
    if root not in stats:
        return math.nan
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        kids.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo.extend(kids.get(pid, ()))
    return total / CLK_TCK


def proc_cpu_s(pid: int) -> float:
    s = _stat(pid)
    return math.nan if s is None else s[1] / CLK_TCK


def machine_cpu_s() -> tuple[float, float]:
    """Whole-machine CPU seconds from /proc/stat: (user+nice+system, irq+softirq). The kernel charges loopback
    TCP work done in softirq context to no process, so it is kept apart."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2]) / CLK_TCK, (v[5] + v[6]) / CLK_TCK


def machine_busy_s() -> float:
    return machine_cpu_s()[0]


def other_load_cores(seconds: float = 2.0) -> float:
    """Cores busy on this machine over ``seconds``, minus this script's own share."""
    m0, p0 = machine_busy_s(), time.process_time()
    time.sleep(seconds)
    return max(0.0, (machine_busy_s() - m0) - (time.process_time() - p0)) / seconds


def wait_quiet(limit_s: float, threshold: float) -> float:
    """Wait (at most ``limit_s``) until other processes use under ``threshold`` cores; returns the last reading."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while True:
        load = other_load_cores()
        quiet = quiet + 1 if load < threshold else 0
        if quiet >= 2 or time.monotonic() >= deadline:
            return load
        if quiet == 0:
            print(f"    machine busy with {load:.2f} cores of other work; waiting …", flush=True)
            time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))


class Sampler(threading.Thread):
    """Every SAMPLE_EVERY_S: (wall time, client tree CPU s, server CPU s, machine task CPU s, machine irq CPU s)."""

    def __init__(self, client_pid: int, server_pid: int) -> None:
        super().__init__(daemon=True)
        self.client_pid, self.server_pid = client_pid, server_pid
        self.samples: list[tuple[float, float, float, float, float]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            t = time.time()
            c, s, (m, irq) = tree_cpu_s(self.client_pid), proc_cpu_s(self.server_pid), machine_cpu_s()
            if not math.isnan(c):
                self.samples.append((t, c, s, m, irq))
            self._halt.wait(SAMPLE_EVERY_S)

    def stop(self) -> None:
        self._halt.set()
        self.join(5.0)

    def at(self, t: float, col: int) -> float:
        """Linear interpolation of column ``col`` (1 client, 2 server, 3 machine, 4 irq) at wall time ``t``."""
        xs = self.samples
        if not xs or t < xs[0][0] or t > xs[-1][0]:
            return math.nan
        for (t0, *a), (t1, *b) in itertools.pairwise(xs):
            if t0 <= t <= t1:
                f = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
                return a[col - 1] + f * (b[col - 1] - a[col - 1])
        return xs[-1][col]


# ------------------------------------------------------------------------------------------------- fake server

class Server:
    """The fake server on 127.0.0.1 in its own process group (kvcap.procs), its stderr in ``log``."""

    def __init__(self, ttft: str, itl: str, log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        self.process = procs.start(
            [sys.executable, "-m", "kvcap.testing.server", "--host", "127.0.0.1", "--port", "0",
             "--ttft", ttft, "--itl", itl],
            name="fake server", log=log, pipe_stdout=True, cwd=ROOT, env=env, grace_s=5.0)
        self.url = self.process.wait_for_line(r"^listening on (http://127\.0\.0\.1:\d+)\s*$", 20.0).group(1)

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/stats", timeout=5.0) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.process.stop()


# ------------------------------------------------------------------------------------------------------ helpers

def pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def tokens_in(times: list[float], a: float, b: float) -> int:
    return sum(1 for t in times if a <= t <= b)


@dataclass
class Result:
    tool: str
    streams: int
    ok: bool = False
    problem: str | None = None
    window_s: float = math.nan
    tokens_window: int = 0
    tok_s: float = math.nan
    tok_s_ceiling: float = math.nan
    cpu_window_s: float = math.nan
    cpu_per_1k_steady: float = math.nan
    client_cores: float = math.nan
    server_cores: float = math.nan
    other_cores: float = math.nan
    softirq_cores: float = math.nan
    cpu_run_s: float = math.nan
    tokens_run: int = 0
    cpu_per_1k_run: float = math.nan
    fixed_cpu_s: float = math.nan
    server_cpu_run_s: float = math.nan
    wall_run_s: float = math.nan
    requests_ok: int = 0
    requests_failed: int = 0
    ttft_err_p50: float = math.nan
    ttft_err_p99: float = math.nan
    ttft_p50: float = math.nan
    tpot_p50: float = math.nan
    itl_err_p50: float = math.nan
    itl_err_p99: float = math.nan
    tpot_err_p50: float = math.nan
    tpot_err_p99: float = math.nan
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- one client run

def run_client(cmd: list[str], env: dict[str, str], cwd: Path, server: Server, limit_s: float, log: Path,
               res: Result) -> bool:
    """Run one client process against ``server``; fills the CPU/wall/token totals. False if it failed."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    st0 = server.stats()
    s0 = st0["completion_tokens_total"]
    t0 = time.monotonic()
    with procs.start(cmd, log=log, cwd=cwd, env=env, grace_s=5.0) as proc:  # its whole group is stopped at the end
        sampler = Sampler(proc.pid, server.process.pid)
        sampler.start()
        try:
            rc = proc.wait(limit_s)
        finally:
            sampler.stop()
    res.wall_run_s = time.monotonic() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res.cpu_run_s = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    with contextlib.suppress(Exception):
        st1 = server.stats()
        res.tokens_run = st1["completion_tokens_total"] - s0
        res.extra["server_requests"] = st1["requests_started"] - st0["requests_started"]
        res.extra["server_connections"] = st1["connections_opened"] - st0["connections_opened"] - 1  # less /stats
    res.cpu_per_1k_run = res.cpu_run_s / (res.tokens_run / 1e3) if res.tokens_run else math.nan
    res.extra["sampler"] = sampler
    if rc is None:
        res.problem = f"timed out after {limit_s:.0f}s (killed); see {log}"
        return False
    if rc != 0:
        tail = log.read_text(errors="replace")[-1500:]
        res.problem = f"exit {rc}: {tail.strip().splitlines()[-1] if tail.strip() else ''} (see {log})"
        return False
    return True


def finish_window(res: Result, sampler: Sampler, a: float, b: float, token_times: list[float]) -> None:
    res.window_s = b - a
    res.tokens_window = tokens_in(token_times, a, b)
    res.tok_s = res.tokens_window / res.window_s if res.window_s > 0 else math.nan
    c = sampler.at(b, 1) - sampler.at(a, 1)
    s = sampler.at(b, 2) - sampler.at(a, 2)
    res.cpu_window_s = c
    res.client_cores = c / res.window_s
    res.server_cores = s / res.window_s
    # everything else the machine did meanwhile (other users' work, and this script's own light sampler)
    res.other_cores = max(0.0, sampler.at(b, 3) - sampler.at(a, 3) - c - s) / res.window_s
    res.softirq_cores = (sampler.at(b, 4) - sampler.at(a, 4)) / res.window_s
    res.cpu_per_1k_steady = c / (res.tokens_window / 1e3) if res.tokens_window else math.nan


def bench_kvcap(args: argparse.Namespace, streams: int, run_dir: Path, server: Server) -> Result:
    res = Result("kvcap", streams)
    out = run_dir / "run"
    cmd = [args.kvcap_python, "-m", "kvcap", "bench", "--url", server.url, "--concurrency", str(streams),
           "--input-tokens", str(args.input_tokens), "--output-tokens", str(args.output_tokens),
           "--warmup", f"{args.warmup}s", "--duration", f"{args.duration}s", "--out", str(out), "--overwrite",
           "--quiet", "--json"]
    res.extra["cmd"] = cmd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    limit = 120 + 3 * (args.warmup + args.duration)
    if not run_client(cmd, env, ROOT, server, limit, run_dir / "client.log", res):
        return res
    manifest = json.loads((out / "manifest.json").read_text())
    level = json.loads((out / "levels.jsonl").read_text().splitlines()[0])
    origin = manifest["started_at"]  # wall time taken a few ms before the run clock's zero
    a, b = origin + level["measure_start_s"], origin + level["measure_end_s"]
    ttft, gaps, tpot, times, tpot_raw = [], [], [], [], []
    for line in (out / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("ttft_ms") is not None:
            t = origin + r["start_s"] + r["ttft_ms"] / 1e3
            times.append(t)
            for g in r.get("itl_ms") or ():
                t += g / 1e3
                times.append(t)
        if r.get("phase") != "measure":
            continue
        if not r.get("ok"):
            res.requests_failed += 1
            continue
        res.requests_ok += 1
        ttft.append(r["ttft_ms"])
        gaps.extend(abs(g - args.itl_ms) for g in r.get("itl_ms") or ())
        if r.get("tpot_ms") is not None:
            tpot.append(abs(r["tpot_ms"] - args.itl_ms))
            tpot_raw.append(r["tpot_ms"])
    finish_window(res, res.extra["sampler"], a, b, times)
    res.ttft_p50, res.tpot_p50 = pct(ttft, 50), pct(tpot_raw, 50)
    errs = [abs(x - args.ttft_ms) for x in ttft]
    res.ttft_err_p50, res.ttft_err_p99 = pct(errs, 50), pct(errs, 99)
    res.itl_err_p50, res.itl_err_p99 = pct(gaps, 50), pct(gaps, 99)
    res.tpot_err_p50, res.tpot_err_p99 = pct(tpot, 50), pct(tpot, 99)
    client = level.get("client") or {}
    res.extra.update(loop_lag_p99_ms=client.get("loop_lag_p99_ms"), cpu_fraction=client.get("cpu_fraction"),
                     client_warnings=client.get("warnings"))
    res.ok = res.requests_ok > 0
    if not res.ok:
        res.problem = f"no successful measured request ({res.requests_failed} failed)"
    return res


def bench_bare(args: argparse.Namespace, streams: int, run_dir: Path, server: Server) -> Result:
    """benchmarks/bare_client.py: the yardstick (its window and token times are wall-clock, like the sampler's)."""
    res = Result("bare", streams)
    out_json = run_dir / "bare.json"
    cmd = [args.kvcap_python, str(HERE / "bare_client.py"), "--url", server.url, "--streams", str(streams),
           "--warmup", f"{args.warmup:g}", "--duration", f"{args.duration:g}", "--input-tokens",
           str(args.input_tokens), "--output-tokens", str(args.output_tokens), "--out", str(out_json)]
    res.extra["cmd"] = cmd
    if not run_client(cmd, dict(os.environ), ROOT, server, 60 + 3 * (args.warmup + args.duration),
                      run_dir / "client.log", res):
        return res
    b = json.loads(out_json.read_text())
    finish_window(res, res.extra["sampler"], b["measure_start_s"], b["measure_end_s"], b["token_times"])
    res.requests_ok, res.requests_failed = len(b["ttft_ms"]), b["errors"]
    res.ttft_p50, res.tpot_p50 = pct(b["ttft_ms"], 50), pct(b["tpot_ms"], 50)
    errs = [abs(x - args.ttft_ms) for x in b["ttft_ms"]]
    res.ttft_err_p50, res.ttft_err_p99 = pct(errs, 50), pct(errs, 99)
    tpot = [abs(x - args.itl_ms) for x in b["tpot_ms"]]
    res.tpot_err_p50, res.tpot_err_p99 = pct(tpot, 50), pct(tpot, 99)
    res.ok = res.requests_ok > 0
    if not res.ok:
        res.problem = f"no successful request ({res.requests_failed} errored)"
    return res


def guidellm_bin(venv: Path) -> Path:
    return venv / "bin" / "guidellm"


def ensure_tokenizer(venv: Path, where: Path) -> Path:
    """Build (once per TOKENIZER_TAG) the local tokenizer guidellm loads with HF_HUB_OFFLINE=1."""
    tag = where / ".tag"
    if not (where / "tokenizer.json").exists() or not tag.exists() or tag.read_text().strip() != TOKENIZER_TAG:
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(venv / "bin" / "python"), "-c", TOKENIZER_SCRIPT, str(where)], check=True,
                       timeout=300, stdout=subprocess.DEVNULL)
        tag.write_text(TOKENIZER_TAG + "\n")
    return where


def bench_guidellm(args: argparse.Namespace, streams: int, run_dir: Path, server: Server) -> Result:
    res = Result("guidellm", streams)
    venv = Path(args.guidellm_venv)
    out_json = run_dir / "benchmarks.json"
    cmd = [str(guidellm_bin(venv)), "run",
           "--backend", f"kind=openai_http,target={server.url},request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={streams},warmup={args.warmup:g}",
           "--constraint", f"kind=max_duration,seconds={args.warmup + args.duration:g}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.input_tokens},output_tokens={args.output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={args.tokenizer_dir}",
           "--output", f"kind=json,path={out_json}", "--disable-console-interactive"]
    res.extra["cmd"] = cmd
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "GUIDELLM__LOGGING__LOG_FILE": str(run_dir / "guidellm.log"), "NO_COLOR": "1"}
    if args.guidellm_workers:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(args.guidellm_workers)
    limit = 180 + 3 * (args.warmup + args.duration)
    if not run_client(cmd, env, run_dir, server, limit, run_dir / "client.log", res):
        return res
    bench = json.loads(out_json.read_text())["benchmarks"][0]
    sm = bench["scheduler_metrics"]
    a, b = sm["measure_start_time"], sm["measure_end_time"]
    reqs = bench["requests"]
    times: list[float] = []
    for r in (reqs.get("successful") or []) + (reqs.get("incomplete") or []):
        t = r["info"]["timings"]
        f, last, n = t.get("first_token_iteration"), t.get("last_token_iteration"), r.get("output_tokens") or 0
        if f is None or n <= 0:
            continue
        if n == 1 or last is None:
            times.append(f)
            continue
        dt = (last - f) / (n - 1)
        times.extend(f + k * dt for k in range(n))
    finish_window(res, res.extra["sampler"], a, b, times)
    ok = reqs.get("successful") or []
    res.requests_ok = len(ok)
    res.requests_failed = len(reqs.get("errored") or [])
    ttft = [r["time_to_first_token_ms"] for r in ok if r.get("time_to_first_token_ms") is not None]
    itl = [abs(r["inter_token_latency_ms"] - args.itl_ms) for r in ok if r.get("inter_token_latency_ms") is not None]
    res.ttft_p50 = pct(ttft, 50)
    errs = [abs(x - args.ttft_ms) for x in ttft]
    res.ttft_err_p50, res.ttft_err_p99 = pct(errs, 50), pct(errs, 99)
    res.tpot_err_p50, res.tpot_err_p99 = pct(itl, 50), pct(itl, 99)
    res.extra.update(incomplete=len(reqs.get("incomplete") or []),
                     worker_count=bench["config"]["strategy"].get("worker_count"),
                     warnings=[w.get("code") for w in bench.get("warnings") or []])
    res.ok = res.requests_ok > 0
    if not res.ok:
        res.problem = f"no successful request ({res.requests_failed} errored)"
    return res


def profile_kvcap(args: argparse.Namespace, streams: int, run_dir: Path) -> str:
    """One extra kvcap run under py-spy (not counted in the table: sampling costs CPU); the hot spots as text."""
    run_dir.mkdir(parents=True, exist_ok=True)
    raw = run_dir / "pyspy.txt"
    server = Server(f"{args.ttft_ms:g}ms", f"{args.itl_ms:g}ms", run_dir / "server.log")
    try:
        cmd = [args.py_spy, "record", "-f", "raw", "-r", "100", "--full-filenames", "-o", str(raw), "--",
               args.kvcap_python, "-m", "kvcap", "bench", "--url", server.url, "--concurrency", str(streams),
               "--input-tokens", str(args.input_tokens), "--output-tokens", str(args.output_tokens),
               "--warmup", f"{args.warmup}s", "--duration", f"{args.duration}s", "--out", str(run_dir / "run"),
               "--overwrite", "--quiet"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        with procs.start(cmd, log=run_dir / "client.log", cwd=ROOT, env=env, grace_s=5.0) as proc:
            proc.wait(180 + 3 * (args.warmup + args.duration))
    finally:
        server.stop()
    if not raw.exists():
        return f"py-spy wrote nothing (see {run_dir / 'client.log'})"
    self_n: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n_s = line.rpartition(" ")
        n = int(n_s)
        total += n
        frames = [f.replace(str(ROOT) + "/", "") for f in stack.split(";")]
        self_n[frames[-1]] = self_n.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    out = [f"py-spy, kvcap at {streams} streams, {total} samples ({raw})", "self time:"]
    out += [f"  {n / total:6.1%}  {f}" for f, n in sorted(self_n.items(), key=lambda x: -x[1])[:15]]
    out.append("inclusive, kvcap frames:")
    kv = [(f, n) for f, n in incl.items() if "(kvcap/" in f and "__main__" not in f and "cli.py" not in f]
    out += [f"  {n / total:6.1%}  {f}" for f, n in sorted(kv, key=lambda x: -x[1])[:15]]
    return "\n".join(out)


def one_run(args: argparse.Namespace, tool: str, c: int, run_dir: Path) -> Result:
    """One (tool, streams) run against a fresh fake server."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.wait_quiet > 0:
        wait_quiet(args.wait_quiet, args.quiet_cores)
    server = Server(f"{args.ttft_ms:g}ms", f"{args.itl_ms:g}ms", run_dir / "server.log")
    try:
        cpu0 = proc_cpu_s(server.process.pid)
        fn = {"kvcap": bench_kvcap, "bare": bench_bare, "guidellm": bench_guidellm}[tool]
        try:
            res = fn(args, c, run_dir, server)
        except Exception as exc:  # a tool's output we could not read: report it, go on
            res = Result(tool, c, problem=f"{type(exc).__name__}: {exc}")
        res.server_cpu_run_s = proc_cpu_s(server.process.pid) - cpu0
        with contextlib.suppress(Exception):
            res.extra["server_timer"] = server.stats()["timer"]
    finally:
        server.stop()
    L = args.output_tokens
    res.tok_s_ceiling = c * L / ((args.ttft_ms + (L - 1) * args.itl_ms) / 1e3)
    res.extra.pop("sampler", None)
    res.extra["run_dir"] = str(run_dir)
    # start-up, warm-up ramp, drain and report writing: what the whole run cost beyond the steady rate
    res.fixed_cpu_s = res.cpu_run_s - res.cpu_per_1k_steady * res.tokens_run / 1e3
    return res


# ------------------------------------------------------------------------------------------------------ report

def fmt(x: float, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:,.{nd}f}"


def table(results: list[Result]) -> str:
    head = ["tool", "streams", "tok/s", "ceiling", "CPU s/1k tok", "CPU s/1k (run)", "fixed CPU s", "client cores",
            "server cores", "softirq", "other load", "TTFT err p50", "ITL err p50/p99", "mean-ITL err p50/p99",
            "ok/failed"]
    rows = []
    for r in results:
        if not r.ok:
            rows.append([r.tool, str(r.streams), "FAILED", *[""] * (len(head) - 4), r.problem or ""])
            continue
        rows.append([r.tool, str(r.streams), fmt(r.tok_s, 0), fmt(r.tok_s_ceiling, 0), fmt(r.cpu_per_1k_steady, 4),
                     fmt(r.cpu_per_1k_run, 4), fmt(r.fixed_cpu_s, 1), fmt(r.client_cores, 2), fmt(r.server_cores, 2),
                     fmt(r.softirq_cores, 2), fmt(r.other_cores, 2),
                     fmt(r.ttft_err_p50, 2) + " ms",
                     (fmt(r.itl_err_p50, 2) + " / " + fmt(r.itl_err_p99, 2) + " ms") if not math.isnan(r.itl_err_p50)
                     else "n/a", fmt(r.tpot_err_p50, 3) + " / " + fmt(r.tpot_err_p99, 3) + " ms",
                     f"{r.requests_ok}/{r.requests_failed}"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out.extend(line(row) for row in rows)
    return "\n".join(out)


def ratios(results: list[Result]) -> str:
    by = {(r.tool, r.streams): r for r in results if r.ok}
    levels = sorted({r.streams for r in results})
    lines = []
    for c in levels:
        k, g = by.get(("kvcap", c)), by.get(("guidellm", c))
        if not (k and g):
            continue

        def q(a: float, b: float) -> str:
            return fmt(a / b, 2) + "×" if b and not (math.isnan(a) or math.isnan(b)) else "—"

        lines.append(f"| {c} | {q(k.tok_s, g.tok_s)} | {q(k.cpu_per_1k_steady, g.cpu_per_1k_steady)} | "
                     f"{q(k.cpu_per_1k_run, g.cpu_per_1k_run)} | {q(k.ttft_err_p50, g.ttft_err_p50)} | "
                     f"{q(k.tpot_err_p50, g.tpot_err_p50)} |")
    if not lines:
        return ""
    return ("| streams | tok/s kvcap/guidellm | CPU s/1k steady | CPU s/1k whole run | TTFT err p50 | "
            "mean-ITL err p50 |\n|---|---|---|---|---|---|\n" + "\n".join(lines))


def versus_bare(results: list[Result], ttft_ms: float) -> str:
    """kvcap against the bare client per level (medians over rounds): TTFT, TPOT, CPU."""
    def med(tool: str, c: int, key: str) -> float:
        xs = [getattr(r, key) for r in results if r.ok and r.tool == tool and r.streams == c]
        xs = [x for x in xs if not math.isnan(x)]
        return pct(xs, 50) if xs else math.nan

    def late(c: int) -> str:
        timers = [r.extra.get("server_timer") for r in results if r.streams == c and r.extra.get("server_timer")]
        shares = [t["late_over_1ms"] / t["wakeups"] for t in timers if t.get("wakeups")]
        return fmt(100 * pct(shares, 50), 1) + " %" if shares else "—"

    lines = []
    for c in sorted({r.streams for r in results if r.tool in ("kvcap", "bare")}):
        kt, bt = med("kvcap", c, "ttft_p50"), med("bare", c, "ttft_p50")
        kc, bc = med("kvcap", c, "cpu_per_1k_steady"), med("bare", c, "cpu_per_1k_steady")
        lines.append(f"| {c} | {ttft_ms:g} ms, {late(c)} late | {fmt(bt, 2)} | {fmt(kt, 2)} | {fmt(kt - bt, 2)} | "
                     f"{fmt(med('bare', c, 'tpot_p50'), 3)} | {fmt(med('kvcap', c, 'tpot_p50'), 3)} | {fmt(bc, 4)} | "
                     f"{fmt(kc, 4)} | {fmt(kc / bc, 2) + '×' if bc else '—'} |")
    if not lines:
        return ""
    return ("| streams | server TTFT, sends >1 ms late | bare TTFT p50 | kvcap TTFT p50 | Δ ms | bare TPOT p50 | "
            "kvcap TPOT p50 | bare CPU s/1k | kvcap CPU s/1k | CPU ratio |\n|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(lines))


# -------------------------------------------------------------------------------------------------------- main

def setup_guidellm(venv: Path) -> None:
    """Make a separate venv with the local CPU torch wheel (a plain `torch` would fetch a CUDA build)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "torch==2.13.0",
                    f"guidellm=={GUIDELLM_VERSION}"], check=True, timeout=1800)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default="kvcap,bare,guidellm", help="comma list of kvcap, bare, guidellm")
    p.add_argument("--streams", default=None, help="concurrency levels (default 32,256,1024; --quick 32,256)")
    p.add_argument("--quick", action="store_true", help="warm-up 1 s, 4 s measured, 32 and 256 streams")
    p.add_argument("--rounds", type=int, default=1, help="alternate the tools this many times per level")
    p.add_argument("--warmup", type=float, default=None, help="seconds per level not measured (2; --quick 1)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per level (10; --quick 4)")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--ttft-ms", type=float, default=50.0, help="fake server's time to first token")
    p.add_argument("--itl-ms", type=float, default=20.0, help="fake server's inter-token latency")
    p.add_argument("--guidellm-venv", default=os.environ.get("GUIDELLM_VENV", str(HERE / ".venv-guidellm")))
    p.add_argument("--guidellm-workers", type=int, default=None,
                   help="GUIDELLM__MAX_WORKER_PROCESSES (default: guidellm's own, 10)")
    p.add_argument("--setup-guidellm", action="store_true",
                   help=f"create --guidellm-venv with guidellm=={GUIDELLM_VERSION}")
    p.add_argument("--kvcap-python", default=sys.executable, help="python that has kvcap installed")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<timestamp>)")
    p.add_argument("--profile", type=int, default=None, metavar="STREAMS",
                   help="after the table, one extra kvcap run at STREAMS under py-spy, and its hot spots")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy", help="py-spy executable for --profile")
    p.add_argument("--pause", type=float, default=2.0, help="seconds of idle between runs")
    p.add_argument("--wait-quiet", type=float, default=300.0,
                   help="before each run, wait up to this many seconds for other load < --quiet-cores (0: never)")
    p.add_argument("--quiet-cores", type=float, default=0.2, help="other processes' CPU counted as quiet")
    p.add_argument("--retries", type=int, default=2,
                   help="run a (tool, streams) pair again, up to this many times, when other load exceeded "
                        "--quiet-cores during it; the quietest attempt is reported")
    args = p.parse_args(argv)

    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    for t in tools:
        if t not in ("kvcap", "bare", "guidellm"):
            p.error(f"unknown tool {t!r}")
    streams = [int(x) for x in (args.streams or ("32,256" if args.quick else "32,256,1024")).split(",")]
    args.warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 2.0)
    args.duration = args.duration if args.duration is not None else (4.0 if args.quick else 10.0)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else HERE / "results" / stamp
    out.mkdir(parents=True, exist_ok=True)

    notes: list[str] = []
    if "guidellm" in tools:
        venv = Path(args.guidellm_venv)
        if args.setup_guidellm and not guidellm_bin(venv).exists():
            print(f"installing guidellm=={GUIDELLM_VERSION} into {venv} …", flush=True)
            setup_guidellm(venv)
        if not guidellm_bin(venv).exists():
            notes.append(f"guidellm skipped: {guidellm_bin(venv)} not found (run with --setup-guidellm, or set "
                         f"--guidellm-venv / $GUIDELLM_VENV)")
            tools.remove("guidellm")
        else:
            v = subprocess.run([str(guidellm_bin(venv)), "--version"], capture_output=True, text=True, timeout=120)
            args.guidellm_version = (v.stdout.strip() or v.stderr.strip()).split()[-1]
            args.tokenizer_dir = str(ensure_tokenizer(venv, HERE / ".guidellm-tokenizer"))

    ttft, itl = f"{args.ttft_ms:g}ms", f"{args.itl_ms:g}ms"
    L = args.output_tokens
    results: list[Result] = []
    print(f"fake server TTFT {ttft}, ITL {itl}; {args.input_tokens} in / {L} out; warm-up {args.warmup:g}s, "
          f"{args.duration:g}s measured; streams {streams}; tools {tools}; results in {out}", flush=True)
    try:
        for c in streams:
            for tool, rnd in ((t, k) for k in range(args.rounds) for t in tools):
                best: Result | None = None
                for attempt in range(args.retries + 1):
                    run_dir = out / (f"{tool}-{c}" + (f"-round{rnd}" if rnd else "")
                                     + (f"-retry{attempt}" if attempt else ""))
                    res = one_run(args, tool, c, run_dir)
                    status = "ok" if res.ok else f"FAILED: {res.problem}"
                    print(f"  {tool:8s} {c:5d} streams: {fmt(res.tok_s, 0)} tok/s, TTFT p50 {fmt(res.ttft_p50, 2)} ms, "
                          f"{fmt(res.cpu_per_1k_steady, 4)} CPU s/1k tok steady, {fmt(res.cpu_per_1k_run, 4)} whole "
                          f"run, client {fmt(res.client_cores, 2)} cores, server {fmt(res.server_cores, 2)} cores, "
                          f"softirq {fmt(res.softirq_cores, 2)}, other {fmt(res.other_cores, 2)} cores [{status}]",
                          flush=True)
                    if best is None or (res.ok and (not best.ok or res.other_cores < best.other_cores)):
                        best = res
                    time.sleep(args.pause)
                    if not res.ok or not res.other_cores > args.quiet_cores:
                        break
                    print(f"    other load {res.other_cores:.2f} cores > {args.quiet_cores:g} during the run: "
                          "running it again", flush=True)
                assert best is not None
                best.extra["attempts"] = attempt + 1
                results.append(best)
    except KeyboardInterrupt:
        notes.append("interrupted")

    kv_bad = [r for r in results if r.tool == "kvcap" and r.ok and
              ((r.client_cores or 0) > 0.5 or (r.extra.get("client_warnings") or []) or r.requests_failed)]
    for r in results:
        if r.ok and r.other_cores > args.quiet_cores:
            notes.append(f"{r.tool} at {r.streams} streams ran beside {r.other_cores:.2f} cores of other work on this "
                         f"machine: its latency figures are not clean")
    for r in kv_bad:
        notes.append(f"kvcap at {r.streams} streams: {r.client_cores:.2f} cores, loop lag p99 "
                     f"{r.extra.get('loop_lag_p99_ms')} ms, warnings {r.extra.get('client_warnings')}, "
                     f"{r.requests_failed} failed")

    meta = {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "guidellm_version": getattr(args, "guidellm_version", None),
            "ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "input_tokens": args.input_tokens, "output_tokens": L,
            "warmup_s": args.warmup, "duration_s": args.duration, "streams": streams, "notes": notes}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": [
        {k: v for k, v in r.__dict__.items()} for r in results]}, indent=1, default=str) + "\n")
    print()
    print(f"{meta['date']}, {meta['cpus']} CPUs, guidellm {meta['guidellm_version']}, fake server TTFT {ttft} / "
          f"ITL {itl}, {args.input_tokens} in / {L} out, {args.warmup:g}s warm-up + {args.duration:g}s measured")
    print(table(results))
    v = versus_bare(results, args.ttft_ms)
    if v:
        print()
        print(v)
    r = ratios(results)
    if r:
        print()
        print(r)
    for n in notes:
        print("note:", n)
    if args.profile:
        if args.wait_quiet > 0:
            wait_quiet(args.wait_quiet, args.quiet_cores)
        print()
        print(profile_kvcap(args, args.profile, out / f"profile-kvcap-{args.profile}"))
    print(f"\nper-run logs and records: {out}")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
