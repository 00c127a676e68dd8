"""Id uniqueness in bounded memory (IdChecker's sorted runs on disk): exact behaviour
at small sizes, with the spill threshold made small so a few thousand rows span
many runs. Speed and memory at 10M–100M rows live in bench/producer.py."""

from __future__ import annotations

import csv
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffq.producer.sources import IdChecker, InputError, generated_id, read_prompts
from diffq.core.options import GenerationOptions
from diffq.producer.submit import make_options, submit, validate

ROWS = 3000
SPILL = 256  # 11 full runs on disk + the last one in memory


def write_jsonl(path, ids, extra=None):
    """One row per id (None: no id field, so a generated one); `extra` patches rows by index."""
    rows = [{"prompt": f"p{index}"} | ({"id": item_id} if item_id is not None else {})
            for index, item_id in enumerate(ids)]
    for index, patch in (extra or {}).items():
        rows[index] |= patch
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def check_file(path, **kwargs) -> IdChecker:
    checker = IdChecker(path, **kwargs)
    for prompt in read_prompts(path):
        checker.check(prompt)
    checker.finish()
    return checker


def first_repeat(ids: list[str]) -> tuple[int, int, str] | None:
    """The reference: (line, first line, id) of the first row whose id came before."""
    seen: dict[str, int] = {}
    for line, item_id in enumerate(ids, start=1):
        if item_id in seen:
            return line, seen[item_id], item_id
        seen[item_id] = line
    return None


def distinct(n: int) -> list[str]:
    return [f"id-{index}" for index in range(n)]


def error_of(path, **kwargs) -> InputError | None:
    try:
        check_file(path, **kwargs)
    except InputError as error:
        return error
    return None


