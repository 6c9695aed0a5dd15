"""verl's file logger (trainer.logger includes "file"): `{project}/{experiment}.jsonl` under
VERL_FILE_LOGGER_ROOT, one `{"step": N, "data": {...}}` per line, `data` holding every metric of step N."""

from __future__ import annotations

from pathlib import Path

from rlsync.readers.base import STEP, History, Reader, ReadRefused, bounded, first_line, jsonl_objects, number


def is_verl_line(line: bytes) -> bool:
    import json

    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and "step" in obj and isinstance(obj.get("data"), dict)


class VerlJsonlReader(Reader):
    title = "verl file logger"

    @classmethod
    def sources(cls, found: list[Path]) -> list[Path]:
        return [p for p in found if p.suffix == ".jsonl" and is_verl_line(first_line(p))]

    @classmethod
    def read(cls, source: Path) -> History:
        rows = []
        for index, obj in enumerate(jsonl_objects(source), 1):
            step, data = number(obj.get("step")), obj.get("data")
            if step is None or not isinstance(data, dict):
                raise ReadRefused(f'{source}: line {index} is not verl\'s {{"step": N, "data": {{...}}}}')
            row = {k: v for k, v in ((k, number(v)) for k, v in data.items()) if v is not None}
            rows.append({**row, STEP: step})
        return History(source, "verl_jsonl", source.stem, bounded(rows, source), hints=("verl",))
