"""Every `diffq …` command the docs and the infra files show parses with the real CLI.

Collected from README.md, ARCHITECTURE.md, docs/*.md, infra/ and the Makefile: fenced
code blocks and inline code spans of markdown (commands shown through
`docker compose run` / `docker run` too), shell comments in YAML, Makefile recipes,
Kubernetes containers (`args` after the image's ENTRYPOINT, read from its
Dockerfile) and docker-compose `command:`s. Each is parsed by the Typer app's click
command as `diffq` would parse it (`make_context`, no callback runs): an option
that does not exist, a missing required one or a bad value fails, with file and line.

Docs write placeholders: a value like `M`, `OUT`, `N`, `$VAR`, `$(cmd)`, `<name>` or
one with an ellipsis (`redis://…`) stands for any value, so where the option wants a
number or a choice a valid one is put in its place; option names, counts and real
choices are still checked. Synopses are read as synopses: `[…]` is optional and is
included, `a|b` lists alternatives (each is checked), a bracket group without an
option (`[same options]`) is prose. A mention in running text (an inline span) or a
command ending in a bare `…` may leave required parts out: those are filled in and
the rest is checked.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pytest
import typer
import typer.main
import yaml

from diffq.app.cli import app
from tests.test_infra import dockerfile

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "infra").rglob("*.md"))]
YAMLS = [ROOT / "docker-compose.yml", *sorted(p for p in (ROOT / "infra").rglob("*") if p.suffix in (".yaml", ".yml"))]
MAKEFILE = ROOT / "Makefile"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILES = ROOT / "infra" / "docker"
# Commands found today are well above this: a collector that silently stops finding
# them fails here rather than passing on nothing.
FLOOR = 80

ELLIPSES = ("…", "...")
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}
# docker run / docker compose run options that take a value (the rest are flags).
DOCKER_VALUE_OPTIONS = {"-e", "--env", "--env-file", "-v", "--volume", "--mount", "--name", "--network", "-p",
                        "--publish", "-w", "--workdir", "-u", "--user", "--entrypoint", "--gpus", "--device",
                        "--shm-size", "--platform", "-l", "--label", "--ipc", "--pull", "--cpus", "-m",
                        "--memory"}


@dataclass(frozen=True)
class Documented:
    where: str  # file:line
    text: str  # the command as written
    variants: tuple[tuple[str, ...], ...]  # argv after `diffq`, one per alternative of a synopsis
    partial: bool  # may leave required parts out (running text, a trailing …)
    kind: str  # which collector found it


# --- tokens and synopses -------------------------------------------------------------

def _strip_comment(line: str) -> str:
    """The line up to an unquoted `#` that starts a word (as the shell reads it)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _words(text: str) -> list[str] | None:
    # $(…) is one placeholder word (a Makefile variable, a command substitution).
    text = re.sub(r"\$\([^()]*\)", "$SUBST", _strip_comment(text))
    try:
        return shlex.split(text)
    except ValueError:  # unbalanced quotes: prose or output, unless it names diffq
        return None


def _brackets(word: str) -> tuple[int, str, int]:
    """Synopsis brackets around a word: (opened, the word, closed); `HxW[,HxW…]` keeps its own."""
    core = word.lstrip("[")
    opened = len(word) - len(core)
    closed = 0
    while core.endswith("]") and core.count("[") < core.count("]"):
        core, closed = core[:-1], closed + 1
    return opened, core, closed


