"""A hostile MCP server written as raw JSON-RPC lines (no SDK): it answers one ping with a line over the bound.

``python big_pong.py`` serves over stdio two tools. ``arm`` is answered at once, and from then on the next ping is
answered by one line of about 200 kB (its ``id`` first, so the reader knows which request it answers) and every ping
after it briefly. ``after_pings`` is answered (``pings N``, the pings seen since arming) only once a ping after the
long answer has come: so on a connection that lives on past that answer.
"""

from __future__ import annotations

import json
import sys


def _send(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _answer(ident: str, result: str) -> None:
    _send(f'{{"jsonrpc": "2.0", "id": {ident}, "result": {result}}}')


def _text(text: str) -> str:
    return json.dumps({"content": [{"type": "text", "text": text}]})


def main() -> None:
    armed = False
    pings = 0  # since arming
    waiting: str | None = None  # an after_pings call not answered yet
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message:
            continue  # a notification (initialized, cancelled)
        ident = json.dumps(message["id"])
        method = message.get("method")
        if method == "initialize":
            info = {"name": "big_pong", "version": "1"}
            version = message["params"]["protocolVersion"]
            _answer(ident, json.dumps({"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": info}))
        elif method == "tools/list":
            schema = {"type": "object", "properties": {}}
            tools = [{"name": name, "description": name, "inputSchema": schema} for name in ("arm", "after_pings")]
            _answer(ident, json.dumps({"tools": tools}))
        elif method == "tools/call" and message["params"]["name"] == "arm":
            armed = True
            _answer(ident, _text("armed"))
        elif method == "tools/call":
            waiting = ident
        elif method == "ping" and armed:
            pings += 1
            _answer(ident, json.dumps({"pong": "x" * 200_000}) if pings == 1 else "{}")
            if pings > 1 and waiting is not None:
                _answer(waiting, _text(f"pings {pings}"))
                waiting = None
        else:
            _answer(ident, "{}")  # a ping before arming


if __name__ == "__main__":
    main()
