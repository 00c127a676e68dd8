"""The sink's helper process (worker/sink/helper.py): batches handed over as raw
pixels come out as the same images, records and credits the threaded sink writes;
a helper that dies fails only what it held (the acks turn into requeues) and the
next batch gets a new helper; a worker that goes away leaves its helper to store
what it was handed, then exit."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest
from PIL import Image

from diffq.core import layout, progress
from diffq.core.contract import BatchItem, BatchMessage, BatchParams, ShapeKey
from diffq.core.storage import open_storage
from diffq.worker.observe import metrics
from diffq.worker.sink.store import Pixels, Sink
from diffq.worker.sink.helper import SinkError, SinkLost, SinkProcess, Slots, make_sink
from tests.helpers import MEASURED

SHAPE = ShapeKey(model="tiny", height=24, width=40, batch_size=4, max_sequence_length=64, cfg=False)
PARAMS = BatchParams(num_inference_steps=2, guidance_scale=1.0)


@pytest.fixture(params=["local", "s3"])
def out(request, tmp_path):
    return str(tmp_path / "run") if request.param == "local" else request.getfixturevalue("s3_bucket")


def batch(out: str, index: int, items: int = 4) -> BatchMessage:
    return BatchMessage(run_id="r", out=out, batch_id=f"b{index:03d}", shape=SHAPE, params=PARAMS,
                        items=[BatchItem(id=f"i{index}-{n}", prompt=f"p{n}", seed=n) for n in range(items)])


def pictures(message: BatchMessage) -> list[Image.Image]:
    rng = np.random.default_rng(len(message.batch_id) + int(message.batch_id[1:]))
    return [Image.fromarray(rng.integers(0, 256, (SHAPE.height, SHAPE.width, 3), dtype=np.uint8))
            for _ in message.items]


def store(sink, out: str, message: BatchMessage, images: list, extra: dict | None = None):
    """Hand a batch over and wait as the worker does: stored (back-pressure), then
    credited (the ack); returns the BatchOutcome."""
    handed = sink.submit(open_storage(out), message, images, {**MEASURED, **(extra or {})})
    outcome = handed.stored.result(timeout=60)
    assert handed.credited.result(timeout=60) is None
    return outcome


def credited(out: str) -> set[str]:
    storage = open_storage(out)
    return {batch_id for key in storage.list(layout.PROGRESS_PREFIX)
            for batch_id, _queue, _count, _ids in progress.parse_segment(storage.get_bytes(key))}


def assert_stored(out: str, message: BatchMessage, images: list[Image.Image]) -> None:
    storage = open_storage(out)
    for item, image in zip(message.items, images):
        stored = Image.open(io.BytesIO(storage.get_bytes(layout.image_key(item.id, "png"))))
        assert np.array_equal(np.asarray(stored), np.asarray(image))
    lines = [json.loads(line) for line in storage.get_bytes(layout.record_key(message.batch_id)).splitlines()]
    assert [line["id"] for line in lines] == [item.id for item in message.items]
    assert {line["generate_s"] for line in lines} == {0.25}


def test_helper_stores_the_same_images_records_and_credits(out):
    sink = SinkProcess()
    try:
        messages = [batch(out, i) for i in range(3)]
        images = [pictures(message) for message in messages]
        outcomes = [store(sink, out, m, im, {"generate_s": 0.25})
                    for m, im in zip(messages, images)]
        assert [(o.batch_id, o.written) for o in outcomes] == [(m.batch_id, 4) for m in messages]
        assert all(o.bytes > 0 and o.store_s > 0 for o in outcomes)
        for message, imgs in zip(messages, images):
            assert_stored(out, message, imgs)
        assert credited(out) == {m.batch_id for m in messages}
        # A redelivered copy: nothing rewritten, credited again (by the same helper).
        assert store(sink, out, messages[0], pictures(batch(out, 9)), {"generate_s": 0.25}).written == 0
        assert_stored(out, messages[0], images[0])
        assert sink.credit(open_storage(out), messages[1]).result(timeout=60) is None
    finally:
        sink.close()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_generated_arrays_are_stored_as_the_same_pixels(tmp_path, mode):
    """The worker hands over what the pipeline host makes (H×W×3 uint8 arrays, views
    of one batch array): both sinks store exactly those pixels."""
    out = str(tmp_path / "run")
    message = batch(out, 5)
    arrays = list(np.stack([np.asarray(image) for image in pictures(message)]))
    sink = SinkProcess() if mode == "process" else Sink()
    try:
        assert store(sink, out, message, arrays, {"generate_s": 0.25}).written == 4
        assert_stored(out, message, arrays)
    finally:
        sink.close()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_flagged_items_reach_their_records_and_no_other_field(tmp_path, mode):
    """The task hands per-item degenerate flags with the batch's record fields
    (worker/delivery/tasks.py): each lands in its own item's record only."""
    from diffq.core.runfolder import iter_records
    from diffq.worker.sink.store import DEGENERATE_KEY

    out = str(tmp_path / "run")
    message = batch(out, 6)
    sink = SinkProcess() if mode == "process" else Sink()
    try:
        store(sink, out, message, pictures(message), {DEGENERATE_KEY: {"i6-2": "flat"}})
    finally:
        sink.close()
    records = {record.id: record for record in iter_records(open_storage(out))}
    assert {i: r.degenerate for i, r in records.items()} == {"i6-0": None, "i6-1": None, "i6-2": "flat", "i6-3": None}


