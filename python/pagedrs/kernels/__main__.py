"""Command line: ``python -m pagedrs.kernels --check`` (see pagedrs.kernels.check)."""

from __future__ import annotations

import argparse
import sys

from pagedrs.kernels.check import ARCHS, run_check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedrs.kernels", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compile every kernel instance with NVRTC (no GPU needed)")
    parser.add_argument("--arch", action="append", help=f"architecture(s) to compile for (default {' '.join(ARCHS)})")
    args = parser.parse_args(argv)
    if not args.check:
        parser.print_help()
        return 2
    return run_check(tuple(args.arch) if args.arch else ARCHS)


if __name__ == "__main__":
    sys.exit(main())
