"""docs/BENCHMARKS.md's "## Scale" (issue 27): the subsections whose figures the scale
benchmarks keep in docs/scale_*.json (they run for tens of minutes, outside `make
bench`), then the control plane from docs/benchmarks.json; and their goals.

    python -m bench.status --scale … --json docs/scale_status.json --plot docs/scale_status.png
    python -m bench.producer --scale … --json docs/scale_producer.json
    python -m bench.window --json docs/scale_window.json
    python -m bench.export … --json docs/scale_export.json --plot docs/scale_export.png
    python -m bench.run_metrics --items 30000000 --writers 1024 --json docs/scale_run_metrics.json
"""

from __future__ import annotations

from bench.common import Goal


def section(fleet_rows: list[dict]) -> list[str]:
    """The subsections (###), each from its own figures."""
    from bench import export, fleet, producer, run_metrics, status, window

    parts = [*status.scale_section(), *run_metrics.scale_section(), *producer.scale_section(),
             *window.scale_section(), *export.scale_section(), *fleet.render(fleet_rows)]
    while parts and not parts[-1]:
        parts.pop()
    return parts


def goals() -> list[Goal]:
    """Issue 27's read side, producer and export goals (the control plane's come with its rows)."""
    from bench import export, producer, run_metrics, status, window

    return [*status.scale_goals(), *run_metrics.scale_goals(), *producer.scale_goals(), *window.scale_goals(),
            *export.scale_goals()]
