"""The `kbert` command."""

import argparse
import sys


def _presets(args):
    from kbert.presets import list_presets

    for name, description in list_presets().items():
        print(f"{name}\t{description}")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="kbert", description="BERT for Keras 3.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("presets", help="list registered presets").set_defaults(func=_presets)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
