"""The `dflash2` command: a dispatcher over one module per command (`dflash2_apps.generate`, `.serve`, ...;
`tree-sim`'s is `dflash2_apps.tree_sim`).

Each command's module has `add_parser(subparsers)` (its flags, with `run` as the parser's default) and
`run(args)`; only the module of the command that runs is imported. Bad input (ValueError, FileNotFoundError)
is one line on stderr and exit 2; any other error names its type and its causes (exit 1), and `--verbose`
shows its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dflash2_apps.openblas import restart_with_openblas

COMMANDS = ("generate", "serve", "chat", "convert", "export", "data", "train", "bench", "replay", "tree-sim", "info")
VERBOSE_HELP = "on an error, show its full traceback"
USAGE_ERRORS = (ValueError, FileNotFoundError)


def module_of(command: str) -> str:
    """The module that defines `command` (`add_parser`, `run`): its name with '-' as '_'."""
    return "dflash2_apps." + command.replace("-", "_")


def make_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; with `command`, the others are names only (their modules not imported)."""
    parser = argparse.ArgumentParser(prog="dflash2", description="DFlash / DFlash 2 speculative decoding on MLX")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        if command not in (None, name):
            sub.add_parser(name)
            continue
        importlib.import_module(module_of(name)).add_parser(sub)
        # after the command too; SUPPRESS keeps the global flag's value when this one is absent
        sub.choices[name].add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


# Commands that preload OpenBLAS themselves, once they know MLX does their work: `data` with the torch engine
# runs without it (preloaded, it takes over PyTorch's float32 matmuls: 2.7x slower on a 2-core AVX2 EPYC).
OWN_BLAS = ("data",)


def command_in(argv: list[str]) -> str | None:
    """The command `argv` runs, if it names one before any help flag (`dflash2 --help` lists them all)."""
    for arg in argv:
        if arg in ("-h", "--help"):
            return None
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def error_lines(error: BaseException) -> list[str]:
    """The error's type and message, then each exception it came from (its chain of causes)."""
    lines, seen = [f"{type(error).__name__}: {error}"], {id(error)}
    cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        lines.append(f"  caused by {type(cause).__name__}: {cause}")
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return lines


def main(argv: list[str] | None = None) -> int:
    restart = argv is None
    if restart and command_in(sys.argv[1:]) not in OWN_BLAS:
        restart_with_openblas(["-m", "dflash2_apps.cli", *sys.argv[1:]])
    argv = sys.argv[1:] if argv is None else argv
    args = make_parser(command_in(argv)).parse_args(argv)
    args.argv = list(argv)  # the words after `dflash2`: reports say how they were made
    args.restart = restart  # whether a command may replace this process (`openblas.restart_with_openblas`)
    # the library's notices (logging, never print): a download, a measurement, a dtype it had to change
    logging.basicConfig(level=logging.INFO, format="[dflash2] %(message)s")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as e:
        if args.verbose:
            raise
        if isinstance(e, USAGE_ERRORS):
            print(f"dflash2 {args.command}: error: {e}", file=sys.stderr)
            return 2
        lines = error_lines(e)
        print(f"dflash2 {args.command}: error: " + "\n".join(lines), file=sys.stderr)
        print("(rerun with --verbose for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
