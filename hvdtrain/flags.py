"""The flag machinery every command shares: a dataclass's fields as flags (typed by their
annotations, documented by the docstring under each), an argparse that fails in one line, and
help that shows the defaults worth showing. hvdtrain.training.config builds the training flags with it,
the launcher, the Slurm renderer and the converter theirs.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
import typing
from typing import Literal

from hvdtrain.errors import UserError


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises a UserError (one line, once: see hvdtrain.errors.reported) instead
    of printing its usage from every rank and exiting, and takes no abbreviated flag (`--ker 3`
    would be read as --keras 3 after hvdtrain had chosen Keras 2 from the exact flag)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        raise UserError(f"{message}{self._did_you_mean(message)} (see --help)")

    def _did_you_mean(self, message: str) -> str:
        """"; did you mean --epochs?" for the first unrecognized flag close to a known one."""
        prefix = "unrecognized arguments:"
        if not message.startswith(prefix):
            return ""
        known = [flag for flag in self._option_string_actions if flag.startswith("--")]
        for word in message[len(prefix):].split():
            if word.startswith("-"):
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.7)
                if close:
                    return f"; did you mean {close[0]}?"
        return ""


class FlagHelpFormatter(argparse.HelpFormatter):
    """A flag's default after its help when it has one worth saying (a switch says its own, and
    a help that names its default keeps its words)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if (not action.option_strings or action.default in (None, argparse.SUPPRESS)
                or isinstance(action.default, bool) or "(default" in help_text):
            return help_text
        return help_text + " (default: %(default)s)"


class ProseHelpFormatter(FlagHelpFormatter):
    """A command's description (its module docstring) as plain text filled to the terminal's
    width: paragraphs and list items ("* " or "- ", continued by indented lines) re-wrapped,
    other indented lines (commands) kept as written, the docstring's ``code`` and **bold**
    marks left out."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = re.sub(r"``([^`]+)``|\*\*([^*]+)\*\*", lambda m: m.group(1) or m.group(2), text)
        blocks = []
        for paragraph in re.split(r"\n\s*\n", text.strip("\n")):
            items: list[list[str]] = []  # each: a plain paragraph, a list item or a command
            for line in paragraph.splitlines():
                kind = "item" if re.match(r"[*-] ", line) else (
                    "command" if line.startswith(" ") else "plain")
                last = items and ("item" if re.match(r"[*-] ", items[-1][0]) else (
                    "command" if items[-1][0].startswith(" ") else "plain"))
                joins = (kind == "command" and last in ("item", "command")
                         or kind == "plain" and last == "plain")
                if joins:
                    items[-1].append(line)
                else:
                    items.append([line])
            for item in items:
                first = item[0]
                if first.startswith(" ") and not re.match(r"[*-] ", first):
                    blocks.append("\n".join(indent + line for line in item))  # a command
                    continue
                bullet = "  " if re.match(r"[*-] ", first) else ""
                blocks.append(textwrap.fill(" ".join(line.strip() for line in item), width,
                                            initial_indent=indent,
                                            subsequent_indent=indent + bullet))
            blocks.append("")
        return "\n".join(blocks).rstrip("\n")


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, config_class: type,
             field: dataclasses.Field, default, doc: str, short: str | None = None):
    """The flag of one dataclass field: --field-name, typed by its annotation (a bool is
    --name/--no-name, a Literal a choice), its docstring as the help."""
    names = [flag_name(field.name)] + ([short] if short else [])
    help_text = " ".join(doc.split()).replace("%", "%%")
    kind = base_type(config_class, field)
    choices = literal_choices(config_class, field)
    if kind is bool:
        parser.add_argument(*names, action=argparse.BooleanOptionalAction,
                            default=default, help=help_text)
    elif choices:
        parser.add_argument(*names, default=default, choices=choices, help=help_text)
    else:  # a type of the config's own (--cache's) is given as text, which the config parses
        parser.add_argument(*names, default=default, type=kind if kind in (int, float) else str,
                            help=help_text, metavar=field.name.upper())


def flag_name(name: str) -> str:
    """'--batch-size' for the field batch_size."""
    return "--" + name.replace("_", "-")


@functools.cache
def resolved_hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def literal_choices(config_class: type, field: dataclasses.Field) -> tuple:
    hint = resolved_hints(config_class)[field.name]
    if typing.get_origin(hint) is not Literal:  # Literal[...] | None: the Literal's choices
        hint = next((a for a in typing.get_args(hint) if typing.get_origin(a) is Literal), hint)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def base_type(config_class: type, field: dataclasses.Field) -> type:
    hint = resolved_hints(config_class)[field.name]
    if typing.get_origin(hint) is Literal:
        return str
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs
