"""The command names and options the issues name are a contract: keep them."""

import pytest
from typer.testing import CliRunner

from diffq.app.cli import app

CONTRACT = {
    "tiny-pipeline": ["--family"],
    "run": ["--model", "--out", "--workers", "--batch-size", "--steps", "--guidance-scale", "--max-sequence-length",
            "--height", "--width", "--format", "--device", "--compile", "--compile-cache", "--warmup", "--offload",
            "--cores", "--chips", "--gpus", "--seed-base"],
    "submit": ["--model", "--out", "--broker", "--batch-size", "--steps", "--guidance-scale",
               "--max-sequence-length", "--height", "--width", "--format", "--seed-base"],
    "worker": ["--broker", "--device", "--workers", "--queues", "--cores", "--chips", "--gpus", "--plan",
               "--compile", "--compile-cache", "--warmup", "--offload", "--drain-timeout"],
    "status": ["--json", "--watch"],
    "fetch": ["--only-new"],
    "resume": ["--broker"],
    "retry-failed": ["--broker"],
    "export": ["--format", "--shard-size"],
    "report": ["--html", "--price-per-device-hour"],
    "queues": ["--broker", "--json"],
    "fleet manifests": ["--model", "--shapes", "--batch-size", "--device"],
}


@pytest.mark.parametrize("command, options", CONTRACT.items())
def test_command_exists_with_its_options(command, options):
    result = CliRunner().invoke(app, [*command.split(), "--help"], env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    for option in options:
        assert option in result.output, f"diffq {command} lacks {option}"