def _segments(words: list[str], pipes: bool) -> list[tuple[list, bool]]:
    """Shell commands of a line as synopsis trees: [word | [alternative, …]] and whether a
    bare … makes one partial. `|` inside brackets (or anywhere, when `pipes` is False)
    separates alternatives; elsewhere it and && ; ends a command."""
    segments, stack, partial, target = [], [[[]]], False, False  # stack of groups; a group is alternatives

    def current() -> list:
        return stack[-1][-1]

    def close_segment():
        nonlocal partial
        while len(stack) > 1:  # an unclosed bracket ends with its command
            group = stack.pop()
            current().append(group)
        segments.append((stack[0][0], partial))
        stack[0][0], partial = [], False

    for word in words:
        if target:  # the file of a redirection
            target = False
            continue
        if word in ELLIPSES:
            partial = True
            continue
        if word in SHELL_OPERATORS and len(stack) == 1 and (pipes or word != "|"):
            close_segment()
            continue
        if word == "|" and len(stack) > 1:
            stack[-1].append([])
            continue
        redirection = re.fullmatch(r"\d*(>>?|<)(&\d+|[^<>]+)?", word)
        if redirection and not re.fullmatch(r"<[^<>]+>", word):  # `<name>` is a placeholder
            target = redirection.group(2) is None
            continue
        opened, core, closed = _brackets(word)
        for _ in range(opened):
            stack.append([[]])
        if core:
            current().append(core)
        for _ in range(min(closed, len(stack) - 1)):
            group = stack.pop()
            if any(w.startswith("-") for alt in group for w in _flat(alt)):
                current().append(group)
            else:
                partial = True  # prose such as [same options]
    close_segment()
    return [(tree, part) for tree, part in segments if tree]


def _flat(tree: list) -> list[str]:
    return [w for item in tree for w in ([item] if isinstance(item, str) else
                                         [x for alt in item for x in _flat(alt)])]


def _choices(tree: list) -> int:
    counts = [1]
    for item in tree:
        if isinstance(item, str):
            counts.append(len(item.split("|")))
        else:
            counts += [len(item)] + [_choices(alt) for alt in item]
    return max(counts)


def _expand(tree: list, pick: int) -> list[str]:
    """Alternative `pick` of every choice (the last one where a choice has fewer)."""
    words = []
    for item in tree:
        if isinstance(item, str):
            options = item.split("|")
            words.append(options[min(pick, len(options) - 1)])
        else:
            words += _expand(item[min(pick, len(item) - 1)], pick)
    return words


def _variants(tree: list) -> tuple[tuple[str, ...], ...]:
    return tuple(dict.fromkeys(tuple(_expand(tree, pick)) for pick in range(_choices(tree))))


# --- what runs diffq ----------------------------------------------------------------

def entrypoint_of(dockerfile_path: Path) -> list[str]:
    return json.loads([args for kind, args in dockerfile(dockerfile_path) if kind == "ENTRYPOINT"][-1])


def image_entrypoint(image: str) -> list[str] | None:
    """The ENTRYPOINT of a diffq image (ghcr.io/diffq/diffq-neuron:0.1.0 → Dockerfile.neuron)."""
    found = re.search(r"(?:^|/)diffq-([a-z0-9]+)(?::|$)", image)
    if not found:
        return None
    path = DOCKERFILES / f"Dockerfile.{found.group(1)}"
    assert path.is_file(), f"image {image}: no {path.relative_to(ROOT)}"
    return entrypoint_of(path)


def compose_services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def service_entrypoint(service: dict) -> list[str] | None:
    entrypoint = service.get("entrypoint")
    if entrypoint is not None:
        return shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
    build = service.get("build")
    if isinstance(build, dict) and build.get("dockerfile"):
        return entrypoint_of(ROOT / build.get("context", ".") / build["dockerfile"])
    return image_entrypoint(service.get("image", ""))


def _docker_run(words: list[str], compose: bool) -> list[str] | None:
    """The container's command line of `docker run … IMAGE ARGS` or `docker compose run … SERVICE ARGS`."""
    entrypoint, i = None, 0
    while i < len(words) and words[i].startswith("-"):
        option, _, inline = words[i].partition("=")
        if option in DOCKER_VALUE_OPTIONS and not inline:
            value, i = words[i + 1] if i + 1 < len(words) else "", i + 2
        else:
            value, i = inline, i + 1
        if option == "--entrypoint":
            entrypoint = shlex.split(value)
    if i >= len(words):
        return None
    target, args = words[i], words[i + 1:]
    if entrypoint is None:
        if compose:
            service = compose_services().get(target)
            assert service is not None, f"docker compose run: no service '{target}' in docker-compose.yml"
            entrypoint = service_entrypoint(service)
        else:
            entrypoint = image_entrypoint(target)
    return [*(entrypoint or []), *args]


