"""A prefill + decode pair of real `baton serve` processes, and a client that plays the router
(same body to both sides with the bootstrap fields and, as the router does, a room ticket signed
with the pair's cluster key: PD tests run with the key on; the decode side's answer is the
result)."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from runtime.auth.key import ENV, ClusterKey
from runtime.auth.ticket import sign
from runtime.protocol import prompt_digest
from tests.ports import free_port
from tests.server.server_process import ServerProcess


@dataclass
class Pair:
    prefill: ServerProcess
    decode: ServerProcess
    bootstrap_port: int
    key: str | None = None  # the cluster key both run with ($BATON_CLUSTER_KEY)

    def stop(self) -> None:
        for srv in (self.prefill, self.decode):
            if srv.proc.poll() is None:
                srv.stop()

    @property
    def env(self) -> dict[str, str]:
        """What a router in front of the pair needs: the key."""
        return {ENV: self.key} if self.key else {}

    def fields(self, room: int | list[int] | None = None, rid: str | None = None,
               bootstrap_port: int | None = None, *, prompt: dict[str, Any]) -> dict[str, Any]:
        """The bootstrap fields the router would add, its room ticket included (which binds
        the request's `prompt`: its text or input_ids)."""
        rid = rid or secrets.token_hex(8)
        room = secrets.randbits(63) if room is None else room
        port = bootstrap_port or self.bootstrap_port
        out = {"rid": rid, "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
               "bootstrap_room": room}
        if self.key:
            out["bootstrap_ticket"] = sign(
                ClusterKey(self.key.encode()), room, rid, instance_id(self.prefill), "127.0.0.1",
                port, instance_id(self.decode), prompt_digest(prompt))
        return out


def instance_id(srv: ServerProcess) -> str:
    """A prefill/decode worker's KV instance id, from its /ready (as the router reads it)."""
    return str(httpx.get(f"{srv.url}/ready").json()["instance_id"])


def start_pair(
    log_dir: Path, transfer: str, *extra: str, model: str | None = None,
    prefill_extra: tuple[str, ...] = (), decode_extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None, key: bool = True,
) -> Pair:
    """Both servers load at once (with a fresh cluster key unless `key` is False); returns when
    both are ready."""
    bport = free_port()
    secret = secrets.token_hex(32) if key else None
    kw: dict[str, Any] = {"model": model} if model else {}
    kw["env"] = {**(env or {}), **({ENV: secret} if secret else {})}
    prefill = ServerProcess("--role", "prefill", "--bootstrap-port", str(bport), "--kv-transfer",
                            transfer, *extra, *prefill_extra, log_path=log_dir / "prefill.log", **kw)
    decode = ServerProcess("--role", "decode", "--kv-transfer", transfer, "--kv-port", "0", *extra,
                           *decode_extra, log_path=log_dir / "decode.log", **kw)
    pair = Pair(prefill, decode, bport, secret)
    try:
        prefill.wait_ready()
        decode.wait_ready()
    except BaseException:
        pair.stop()
        raise
    return pair


def restart_prefill(pair: Pair, log_dir: Path, transfer: str, *extra: str, model: str | None = None) -> None:
    """A new prefill process on the same HTTP and bootstrap ports (the old one is gone)."""
    kw: dict[str, Any] = {"model": model} if model else {}
    pair.prefill = ServerProcess("--role", "prefill", "--bootstrap-port", str(pair.bootstrap_port),
                                 "--kv-transfer", transfer, *extra, port=pair.prefill.port,
                                 log_path=log_dir / "prefill2.log", env=pair.env, **kw)
    pair.prefill.wait_ready()


async def read_stream(resp: httpx.Response) -> list[dict[str, Any]]:
    events = []
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


async def pd_call(
    http: httpx.AsyncClient, pair: Pair, path: str, body: dict[str, Any]
) -> tuple[httpx.Response, Any]:
    """Send `body` to both sides at once; returns (prefill's response, decode's result): the JSON
    body, or for a stream the list of its events."""

    async def decode_side() -> Any:
        if not body.get("stream"):
            resp = await http.post(f"{pair.decode.url}{path}", json=body)
            return resp.json() if resp.status_code == 200 else resp
        async with http.stream("POST", f"{pair.decode.url}{path}", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return resp
            return await read_stream(resp)

    p_body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
    prefill, decoded = await asyncio.gather(
        http.post(f"{pair.prefill.url}{path}", json=p_body), decode_side())
    return prefill, decoded


def stream_ids(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events for t in e.get("output_ids", [])]


def tiny_model(model_path: Path, dest: Path, init_range: float = 0.02, layers: int = 2) -> Path:
    """A 2-layer random Llama with the real tokenizer: loads in a second; failure tests use it.
    A larger `init_range` makes its greedy tokens depend strongly on attention, so KV that is
    not a request's own shows in its output."""
    import torch
    import transformers

    cfg = json.loads((model_path / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, initializer_range=init_range)
    cfg.pop("rope_parameters", None)
    config = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json", "generation_config.json"):
        if (model_path / name).exists():
            shutil.copy(model_path / name, dest / name)
    return dest
