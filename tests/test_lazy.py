"""dpfl_tf, dpfl_tf.privacy and dpfl_tf.federated import their public names on first
use (`dpfl_tf._lazy`): every name in ``__all__`` is exported and is its module's
object, what static readers see (the ``TYPE_CHECKING`` imports) is the same list,
submodules are reached as attributes, unknown names raise AttributeError, and
importing the packages (or the accountants' names) imports neither dp-accounting,
SciPy nor TensorFlow."""

import ast
import importlib
import inspect
import subprocess
import sys

import pytest

import dpfl_tf
import dpfl_tf.federated as federated
import dpfl_tf.privacy as privacy

PACKAGES = [dpfl_tf, privacy, federated]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_every_exported_name_is_its_modules_object(package):
    assert set(package._EXPORTS) == set(package.__all__)
    for name in package.__all__:
        module = importlib.import_module(package._EXPORTS[name], package.__name__)
        assert getattr(package, name) is getattr(module, name), name
        assert name in dir(package)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        package.no_such_name
    with pytest.raises(AttributeError):
        package._private_name  # never tried as a submodule


@pytest.mark.parametrize("package", [dpfl_tf, privacy], ids=lambda p: p.__name__)
def test_static_readers_see_the_same_names(package):
    """The API reference and type checkers read the ``if TYPE_CHECKING:`` imports."""
    tree = ast.parse(inspect.getsource(package))
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    ]
    typed = {
        alias.asname or alias.name
        for node in ast.walk(block)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == set(package.__all__)


def test_star_import_gives_all():
    namespace = {}
    exec("from dpfl_tf.privacy import *", namespace)
    assert set(privacy.__all__) <= set(namespace)


def test_a_fresh_import_loads_no_dp_accounting_and_reaches_submodules_on_use():
    code = (
        "import sys, dpfl_tf, dpfl_tf.privacy, dpfl_tf.federated\n"
        "from dpfl_tf.privacy import AccountantKind, SamplingMethod\n"
        "from dpfl_tf.federated.settings import DistributedMechanism\n"
        "heavy = ('dp_accounting', 'tensorflow', 'scipy')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "assert 'accountants' not in vars(dpfl_tf.privacy)\n"
        "assert not hasattr(dpfl_tf, '__main__') and not hasattr(dpfl_tf, 'nothing')\n"
        "assert dpfl_tf.privacy.accountants.AccountantKind is AccountantKind\n"
        "assert dpfl_tf.compute_epsilon is dpfl_tf.privacy.accountants.compute_epsilon\n"
        "print('dp_accounting' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "True"]
