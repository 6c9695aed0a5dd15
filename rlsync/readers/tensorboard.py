"""TensorBoard event files (events.out.tfevents.*: verl, NeMo-RL, Miles/slime and others write them),
one run per directory, read with the tensorboard package's own record reader and Event protos.

Its record reader (tensorboard.compat's PyRecordReader_New, what EventFileLoader iterates) checks
each record's CRC-32C and raises on a truncated or corrupt one; EventFileLoader itself swallows that
error and stops, which would report a cut file's first steps as the whole run, so the records are
iterated here and a bad one refuses the run. Scalars logged either way (TF1 `simple_value`, TF2
scalar tensors) are read through tensorboard's data_compat; the Event's wall time is the row's clock.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from rlsync.fmt import fmt_bytes
from rlsync.readers.base import CLOCK, STEP, History, Reader, ReadRefused, bounded

MAX_BYTES = 4 << 30  # one event file; a run's scalars are MiBs, images and histograms make GiBs


def is_event_file(path: Path) -> bool:
    return "tfevents" in path.name


def scalars(path: Path) -> list[tuple[int, float, str, float]]:
    """(step, wall time, tag, value) of every scalar in one event file; ReadRefused for a bad record."""
    try:
        from tensorboard import data_compat
        from tensorboard.compat.proto import event_pb2
        from tensorboard.compat.tensorflow_stub import errors
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
        from tensorboard.util import tensor_util
    except ImportError:
        raise ReadRefused(
            f"{path}: reading TensorBoard events needs the tensorboard package (pip install 'rlsync[report]')"
        ) from None
    from google.protobuf.message import DecodeError

    if path.stat().st_size > MAX_BYTES:
        raise ReadRefused(f"{path} is {fmt_bytes(path.stat().st_size)}, over the limit of {fmt_bytes(MAX_BYTES)}")
    out = []
    reader = PyRecordReader_New(str(path))
    try:
        while True:
            try:
                reader.GetNext()
            except errors.OutOfRangeError:
                break
            except errors.DataLossError as err:
                raise ReadRefused(f"{path} is corrupt or truncated ({err.message.rpartition(' ')[0] or err})") from None
            try:
                event = event_pb2.Event.FromString(reader.record())
            except DecodeError:
                raise ReadRefused(f"{path} holds a record that is not a TensorBoard event (corrupt)") from None
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":  # TF1 / torch's SummaryWriter: the number itself
                    out.append((int(event.step), float(event.wall_time), value.tag, float(value.simple_value)))
                    continue
                migrated = data_compat.migrate_value(value)  # TF2: a scalar tensor under the scalars plugin
                if migrated.metadata.plugin_data.plugin_name != "scalars" or not migrated.HasField("tensor"):
                    continue
                array = tensor_util.make_ndarray(migrated.tensor)
                if array.size == 1:
                    out.append((int(event.step), float(event.wall_time), migrated.tag, float(array.reshape(-1)[0])))
    finally:
        reader.file_handle.close()
    return out


class TensorBoardReader(Reader):
    title = "TensorBoard events"

    @classmethod
    def sources(cls, found: list[Path]) -> list[Path]:
        return sorted({p.parent for p in found if is_event_file(p)})

    @classmethod
    def read(cls, source: Path) -> History:
        files = sorted(p for p in source.iterdir() if is_event_file(p) and p.is_file() and not p.is_symlink())
        by_step: dict[int, dict[str, float]] = defaultdict(dict)
        for path in files:  # in the order written (the name holds the start time): a later value wins
            for step, wall, tag, value in scalars(path):
                row = by_step[step]
                row[tag] = value
                row[CLOCK] = max(row.get(CLOCK, wall), wall)  # the step's last write
        if not by_step:
            raise ReadRefused(f"{source}: its TensorBoard events hold no scalars")
        rows = [{STEP: float(step), **row} for step, row in sorted(by_step.items())]
        return History(source, "tensorboard", source.name, bounded(rows, source))
