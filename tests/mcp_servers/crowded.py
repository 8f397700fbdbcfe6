"""A hostile MCP server written as raw JSON-RPC lines (no SDK): an answer over the bound whose id cannot be read.

``python crowded.py`` serves over stdio three tools. ``hold`` is never answered; ``crowded`` is answered (once a
``hold`` call has come, so that one is in flight meanwhile) by one line of about 200 kB whose ``id`` comes after
70 top-level members (more than any JSON-RPC message has, so a reader of the bounded kind gives up before reaching
it); ``small`` is answered at once, briefly.
"""

from __future__ import annotations

import json
import sys


def _send(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _answer(ident: str, result: str) -> None:
    _send(f'{{"jsonrpc": "2.0", "id": {ident}, "result": {result}}}')


def _crowded(ident: str) -> None:
    members = "".join(f'"m{n}": {n}, ' for n in range(70))
    text = json.dumps({"content": [{"type": "text", "text": "x" * 200_000}]})
    _send(f'{{"jsonrpc": "2.0", {members}"result": {text}, "id": {ident}}}')


def main() -> None:
    held = False
    waiting: str | None = None  # a crowded call that came before any hold call
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message:
            continue  # a notification (initialized, cancelled)
        ident = json.dumps(message["id"])
        method = message.get("method")
        if method == "initialize":
            info = {"name": "crowded", "version": "1"}
            version = message["params"]["protocolVersion"]
            _answer(ident, json.dumps({"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": info}))
        elif method == "tools/list":
            schema = {"type": "object", "properties": {}}
            tools = [
                {"name": name, "description": name, "inputSchema": schema} for name in ("hold", "crowded", "small")
            ]
            _answer(ident, json.dumps({"tools": tools}))
        elif method == "tools/call" and message["params"]["name"] == "hold":
            held = True
            if waiting is not None:
                _crowded(waiting)
                waiting = None
        elif method == "tools/call" and message["params"]["name"] == "crowded":
            if held:
                _crowded(ident)
            else:
                waiting = ident
        elif method == "tools/call":
            _answer(ident, json.dumps({"content": [{"type": "text", "text": "small"}]}))
        else:
            _answer(ident, "{}")  # ping


if __name__ == "__main__":
    main()
