"""dpfl_tf and dpfl_tf.privacy import their public names on first use
(`dpfl_tf._lazy`): the names are the modules' own objects, submodules are reached
as attributes, unknown names raise AttributeError, and importing the packages (or
the accountants' names) imports neither dp-accounting nor TensorFlow."""

import subprocess
import sys

import pytest

import dpfl_tf
import dpfl_tf.privacy as privacy


@pytest.mark.parametrize("package", [dpfl_tf, privacy], ids=lambda p: p.__name__)
def test_every_exported_name_is_its_modules_object(package):
    import importlib

    for name in package.__all__:
        module = importlib.import_module(package._EXPORTS[name])
        assert getattr(package, name) is getattr(module, name), name
        assert name in dir(package)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        package.no_such_name
    with pytest.raises(AttributeError):
        package._private_name  # never tried as a submodule


def test_submodules_are_attributes_and_star_import_gives_all():
    assert privacy.ledger.PrivacyLedger is privacy.PrivacyLedger
    assert dpfl_tf.privacy is privacy
    namespace = {}
    exec("from dpfl_tf.privacy import *", namespace)
    assert set(privacy.__all__) <= set(namespace)


def test_importing_the_packages_and_the_choices_loads_no_dp_accounting():
    code = (
        "import sys, dpfl_tf, dpfl_tf.privacy\n"
        "from dpfl_tf.privacy import AccountantKind, SamplingMethod\n"
        "from dpfl_tf.federated.settings import DistributedMechanism\n"
        "print(sorted(m for m in ('dp_accounting', 'tensorflow', 'scipy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
