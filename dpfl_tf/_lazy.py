"""Packages whose public names are imported on first use (PEP 562): `dpfl_tf`,
`dpfl_tf.privacy` and `dpfl_tf.federated` list each name's module, so a process
that needs a small part (the command line's ``--help``, a Flower ClientApp) does
not import TensorFlow or dp-accounting for the rest."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str], namespace: dict):
    """(``__getattr__``, ``__dir__``) for `package`: a name of `exports` comes from its
    module (absolute, or relative to `package`: ``".partition"``) when first asked for,
    then is kept in the package's namespace; any other public name is tried as a
    submodule (``import dpfl_tf; dpfl_tf.privacy``).  `namespace`: the package's globals."""

    def __getattr__(name):
        if name in exports:
            value = namespace[name] = getattr(importlib.import_module(exports[name], package), name)
            return value
        if not name.startswith("_"):  # never runs dpfl_tf.__main__ (the CLI) on a hasattr
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