def test_distinct_ids_pass_and_every_full_run_is_spilled(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", distinct(ROWS))
    assert check_file(path, spill_rows=SPILL).spilled_runs == ROWS // SPILL
    assert check_file(path).spilled_runs == 0  # the default threshold: one run, in memory


@pytest.mark.parametrize("first, repeat", [
    (1, 2), (1, ROWS), (ROWS - 1, ROWS),  # first and last rows
    (100, 200),  # within one run
    (SPILL, SPILL + 1), (1, SPILL + 1), (7, 2 * SPILL + 3), (SPILL + 5, ROWS),  # across runs
    (11 * SPILL + 5, ROWS - 1),  # within the last, unspilled run
])
def test_a_repeat_anywhere_is_named_with_both_lines(tmp_path, first, repeat):
    ids = distinct(ROWS)
    ids[repeat - 1] = ids[first - 1]
    path = write_jsonl(tmp_path / "dup.jsonl", ids)
    with pytest.raises(InputError) as info:
        check_file(path, spill_rows=SPILL)
    assert str(info.value) == f"{path}:{repeat}: field 'id': duplicate id 'id-{first - 1}' (first seen on line {first})"
    assert (info.value.line, info.value.field) == (repeat, "id")


def test_of_several_repeats_the_earliest_repeating_line_is_named(tmp_path):
    ids = distinct(ROWS)
    ids[2899] = ids[9]  # line 2900 repeats line 10: the earliest first line ...
    ids[599] = ids[499]  # ... but line 600 repeats first
    ids[1999] = ids[1499] = ids[4]  # an id three times
    path = write_jsonl(tmp_path / "dup.jsonl", ids)
    assert first_repeat(ids) == (600, 500, "id-499")
    with pytest.raises(InputError, match=r"dup.jsonl:600: field 'id': duplicate id 'id-499' \(first seen on line 500\)"):
        check_file(path, spill_rows=SPILL)


@pytest.mark.parametrize("seed", range(12))
def test_random_files_match_the_reference(tmp_path, seed):
    """Ids drawn from a pool a little larger than the file: repeats land anywhere,
    some files have none; the checker names exactly what a dict would."""
    rng = random.Random(seed)
    n = rng.randrange(500, 2500)
    pool = n * rng.choice([1, 4, 40, 400])
    ids = [f"k{rng.randrange(pool)}" for _ in range(n)] if seed % 3 else distinct(n)
    path = write_jsonl(tmp_path / "r.jsonl", ids)
    error = error_of(path, spill_rows=rng.choice([7, 64, 300, 10_000]))
    expected = first_repeat(ids)
    if expected is None:
        assert error is None
    else:
        line, first, item_id = expected
        assert error is not None
        assert str(error) == f"{path}:{line}: field 'id': duplicate id '{item_id}' (first seen on line {first})"


@pytest.mark.parametrize("hash_id", [lambda _: 7, lambda item_id: len(item_id) % 3, lambda item_id: hash(item_id) % 5],
                         ids=["one hash", "three hashes", "five hashes"])
def test_colliding_hashes_never_refuse_distinct_ids(tmp_path, monkeypatch, hash_id):
    # Few candidates per read of the file: confirming takes several rounds.
    monkeypatch.setattr(IdChecker, "CANDIDATES", 100)
    n = 1200  # 4 runs on disk and one in memory
    ids = distinct(n)
    path = write_jsonl(tmp_path / "c.jsonl", ids)
    assert error_of(path, spill_rows=SPILL, hash_id=hash_id) is None
    # A true repeat among a thousand collisions is still found, with both lines.
    ids[n - 2] = ids[2]
    path = write_jsonl(tmp_path / "c.jsonl", ids)
    error = error_of(path, spill_rows=SPILL, hash_id=hash_id)
    assert str(error) == f"{path}:{n - 1}: field 'id': duplicate id 'id-2' (first seen on line 3)"


def test_a_collision_inside_a_run_is_confirmed_and_the_pass_goes_on(tmp_path):
    """A hash repeated within a run is confirmed when the run is sorted (before the
    rest of the file is read); a mere collision is not refused, and a real repeat
    later in the file is still found."""
    reads = []

    def hash_id(item_id: str) -> int:
        reads.append(item_id)
        return 1 if item_id in ("id-3", "id-5") else hash(item_id)

    ids = distinct(ROWS)
    path = write_jsonl(tmp_path / "c.jsonl", ids)
    assert error_of(path, spill_rows=SPILL, hash_id=hash_id) is None
    assert len(reads) > ROWS  # the first run's collision was confirmed by reading ids again
    ids[ROWS - 1] = ids[5]
    path = write_jsonl(tmp_path / "c.jsonl", ids)
    error = error_of(path, spill_rows=SPILL, hash_id=hash_id)
    assert str(error) == f"{path}:{ROWS}: field 'id': duplicate id 'id-5' (first seen on line 6)"


def test_generated_and_explicit_ids_repeat_across_runs(tmp_path):
    ids: list[str | None] = [None] * ROWS  # every id generated from its line
    ids[2500] = generated_id(40)  # line 2501 says it is line 40
    path = write_jsonl(tmp_path / "g.jsonl", ids)
    with pytest.raises(InputError, match=r"g.jsonl:2501: field 'id': duplicate id 'line-00000040' "
                                         r"\(first seen on line 40\)"):
        check_file(path, spill_rows=SPILL)


def test_a_repeat_in_an_earlier_run_is_named_before_a_later_bad_row(tmp_path):
    options, defaults = make_options(model="tiny", options=GenerationOptions.of())
    ids = distinct(ROWS)
    ids[1000] = ids[20]  # line 1001 repeats line 21, runs apart ...
    path = write_jsonl(tmp_path / "v.jsonl", ids, extra={1100: {"height": 100}})  # ... and line 1101 is bad
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(IdChecker, "SPILL_ROWS", SPILL)
        with pytest.raises(InputError, match=r"v.jsonl:1001: field 'id': duplicate id 'id-20'"):
            validate(path, options, defaults)
        # A bad row before the first repeat is the one named.
        path = write_jsonl(tmp_path / "v.jsonl", ids, extra={900: {"height": 100}})
        with pytest.raises(InputError, match=r"v.jsonl:901: field 'height'"):
            validate(path, options, defaults)


def test_a_repeat_across_runs_means_nothing_is_written_or_enqueued(tmp_path, monkeypatch):
    class Recorder:
        published: list = []

        def publish(self, message):
            self.published.append(message)

    monkeypatch.setattr(IdChecker, "SPILL_ROWS", SPILL)
    ids = distinct(ROWS)
    ids[ROWS - 1] = ids[0]
    path = write_jsonl(tmp_path / "p.jsonl", ids)
    out, recorder = tmp_path / "out", Recorder()
    with pytest.raises(InputError, match=rf"p.jsonl:{ROWS}: field 'id': duplicate id 'id-0' \(first seen on line 1\)"):
        submit(path, str(out), model="m", publisher=recorder)
    assert recorder.published == [] and not any(out.rglob("*"))
    # The same file with the repeat gone: every row is planned and published.
    ids[ROWS - 1] = "last"
    write_jsonl(path, ids)
    result = submit(path, str(out), model="m", publisher=recorder, batch_size=4)
    assert result.total == ROWS and len(recorder.published) == ROWS // 4


def test_csv_txt_and_parquet_name_their_own_lines(tmp_path):
    ids = distinct(ROWS)
    ids[2000] = ids[10]
    # CSV: a header, and a quoted two-line prompt in row 5: row i ends on line i + 2, or i + 3 after it.
    path = tmp_path / "p.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["prompt", "id"])
        writer.writerows([["two\nlines" if index == 4 else f"p{index}", item_id] for index, item_id in enumerate(ids)])
    with pytest.raises(InputError, match=r"p.csv:2003: field 'id': duplicate id 'id-10' \(first seen on line 13\)"):
        check_file(path, spill_rows=SPILL)
    # Parquet: rows are numbered from 1.
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"p{index}", "id": item_id} for index, item_id in enumerate(ids)]),
                   path, row_group_size=700)
    with pytest.raises(InputError, match=r"p.parquet:2001: field 'id': duplicate id 'id-10' \(first seen on line 11\)"):
        check_file(path, spill_rows=SPILL)
    # TXT: ids are generated from lines; blank lines are skipped, never repeated.
    path = tmp_path / "p.txt"
    path.write_text("".join(f"prompt {index}\n" + ("\n" if index % 7 == 0 else "") for index in range(ROWS)))
    assert check_file(path, spill_rows=SPILL, hash_id=lambda item_id: len(item_id) % 2).spilled_runs == ROWS // SPILL


def test_an_empty_file_and_a_bad_first_row_are_named_as_such(tmp_path):
    options, defaults = make_options(model="tiny", options=GenerationOptions.of())
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(InputError, match=r"empty.jsonl: no prompts in file"):
        validate(path, options, defaults)
    path = write_jsonl(tmp_path / "bad.jsonl", distinct(5), extra={0: {"height": 100}})
    with pytest.raises(InputError, match=r"bad.jsonl:1: field 'height'"):
        validate(path, options, defaults)
