"""The complete example of docs/testing-routes.rst runs as written, under pytest-xdist, and passes."""

from __future__ import annotations

import re

import pytest

from .support.servers import ROOT

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "testing-routes.rst"


def files_of(text: str) -> dict[str, str]:
    """The ``.. code-block:: python`` blocks of an reST page that carry a ``:caption:``, by caption."""
    found = {}
    pattern = re.compile(
        r"^\.\. code-block:: python\n    :caption: (?P<name>\S+)\n\n(?P<body>(?:(?: {4}.*)?\n)+)", re.M
    )
    for match in pattern.finditer(text):
        lines = match["body"].splitlines()
        found[match["name"]] = "\n".join(line[4:] for line in lines).strip() + "\n"
    return found


def test_the_page_has_the_three_files() -> None:
    """The example is the shop, its conftest and its tests: nothing for the reader to add."""
    assert sorted(files_of(PAGE.read_text("utf-8"))) == ["conftest.py", "shop.py", "test_shop.py"]


def test_the_example_runs_as_written(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, server_url: str
) -> None:
    """pytest -n 2 on the page's three files: every test passes, the planted bug is caught."""
    for name, source in files_of(PAGE.read_text("utf-8")).items():
        pytester.path.joinpath(name).write_text(source, "utf-8")
    monkeypatch.setenv("FLASK_IDEM_TEST_DATABASE_URL", server_url)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=8)


def test_the_shown_failure_is_the_real_one(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, server_url: str
) -> None:
    """Without pytest.raises, the test of POST /gifts fails with the message the page shows."""
    files = files_of(PAGE.read_text("utf-8"))
    files["test_shop.py"] = files["test_shop.py"].replace(
        '    with pytest.raises(NotRetrySafe, match="does the view write outside idem.connection"):\n'
        '        check_replay(app, "POST", "/gifts"',
        '    if True:\n        check_replay(app, "POST", "/gifts"',
    )
    for name, source in files.items():
        pytester.path.joinpath(name).write_text(source, "utf-8")
    monkeypatch.setenv("FLASK_IDEM_TEST_DATABASE_URL", server_url)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "gifts", timeout=300)
    result.assert_outcomes(failed=1)
    shown = PAGE.read_text("utf-8").split("fails with:\n\n.. code-block:: text\n\n", 1)[1].split("\n\n")[0]
    message = " ".join(shown.split())
    assert message in " ".join(result.stdout.str().split())