def test_sink_cpus_place_the_helper_and_the_sink_threads(tmp_path, monkeypatch):
    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    monkeypatch.setenv("DIFFQ_SINK_CPUS", str(cpu))
    threaded = Sink()
    try:
        assert threaded._pool.submit(os.sched_getaffinity, 0).result() == {cpu}
        assert threaded._writer.submit(os.sched_getaffinity, 0).result() == {cpu}
        assert os.sched_getaffinity(0) == mine  # only the sink's threads moved
    finally:
        threaded.close()
    sink = SinkProcess()
    try:
        message = batch(str(tmp_path / "run"), 6)
        store(sink, str(tmp_path / "run"), message, pictures(message))
        status = open(f"/proc/{sink._helper.process.pid}/status").read()
        assert f"Cpus_allowed_list:\t{cpu}\n" in status
    finally:
        sink.close()


def test_the_sink_keeps_freed_pixel_blocks_for_the_next_batch(monkeypatch):
    from PIL import Image

    from diffq.worker.sink.store import PIXEL_BLOCKS_KEPT

    monkeypatch.delenv("PILLOW_BLOCKS_MAX", raising=False)
    before = Image.core.get_blocks_max()
    try:
        Image.core.set_blocks_max(0)  # PIL's default: every image's memory goes back to the OS
        Sink().close()
        assert Image.core.get_blocks_max() == PIXEL_BLOCKS_KEPT
        Image.core.set_blocks_max(0)
        monkeypatch.setenv("PILLOW_BLOCKS_MAX", "0")  # the user's setting wins
        Sink().close()
        assert Image.core.get_blocks_max() == 0
    finally:
        Image.core.set_blocks_max(before)


def test_a_dead_helper_fails_what_it_held_and_the_next_batch_gets_a_new_one(tmp_path):
    out = str(tmp_path / "run")
    sink = SinkProcess()
    try:
        sink.start()
        first = sink._helper.process
        first.send_signal(signal.SIGSTOP)  # holds the next batch without storing it
        held = sink.submit(open_storage(out), batch(out, 0), pictures(batch(out, 0)), {**MEASURED, "generate_s": 0.25})
        first.send_signal(signal.SIGKILL)
        with pytest.raises(SinkLost):
            held.stored.result(60)
        with pytest.raises(SinkLost):
            held.credited.result(60)
        message = batch(out, 1)
        images = pictures(message)
        assert store(sink, out, message, images, {"generate_s": 0.25}).written == 4
        assert sink._helper.process.pid != first.pid
        assert_stored(out, message, images)
        assert not open_storage(out).exists(layout.record_key("b000"))  # it comes back via the broker
    finally:
        sink.close()


