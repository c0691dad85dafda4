"""The engine's command-line flags, generated from EngineConfig's fields (the one definition).

    add_engine_flags(parser, exclude=("seed",))       # --model (required), --block-size, ...
    args = parser.parse_args(argv)
    LLM(args.model, **engine_kwargs(args, exclude=("seed",)))

Every field becomes `--field-name` with the field's default, its type (`int | None` takes an
int, a bool field is a `--x / --no-x` pair), the help from its metadata, and its choices
checked with EngineConfig's own message; `model`, the one field without a default, is
required. A command leaves out the fields whose flag names it uses for something else
(`folio generate --seed` seeds the sampling) and may change a default for its own use
(`folio serve` runs on the workers' GPUs: `device="auto"`, `warm_up=True`). The values are
checked again, with the rest of EngineConfig's checks, when the EngineConfig is built.
"""

from __future__ import annotations

import argparse
import dataclasses

from folio.worker.config import EngineConfig, check_choice
from folio.worker.errors import ConfigError

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def engine_fields(exclude: tuple[str, ...] = ()) -> list[dataclasses.Field]:
    """EngineConfig's fields in definition order, less `exclude`."""
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in exclude]


def _type(f: dataclasses.Field) -> type:
    name = f.type if isinstance(f.type, str) else f.type.__name__  # postponed annotations are strings
    return _TYPES[name.replace("| None", "").strip()]


def _choice(name: str, choices: tuple):
    def parse(value: str) -> str:
        try:
            check_choice(name, value, choices)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return parse


def add_engine_flags(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                     defaults: dict | None = None) -> None:
    """`--field-name` on `parser` for every EngineConfig field but `exclude`; `defaults`
    overrides a field's default for this command."""
    defaults = defaults or {}
    for f in engine_fields(exclude):
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help")
        if f.default is dataclasses.MISSING:
            parser.add_argument(flag, required=True, type=_type(f), help=help_)
            continue
        default = defaults.get(f.name, f.default)
        if help_ and default is not None and "default" not in help_:
            help_ += " (default: %(default)s)"
        if _type(f) is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
            continue
        choices = f.metadata.get("choices")
        if choices:
            parser.add_argument(flag, type=_choice(f.name, choices), choices=choices, default=default, help=help_)
        else:
            parser.add_argument(flag, type=_type(f), default=default, help=help_)


def engine_kwargs(args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> dict:
    """EngineConfig's keyword arguments from parsed flags, less `model` and `exclude`."""
    return {f.name: getattr(args, f.name) for f in engine_fields(("model", *exclude))}
