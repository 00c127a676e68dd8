"""The image format table (diffq/core/layout.py) is the one place a format's facts
live: every row encodes, with its provenance written where its row says."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from diffq.core.layout import IMAGE_FORMATS, PROVENANCE_CARRIERS
from diffq.worker.sink.store import PROVENANCE_WRITERS, encode
from tests.test_families_e2e import embedded_text

TEXT = {"prompt": "a lighthouse — «ünïcode» 灯台", "seed": "7"}


def test_every_carrier_has_a_writer():
    assert set(PROVENANCE_WRITERS) == set(PROVENANCE_CARRIERS)
    assert {row.provenance for row in IMAGE_FORMATS.values()} <= set(PROVENANCE_CARRIERS)


@pytest.mark.parametrize("fmt", sorted(IMAGE_FORMATS))
def test_every_format_row_encodes_with_its_provenance(fmt):
    image = Image.fromarray(np.full((16, 16, 3), 128, dtype=np.uint8))
    data = encode(image, fmt, TEXT)
    assert Image.open(io.BytesIO(data)).format == IMAGE_FORMATS[fmt].pil
    assert embedded_text(data) == TEXT
    assert embedded_text(encode(image, fmt)) == {}
