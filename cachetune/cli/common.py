"""What several commands share: the engine flags built from EngineConfig's fields, the engine they
configure, and the parsing of method, ratio and dataset lists."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

from cachetune.config import ALLOCATIONS, DTYPES, SIGNALS, EngineConfig, byte_size

CHOICES = {"dtype": sorted(DTYPES), "allocation": ALLOCATIONS, "signal": SIGNALS}


def flag_type(annotation) -> type:
    """The one non-None type of a field's annotation (str, int, float or bool)."""
    args = [a for a in typing.get_args(annotation) or (annotation,) if a is not type(None)]
    return args[0]


def engine_args(p: argparse.ArgumentParser, own: tuple[str, ...] = ()) -> None:
    """--config plus one flag per EngineConfig field, except `own` fields the command defines itself
    (their values still reach the config)."""
    p.add_argument("--config", help="EngineConfig as .json or .toml; the flags below override it")
    field_args(p, EngineConfig, "engine", own)


def field_args(p: argparse.ArgumentParser, cls, title: str, own: tuple[str, ...] = ()) -> None:
    """One flag per field of the config dataclass `cls` (help from its comments)."""
    group = p.add_argument_group(title, f"{cls.__name__} fields (defaults in brackets)")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in own:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{cls.help(f.name)} [{f.default}]"
        kind = flag_type(hints[f.name])
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name.endswith("_bytes"):
            group.add_argument(flag, dest=f.name, type=byte_size, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, choices=CHOICES.get(f.name), help=help_text)


def config(args, **fixed) -> EngineConfig:
    """The EngineConfig of the flags (over --config's file); `fixed` fields win over both."""
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(EngineConfig)} | fixed
    if args.config:
        return EngineConfig.from_file(args.config, **overrides)
    return EngineConfig(**{k: v for k, v in overrides.items() if v is not None})


def engine(args, **fixed):
    """The engine the flags configure; a model on which reuse was refused is a warning, not an error."""
    from cachetune.engine.engine import Engine

    loaded = Engine.from_pretrained(config=config(args, **fixed))
    if loaded.reuse_error:
        print(f"warning: {loaded.reuse_error}", file=sys.stderr)
    return loaded


def methods(text: str) -> list[str]:
    from cachetune.methods import method_names

    return method_names() if text == "all" else [m.strip() for m in text.split(",") if m.strip()]


def ratio(text: str) -> float | str:
    """A --ratio value: a number in [0, 1], or "auto" (the calibrated ratio of the chunks' tier)."""
    from cachetune.engine.calibration import AUTO

    if text == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'not a ratio: {text!r} (a number in [0, 1] or "auto")') from None


def floats(text: str | None) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip()) if text else ()


def datasets(args, default: str) -> dict:
    """--data values (names or files, repeated or comma-separated) -> {name or file stem: examples}.

    Names are unique: a file whose stem is taken already (a/musique.json, then b/musique.json) is
    named with its parent folders as needed ("b/musique"), and as a last resort numbered ("musique#2").
    A dataset without examples (an empty file, --limit 0) is a ValueError."""
    from cachetune.eval.datasets import DATASETS, load_dataset

    specs = [d for arg in (args.data or [default]) for d in arg.split(",") if d]
    out: dict = {}
    for spec in specs:
        examples = load_dataset(spec, args.limit)  # first: a missing file fails here, with its own message
        if spec in DATASETS:
            candidates = [spec]
        else:  # "stem", "parent/stem", "grandparent/parent/stem", ...
            path = Path(spec)
            folders = path.parent.parts[1:] if path.anchor else path.parent.parts
            parts = [p for p in folders if p != "."] + [path.stem]
            candidates = ["/".join(parts[-n:]) for n in range(1, len(parts) + 1)]
        name = next((c for c in candidates if c not in out), None)
        n = 2
        while name is None or name in out:  # the same file twice
            name, n = f"{candidates[0]}#{n}", n + 1
        if not examples:
            limit = f" with --limit {args.limit}" if args.limit is not None else ""
            raise ValueError(f"dataset {name!r} ({spec}) has no examples{limit}")
        out[name] = examples
    return out


def report_out(report: dict, table: str, json_path: str | None, plot=None) -> None:
    """Print the table; with a path, write the report there as JSON, the table beside it (.md) and,
    given `plot(report, png_path)`, a plot (.png)."""
    from cachetune.eval.report import write_json

    print(table)
    if json_path:
        write_json(report, json_path)
        Path(json_path).with_suffix(".md").write_text(table + "\n")
        print(f"wrote {json_path}", file=sys.stderr)
        if plot is not None:
            print(f"wrote {plot(report, Path(json_path).with_suffix('.png'))}", file=sys.stderr)
