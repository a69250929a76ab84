"""``python -m sparsespec provision NAME...``: provision models now and print their folders."""
from __future__ import annotations

import argparse

from sparsespec.provision import ModelNotAvailableError, resolve_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsespec")
    sub = parser.add_subparsers(dest="command", required=True)
    prov = sub.add_parser("provision", help="provision models offline (convert once into the cache)")
    prov.add_argument("models", nargs="+", help="preset names or local Hugging Face folders")
    args = parser.parse_args(argv)
    for name in args.models:
        try:
            print(f"{name}: {resolve_model(name)}")
        except ModelNotAvailableError as e:
            print(f"error: {e}")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
