"""Streaming generation from a standalone engine: the typed messages and a bounded client.

A client of `python -m rlsync.serve` that is not a trainer (a user, a load generator) asks for one
answer with `POST /v1/stream` (a `StreamRequest`, JSON) and reads the answer as it is generated: one
`StreamLine` per token (its id, its log-prob under the weights that produced it, and the version of
those weights: the number of updates the engine had swapped in), then an "end" line. `GET /v1/serving`
answers a `ServingState`: the weights' version, the update policy, the streams being served, and the
last update's hold as the engine timed it. Nothing is pickled; every read of the client is bounded.

Time stamps are `time.perf_counter()` on both sides: CLOCK_MONOTONIC on Linux, one clock for every
process of the machine, so a load generator on loopback can place the engine's hold among its own
token arrivals.

    POST /v1/stream   StreamRequest -> 200 + StreamLine lines | 409 Failure (NoWeights) | 422 | 503 (Busy, Torn)
    GET  /v1/serving                -> ServingState

This module sits in rlsync.client (below rlsync.serve and rlsync.bench), so that both the engine and the
load generator (rlsync/bench/stall.py) speak it without importing each other.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

from rlsync.client.client import parse_address, token_headers
from rlsync.client.messages import TokenId

MAX_LINE_BYTES = 4096  # one line of a stream


class StreamMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamRequest(StreamMessage):
    """Strict numbers (no `true` or `"4"` taken for an int); token ids within the engine's vocabulary
    (validated with its size as context, messages.py `TokenId`)."""

    prompt: list[TokenId] = Field(min_length=1, max_length=65536)
    max_new_tokens: StrictInt = Field(ge=1, le=1 << 20)
    temperature: StrictFloat = Field(default=1.0, ge=0, le=100, allow_inf_nan=False)
    seed: StrictInt = Field(default=0, ge=0, lt=1 << 63)


class StreamLine(StreamMessage):
    """One line of an answer's stream: a token, or the end (why it ended, and the error if it failed)."""

    kind: Literal["token", "end"]
    token: Optional[int] = None
    logprob: Optional[float] = None
    # the weights' version this token was generated with (at "end": the version then; None: torn weights)
    version: Optional[int] = Field(default=None, ge=0)
    t: float = 0.0  # the engine's perf_counter when it produced the line
    reason: Optional[Literal["eos", "length", "cancelled", "error"]] = None
    error: Optional[str] = None


class SwapRecord(StreamMessage):
    """The last update as the engine saw it: when generation stopped and went on again (perf_counter)."""

    version: int  # the version the update made current
    policy: str = Field(max_length=64)  # serve.update_policy (rlsync/serve/policies: a registered name)
    swap: str = Field(max_length=64)  # how the update reached the weights (UpdatePolicy.swap_phrase)
    receive_start: float  # the update's receive began
    receive_end: float
    pause_start: float  # the engine's hold began: generation stopped (between two tokens)
    pause_end: float  # the hold ended: generation went on with the new weights
    staged_bytes: int  # the side copy the policy holds (0 under pause)
    # CPU seconds spent during the receive (its wall time is receive_end - receive_start): the whole engine
    # process's, and its decoder thread's (the rest is the receive: gloo's threads, the copies, HTTP)
    engine_cpu_s: float = 0.0
    decoder_cpu_s: float = 0.0


class ServingState(StreamMessage):
    version: Optional[int]  # updates swapped in; None while the weights are torn (an update cut off midway)
    torn: Optional[str] = None  # why no answer is served until a complete update lands
    policy: str = Field(max_length=64)  # serve.update_policy
    streams: int  # answers being generated now
    max_streams: int
    served: int  # answers started since the engine started
    # CPU seconds used since the engine started (cumulative: a client differences two readings): the
    # whole engine process's, and its decoder thread's alone (its OpenMP workers count in the process's)
    engine_cpu_s: float = 0.0
    decoder_cpu_s: float = 0.0
    last_update: Optional[SwapRecord] = None


class StreamFailed(RuntimeError):
    """The engine refused the stream, or it broke before its end line."""


def stream_answer(
    address: str, request: StreamRequest, *, timeout_s: float, stamps: Optional[list[float]] = None
) -> Iterator[tuple[float, StreamLine]]:
    """(arrival perf_counter, line) for each line of one answer, the end line last. Every socket wait is
    bounded by `timeout_s`; StreamFailed if the engine refuses it or the stream breaks.

    `stamps`, if given, gets the perf_counter just before the request is sent (its first wait's start)."""
    host, port = parse_address(address)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        body = request.model_dump_json().encode()
        if stamps is not None:
            stamps.append(time.perf_counter())
        conn.request("POST", "/v1/stream", body=body, headers={**token_headers(), "Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise StreamFailed(f"HTTP {response.status}: {response.read(MAX_LINE_BYTES).decode('utf-8', 'replace')}")
        while True:
            raw = response.readline(MAX_LINE_BYTES)
            arrived = time.perf_counter()
            if not raw:
                raise StreamFailed("the stream closed before its end line")
            line = StreamLine.model_validate_json(raw)
            yield arrived, line
            if line.kind == "end":
                return
    except (OSError, http.client.HTTPException) as err:
        raise StreamFailed(f"{type(err).__name__}: {err}") from None
    finally:
        conn.close()


def serving_state(address: str, *, timeout_s: float) -> ServingState:
    """`GET /v1/serving` of the engine at `address`."""
    host, port = parse_address(address)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", "/v1/serving", headers=token_headers())
        response = conn.getresponse()
        body = response.read(1 << 16)
        if response.status != 200:
            raise StreamFailed(f"HTTP {response.status}: {body[:200].decode('utf-8', 'replace')}")
        return ServingState.model_validate_json(body)
    finally:
        conn.close()
