"""``python -m infera.operator``: ``render`` a CR to YAML, print the ``crd``, or ``run`` the operator.

``render -f FILE [-n NS] [--sim]`` prints the objects as a YAML stream (``---`` between them), like
``helm template``; a bad file or spec exits 2 with one line naming the field. ``run ...`` hands its
arguments to ``infera.operator.controller.main`` (imported only then: render and crd need no kopf).
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

import yaml

USAGE = "python -m infera.operator {render,crd,run} ..."


def _load_cr(path: str) -> dict:
    """The one InferaDeployment in ``path`` ('-': stdin); other documents are refused."""
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {str(exc).splitlines()[0]}") from None
    if len(docs) != 1:
        raise ValueError(f"{path}: expected one InferaDeployment document, found {len(docs)}")
    if not isinstance(docs[0], dict):
        raise ValueError(f"{path}: the document is not a mapping")
    return docs[0]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the dashboard JSON) as literal blocks, readable and diffable."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def dump_stream(objects: list[dict]) -> str:
    """The objects as a YAML stream, each document after a ``---`` line."""
    return "".join("---\n" + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)
                   for obj in objects)


def _render(argv: Sequence[str]) -> int:
    from infera.operator.render import RenderOptions, render
    from infera.operator.spec import SpecError

    p = argparse.ArgumentParser(prog="python -m infera.operator render",
                                description="Print the Kubernetes objects of an InferaDeployment as YAML.")
    p.add_argument("-f", "--filename", required=True, help="the InferaDeployment manifest ('-': stdin)")
    p.add_argument("-n", "--namespace", default=None,
                   help="namespace of the objects when the manifest names none (default: default)")
    p.add_argument("--sim", action="store_true",
                   help="run every worker as infera.engine.sim with the Infera image (tests, capacity planning)")
    p.add_argument("--infera-image", default=None, help="image of the server, sim workers and kvd")
    args = p.parse_args(list(argv))
    opts = RenderOptions(sim=args.sim, namespace=args.namespace)
    if args.infera_image:
        opts = RenderOptions(sim=args.sim, namespace=args.namespace, infera_image=args.infera_image)
    try:
        objects = render(_load_cr(args.filename), opts)
    except (SpecError, ValueError) as exc:
        print(f"render: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(dump_stream(objects))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {USAGE}\n  render -f FILE [-n NS] [--sim]  print the objects of an InferaDeployment\n"
              "  crd                             print the CustomResourceDefinition\n"
              "  run ...                         run the operator (see run --help)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "render":
        return _render(rest)
    if command == "crd":
        from infera.operator.crd import crd_yaml

        sys.stdout.write(crd_yaml())
        return 0
    if command == "run":
        from infera.operator import controller  # kopf is imported only to run the operator

        return controller.main(rest) or 0
    print(f"usage: {USAGE} (unknown command {command!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
