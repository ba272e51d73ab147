"""An engine adapter driven as the base launcher drives it, without starting any engine."""
from __future__ import annotations

from infera.engine.base.launcher import Launcher, build_launcher_parser


def parse(adapter, argv, *launcher_flags, environ=None):
    """(launcher args, engine argv) as the launcher splits the command line."""
    parser = build_launcher_parser(adapter, "t", environ={} if environ is None else environ)
    return parser.parse_known_args(["--etcd-endpoint", "e", *launcher_flags, *argv])


def prepare(adapter, argv, *launcher_flags, environ=None):
    """(adapter, launcher args, the engine's process spec)."""
    args, engine_argv = parse(adapter, argv, *launcher_flags, environ=environ)
    return adapter, args, adapter.prepare(engine_argv, args)


async def record(adapter, argv, *launcher_flags, session=None):
    """(adapter, spec, the worker record the launcher would register: describe's fields + id/url)."""
    adapter, args, spec = prepare(adapter, argv, *launcher_flags)
    fields = await adapter.describe(session, "http://unused", spec.argv, args)
    launcher = Launcher(adapter, args, list(argv))
    launcher.spec = spec
    return adapter, spec, launcher._make_record(fields)
