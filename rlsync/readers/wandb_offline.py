"""A W&B run written offline (WANDB_MODE=offline: wandb/offline-run-<time>-<id>/run-<id>.wandb), read
from its `.wandb` file with no network.

The file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB's
log framing (32 KiB blocks of records, each a CRC-32, a length and a type: full, first, middle or
last piece), each record one of wandb's own protobuf `Record` messages (wandb.proto), decoded by
wandb's generated classes. wandb 0.19+ writes it from its Go core and no longer ships the Python
reader (wandb.sdk.internal.datastore), so the framing is read here, as its docs specify it; the
records are wandb's. History rows (`history.item`: a key, or a nested key, and a JSON value) become
rows; the run record's and config records' updates become the config; the environment record's GPU the device.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

from rlsync.readers.base import CLOCK, STEP, History, Reader, ReadRefused, bounded, number, read_file

HEADER = struct.Struct("<4sHB")  # ident, magic, version
IDENT, MAGIC = b":W&B", 0xBEE1
BLOCK = 32768
RECORD = struct.Struct("<IHB")  # CRC-32 of type byte and data, data length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
CRC = {kind: zlib.crc32(bytes([kind])) & 0xFFFFFFFF for kind in (FULL, FIRST, MIDDLE, LAST)}
MAX_BYTES = 1 << 30  # a .wandb file: media logs make GiBs; history alone is MiBs


def payloads(data: bytes, path: Path) -> list[bytes]:
    """The records' bytes, reassembled from their pieces; ReadRefused for a file W&B did not write
    whole (a bad header, a checksum that does not match, a record cut short)."""
    if len(data) < HEADER.size:
        raise ReadRefused(f"{path} is not a W&B run file (only {len(data)} bytes)")
    ident, magic, version = HEADER.unpack_from(data)
    if ident != IDENT or magic != MAGIC:
        raise ReadRefused(f"{path} is not a W&B run file (no :W&B header)")
    if version != 0:
        raise ReadRefused(f"{path} is a W&B run file of format version {version}; this reader knows version 0")
    out: list[bytes] = []
    pending: list[bytes] | None = None
    pos = HEADER.size
    while pos < len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < RECORD.size:  # a block's trailer: zeros
            pos += left_in_block
            continue
        if pos + RECORD.size > len(data):
            raise ReadRefused(f"{path} ends inside a record at byte {pos:,} (truncated: copy it again once W&B ends)")
        checksum, length, kind = RECORD.unpack_from(data, pos)
        if kind == 0 and length == 0 and checksum == 0:  # zero padding to the block's end
            pos += left_in_block
            continue
        start, end = pos + RECORD.size, pos + RECORD.size + length
        if kind not in CRC or end > len(data) or length > left_in_block - RECORD.size:
            raise ReadRefused(f"{path} is corrupt at byte {pos:,} (not a record W&B writes; truncated?)")
        piece = data[start:end]
        if zlib.crc32(piece, CRC[kind]) & 0xFFFFFFFF != checksum:
            raise ReadRefused(f"{path} is corrupt at byte {pos:,} (checksum mismatch)")
        pos = end
        if kind == FULL:
            out.append(piece)
        elif kind == FIRST:
            pending = [piece]
        elif pending is None:
            raise ReadRefused(
                f"{path} is corrupt at byte {start - RECORD.size:,} (a record's middle without its start)"
            )
        else:
            pending.append(piece)
            if kind == LAST:
                out.append(b"".join(pending))
                pending = None
    return out


def item_key(item: Any) -> str:
    """A history or config item's name: its key, or its nested key joined by dots (W&B's flat name)."""
    return item.key or ".".join(item.nested_key)


def json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class WandbOfflineReader(Reader):
    title = "W&B offline run"

    @classmethod
    def sources(cls, found: list[Path]) -> list[Path]:
        return [p for p in found if p.suffix == ".wandb"]

    @classmethod
    def read(cls, source: Path) -> History:
        try:
            from wandb.proto import wandb_internal_pb2 as pb
        except ImportError:
            raise ReadRefused(f"{source}: reading a W&B run needs the wandb package (pip install wandb)") from None
        from google.protobuf.message import DecodeError

        rows: list[dict[str, float]] = []
        config: dict[str, Any] = {}
        device = None  # the GPU W&B's system record names (environment: gpu_type, gpu_nvidia)
        for raw in payloads(read_file(source, MAX_BYTES), source):
            record = pb.Record()
            try:
                record.ParseFromString(raw)
            except DecodeError:
                raise ReadRefused(f"{source} holds a record that is not W&B's (corrupt)") from None
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {}
                for item in record.history.item:
                    value = number(json_value(item.value_json))
                    if value is not None:
                        row[item_key(item)] = value
                if record.history.HasField("step") and STEP not in row:
                    row[STEP] = float(record.history.step.num)
                if STEP in row:
                    rows.append(row)
            elif kind == "environment":
                env = record.environment
                device = device or env.gpu_type or next((g.name for g in env.gpu_nvidia if g.name), None)
            elif kind in ("run", "config"):
                updates = record.run.config.update if kind == "run" else record.config.update
                for item in updates:
                    if item_key(item) != "_wandb":
                        config[item_key(item)] = json_value(item.value_json)
        for row in rows:  # W&B's own clock: seconds since the epoch
            if CLOCK not in row and "_runtime" in row:
                row[CLOCK] = row["_runtime"]
        # the run's directory (wandb/offline-run-<time>-<id>) names it, as W&B does; a lone file its stem
        where = source.parent if source.parent.name.startswith(("offline-run-", "run-")) else source
        return History(where, "wandb", where.name, bounded(rows, source), config, device=device)
