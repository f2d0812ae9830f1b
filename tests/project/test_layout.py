"""The house's layout: the top of skyrl_clora/ holds at most 8 modules (the rest live in the packages named for
their role), and tests/ mirrors the package file by file: ``skyrl_clora/<dir>/<name>.py`` is tested in
``tests/<dir>/test_<name>.py`` and ``kernels/<dir>/<name>.py`` in ``tests/kernels/<dir>/test_<name>.py``, so the top
of tests/ holds one test file per top-level module."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTED_TREES = {ROOT / "skyrl_clora": ROOT / "tests", ROOT / "kernels": ROOT / "tests" / "kernels"}


def _top_modules() -> list[str]:
    return sorted(path.stem for path in (ROOT / "skyrl_clora").glob("*.py") if path.name != "__init__.py")


def test_the_top_of_the_package_holds_at_most_8_modules() -> None:
    assert len(_top_modules()) <= 8, _top_modules()


def test_every_module_has_a_test_file_named_for_it() -> None:
    untested = []
    for package, tests in TESTED_TREES.items():
        for module in sorted(package.rglob("*.py")):
            relative = module.relative_to(package)
            if module.name != "__init__.py" and not (tests / relative.parent / f"test_{module.stem}.py").is_file():
                untested.append(str(module.relative_to(ROOT)))
    assert untested == [], f"modules without tests/<dir>/test_<name>.py: {untested}"


def test_the_top_of_tests_holds_one_test_file_per_top_level_module() -> None:
    top = sorted(path.stem.removeprefix("test_") for path in (ROOT / "tests").glob("test_*.py"))
    assert top == _top_modules()
