"""Build of cannc's native ORT shim (metadata lives in pyproject.toml).

cannc/ort/_shim.c is compiled with the system C compiler into cannc/ort/_shim.so: a plain
shared library loaded with ctypes (ONNX Runtime dlopens it as a plugin EP), not a Python
module -- so no Python ABI tag in its name and no PyInit symbol.
"""

import hashlib
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SRC = os.path.join("cannc", "ort", "_shim.c")
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), SRC), "rb") as f:
    SHIM_HASH = hashlib.sha256(f.read()).hexdigest()[:16]   # = cannc.ort._native.source_hash


class BuildShim(build_ext):
    def get_ext_filename(self, fullname):
        return os.path.join(*fullname.split(".")) + ".so"

    def get_export_symbols(self, ext):
        return []


setup(
    ext_modules=[Extension(
        "cannc.ort._shim", [SRC],
        define_macros=[("CANNC_SHIM_HASH", f'"{SHIM_HASH}"')],
        extra_compile_args=["-O2", "-pthread"],
        extra_link_args=["-pthread"],
        # without a compiler the install still succeeds: cannc.ort._native then builds the
        # shim on first use, or says how to get a compiler
        optional=True,
    )],
    cmdclass={"build_ext": BuildShim},
)
