"""The command-line reference, from the argparse parsers `batchpilot` itself runs.

`batchpilot.cli.build_parser` holds the product's commands and the ones other distributions add
(`batchpilot sidecar`, `batchpilot demo`); each becomes a section with its usage, description
and one row per option, in the parser's own words. Help is rendered here, not by argparse's
formatter, whose line width follows the terminal.
"""

from __future__ import annotations

import argparse

from batchpilot import cli
from batchpilot_docs import formats


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_texts(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each subcommand's one-line help, as `batchpilot --help` lists it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def _option(action: argparse.Action) -> tuple[str, str, str, str]:
    if action.choices is not None:
        metavar = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        metavar = str(action.metavar or action.dest.upper())
    if action.option_strings:
        spelled = ", ".join(action.option_strings)
        if action.nargs != 0:
            spelled += f" {metavar}"
    else:
        spelled = metavar
    default = action.default
    shown = (
        "required"
        if action.required
        else formats.code(str(default))
        if default not in (None, [], False, argparse.SUPPRESS)
        else ""
    )
    repeatable = "yes" if isinstance(action, argparse._AppendAction) else ""
    return formats.code(spelled), shown, repeatable, action.help or ""


def _section(name: str, summary: str, parser: argparse.ArgumentParser) -> str:
    usage = " ".join(parser.format_usage().removeprefix("usage: ").split())
    sentence = summary[:1].upper() + summary[1:].rstrip(".") + "."
    parts = [f"## `batchpilot {name}`", "", sentence, ""]
    parts += ["```text", usage, "```", ""]
    if parser.description:
        parts += [parser.description, ""]
    actions = [
        action
        for action in parser._actions
        if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
    ]
    if actions:
        rows = [_option(action) for action in actions]
        parts.append(formats.table(("Option", "Default", "Repeatable", "What it does"), rows))
    else:
        parts.append("It takes no options here (it is not part of this installation).\n")
    return "\n".join(parts)


def page() -> str:
    """docs/reference/cli.md."""
    parser = cli.build_parser()
    summaries = _help_texts(parser)
    sections = [
        _section(name, summaries.get(name, ""), command)
        for name, command in _subcommands(parser).items()
    ]
    intro = f"""# Command line

{parser.description} `batchpilot` is one command with subcommands, and `batchpilot COMMAND
--help` says what this page says. `batchpilot sidecar` comes with the sidecar's distribution and
`batchpilot demo` with the tooling's (`tools/`); an installation without them says so.

"""
    return formats.header("the argparse parsers of batchpilot.cli") + intro + "\n".join(sections)
