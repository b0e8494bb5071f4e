"""The shared command line of the converters: arguments, messages and exit codes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from .layout import CheckpointError
from .streaming import DestinationExistsError, NonFiniteWeightError, parse_size, partial_dir

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # argparse's own code for bad arguments
EXIT_INVALID_SOURCE = 3
EXIT_DESTINATION_EXISTS = 4
EXIT_NON_FINITE = 5  # NaN/Inf weights refused; rerun with --keep-non-finite to convert them as they are


def run_cli(doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
            convert: Callable[[argparse.Namespace], Path], argv: list[str] | None = None) -> int:
    """Parse `--src`, `--dst`, `--max-shard-size`, `--quiet`, `--keep-non-finite` plus the script's own options, run `convert` and map
    its failures to exit codes with a one-paragraph message on stderr."""
    summary, _, details = doc.strip().partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details.strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True, type=Path, help="source checkpoint folder")
    parser.add_argument("--dst", required=True, type=Path, help="output folder (must not exist)")
    parser.add_argument("--max-shard-size", default=None, type=parse_size,
                        help="split output files at this size (e.g. 5GB); default: one output file per source shard")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--keep-non-finite", action="store_true",
                        help="convert NaN/Inf weight values as they are (default: refuse them, naming the tensor)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        out = convert(args)
    except CheckpointError as error:
        print(f"error: invalid source checkpoint {args.src}:\n{error}", file=sys.stderr)
        return EXIT_INVALID_SOURCE
    except DestinationExistsError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_DESTINATION_EXISTS
    except KeyboardInterrupt:
        print(f"\ninterrupted; rerun the same command to resume from {partial_dir(args.dst)}", file=sys.stderr)
        return EXIT_FAILED
    except NonFiniteWeightError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_NON_FINITE
    except (OSError, RuntimeError, ValueError) as error:
        print(f"error: conversion failed: {error}\nrerun the same command to resume from {partial_dir(args.dst)}",
              file=sys.stderr)
        return EXIT_FAILED
    print(f"wrote {out}")
    return EXIT_OK
