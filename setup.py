"""The package's one compiled part, infera.kv._native (metadata is in pyproject.toml).

It is optional: where it cannot be built (no C compiler), the build warns and infera runs its
pure-Python implementations of the same functions (infera/kv/native.py says which is in use).
Its sources are infera/kv/csrc/*.c, one file per concern, sharing the headers there.
"""
import sys
from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "infera.kv._native",
            sorted(glob("infera/kv/csrc/*.c")),
            depends=sorted(glob("infera/kv/csrc/*.h")),  # a header edited rebuilds the module
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wno-missing-braces"],
            libraries=["dl"] if sys.platform.startswith("linux") else [],
            optional=True,
        )
    ]
)
