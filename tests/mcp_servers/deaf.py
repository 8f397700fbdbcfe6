"""A raw JSON-RPC MCP server (no SDK) that never answers a ping.

``python deaf.py`` serves over stdio: it answers initialize and lists no tools; a ping stays unanswered, so a
client's ping is in flight for as long as a test needs it to be.
"""

from __future__ import annotations

import json
import sys


def _answer(ident: object, result: dict[str, object]) -> None:
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": ident, "result": result}) + "\n")
    sys.stdout.flush()


def main() -> None:
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message:
            continue  # a notification (initialized, cancelled)
        method = message.get("method")
        if method == "initialize":
            info = {"name": "deaf", "version": "1"}
            version = message["params"]["protocolVersion"]
            _answer(message["id"], {"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": info})
        elif method == "tools/list":
            _answer(message["id"], {"tools": []})
        elif method != "ping":
            _answer(message["id"], {})


if __name__ == "__main__":
    main()
