"""Property-based: whatever the input, a clear InputError (file, line, field) or a
valid prompt — never a traceback, never a partial enqueue; messages likewise."""

from __future__ import annotations

import io
import json
import string

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from diffq.core.contract import BatchMessage
from diffq.producer.sources import InputError, read_prompts
from diffq.producer.submit import submit

FIELDS = ["prompt", "id", "height", "width", "seed", "num_inference_steps", "guidance_scale", "extra"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=5,
)
rows = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def read_all(path):
    """Either every prompt, or an InputError that says where."""
    try:
        return list(read_prompts(path)), None
    except InputError as error:
        assert error.path == str(path)
        assert str(error).startswith(str(path))
        return None, error


@SETTINGS
@given(st.lists(rows, min_size=1, max_size=5))
def test_jsonl_rows(tmp_path_factory, batch):
    path = tmp_path_factory.mktemp("p") / "p.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in batch))
    prompts, error = read_all(path)
    if error is not None:
        assert 1 <= error.line <= len(batch)
        bad = batch[error.line - 1]
        assert error.field is None or error.field.split(".")[0] in bad or error.field == "prompt"
    else:
        assert len(prompts) == len(batch)


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_bytes_in_every_text_format(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("p")
    body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data  # a leading UTF-8 mark is not text
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    for name in ("p.jsonl", "p.csv", "p.txt"):
        path = folder / name
        path.write_bytes(data)
        prompts, error = read_all(path)
        if text is None:
            assert error is not None, "bytes that are not UTF-8 are refused, never half-read"
            continue
        if prompts is None:
            continue
        assert all(p.prompt and not p.prompt.startswith("\ufeff") or "\ufeff" in text for p in prompts)
        if name == "p.txt":
            # One prompt per non-blank line, in order, the line itself (no line break kept).
            lines = [line.rstrip("\r\n") for line in io.StringIO(text, newline="")]
            assert [p.prompt for p in prompts] == [line for line in lines if line.strip()]


@SETTINGS
@given(st.lists(st.lists(st.text(alphabet=string.printable, max_size=8), min_size=1, max_size=4), min_size=1, max_size=5),
       st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True))
def test_csv_tables(tmp_path_factory, table, header):
    import csv

    path = tmp_path_factory.mktemp("p") / "p.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(table)
    prompts, error = read_all(path)
    if prompts is not None:
        # Every prompt is a cell of the prompt column, row by row (empty rows skipped).
        assert "prompt" in header and len(prompts) <= len(table)
        column = header.index("prompt")
        cells = [row[column] for row in table if len(row) > column]
        assert all(p.prompt in cells for p in prompts)


@SETTINGS
@given(st.lists(st.fixed_dictionaries({"prompt": st.one_of(st.none(), st.text(max_size=10)),
                                       "height": st.one_of(st.none(), st.integers(-100, 5000))}),
                min_size=1, max_size=6))
def test_parquet_tables(tmp_path_factory, batch):
    path = tmp_path_factory.mktemp("p") / "p.parquet"
    pq.write_table(pa.Table.from_pylist(batch), path)
    prompts, error = read_all(path)
    if error is not None:
        assert 1 <= error.line <= len(batch)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["schema_version", "run_id", "out", "batch_id", "shape", "params", "items",
                                        "x"]), json_values, max_size=8))
def test_message_schema_only_raises_validation_errors(payload):
    with pytest.raises((ValidationError, ValueError)):
        BatchMessage.from_json_payload(json.dumps(payload).encode())


def test_a_bad_row_anywhere_means_nothing_is_written_or_enqueued(tmp_path):
    class Recorder:
        published = []

        def publish(self, message):
            self.published.append(message)

        def close(self):
            pass

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(5000))
                    + '{"prompt": "bad", "seed": -1}\n')
    out = tmp_path / "out"
    recorder = Recorder()
    with pytest.raises(InputError, match=r"p.jsonl:5001: field 'seed'"):
        submit(path, str(out), model="m", publisher=recorder)
    assert recorder.published == [] and not any(out.rglob("*"))


plain_values = st.none() | st.booleans() | st.integers(-2, 2**64) | st.floats(-1, 101) | st.just(float("nan")) \
    | st.text(max_size=4) | st.sampled_from([" \u3000", "a\x00", "\x1b", "x" * 201])


@SETTINGS
@given(st.dictionaries(st.sampled_from(FIELDS), plain_values, max_size=7))
def test_fast_row_check_accepts_only_what_pydantic_accepts(row):
    from diffq.producer.sources import PromptRow, _plain_row

    if _plain_row(row) is not None:
        assert PromptRow.model_validate(row).model_dump(exclude_unset=True) == row
