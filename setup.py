"""Package discovery for rhino's layout (the rest of the metadata is in setup.cfg).

``hlo_passes/`` and ``runtime/`` live at the top of the repository but install under the
rhino namespace (``rhino.hlo_passes``, ``rhino.runtime``): a top-level ``runtime`` package
in site-packages would collide with other software. Every package below the three roots is
found by walking the tree, so a new subpackage cannot be left out of the wheel; a folder of
modules without ``__init__.py`` stops the build instead of silently missing from it.
"""

from pathlib import Path

ROOTS = {"rhino": "rhino", "rhino.hlo_passes": "hlo_passes", "rhino.runtime": "runtime"}


def discover_packages(top: Path) -> list[str]:
    """Every package under ``ROOTS`` in the tree at ``top``, as dotted names under the rhino
    namespace."""
    packages = []
    for name, folder in ROOTS.items():
        root = top / folder
        for d in sorted(p for p in [root, *root.rglob("*")] if p.is_dir()):
            rel = d.relative_to(root).parts
            if "__pycache__" in rel or any(part.startswith(".") for part in rel):
                continue
            has_init = (d / "__init__.py").exists()
            if not has_init and any(d.glob("*.py")):
                raise SystemExit(f"setup.py: {d.relative_to(top)} holds Python modules but "
                                 f"no __init__.py; it would be missing from the wheel")
            if has_init:
                packages.append(".".join((name, *rel)))
    return packages


if __name__ == "__main__":
    from setuptools import setup  # here: discovery is importable without setuptools

    setup(packages=discover_packages(Path(__file__).resolve().parent), package_dir=ROOTS)