def diffq_argv(words: list[str]) -> list[str] | None:
    """The argv after `diffq` if this shell command runs diffq (directly, as a module or
    in a container), else None."""
    while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]) or words[0] in ("$", "env", "sudo", "time", "exec")):
        words = words[1:]  # environment assignments, prompts and wrappers
    if not words:
        return None
    head = words[0].lstrip("@-+")  # Makefile recipe prefixes
    if head == "diffq" or head.endswith("/diffq"):
        return words[1:]
    if re.fullmatch(r"(\S*/)?python3?", head) and words[1:3] == ["-m", "diffq"]:
        return words[3:]
    if head == "docker" and words[1:3] == ["compose", "run"] or head == "docker-compose" and words[1:2] == ["run"]:
        argv = _docker_run(words[3:] if head == "docker" else words[2:], compose=True)
    elif head == "docker" and words[1:2] == ["run"]:
        argv = _docker_run(words[2:], compose=False)
    else:
        return None
    return argv[1:] if argv and argv[0] == "diffq" else None


# --- collectors -----------------------------------------------------------------------

def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def shell_commands(path: Path, lines: list[tuple[int, str]], kind: str, pipes: bool = True,
                   partial: bool = False) -> list[Documented]:
    """diffq commands in shell text: (line number, text) pairs, `\\` continuations joined."""
    found, pending, start = [], "", None
    for number, line in lines:
        if start is None:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending = pending + line, ""
        where, start = f"{_relative(path)}:{start}", None
        words = _words(text)
        if words is None:
            if re.search(r"(^|[\s;&|(`])(\S*/)?diffq\s", _strip_comment(text)):
                found.append(Documented(where, text.strip(), (), partial, kind))  # reported as unreadable
            continue
        for tree, bare_ellipsis in _segments(words, pipes):
            # A bare `diffq` is the program's name in prose, not a command.
            variants = [argv for variant in _variants(tree) if (argv := diffq_argv(list(variant)))]
            if variants:
                found.append(Documented(where, " ".join(_flat(tree)), tuple(tuple(v) for v in variants),
                                        partial or bare_ellipsis, kind))
    return found


def markdown_commands(path: Path) -> list[Documented]:
    found, block, fence, language = [], [], None, ""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        stripped = line.strip()
        if fence is None and re.match(r"(```|~~~)", stripped):
            fence, language, block = stripped[:3], stripped[3:].strip().lower(), []
            continue
        if fence is not None:
            if stripped.startswith(fence):
                if language not in ("python", "py", "json", "yaml", "yml", "dockerfile"):
                    found += shell_commands(path, block, "markdown block")
                fence = None
            else:
                block.append((number, line))
            continue
        for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
            span = span.replace("\\|", "|")  # a | inside a table cell
            if re.search(r"(^|[\s/])diffq\s+\S", span):  # `diffq …`, `time diffq …`, `python -m diffq …`
                found += shell_commands(path, [(number, span)], "markdown inline", pipes=False, partial=True)
    return found


def yaml_comment_commands(path: Path) -> list[Documented]:
    lines = [(number, match.group(1)) for number, line in enumerate(path.read_text().splitlines(), start=1)
             if (match := re.match(r"\s*#(.*)", line))]
    return shell_commands(path, lines, "yaml comment")


def makefile_commands(path: Path) -> list[Documented]:
    lines = [(number, line[1:]) for number, line in enumerate(path.read_text().splitlines(), start=1)
             if line.startswith("\t")]
    return shell_commands(path, lines, "Makefile recipe")


class _Lined(dict):
    """A YAML mapping that knows the line of each of its keys."""

    lines: dict


class _LineLoader(yaml.SafeLoader):
    pass


