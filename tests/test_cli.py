"""The command names and options the issues name are a contract: keep them."""

import pytest
from typer.testing import CliRunner

from diffq.app.cli import app

CONTRACT = {
    "tiny-pipeline": ["--family"],
    "tiny-lora": ["--rank", "--seed", "--targets"],
    "run": ["--model", "--out", "--workers", "--batch-size", "--steps", "--guidance-scale", "--max-sequence-length",
            "--height", "--width", "--format", "--device", "--compile", "--compile-cache", "--warmup", "--offload",
            "--cores", "--chips", "--gpus", "--seed-base", "--dtype"],
    "submit": ["--model", "--out", "--broker", "--batch-size", "--steps", "--guidance-scale",
               "--max-sequence-length", "--height", "--width", "--format", "--seed-base", "--dtype"],
    "worker": ["--broker", "--device", "--workers", "--queues", "--cores", "--chips", "--gpus", "--plan",
               "--compile", "--compile-cache", "--warmup", "--offload", "--drain-timeout"],
    "status": ["--json", "--watch"],
    "fetch": ["--only-new"],
    "resume": ["--broker", "--workers", "--device"],
    "retry-failed": ["--broker"],
    "export": ["--format", "--shard-size"],
    "report": ["--html", "--price-per-device-hour"],
    "queues": ["--broker", "--json"],
    "fleet manifests": ["--model", "--shapes", "--batch-size", "--device", "--dtype", "--broker"],
    "fleet backlog": ["--broker", "--port"],
    "plan": ["--model", "--dtype", "--batch-size"],
}


def declared_options(command: str) -> set[str]:
    """Every option name the command really declares (not a substring of its help:
    `--compile` must not pass because `--compile-cache` exists)."""
    import click
    import typer

    group = typer.main.get_command(app)
    ctx = click.Context(group, info_name="diffq")
    cmd = group
    for part in command.split():
        cmd = cmd.get_command(ctx, part)
        assert cmd is not None, f"no diffq {command}"
    return {name for param in cmd.params for name in (*param.opts, *param.secondary_opts)}


@pytest.mark.parametrize("command, options", CONTRACT.items())
def test_command_exists_with_its_options(command, options):
    declared = declared_options(command)
    for option in options:
        assert option in declared, f"diffq {command} lacks {option}"
    result = CliRunner().invoke(app, [*command.split(), "--help"], env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output


def test_option_check_is_exact():
    assert "--compile-cache" in declared_options("run") and "--compil" not in declared_options("run")


def test_version_prints_the_package_version():
    from diffq import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"diffq {__version__}"


@pytest.mark.parametrize("command", ["run", "submit", "plan"])
@pytest.mark.parametrize("option, value, bound", [("--steps", "1200", "1000"), ("--max-sequence-length", "100000", "4096"),
                                                  ("--batch-size", "0", "1"), ("--guidance-scale", "101", "100")])
def test_generation_options_carry_the_contracts_ranges(command, option, value, bound, tmp_path):
    """Out of the contract's range: refused by the option parser, naming the option and
    the bound, before any schema error (no 'validation error for BatchParams')."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    args = [command, str(prompts), "--model", "m", option, value]
    args += [] if command == "plan" else ["--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert option in result.output and bound in result.output
    assert "validation error" not in result.output and not (tmp_path / "o").exists()


@pytest.mark.parametrize("dtype, cuda", [("auto", "bfloat16"), ("float32", "float32")])
def test_plan_says_what_the_dtype_runs_as_on_each_device(dtype, cuda, tmp_path):
    import json

    from diffq.worker.device.backends import BACKENDS

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    result = CliRunner().invoke(app, ["plan", str(prompts), "--model", "m", "--dtype", dtype, "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["dtype"]["queue"] == dtype and plan["dtype"]["runs_at"]["cuda"] == cuda
    assert plan["dtype"]["runs_at"]["cpu"] == "float32" and set(plan["dtype"]["runs_at"]) == set(BACKENDS)
    assert all(shape["queue"].endswith("." + {"auto": "auto", "float32": "fp32"}[dtype]) for shape in plan["shapes"])
