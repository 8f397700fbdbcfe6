"""A hostile MCP server written as raw JSON-RPC lines (no SDK): what the SDK's own servers never write.

``python raw_numbers.py`` serves over stdio one tool, ``measure``, whose answer carries no text, only structured
content holding numbers JSON has no place for (``1e400``, ``NaN``): the client's parser reads them as floats
Kazma's canonical JSON refuses.
"""

from __future__ import annotations

import json
import sys

_ANSWER = '{"content": [], "structuredContent": {"reading": 1e400, "spread": NaN, "unit": "K"}}'


def _send(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main() -> None:
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message:
            continue  # a notification (initialized)
        ident = json.dumps(message["id"])
        method = message.get("method")
        if method == "initialize":
            result = json.dumps(
                {
                    "protocolVersion": message["params"]["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "raw", "version": "1"},
                }
            )
        elif method == "tools/list":
            schema = {"type": "object", "properties": {}}
            result = json.dumps({"tools": [{"name": "measure", "description": "Measures.", "inputSchema": schema}]})
        elif method == "tools/call":
            result = _ANSWER
        else:
            result = "{}"  # ping
        _send(f'{{"jsonrpc": "2.0", "id": {ident}, "result": {result}}}')


if __name__ == "__main__":
    main()
