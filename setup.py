"""The build, with the proxy path compiled by mypyc when PULSEGATE_MYPYC=1.

Metadata lives in pyproject.toml; this file only adds the compiled modules. Without the
variable the package is pure Python, as `make install` builds it. With it (`make compiled`,
or `PULSEGATE_MYPYC=1 pip install --no-build-isolation .` beside mypy, a C compiler and
Python's headers), the modules in `COMPILED` become C extensions: the same source, about a
quarter less CPU per proxied request (docs/performance.md, "mypyc, revisited").
"""

import os
from pathlib import Path

from setuptools import setup

# The request and token path: the lean server, the upstream client, the relay, the dialects
# and the balancer's pick; a module added to proxy/ joins by itself. The records made per
# request or per event there are plain classes, not dataclasses or NamedTuples: mypyc makes
# those native, while a dataclass's `__init__` or a NamedTuple's constructor stays an
# interpreted call (`tests/test_compiled.py` holds the list).
_SKIP = {"__init__.py"}
_HERE = Path(__file__).resolve().parent
COMPILED = [
    "src/pulsegate/balancer.py",
    *sorted(
        p.relative_to(_HERE).as_posix()
        for d in ("proxy", "proxy/dialects")
        for p in (_HERE / "src/pulsegate" / d).glob("*.py")
        if p.name not in _SKIP
    ),
]

if __name__ == "__main__":
    ext_modules = []
    if os.environ.get("PULSEGATE_MYPYC") == "1":
        from mypyc.build import mypycify

        ext_modules = mypycify(COMPILED, opt_level="3")
    setup(ext_modules=ext_modules)