def _mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> _Lined:
    data = _Lined(loader.construct_mapping(node, deep=True))  # merges `<<:` keys first
    data.lines = {key.value: key.start_mark.line + 1 for key, _ in node.value if isinstance(key, yaml.ScalarNode)}
    return data


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _containers(node) -> list[_Lined]:
    if isinstance(node, dict):
        own = [c for key in ("containers", "initContainers") for c in node.get(key) or [] if isinstance(c, dict)]
        return own + [c for value in node.values() for c in _containers(value)]
    if isinstance(node, list):
        return [c for value in node for c in _containers(value)]
    return []


def _as_list(value) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def manifest_commands(path: Path) -> list[Documented]:
    """Kubernetes containers of diffq images: their command (or the image's ENTRYPOINT) + args."""
    found = []
    for doc in yaml.load_all(path.read_text(), Loader=_LineLoader):
        for container in _containers(doc):
            entrypoint = (_as_list(container["command"]) if "command" in container
                          else image_entrypoint(str(container.get("image", ""))))
            argv = [*(entrypoint or []), *_as_list(container.get("args") or [])]
            if argv[:1] == ["diffq"]:
                line = container.lines.get("args", container.lines.get("command", container.lines.get("image")))
                found.append(Documented(f"{_relative(path)}:{line}", " ".join(argv), (tuple(argv[1:]),), False,
                                        "Kubernetes container"))
    return found


def compose_commands(path: Path) -> list[Documented]:
    found = []
    services = yaml.load(path.read_text(), Loader=_LineLoader).get("services") or {}
    for name, service in services.items():
        if "command" not in service:
            continue  # the image's CMD
        argv = [*(service_entrypoint(service) or []), *_as_list(service["command"])]
        if argv[:1] == ["diffq"]:
            found.append(Documented(f"{_relative(path)}:{service.lines['command']}", " ".join(argv),
                                    (tuple(argv[1:]),), False, "compose command"))
    return found


def documented_commands() -> list[Documented]:
    found = [c for path in MARKDOWN for c in markdown_commands(path)]
    found += makefile_commands(MAKEFILE)
    for path in YAMLS:
        found += yaml_comment_commands(path)
        found += compose_commands(path) if path == COMPOSE else manifest_commands(path)
    return found


# --- parsing with the real CLI -----------------------------------------------------------

try:  # Typer >= 0.2x carries its own click (typer._click): its commands raise its exceptions
    from typer._click import core as click_core, exceptions as click_errors
except ImportError:  # older Typer builds on click itself
    import click.core as click_core
    import click.exceptions as click_errors

ROOT_COMMAND = typer.main.get_command(app)


