"""One HTML escape for everything the console and the web door write: ``kazma.adapters.web.render.e``.

Four copies once differed (one wrote ``None`` for a missing value, the others nothing); a fifth would drift
the same way. Telegram's renderer escapes for Telegram's own HTML subset and is not the console's.
"""

from __future__ import annotations

import re
from pathlib import Path

from kazma.adapters.web.render import e
from kazma.bot.console import charts, pages, swarm_views, times

REPO = Path(__file__).resolve().parent.parent
_ESCAPING = re.compile(r"\bhtml\.escape\(|^def _?e\(|^def _?esc\w*\(", re.MULTILINE)


def test_the_console_and_the_web_door_escape_html_in_one_place() -> None:
    found = sorted(
        str(path.relative_to(REPO))
        for folder in ("bot", "adapters/web")
        for path in (REPO / folder).rglob("*.py")
        if _ESCAPING.search(path.read_text(encoding="utf-8"))
    )
    assert found == ["adapters/web/render.py"]
    for module in (pages, charts, swarm_views, times):
        assert module.e is e, module.__name__


def test_the_one_escape_covers_text_and_attributes() -> None:
    assert e("""<a href="x" title='y'>&</a>""") == "&lt;a href=&quot;x&quot; title=&#x27;y&#x27;&gt;&amp;&lt;/a&gt;"
    assert e(None) == ""
    assert e(0) == "0"
