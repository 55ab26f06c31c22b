"""The oldest supported torch is declared the same everywhere, and is the one CI tests.

requirements.txt, pyproject.toml, environment.yml and .ci/run each name the floor; .ci/run
installs exactly that pair in a second environment and runs the unit tests there. Reads text
files only: no torch import.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Left out of the floor environment: the notebooks and the browser test do not run there, and
# mgtutor itself is installed on its own (--no-deps -e .).
NOT_ON_FLOOR = {"torch", "torchvision", "jupyterlab", "playwright"}


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


def test_floor_is_the_same_in_requirements_pyproject_environment_and_ci() -> None:
    requirements = _requirements()
    torch_floor = _floor(requirements["torch"], "torch")
    vision_floor = _floor(requirements["torchvision"], "torchvision")
    declared = {f"torch>={torch_floor}", f"torchvision>={vision_floor}"}

    pyproject = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.MULTILINE | re.DOTALL).group(1)
    dependencies = set(re.findall(r'"([^"]+)"', block))
    assert {d for d in dependencies if re.match(r"torch(vision)?\b", d)} == declared

    environment = (ROOT / "environment.yml").read_text()
    for requirement in declared:
        assert requirement in environment, f"environment.yml does not mention {requirement}"

    ci = (ROOT / ".ci" / "run").read_text()
    assert _ci_value(ci, "FLOOR_TORCH") == torch_floor
    assert _ci_value(ci, "FLOOR_TORCHVISION") == vision_floor


def test_floor_is_a_matching_pair_no_newer_than_2_6() -> None:
    requirements = _requirements()
    torch_floor = _floor(requirements["torch"], "torch").split(".")
    vision_floor = _floor(requirements["torchvision"], "torchvision").split(".")
    major, minor, patch = map(int, torch_floor)
    # torch 2.N.P is released with torchvision 0.(N+15).P (2.4.1 with 0.19.1, 2.6.0 with 0.21.0).
    assert major == 2 and list(map(int, vision_floor)) == [0, minor + 15, patch]
    # Many clusters run torch 2.5 to 2.8: the floor must not shut them out.
    assert (major, minor) <= (2, 6)


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