def _value_type(param) -> tuple[type | None, tuple[str, ...]]:
    """(int / float / bool / None, the choices) a parameter's value must meet."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)  # Typer's own params
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return None, tuple(str(member.value) for member in annotation)
    if annotation in (int, float, bool):
        return annotation, ()
    kind = getattr(param, "type", None)  # click's
    if getattr(kind, "choices", None):
        return None, tuple(map(str, kind.choices))
    return {"integer": int, "float": float, "boolean": bool}.get(str(getattr(kind, "name", "")).partition(" ")[0]), ()


def _is_placeholder(value: str, param) -> bool:
    if re.fullmatch(r"\$\w+|\$\{\w+\}|<[^<>]+>", value) or any(e in value for e in ELLIPSES):
        return True
    if re.fullmatch(r"[A-Z][A-Z0-9_]*(,[A-Z][A-Z0-9_]*)*", value):
        # `DEVICE` stands for a device; `CPU` is a misspelt choice, not a placeholder.
        return value.lower() not in {c.lower() for c in _value_type(param)[1]}
    return False


def _valid_value(param) -> str | None:
    """A value `param` accepts, for a placeholder; None: any string will do."""
    number, choices = _value_type(param)
    if choices:
        return choices[0]
    if number is bool:
        return "true"
    if number is not None:
        low, high = getattr(param, "min", None), getattr(param, "max", None)
        return str(low if low is not None else high if high is not None else 1)
    return None


def _stand_in(param, value: str) -> str:
    if param is None or not _is_placeholder(value, param):
        return value
    valid = _valid_value(param)
    return value if valid is None else valid


def _with_stand_ins(command, args: list[str]) -> list[str]:
    """args with each placeholder value replaced by one its option or argument accepts."""
    options = {name: p for p in command.params if p.param_type_name == "option"
               for name in (*p.opts, *p.secondary_opts)}
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    result, positional, i = [], 0, 0
    while i < len(args):
        word = args[i]
        if word.startswith("-") and len(word) > 1 and word != "--":
            name, equals, value = word.partition("=")
            param = options.get(name)
            takes_value = param is not None and not param.is_flag and not param.count
            if takes_value and equals:
                result.append(f"{name}={_stand_in(param, value)}")
            elif takes_value and i + 1 < len(args):
                result += [word, _stand_in(param, args[i + 1])]
                i += 1
            else:
                result.append(word)  # a flag, or unknown: the parser names it
        else:
            result.append(_stand_in(arguments[positional] if positional < len(arguments) else None, word))
            positional += 1
        i += 1
    return result


def parse_error(argv: tuple[str, ...], partial: bool) -> str | None:
    """Why `diffq ARGV` would not parse, or None. Nothing is executed."""
    args, command = list(argv), ROOT_COMMAND
    ctx = click_core.Context(command, info_name="diffq")
    while hasattr(command, "list_commands"):  # a command group
        if not args:
            return None if partial else f"names no `{ctx.command_path}` subcommand"
        name = args.pop(0)
        sub = command.get_command(ctx, name)
        if sub is None:
            return f"no command '{name}' in `{ctx.command_path}` (it has {', '.join(command.list_commands(ctx))})"
        command, ctx = sub, click_core.Context(sub, info_name=name, parent=ctx)
    args = _with_stand_ins(command, args)
    for _ in range(len(command.params) + 1):
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # --help prints
                command.make_context(ctx.info_name, list(args), parent=ctx.parent, resilient_parsing=False)
            return None
        except (typer.Exit, getattr(click_errors, "Exit", typer.Exit)):  # --help: handled, nothing wrong
            return None
        except click_errors.MissingParameter as exc:
            if not partial or exc.param is None:
                return exc.format_message()
            # A mention in running text: give the left-out part a value and check the rest.
            filler = _valid_value(exc.param) or exc.param.name.upper()
            args += [exc.param.opts[0], filler] if exc.param.param_type_name == "option" else [filler]
        except click_errors.UsageError as exc:
            return exc.format_message()
    return "could not complete the command"


def command_errors(commands: list[Documented]) -> list[str]:
    errors = []
    for command in commands:
        if not command.variants:
            errors.append(f"{command.where}: `{command.text}`: cannot be read as a shell command (quotes?)")
        for argv in command.variants:
            error = parse_error(argv, command.partial)
            if error:
                shown = " ".join(("diffq", *argv)) if len(command.variants) > 1 else command.text
                errors.append(f"{command.where}: `{shown}`: {error}")
    return errors


# --- the test -----------------------------------------------------------------------------

def test_every_documented_command_parses():
    commands = documented_commands()
    kinds = {kind: sum(c.kind == kind for c in commands) for kind in
             ("markdown block", "markdown inline", "Makefile recipe", "Kubernetes container", "compose command",
              "yaml comment")}
    print(f"parsed {len(commands)} documented diffq commands "
          f"({sum(len(c.variants) for c in commands)} with synopsis alternatives): {kinds}")
    assert all(n for kind, n in kinds.items() if kind != "yaml comment"), f"a collector found nothing: {kinds}"
    assert len(commands) >= FLOOR, f"only {len(commands)} documented commands found"
    errors = command_errors(commands)
    assert not errors, f"{len(errors)} of {len(commands)} documented commands do not parse:\n" + "\n".join(errors)


def test_documented_fleets_say_where_their_workers_write():
    """`fleet manifests` refuses a fleet without a run-folder prefix when it runs (not
    when it parses): every complete documented one names `--out-prefix` or `--any-out`."""
    fleets = [c for c in documented_commands() if c.variants and c.variants[0][:2] == ("fleet", "manifests")]
    assert any(not c.partial for c in fleets), "no complete `diffq fleet manifests` in the docs"
    unsaid = [f"{c.where}: `{c.text}`" for c in fleets if not c.partial
              and not any({"--out-prefix", "--any-out"} & set(argv) for argv in c.variants)]
    assert not unsaid, "name --out-prefix PREFIX (or --any-out):\n" + "\n".join(unsaid)


# --- the checker itself: it finds what it must, and tolerates placeholders -----------------

def _doc(tmp_path, text: str) -> list[Documented]:
    path = tmp_path / "doc.md"
    path.write_text(text)
    return markdown_commands(path)


@pytest.mark.parametrize("command, error", [
    ("diffq run p.jsonl --model M --out OUT --wrokers 2", "No such option: --wrokers"),
    ("diffq run p.jsonl --out OUT", "Missing option '--model'"),
    ("diffq run p.jsonl --model M --out OUT --device gpu", "'gpu' is not one of 'cpu'"),
    ("diffq run p.jsonl --model M --out OUT --device CPU", "'CPU' is not one of 'cpu'"),
    ("diffq run p.jsonl --model M --out OUT --workers two", "'--workers' / '-w': Input should be a valid integer"),
    ("diffq run p.jsonl --model M --out OUT --workers 0", "greater than or equal to 1"),
    ("diffq status OUT extra", "unexpected extra argument(s) (extra)"),
    ("diffq fleet manifest --model M", "no command 'manifest' in `diffq fleet`"),
    ("diffq fleet manifests --model M --shapes 64x64 --out-prefix", "'--out-prefix' requires an argument"),
    ("diffq fetch OUT", "Missing argument 'dest'"),
])
def test_a_wrong_command_in_a_code_block_fails_with_file_and_line(tmp_path, command, error):
    commands = _doc(tmp_path, f"# title\n\n```\n{command}\n```\n")
    errors = command_errors(commands)
    assert len(commands) == 1 and len(errors) == 1
    assert errors[0].startswith(f"{tmp_path / 'doc.md'}:4: `{command}`: ") and error in errors[0], errors


def test_placeholders_continuations_env_and_pipes_are_read_as_the_shell_and_docs_mean_them(tmp_path):
    commands = _doc(tmp_path, "\n".join([
        "```bash",
        "$ DIFFQ_BROKER_URL=redis://… diffq worker --device $DEVICE --workers N \\",
        "    --queues Q1,Q2 --drain-timeout <seconds>   # a comment with `diffq nonsense`",
        "diffq status s3://b/r1 --json | jq .done && diffq fetch OUT DEST --only-new > fetch.log 2>&1",
        "python -m diffq run prompts.jsonl --model M --out $(mktemp -d) --threads ${THREADS}",
        "diffq fleet manifests --device neuron --devices-per-pod 8 --tp 8 …",
        "diffq qualify --model M --report DIR [--json]",
        "```",
    ]))
    assert [(c.where.rsplit(":", 1)[1], c.variants[0][0], c.partial) for c in commands] == [
        ("2", "worker", False), ("4", "status", False), ("4", "fetch", False), ("5", "run", False),
        ("6", "fleet", True), ("7", "qualify", False)]
    assert commands[0].variants == (("worker", "--device", "$DEVICE", "--workers", "N", "--queues", "Q1,Q2",
                                     "--drain-timeout", "<seconds>"),)
    assert commands[-1].variants == (("qualify", "--model", "M", "--report", "DIR", "--json"),)
    assert command_errors(commands) == []


def test_synopses_check_every_alternative_and_running_text_may_leave_parts_out(tmp_path):
    commands = _doc(tmp_path, "\n".join([
        "| `diffq run PROMPTS --model M --out OUT [--format png\\|jpeg\\|gif] [same options]` | x |",
        "Use `diffq worker [--queues Q1,Q2 | --run OUT] --plan` or `diffq fetch OUT` (see `diffq.dead`).",
        "`diffq export OUT DEST --format imagefolder|webdataset|parquet` and `diffq run --wrokers 2`.",
    ]))
    assert [c.variants for c in commands] == [
        (("run", "PROMPTS", "--model", "M", "--out", "OUT", "--format", "png"),
         ("run", "PROMPTS", "--model", "M", "--out", "OUT", "--format", "jpeg"),
         ("run", "PROMPTS", "--model", "M", "--out", "OUT", "--format", "gif")),
        (("worker", "--queues", "Q1,Q2", "--plan"), ("worker", "--run", "OUT", "--plan")),
        (("fetch", "OUT"),),
        tuple(("export", "OUT", "DEST", "--format", f) for f in ("imagefolder", "webdataset", "parquet")),
        (("run", "--wrokers", "2"),),
    ]
    assert all(c.partial for c in commands)
    errors = command_errors(commands)
    assert len(errors) == 2, errors  # fetch OUT is completed; gif and --wrokers are not choices / options
    assert "doc.md:1: `diffq run PROMPTS --model M --out OUT --format gif`: " in errors[0] and "'gif'" in errors[0]
    assert "doc.md:3: `diffq run --wrokers 2`: No such option: --wrokers" in errors[1]


def test_manifest_args_follow_the_images_entrypoint_and_compose_commands_their_service(tmp_path):
    manifest = tmp_path / "deploy.yaml"
    manifest.write_text(yaml.safe_dump({
        "kind": "Deployment", "spec": {"template": {"spec": {"containers": [
            {"name": "worker", "image": "REGISTRY/diffq-neuron:0.1.0", "args": ["--device", "neuron", "--cores", "eight"]},
            {"name": "sidecar", "image": "busybox", "args": ["--device", "x"]},
            {"name": "job", "image": "ghcr.io/diffq/diffq-cpu:0.1.0", "command": ["diffq", "status", "OUT"]},
        ]}}}}, sort_keys=False))
    found = manifest_commands(manifest)
    lines = manifest.read_text().splitlines()
    line_of = lambda key: next(n for n, line in enumerate(lines, start=1) if line.strip().startswith(key))  # noqa: E731
    assert [(c.where, c.variants) for c in found] == [
        (f"{manifest}:{line_of('args:')}", (("worker", "--device", "neuron", "--cores", "eight"),)),
        (f"{manifest}:{line_of('command:')}", (("status", "OUT"),)),
    ]
    assert command_errors(found) == []  # --cores takes any text: the worker checks the list
    assert entrypoint_of(DOCKERFILES / "Dockerfile.neuron") == ["diffq", "worker"]
    # docker compose run resolves the service's entrypoint from docker-compose.yml.
    assert diffq_argv(shlex.split("docker compose run --rm producer status OUT")) == ["status", "OUT"]
    assert diffq_argv(shlex.split("docker compose run --rm worker --device cpu")) == ["worker", "--device", "cpu"]
    assert diffq_argv(shlex.split("docker compose run --entrypoint diffq worker queues")) == ["queues"]
    assert diffq_argv(shlex.split("docker compose up --build")) is None
    compose_doc = tmp_path / "compose.yml"
    compose_doc.write_text("# start:\n#   docker compose run --rm producer submit p.jsonl \\\n#       --model M --out OUT\n"
                           "services: {}\n")
    assert [(c.where, c.variants) for c in yaml_comment_commands(compose_doc)] == [
        (f"{compose_doc}:2", (("submit", "p.jsonl", "--model", "M", "--out", "OUT"),))]
    # docker run: the image's ENTRYPOINT, past docker's own options.
    assert diffq_argv(shlex.split("docker run --rm -e DIFFQ_BROKER_URL=redis://… --gpus all "
                                  "ghcr.io/diffq/diffq-cuda:0.1.0 --device cuda --gpus 0")) == [
        "worker", "--device", "cuda", "--gpus", "0"]
    assert diffq_argv(shlex.split("docker run --rm redis:7 redis-server")) is None
