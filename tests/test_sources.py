"""Prompt sources: all four formats, defaults, and bad rows named by file, line and field."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffq.producer.sources import Defaults, IdChecker, InputError, derive_seed, read_prompts

ROWS = [
    {"id": "a", "prompt": "a red cat", "height": 64, "width": 128, "seed": 7},
    {"id": "b", "prompt": "a blue dog", "num_inference_steps": 2, "guidance_scale": 3.5},
    {"id": "c", "prompt": "café, naïve — ünïcode ✓"},
]


def write(tmp_path, fmt, rows=ROWS):
    path = tmp_path / f"prompts.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif fmt == "csv":
        import csv

        columns = ["id", "prompt", "height", "width", "seed", "num_inference_steps", "guidance_scale"]
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            for row in rows:
                writer.writerow(row)
    elif fmt == "parquet":
        # from_pylist takes its columns from the first row: give every row all keys.
        keys = sorted({key for row in rows for key in row})
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
    elif fmt == "txt":
        path.write_text("".join(r["prompt"] + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_structured_formats_read_every_field(tmp_path, fmt):
    prompts = list(read_prompts(write(tmp_path, fmt), Defaults(height=128, width=128, num_inference_steps=4)))
    assert [p.id for p in prompts] == ["a", "b", "c"]
    a, b, c = prompts
    assert (a.height, a.width, a.seed, a.num_inference_steps) == (64, 128, 7, 4)
    assert (b.height, b.width, b.seed, b.num_inference_steps, b.guidance_scale) == (128, 128, None, 2, 3.5)
    assert c.prompt == "café, naïve — ünïcode ✓"


def test_txt_is_one_prompt_per_line_with_stable_ids(tmp_path):
    path = write(tmp_path, "txt")
    first = [(p.id, p.prompt, p.line) for p in read_prompts(path)]
    assert first == [("line-00000001", "a red cat", 1), ("line-00000002", "a blue dog", 2),
                     ("line-00000003", "café, naïve — ünïcode ✓", 3)]
    assert first == [(p.id, p.prompt, p.line) for p in read_prompts(path)]


def test_jsonl_skips_blank_lines_and_counts_them(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"prompt": "three"}\n')
    assert [(p.line, p.id) for p in read_prompts(path)] == [(1, "line-00000001"), (3, "line-00000003")]


@pytest.mark.parametrize(
    "line, field, fragment",
    [
        ('{"prompt": "x", "height": 100}', "height", "multiple of 16"),
        ('{"prompt": "x", "width": -16}', "width", "greater than 0"),
        ('{"prompt": ""}', "prompt", "at least 1 character"),
        ('{"prompt": "   "}', "prompt", "blank"),
        ('{"id": "x"}', "prompt", "Field required"),
        ('{"prompt": "x", "heigth": 64}', "heigth", "Extra inputs"),
        ('{"prompt": "x", "seed": "abc"}', "seed", "valid integer"),
        ('{"prompt": "x", "num_inference_steps": 0}', "num_inference_steps", "greater than 0"),
        ('{"prompt": 5}', "prompt", "valid string"),
    ],
)
def test_bad_jsonl_row_names_file_line_and_field(tmp_path, line, field, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(InputError) as info:
        list(read_prompts(path))
    error = info.value
    assert (error.path, error.line, error.field) == (str(path), 2, field)
    assert fragment in str(error) and f"{path}:2" in str(error)


def test_broken_json_and_non_objects(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: not valid JSON"):
        list(read_prompts(path))
    path.write_text('["a list"]\n')
    with pytest.raises(InputError, match=r"bad.jsonl:1: expected a JSON object"):
        list(read_prompts(path))


def test_csv_bad_row_reports_physical_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('prompt,height\n"multi\nline prompt",64\nok,65\n')
    with pytest.raises(InputError) as info:
        list(read_prompts(path))
    assert (info.value.line, info.value.field) == (4, "height")


def test_csv_extra_values_and_missing_header(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("prompt\nfine\na,b\n")
    with pytest.raises(InputError, match="bad.csv:3: more values than header"):
        list(read_prompts(path))


def test_parquet_bad_row_names_row(tmp_path):
    path = write(tmp_path, "parquet", [{"prompt": "ok", "height": 64}, {"prompt": "bad", "height": 70}])
    with pytest.raises(InputError) as info:
        list(read_prompts(path))
    assert (info.value.line, info.value.field) == (2, "height")


def test_unknown_suffix_missing_file_and_bad_encoding(tmp_path):
    (tmp_path / "p.xlsx").write_text("x")
    with pytest.raises(InputError, match="unknown file type"):
        list(read_prompts(tmp_path / "p.xlsx"))
    with pytest.raises(InputError, match="file not found"):
        list(read_prompts(tmp_path / "missing.jsonl"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(InputError, match="not UTF-8"):
        list(read_prompts(tmp_path / "latin1.txt"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match="not a readable Parquet"):
        list(read_prompts(tmp_path / "broken.parquet"))


def test_duplicate_ids_are_refused_with_both_lines(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"id": "x", "prompt": "a"}\n{"id": "y", "prompt": "b"}\n{"id": "x", "prompt": "c"}\n')
    checker = IdChecker(path)
    with pytest.raises(InputError, match=r"dup.jsonl:3: field 'id': duplicate id 'x' \(first seen on line 1\)"):
        for prompt in read_prompts(path):
            checker.check(prompt)
        checker.finish()


def test_derived_seeds_are_stable_and_distinct():
    assert derive_seed("run1", "a") == derive_seed("run1", "a")
    assert len({derive_seed("run1", str(i)) for i in range(1000)}) == 1000
    assert derive_seed("run1", "a") != derive_seed("run2", "a")
    assert 0 <= derive_seed("run1", "a") < 2**63


def test_duplicate_generated_and_explicit_ids_and_hash_collisions(tmp_path, monkeypatch):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"prompt": "a"}\n{"id": "x", "prompt": "b"}\n{"id": "line-00000001", "prompt": "c"}\n')
    checker = IdChecker(path)
    with pytest.raises(InputError, match=r"dup.jsonl:3: field 'id': duplicate id 'line-00000001' "
                                         r"\(first seen on line 1\)"):
        for prompt in read_prompts(path):
            checker.check(prompt)
        checker.finish()
    # Every id hashing alike: only the true duplicate (line 4) is refused.
    monkeypatch.setattr("builtins.hash", lambda value: 7)
    path.write_text('{"id": "x", "prompt": "a"}\n{"id": "y", "prompt": "b"}\n{"prompt": "c"}\n'
                    '{"id": "y", "prompt": "d"}\n')
    checker = IdChecker(path)
    with pytest.raises(InputError, match=r"dup.jsonl:4: field 'id': duplicate id 'y' \(first seen on line 2\)"):
        for prompt in read_prompts(path):
            checker.check(prompt)
        checker.finish()


def test_derived_seeds_are_the_documented_sha256():
    import hashlib

    for seed_base, item_id in [("run1", "a"), ("r", "é ✓"), ("", "")]:
        digest = hashlib.sha256(f"{seed_base}\x00{item_id}".encode()).digest()
        assert derive_seed(seed_base, item_id) == int.from_bytes(digest[:8], "big") >> 1


def test_duplicates_are_found_across_runs_and_before_later_row_errors(tmp_path, monkeypatch):
    """Ids are sorted in runs of IdChecker.SPILL_ROWS rows: a repeat in a later run is
    still named with both lines, and a duplicate is reported before a bad row that
    follows it in the same unsorted run."""
    from diffq.core.options import GenerationOptions
    from diffq.producer.submit import make_options, validate

    monkeypatch.setattr(IdChecker, "SPILL_ROWS", 4)
    rows = [{"id": f"id-{i}", "prompt": f"p{i}"} for i in range(50)]
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    options, defaults = make_options(model="tiny", options=GenerationOptions.of())
    assert validate(path, options, defaults).total == 50

    rows[36]["id"] = "id-2"  # line 37 repeats line 3, three chunks later
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(InputError, match=r"many.jsonl:37: field 'id': duplicate id 'id-2' \(first seen on line 3\)"):
        validate(path, options, defaults)

    rows[36]["id"] = "id-36"
    rows[8]["id"] = "id-7"  # line 9 repeats line 8 ...
    rows[10]["height"] = 100  # ... and line 11, in the same chunk, is bad too
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(InputError, match=r"many.jsonl:9: field 'id': duplicate id 'id-7' \(first seen on line 8\)"):
        validate(path, options, defaults)


# What spreadsheets and Windows editors save: a UTF-8 byte-order mark, CRLF line ends.
BOM = "\ufeff"


@pytest.mark.parametrize("name, text", [
    ("bom.csv", BOM + "prompt,id\r\na red cat,a\r\na blue dog,b\r\n"),
    ("bom.jsonl", BOM + '{"prompt": "a red cat", "id": "a"}\r\n{"prompt": "a blue dog", "id": "b"}\r\n'),
])
def test_a_leading_utf8_byte_order_mark_is_not_part_of_the_first_row(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")
    assert [(p.line, p.id, p.prompt) for p in read_prompts(path)] == [(2 if name.endswith("csv") else 1, "a", "a red cat"),
                                                                      (3 if name.endswith("csv") else 2, "b", "a blue dog")]


def test_a_leading_byte_order_mark_in_txt_is_dropped_and_one_further_in_is_data(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes((BOM + "a red cat\r\n" + BOM + "a blue dog\r\n").encode("utf-8"))
    assert [(p.line, p.prompt) for p in read_prompts(path)] == [(1, "a red cat"), (2, BOM + "a blue dog")]


def test_a_byte_order_mark_inside_a_file_is_never_stripped(tmp_path):
    # CSV: the mark opening a later cell is part of that prompt.
    path = tmp_path / "mid.csv"
    path.write_bytes((BOM + "prompt\r\nfirst\r\n" + BOM + "second\r\n").encode("utf-8"))
    assert [p.prompt for p in read_prompts(path)] == ["first", BOM + "second"]
    # JSONL: a mark opening line 2 is not JSON, as before.
    path = tmp_path / "mid.jsonl"
    path.write_bytes((BOM + '{"prompt": "first"}\n' + BOM + '{"prompt": "second"}\n').encode("utf-8"))
    with pytest.raises(InputError, match=r"mid.jsonl:2: not valid JSON") as info:
        list(read_prompts(path))
    assert info.value.line == 2
    # Only one leading mark is the file's: a second one right after it is the header's.
    path = tmp_path / "twice.csv"
    path.write_bytes((BOM + BOM + "prompt\nfirst\n").encode("utf-8"))
    with pytest.raises(InputError, match=r"twice.csv:1: field 'prompt': no 'prompt' column in the header: '\\ufeffprompt'"):
        list(read_prompts(path))


def test_a_file_that_is_only_a_byte_order_mark_is_empty(tmp_path):
    for name in ("empty.jsonl", "empty.txt"):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf")
        assert list(read_prompts(tmp_path / name)) == []
    (tmp_path / "empty.csv").write_bytes(b"\xef\xbb\xbf")
    with pytest.raises(InputError, match=r"empty.csv:1: missing CSV header row"):
        list(read_prompts(tmp_path / "empty.csv"))


TEXTS = {"p.csv": "prompt\r\na red cat\r\n", "p.jsonl": '{"prompt": "a red cat"}\r\n', "p.txt": "a red cat\r\n"}


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("codec, data_of, said", [
    # Notepad's "Unicode" and Excel's "Unicode text": UTF-16 LE with its mark.
    ("utf-16-le+bom", lambda text: b"\xff\xfe" + text.encode("utf-16-le"), "UTF-16 LE (it starts with that byte-order mark)"),
    ("utf-16-be+bom", lambda text: b"\xfe\xff" + text.encode("utf-16-be"), "UTF-16 BE (it starts with that byte-order mark)"),
    ("utf-16-le", lambda text: text.encode("utf-16-le"), "UTF-16 LE (NUL bytes between its characters)"),
    ("utf-16-be", lambda text: text.encode("utf-16-be"), "UTF-16 BE (NUL bytes between its characters)"),
    ("utf-32-le+bom", lambda text: b"\xff\xfe\x00\x00" + text.encode("utf-32-le"), "UTF-32 LE (it starts with that byte-order mark)"),
    ("utf-32-be+bom", lambda text: b"\x00\x00\xfe\xff" + text.encode("utf-32-be"), "UTF-32 BE (it starts with that byte-order mark)"),
])
def test_utf16_and_utf32_files_are_refused_naming_the_file_and_the_encoding(tmp_path, name, codec, data_of, said):
    path = tmp_path / name
    path.write_bytes(data_of(TEXTS[name]))
    with pytest.raises(InputError) as info:
        list(read_prompts(path))
    assert str(info.value) == f"{path}: the file is {said}; save it as UTF-8"
    assert (info.value.line, info.value.field) == (None, None)


def test_utf16_guess_ignores_utf8_text_with_no_nul_and_cjk_utf16_is_still_caught(tmp_path):
    # UTF-8 CJK and emoji have no NUL byte: read as they are.
    path = tmp_path / "cjk.txt"
    path.write_bytes("一只红猫\n🐱 猫\n".encode("utf-8"))
    assert [p.prompt for p in read_prompts(path)] == ["一只红猫", "🐱 猫"]
    # UTF-16 LE JSONL of CJK prompts: the ASCII syntax still puts NULs on one side,
    # and U+4E00's zero low byte on the other does not hide it.
    path = tmp_path / "cjk.jsonl"
    path.write_bytes('{"prompt": "一一一一"}\n{"prompt": "一只红猫"}\n'.encode("utf-16-le"))
    with pytest.raises(InputError, match=r"cjk.jsonl: the file is UTF-16 LE \(NUL bytes"):
        list(read_prompts(path))


def test_parquet_values_are_not_touched_by_byte_order_marks(tmp_path):
    path = write(tmp_path, "parquet", [{"prompt": BOM + "a red cat"}])
    assert [p.prompt for p in read_prompts(path)] == [BOM + "a red cat"]


CSV_INTS = ["height", "width", "seed", "num_inference_steps"]
cells = st.one_of(st.integers(-5, 2**64).map(str), st.sampled_from(["064", "00", " 16", "16 ", "+32", "32.0", "1_024",
                                                                   "٣٢", "１６", "9" * 25, "", "x"]),
                  st.text(alphabet="0123456789 +-._e", max_size=6))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.fixed_dictionaries({name: cells for name in CSV_INTS}), min_size=1, max_size=4))
def test_csv_integers_read_exactly_as_pydantic_reads_them(tmp_path_factory, rows):
    """CSV cells of plain digits become ints before the fast row check: the prompts, or
    the first error (line, field, message), are what pydantic alone makes of the text."""
    import csv

    from diffq.producer import sources

    path = tmp_path_factory.mktemp("csv") / "p.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["prompt", *CSV_INTS])
        writer.writeheader()
        writer.writerows({"prompt": f"p{i}", **row} for i, row in enumerate(rows))

    def outcome():
        try:
            return [tuple(prompt) for prompt in read_prompts(path, Defaults(size_multiple=1))]
        except InputError as error:
            return str(error)

    fast = outcome()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sources, "_typed_csv", lambda raw: raw)  # every CSV row through pydantic
        assert outcome() == fast


def test_a_csv_without_a_prompt_column_is_refused_at_its_header_even_with_no_rows(tmp_path):
    for body in ("id,height\n", "id,height\n,\n", "id,height\na,64\n"):
        path = tmp_path / "p.csv"
        path.write_text(body)
        with pytest.raises(InputError, match=r"p.csv:1: field 'prompt': no 'prompt' column in the header: 'id', 'height'"):
            list(read_prompts(path))
