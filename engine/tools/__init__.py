"""``kazma.engine.tools``: what agents call, and how a call is confined.

- ``registry``: :class:`Tool`, its arguments and outcome, and the registry that validates and runs calls;
  ``workspace``: where a call runs (:class:`ToolContext`) and how paths stay inside it.
- The built-in tools (``builtin`` puts them in one registry): ``shell`` (in the bubblewrap ``sandbox``),
  ``files`` (``read_file``, ``write_file``), ``http_get`` (its address policy: ``netguard``), and
  ``send_file`` (a file from the workspace posted into the chat).
- Tools from MCP servers: ``mcp_tools`` (the connection and its tools), ``mcp_launch`` (how a stdio server
  starts in the sandbox), ``mcp_stdio`` and ``mcp_http`` (its bounded transports).

Whether a call may run at all (approval) is decided before the registry runs it, by the safety policy.
"""