@pytest.mark.parametrize("kind", ["images", "arrays"])
def test_a_storage_error_reaches_the_future_after_the_retries(tmp_path, kind):
    """Arrays cross in a shared-memory slot: a failed batch gives it back too. The
    failed try is counted in the worker's metrics (the ones it serves), not the helper's."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    out = str(blocker / "run")
    def tries() -> float:
        return metrics.REGISTRY.get_sample_value("diffq_upload_failures_total", {"stage": "try"})

    before = tries()
    sink = SinkProcess(retry_for_s=0)
    try:
        with pytest.raises(SinkError, match="run"):
            store(sink, out, batch(out, 0), (pictures if kind == "images" else arrays_of)(batch(out, 0)), {})
        assert tries() == before + 1  # no retry past retry_for_s=0: one try
        assert sink._helper.process.poll() is None  # one bad batch does not end the helper
        assert sink.slots.counts() == ((0, 0) if kind == "images" else (1, 1))
    finally:
        sink.close()


def test_helper_stores_what_it_was_handed_when_the_worker_goes_away(tmp_path):
    """The worker's end closes without a goodbye (SIGKILL): every batch already in
    the socket is stored, recorded and credited, then the helper exits 0."""
    out = str(tmp_path / "run")
    ours, theirs = socket.socketpair()
    helper = subprocess.Popen([sys.executable, "-m", "diffq.worker.sink.helper", str(theirs.fileno()), "2", "60"],
                              pass_fds=[theirs.fileno()])
    theirs.close()
    conn = Connection(ours.detach())
    messages = [batch(out, i) for i in range(5)]
    images = [pictures(message) for message in messages]
    for job, (message, imgs) in enumerate(zip(messages, images)):
        conn.send_bytes(json.dumps({"op": "store", "job": job, "out": out, "message": message.model_dump_json(),
                                    "measures": {**MEASURED, "generate_s": 0.25},
                                    "image": {"mode": "RGB", "size": [SHAPE.width, SHAPE.height], "count": 4}}
                                   ).encode())
        conn.send_bytes(b"".join(image.tobytes() for image in imgs))
    conn.close()
    assert helper.wait(timeout=60) == 0
    for message, imgs in zip(messages, images):
        assert_stored(out, message, imgs)
    assert credited(out) == {m.batch_id for m in messages}


def test_helper_ignores_the_signals_meant_for_its_worker(tmp_path):
    """Ctrl-C or a SIGTERM to the process group must not cut the sink off from the
    batch the worker is finishing; the worker ends it by closing the socket."""
    out = str(tmp_path / "run")
    sink = SinkProcess()
    try:
        assert store(sink, out, batch(out, 0), pictures(batch(out, 0)), {}).written == 4
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(sink._helper.process.pid, sig)
        message = batch(out, 1)
        images = pictures(message)
        assert store(sink, out, message, images, {"generate_s": 0.25}).written == 4
        helper = sink._helper.process
    finally:
        sink.close()
    assert helper.returncode == 0


def test_the_worker_sink_is_a_helper_process_unless_configured(monkeypatch):
    sink = make_sink()
    try:
        assert isinstance(sink, SinkProcess)
        assert sink._helper is not None and sink._helper.process.poll() is None  # started with the worker
    finally:
        sink.close()
    monkeypatch.setenv("DIFFQ_SINK", "thread")
    assert isinstance(make_sink(), Sink)


def test_a_helper_that_cannot_start_falls_back_to_threads(tmp_path, monkeypatch, caplog):
    """A helper that dies again and again without storing anything (broken install)
    must not turn every batch into a requeue forever: after MAX_FAILED_STARTS the
    worker stores in threads itself, and says so."""
    monkeypatch.setattr(SinkProcess, "HELPER_MODULE", "diffq.worker.no_such_module")
    out = str(tmp_path / "run")
    sink = SinkProcess()
    try:
        for index in range(SinkProcess.MAX_FAILED_STARTS):
            with pytest.raises(SinkLost):
                store(sink, out, batch(out, index), pictures(batch(out, index)), {})
        message = batch(out, 9)
        images = pictures(message)
        assert store(sink, out, message, images, {"generate_s": 0.25}).written == 4
        assert_stored(out, message, images)
        assert "storing in threads" in caplog.text
    finally:
        sink.close()


def arrays_of(message: BatchMessage, height: int = SHAPE.height, width: int = SHAPE.width) -> list:
    """What the pipeline host hands over: views of one B×H×W×3 uint8 batch array."""
    rng = np.random.default_rng(int(message.batch_id[1:]))
    return list(rng.integers(0, 256, (len(message.items), height, width, 3), dtype=np.uint8))


def test_array_batches_cross_in_shared_memory_slots_given_back_once_stored(tmp_path):
    """Batches of arrays go through the worker's shared-memory slots (PIL images through
    the socket); each slot is free again once its batch is stored, and slots are
    reused, not made per batch."""
    out = str(tmp_path / "run")
    sink = SinkProcess()
    assert sink.slots is not None
    try:
        for index in range(6):
            message = batch(out, index)
            arrays = arrays_of(message)
            assert store(sink, out, message, arrays, {"generate_s": 0.25}).written == 4
            assert_stored(out, message, arrays)
        made, free = sink.slots.counts()
        assert 1 <= made <= Slots.MOST and free == made
        message = batch(out, 7)
        images = pictures(message)  # PIL images: by the socket, no slot taken
        assert store(sink, out, message, images, {"generate_s": 0.25}).written == 4
        assert_stored(out, message, images)
        assert sink.slots.counts() == (made, made)
    finally:
        sink.close()
    assert sink.slots.counts() == (0, 0)


def test_a_batch_of_another_shape_gets_a_slot_that_fits(tmp_path, monkeypatch):
    """A bigger batch than every slot retires a free one for one that fits (the helper
    unmaps the old one); the pixels are still the batch's own."""
    monkeypatch.setattr(Slots, "MOST", 1)
    out = str(tmp_path / "run")
    sink = SinkProcess()
    try:
        for index, (height, width) in enumerate([(24, 40), (48, 40), (24, 40), (48, 40)]):
            message = batch(out, index)
            arrays = arrays_of(message, height, width)
            assert store(sink, out, message, arrays, {"generate_s": 0.25}).written == 4
            assert_stored(out, message, arrays)
            assert sink.slots.counts() == (1, 1)
    finally:
        sink.close()


