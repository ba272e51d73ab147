"""Build-time check of an engine image: infera is installed next to the engine it launches.

    python3 check_image.py --import infera.engine.vllm --locate vllm.entrypoints.cli.main --report nixl

* ``--import M``: M must import (infera's own launcher modules).
* ``--locate M``: M's file must exist, found without importing M or its parent packages: a vendor
  package may need a GPU runtime to import, and an image builder has none.
* ``--report M``: say whether M is there; never fails (optional connectors).

Prints which implementation of infera's hot loops runs (the C accelerator or Python). Exits 1
naming every module that failed. Run by the Dockerfiles in this directory; standard library only.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from importlib.machinery import all_suffixes


def locate(module: str) -> str | None:
    """The path of ``module``'s source, package directory or extension, or None when absent."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)  # a top-level lookup imports nothing
    if spec is None:
        return None
    if not rest:
        return spec.origin or top
    search = list(spec.submodule_search_locations or [])
    path = None
    for part in rest.split("."):
        path = None
        for directory in search:
            package_dir = os.path.join(directory, part)
            if os.path.isdir(package_dir):  # a package, regular or namespace
                path, search = package_dir, [package_dir]
                break
            for suffix in all_suffixes():  # .py, .pyc, extension modules
                if os.path.isfile(package_dir + suffix):
                    path, search = package_dir + suffix, []
                    break
            if path:
                break
        if path is None:
            return None
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_image.py", description=__doc__.splitlines()[0])
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE")
    parser.add_argument("--locate", action="append", default=[], metavar="MODULE")
    parser.add_argument("--report", action="append", default=[], metavar="MODULE")
    args = parser.parse_args(argv)

    failures = []
    for module in args.imports:
        try:
            importlib.import_module(module)
        except Exception as e:  # any import error is the finding
            failures.append(f"{module}: import failed: {type(e).__name__}: {e}")
    for module in args.locate:
        if locate(module) is None:
            failures.append(f"{module}: not installed")
    for module in args.report:
        print(f"{module}: {'present' if locate(module) else 'absent'}")
    try:
        from infera.kv import native
        print(f"infera hot loops: {native.describe()}")
    except Exception as e:
        failures.append(f"infera.kv.native: import failed: {type(e).__name__}: {e}")
    for failure in failures:
        print(f"check_image: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
