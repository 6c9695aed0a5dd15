"""update.payload=fp8 through the engine-process transports: the engine process holds exactly
what the same quantize-dequantize of the trainer's weights gives (tests/unit/test_fp8.py: the format, direct)."""

import pytest
from conftest import check_fp8_reference


@pytest.mark.parametrize("transport", ["ipc", "broadcast"])
def test_the_engine_holds_the_reference_quantization(tiny, transport):
    check_fp8_reference(tiny, transport)
