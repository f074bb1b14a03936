"""Reference pages generated from the ``sluice`` command line, so that they
cannot disagree with it: ``docs/environment.md``, the environment variables
that its options read.

    python -m sidecar.cli_reference docs/environment.md   # write it again
    python -m sidecar.cli_reference                       # print it
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import click

ENVIRONMENT_PAGE = "docs/environment.md"
REGENERATE = f"python -m sidecar.cli_reference {ENVIRONMENT_PAGE}"


@dataclass(frozen=True)
class EnvironmentOption:
    """An option that an environment variable sets, as the page shows it."""

    variable: str
    option: str
    default: str
    meaning: str


def commands(group: click.Group, path: str = "sluice") -> Iterator[tuple[str, click.Command]]:
    """Every command under ``group``, by its full name (``sluice admin ban``), in help order."""
    context = click.Context(group, info_name=path)
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        if command is None or command.hidden:
            continue
        if isinstance(command, click.Group):
            yield from commands(command, f"{path} {name}")
        else:
            yield f"{path} {name}", command


def environment_options(command: click.Command) -> list[EnvironmentOption]:
    """The options of ``command`` that an environment variable sets."""
    found = []
    for param in command.params:
        if not isinstance(param, click.Option) or not param.envvar:
            continue
        variables = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
        for variable in variables:
            found.append(EnvironmentOption(variable, max(param.opts, key=len), _default(param), _meaning(param)))
    return found


def _default(option: click.Option) -> str:
    value = option.to_info_dict()["default"]  # None when there is none
    if option.is_flag:
        return "on" if value else "off"
    if value is None or value == "":
        return "none"
    return f"`{value}`"


def _meaning(option: click.Option) -> str:
    text = " ".join((option.help or "").split())
    if isinstance(option.type, click.Choice):
        text += " One of " + ", ".join(f"`{choice}`" for choice in option.type.choices) + "."
    return text


def _commands_text(names: Sequence[str], every: dict[str, list[str]]) -> str:
    """The commands of a row: a group's name when it is every command of it
    (the widest such group)."""
    for group, members in sorted(every.items(), key=lambda item: -len(item[1])):
        if names == members and len(members) > 1:
            return f"`{group}` (every command)"
    return ", ".join(f"`{name}`" for name in names)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def environment_page(group: click.Group | None = None) -> str:
    """The Markdown page of every option of every command of ``group``
    (``sluice``) that an environment variable sets."""
    if group is None:
        from sidecar.cli import main

        group = main
    rows: dict[EnvironmentOption, list[str]] = {}
    groups: dict[str, list[str]] = {}
    for name, command in commands(group):
        words = name.split()
        for end in range(2, len(words)):  # every group it is in: sluice admin, sluice admin tier
            groups.setdefault(" ".join(words[:end]), []).append(name)
        for option in environment_options(command):
            rows.setdefault(option, []).append(name)
    lines = [
        "# Environment variables",
        "",
        f"<!-- Generated from the options of `sluice` by `{REGENERATE}`; edit the options' help, "
        "then run it again, not this page. -->",
        "",
        "Each of these options of `sluice` can be set by its environment variable instead, as suits a "
        "container. An option given on the command line wins over its variable. A flag (an option "
        "without a value) is on for `1`, `true`, `yes` or `on`, and off for `0`, `false`, `no` or `off`.",
        "",
        "| Variable | Option | Command | Default | Meaning |",
        "|---|---|---|---|---|",
    ]
    for option, names in sorted(rows.items(), key=lambda row: (row[0].variable, row[1])):
        lines.append(f"| `{option.variable}` | `{option.option}` | {_commands_text(names, groups)} | "
                     f"{_cell(option.default)} | {_cell(option.meaning)} |")
    lines += [
        "",
        "The nginx and Envoy templates take variables of their own (`SLUICE_ADDR`, `SLUICE_READ_TIMEOUT`, "
        "...), read where the templates are rendered, not by `sluice`: see the nginx and Envoy pages.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if len(arguments) > 1 or any(argument.startswith("-") for argument in arguments):
        print(f"usage: python -m sidecar.cli_reference [{ENVIRONMENT_PAGE}]", file=sys.stderr)
        return 2
    page = environment_page()
    if not arguments:
        sys.stdout.write(page)
        return 0
    target = Path(arguments[0])
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(page, encoding="utf-8")
    except OSError as exc:
        print(f"error: cannot write {target}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
