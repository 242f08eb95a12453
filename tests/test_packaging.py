"""What a regular (non-editable) install ships."""
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_is_installed():
    """Each folder of polyjit with an __init__.py is listed in pyproject.toml:
    an editable install finds any, a wheel only those listed."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "polyjit").rglob("__init__.py")}
    found |= {"polyjit.frontends"}  # (frontends/, mapped by package-dir)
    assert found <= listed, sorted(found - listed)
