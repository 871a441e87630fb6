"""Puts the compiled module of a jax_moe_a2a wheel next to the checkout's sources (jax_moe_a2a/), so that the
checkout's package is complete on a machine that only has the wheel: bench/gpu_session.sh and bench/gpu_ab.sh.

  python bench/extension_from_wheel.py WHEEL
"""

import sys
import zipfile


def main(argv) -> int:
  if len(argv) != 1:
    print("usage: python bench/extension_from_wheel.py WHEEL", file=sys.stderr)
    return 2
  with zipfile.ZipFile(argv[0]) as z:
    names = [n for n in z.namelist() if n.startswith("jax_moe_a2a/_jax_moe_a2a") and n.endswith(".so")]
    if not names:
      print(f"{argv[0]}: no compiled module in the wheel", file=sys.stderr)
      return 2
    for n in names:
      z.extract(n, ".")
      print("extension:", n)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
