"""The sink helper process under cProfile, every thread of it (bench only).

`python -m bench.profiled_sink <fd> <threads> <retry_for_s>` runs
`diffq.worker.sink.helper.main` unchanged, with a profiler in each of its threads
(the receive loop, the writer, the encode/upload pool), and at exit writes the merged
statistics to `$DIFFQ_BENCH_PHASES/sink-<pid>.prof` (pstats). bench/phases.py points
the stand-in worker's `SinkProcess.HELPER_MODULE` here when asked to profile the helper.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import threading
import time
from pathlib import Path

from bench.stamps import ENV


def main(argv: list[str]) -> None:
    from diffq.worker.sink import helper as sink_process

    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()

    def start_in_thread(*_event) -> None:  # a new thread's first profile event
        sys.setprofile(None)
        profile = cProfile.Profile(time.thread_time)  # CPU of this thread: blocking waits cost nothing
        with lock:
            profiles.append(profile)
        profile.enable()

    threading.setprofile(start_in_thread)
    main_profile = cProfile.Profile(time.thread_time)
    main_profile.enable()
    try:
        sink_process.main(argv)
    finally:
        main_profile.disable()
        with lock:
            for profile in profiles:
                profile.disable()
            stats = pstats.Stats(main_profile)
            for profile in profiles:
                try:
                    stats.add(profile)
                except TypeError:  # a thread that never made a call
                    pass
        folder = Path(os.environ[ENV])
        folder.mkdir(parents=True, exist_ok=True)
        stats.dump_stats(str(folder / f"sink-{os.getpid()}.prof"))


if __name__ == "__main__":
    main(sys.argv[1:])