def test_pixels_from_a_slot_become_their_image_each_time_they_are_asked(tmp_path, monkeypatch):
    """The helper hands the sink each slot image as `Pixels`, unpacked by the thread
    that encodes it; a store that is retried (here: the first attempt of each batch
    fails) builds its images again from the same slot, which stays the batch's until
    it is stored."""
    arrays = [np.random.default_rng(n).integers(0, 256, (24, 40, 3), dtype=np.uint8) for n in range(2)]
    buffer = bytearray(b"".join(array.tobytes() for array in arrays))
    step = arrays[0].nbytes
    with memoryview(buffer) as view:
        pixels = [Pixels("RGB", (40, 24), view[n * step:(n + 1) * step]) for n in range(2)]
    for one, array in zip(pixels, arrays):
        assert np.array_equal(np.asarray(one.image()), array)
        assert np.array_equal(np.asarray(one.image()), array)  # asked again: the same image
    out = str(tmp_path / "run")
    failures = {"left": 0}
    real_put = type(open_storage(out)).put_bytes

    def flaky_put(self, key, data, **kwargs):
        if key.endswith(".png") and failures["left"]:
            failures["left"] -= 1
            raise OSError("transient")
        return real_put(self, key, data, **kwargs)

    monkeypatch.setattr("diffq.worker.sink.store.time.sleep", lambda seconds: None)  # the retry's back-off
    monkeypatch.setattr(type(open_storage(out)), "put_bytes", flaky_put)
    sink = Sink(threads=2)
    try:
        message = batch(out, 0, items=2)
        failures["left"] = 1
        sink.submit(open_storage(out), message, pixels, {**MEASURED, "generate_s": 0.25}).stored.result(30)
        assert failures["left"] == 0
        assert_stored(out, message, [Image.fromarray(array) for array in arrays])
    finally:
        sink.close()


def test_a_dead_helper_gives_the_slots_of_what_it_held_back(tmp_path):
    """Slots taken by batches a killed helper held are free again once those batches
    fail; the next helper is handed the slots anew and stores the right pixels."""
    out = str(tmp_path / "run")
    sink = SinkProcess()
    try:
        sink.start()
        first = sink._helper.process
        first.send_signal(signal.SIGSTOP)
        held = [sink.submit(open_storage(out), batch(out, i), arrays_of(batch(out, i)),
                            {**MEASURED, "generate_s": 0.25}) for i in range(2)]
        first.send_signal(signal.SIGKILL)
        for handed in held:
            with pytest.raises(SinkLost):
                handed.stored.result(60)
        made, free = sink.slots.counts()
        assert made == free >= 1
        message = batch(out, 3)
        arrays = arrays_of(message)
        assert store(sink, out, message, arrays, {"generate_s": 0.25}).written == 4
        assert sink._helper.process.pid != first.pid
        assert_stored(out, message, arrays)
        assert sink.slots.counts() == (made, made)
    finally:
        sink.close()


