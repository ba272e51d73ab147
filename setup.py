"""The package's one compiled part, infera.kv._native (metadata is in pyproject.toml).

It is optional: where it cannot be built (no C compiler), the build warns and infera runs its
pure-Python implementations of the same functions (infera/kv/native.py says which is in use).
"""
import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "infera.kv._native",
            ["infera/kv/_native.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wno-missing-braces"],
            libraries=["dl"] if sys.platform.startswith("linux") else [],
            optional=True,
        )
    ]
)
