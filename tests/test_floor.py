"""The oldest supported torch is declared the same everywhere, and is the one CI tests.

Two floors: the workbook's (requirements.txt and environment.yml: every notebook and test runs on
it, .ci/run's stage 2) and the package's (pyproject.toml: mgtutor alone, its unit tests, stage 3).
.ci/run names both pairs and installs each in its own environment. Reads text files only: no
torch import.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Left out of the package's floor environment: the notebooks and the browser test do not run
# there, and mgtutor itself is installed on its own (--no-deps -e .).
NOT_ON_FLOOR = {"torch", "torchvision", "jupyterlab", "playwright", "latex2mathml"}


def _requirements() -> dict[str, str]:
    """requirements.txt as {name: specifier}, comments and the editable line left out."""
    found = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            name, spec = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(.*)", line).groups()
            found[name.lower()] = spec
    return found


def _floor(spec: str, name: str) -> str:
    match = re.fullmatch(r">=(\d+\.\d+\.\d+)", spec)
    assert match, f"requirements.txt: want '{name}>=X.Y.Z' (the tested floor), got {spec!r}"
    return match.group(1)


def _ci_value(text: str, variable: str) -> str:
    match = re.search(rf"^{variable}=(\S+)$", text, re.MULTILINE)
    assert match, f".ci/run sets no {variable}"
    return match.group(1)


def _version(text: str) -> tuple[int, ...]:
    return tuple(map(int, text.split(".")))


def _pyproject_floor(name: str) -> str:
    """The floor pyproject.toml gives ``name``, as a dependency or in an optional extra."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    (spec,) = re.findall(rf'"{name}(>=[^"]+)"', pyproject)
    return _floor(spec, name)


def test_workbook_floor_is_the_same_in_requirements_environment_and_ci() -> None:
    requirements = _requirements()
    torch_floor = _floor(requirements["torch"], "torch")
    vision_floor = _floor(requirements["torchvision"], "torchvision")

    environment = (ROOT / "environment.yml").read_text()
    assert "-r requirements.txt" in environment
    for requirement in (f"torch>={torch_floor}", f"torchvision>={vision_floor}"):
        assert requirement in environment, f"environment.yml does not mention {requirement}"

    ci = (ROOT / ".ci" / "run").read_text()
    assert _ci_value(ci, "WORKBOOK_FLOOR_TORCH") == torch_floor
    assert _ci_value(ci, "WORKBOOK_FLOOR_TORCHVISION") == vision_floor
    # Stage 4 runs the README's whole command on that pair, with the oldest Python.
    assert re.search(
        r'^MGTUTOR_PYTHON="\$py_oldest" \\\n'
        r'tools/test_on_torch\.sh "\$WORKBOOK_FLOOR_TORCH" "\$WORKBOOK_FLOOR_TORCHVISION"',
        ci,
        re.MULTILINE,
    )


def test_package_floor_is_the_same_in_pyproject_and_ci() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert _pyproject_floor("torch") == _ci_value(ci, "PACKAGE_FLOOR_TORCH")
    assert _pyproject_floor("torchvision") == _ci_value(ci, "PACKAGE_FLOOR_TORCHVISION")


def test_floors_are_matching_pairs_the_package_no_newer_than_2_6() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    pairs = {
        "workbook": (
            _ci_value(ci, "WORKBOOK_FLOOR_TORCH"),
            _ci_value(ci, "WORKBOOK_FLOOR_TORCHVISION"),
        ),
        "package": (
            _ci_value(ci, "PACKAGE_FLOOR_TORCH"),
            _ci_value(ci, "PACKAGE_FLOOR_TORCHVISION"),
        ),
    }
    for torch_floor, vision_floor in pairs.values():
        major, minor, patch = _version(torch_floor)
        # torch 2.N.P comes with torchvision 0.(N+15).P (2.4.1 with 0.19.1, 2.11.0 with 0.26.0).
        assert major == 2 and _version(vision_floor) == (0, minor + 15, patch)
    # The notebooks need the workbook's floor; mgtutor alone promises no more than it does.
    assert _version(pairs["package"][0]) <= _version(pairs["workbook"][0])
    # Many clusters run torch 2.5 to 2.8: the package's floor must not shut them out.
    assert _version(pairs["package"][0])[:2] <= (2, 6)


def test_ci_floor_environment_gets_the_rest_of_requirements() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    listed = re.search(r"^FLOOR_OTHERS=\((.*?)^\)", ci, re.MULTILINE | re.DOTALL).group(1)
    others = dict(
        re.fullmatch(r"([A-Za-z0-9_.\-]+)(.*)", item).groups()
        for item in re.findall(r'"([^"]+)"', listed)
    )
    wanted = {n: s for n, s in _requirements().items() if n not in NOT_ON_FLOOR}
    # cloudpickle is held at its own floor there (the newest is stage 1's).
    wanted["cloudpickle"] = wanted["cloudpickle"].replace(">=", "==")
    assert others == wanted


def test_ci_tests_the_oldest_python_the_package_declares() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^requires-python = ">=(\d+\.\d+)"', pyproject, re.MULTILINE).group(1)
    assert _ci_value(ci, "OLDEST_PYTHON") == declared
    # ruff checks the code against the same Python's grammar.
    target = re.search(r'^target-version = "py(\d)(\d+)"', pyproject, re.MULTILINE).groups()
    assert ".".join(target) == declared