def test_slots_refuse_a_second_give_back_and_close_their_memory():
    slots = Slots()
    images = [np.zeros((4, 5, 3), np.uint8)] * 2
    slot = slots.acquire(images)
    slot.fill([np.full((4, 5, 3), 7, np.uint8), np.full((4, 5, 3), 9, np.uint8)])
    assert bytes(slot.map[:60]) == bytes([7]) * 60 and bytes(slot.map[60:120]) == bytes([9]) * 60
    assert slots.acquire([Image.new("RGB", (5, 4))]) is None  # PIL images: the socket
    slots.release(slot)
    with pytest.raises(RuntimeError, match="twice"):
        slots.release(slot)
    fd = slot.fd
    slots.close()
    assert slots.counts() == (0, 0) and slot.map.closed
    with pytest.raises(OSError):
        os.fstat(fd)


def test_helper_stores_from_its_own_mapping_when_the_worker_goes_away(tmp_path):
    """The worker's end and its slots close while the helper still holds batches handed
    in shared memory: the helper's mapping keeps the pixels, it stores them, exits 0."""
    out = str(tmp_path / "run")
    sink = SinkProcess()
    sink.start()
    helper = sink._helper
    helper.process.send_signal(signal.SIGSTOP)
    messages = [batch(out, i) for i in range(3)]
    arrays = [arrays_of(message) for message in messages]
    for message, batch_arrays in zip(messages, arrays):
        sink.submit(open_storage(out), message, batch_arrays, {**MEASURED, "generate_s": 0.25})
    while sink.slots.counts()[0] < 3:  # the send thread has copied each batch into a slot
        time.sleep(0.01)
    helper.close()  # the goodbye queues behind the batches: all of them are in the socket then
    while helper._outbox.qsize():
        time.sleep(0.01)
    for slot in list(sink.slots._all):  # the worker gone: its mappings and descriptors too
        slot.close()
    helper._socket.shutdown(socket.SHUT_RDWR)  # as the worker's exit closes its end
    helper.process.send_signal(signal.SIGCONT)
    assert helper.process.wait(timeout=60) == 0
    for message, batch_arrays in zip(messages, arrays):
        assert_stored(out, message, batch_arrays)
    assert credited(out) == {m.batch_id for m in messages}


@pytest.mark.parametrize("channels", [1, 4])
def test_grey_and_rgba_arrays_cross_in_slots_too(tmp_path, channels):
    out = str(tmp_path / "run")
    message = batch(out, 8)
    rng = np.random.default_rng(8)
    shape = (SHAPE.height, SHAPE.width) if channels == 1 else (SHAPE.height, SHAPE.width, channels)
    arrays = list(rng.integers(0, 256, (len(message.items), *shape), dtype=np.uint8))
    sink = SinkProcess()
    try:
        assert store(sink, out, message, arrays, {"generate_s": 0.25}).written == 4
        assert_stored(out, message, arrays)
        assert sink.slots.counts() == (1, 1)
    finally:
        sink.close()


def test_a_diffq_folder_where_the_worker_starts_does_not_shadow_the_helpers_package(tmp_path, monkeypatch):
    """The helper is `python -m …`: without -P the working directory would come first on
    its sys.path, and a checkout (or any `diffq/` folder) there would be imported instead
    of the installed package — here one that cannot import at all."""
    shadow = tmp_path / "cwd"
    (shadow / "diffq").mkdir(parents=True)
    (shadow / "diffq" / "__init__.py").write_text("raise ImportError('the shadow package was imported')\n")
    monkeypatch.chdir(shadow)
    out = str(tmp_path / "run")
    sink = SinkProcess()
    try:
        message = batch(out, 0)
        images = pictures(message)
        store(sink, out, message, images, {"generate_s": 0.25})
        assert_stored(out, message, images)
    finally:
        sink.close()
