"""The package's face: the names a user calls are attributes of `jax_moe_a2a`, each the object of its module, and
importing the package alone does not import jax."""

import importlib
import subprocess
import sys

import jax_moe_a2a as jma


def test_every_public_name_is_its_module_s_object():
  for name, module in jma._PUBLIC.items():  # pylint: disable=protected-access
    assert getattr(jma, name) is getattr(importlib.import_module(f"jax_moe_a2a.{module}"), name), name
  assert set(jma._PUBLIC) <= set(jma.__all__) and set(dir(jma)) == set(jma.__all__)  # pylint: disable=protected-access


def test_an_unknown_name_is_an_attribute_error():
  try:
    jma.no_such_thing  # pylint: disable=pointless-statement
  except AttributeError as e:
    assert "no attribute 'no_such_thing'" in str(e)
  else:
    raise AssertionError("no AttributeError")


def test_importing_the_package_does_not_import_jax():
  code = "import sys, jax_moe_a2a; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
  assert out == "False"
