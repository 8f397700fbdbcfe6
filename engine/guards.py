"""Two declarations the engine's guard tests hold every module to (``tests/test_engine_guards.py``).

:data:`QUIET_HANDLERS` — every ``except`` (and ``contextlib.suppress``) in the
engine that neither re-raises nor logs at WARNING or above, with why staying
quiet loses nothing. A new quiet handler fails the test until it is declared
here with its reason (or made loud).

:data:`UNFENCED_TEXT` — every function that builds text out of worker or tool
output (``.output``, ``.error``, summaries, handoff notes) outside the fence,
with why that text never reaches a model: it goes to people, to a log or to the
task's record. Text that does reach a model is built from
:class:`~kazma.engine.fence.Fenced` values, which only the fence makes.

Keys are ``<file under engine/>:<function>:<exception>`` and ``<file>:<function>``.
"""

from __future__ import annotations

from collections.abc import Mapping

_ANSWERED = "the failure is answered to the caller (a model or a person) as a result it can act on"
_TOOL_RESULT = "the tool call's failure becomes its ToolResult, which the model reads and the record keeps"
_PARSE = "an unparsable value from outside is one of the inputs this function exists to sort out"
_CANCELLED = "waiting for a task this code itself cancelled: its cancellation is the expected end"

QUIET_HANDLERS: Mapping[str, str] = {
    "swarm/owners.py:_boot_id:OSError": "no boot id to read (not Linux): owners are told apart by host and pid alone",
    "swarm/owners.py:_started:OSError": "no such process: the answer is that it is gone",
    "swarm/owners.py:held_by_a_terminal:ValueError": "a replica's name, not a terminal's: judged as a replica is",
    "tools/http_get.py:HttpGetTool._result:zlib.error": "the model is told the body could not be decoded (the result)",
    "attachments.py:_write_new:FileExistsError": "a file of that name is there: the next free name is tried",
    "conversation.py:Conversations.working.keep_showing:suppress(Exception)": "the typing sign is a courtesy: a "
    "platform that cannot show it is told again in a few seconds, and the turn goes on",
    "conversation.py:Conversations.working:suppress(asyncio.CancelledError)": _CANCELLED,
    "conversation.py:Conversations._save_files:FileTooLarge": "the sender is told the bound in the chat",
    "tools/mcp_tools.py:MCPConnection.call:TimeoutError": "_fail logs the timeout and restarts the server; the call's "
    "result says it may have acted",
    "tools/mcp_tools.py:MCPConnection.call:Exception": "_fail logs the failure and restarts the server; a protocol "
    "error is the call's own failed result",
    "model.py:_retry_after_seconds:ValueError": _PARSE,
    "model.py:_retry_after_seconds:(TypeError, ValueError)": _PARSE,
    "model.py:_server_message:(ValueError, RecursionError)": _PARSE,
    "model.py:_parse_arguments:RecursionError": _PARSE,
    "model.py:_parse_arguments:json.JSONDecodeError": _PARSE,
    "model_router.py:ModelRouter.aclose:suppress(Exception)": "closing idle HTTP clients at shutdown: nothing is "
    "left to lose",
    "tools/netguard.py:_literal:ValueError": _PARSE,
    "tools/netguard.py:_fib_local:suppress(ValueError)": _PARSE,
    "tools/netguard.py:_if_inet6:suppress(ValueError)": _PARSE,
    "tools/netguard.py:_read:OSError": "a /proc file this host does not have: the next source of its addresses is used",
    "tools/netguard.py:_read_host_networks:suppress(OSError)": "the host's own name does not resolve: the addresses "
    "read so far are what the policy knows (loopback and the private ranges are refused anyway)",
    "tools/netguard.py:_read_host_networks:suppress(ValueError)": _PARSE,
    "tools/mcp_launch.py:_interpreter:OSError": "an unreadable #! line names no interpreter: the launch is judged by "
    "the command itself",
    "tools/mcp_launch.py:_venv_home:OSError": "no readable pyvenv.cfg: not a virtualenv, nothing more to bind",
    "tools/mcp_stdio.py:Envelope.request_id:ValueError": _PARSE,
    "tools/mcp_stdio.py:_key_name:ValueError": _PARSE,
    "tools/mcp_stdio.py:_matched_as:suppress(ValueError)": _PARSE,
    "tools/mcp_stdio.py:_stop:suppress(OSError, anyio.ClosedResourceError, anyio.BrokenResourceError)": "closing the "
    "stdin of a server that has already gone: stopping it goes on",
    "tools/mcp_stdio.py:_stop:suppress(ProcessLookupError, PermissionError)": "the server's process group is already "
    "gone",
    "tools/mcp_stdio.py:_stop:suppress(OSError)": "closing the pipes of a server that has exited (a server that will "
    "not exit is logged, mcp.server_unkillable)",
    "tools/mcp_stdio.py:bounded_stdio_client.read_stdout:anyio.EndOfStream": "the server closed its stdout: the "
    "session sees the stream end",
    "tools/mcp_stdio.py:bounded_stdio_client.read_stdout:suppress(anyio.ClosedResourceError, "
    "anyio.BrokenResourceError, OSError)": "the pipe or the session's stream closed: the session sees the stream "
    "end and the connection's own checks report the server",
    "tools/mcp_stdio.py:bounded_stdio_client.read_stderr:suppress(anyio.EndOfStream, anyio.ClosedResourceError, "
    "anyio.BrokenResourceError, OSError)": "stderr is only kept as a bounded tail for error messages: its end is "
    "the server's end",
    "tools/mcp_stdio.py:bounded_stdio_client.write_stdin:(anyio.ClosedResourceError, anyio.BrokenResourceError, "
    "OSError)": (
        "the server stopped reading: the session's stream is closed so a waiting call ends instead of hanging"
    ),
    "plan_store.py:PlanStore.replace_pending:_StartedMeanwhile": "rolls the replacement back and answers False: "
    "the lead is told a step started meanwhile",
    "plan_tools.py:lead_plan_tools.write_plan:ValidationError": _ANSWERED,
    "plan_tools.py:lead_plan_tools.write_plan:PlanError": _ANSWERED,
    "plan_tools.py:_repair:ValidationError": _ANSWERED,
    "plan_tools.py:_repair:RepairRefused": _ANSWERED,
    "plan_tools.py:ask_user_tool.ask_user:ValidationError": _ANSWERED,
    "plan_tools.py:ask_user_tool.ask_user:RepairRefused": _ANSWERED,
    "tools/sandbox.py:_probe:subprocess.TimeoutExpired": "the probe's problem is the sandbox's answer, reported by "
    "whoever resolves the sandbox (refused, or said on every card)",
    "tools/sandbox.py:_probe:OSError": "the probe's problem is the sandbox's answer, reported by whoever resolves it",
    "tools/send_file.py:SendFileTool.run:PathRefused": _TOOL_RESULT,
    "swarm/calls.py:WorkerCalls.call:LimitExceeded": "the call fails with the limit named; the task's result says so",
    "swarm/commands.py:SwarmCommands.run:GrammarError": _ANSWERED,
    "swarm/grammar.py:_split_route:AddressError": "words after '->' that are no address are the task's own text: "
    "no route is taken and nothing is dropped",
    "swarm/commands.py:SwarmCommands.run:SwarmRefused": _ANSWERED,
    "swarm/lead_tools.py:swarm_tools.dispatch:ValidationError": _ANSWERED,
    "swarm/lead_tools.py:swarm_tools.dispatch:SwarmRefused": _ANSWERED,
    "swarm/lead_tools.py:swarm_tools.check:ValidationError": _ANSWERED,
    "swarm/lead_tools.py:swarm_tools.check:StoreUnavailable": "the store already logged and counted it; the lead "
    "is told to check again",
    "swarm/reliability.py:RetryPolicy.run:Exception": "an attempt's exception becomes a failed result the policy "
    "retries or returns; each retry is logged (swarm.retry) and the call's record keeps the error",
    "swarm/reliability.py:OutputValidator.validate:pydantic.ValidationError": "validation's answer is the reason",
    "swarm/reliability.py:OutputValidator.validate:ValueError": "validation's answer is the reason",
    "swarm/service.py:CoalescingReporter.close:suppress(asyncio.CancelledError)": _CANCELLED,
    "swarm/checkpoints.py:Checkpoints.wait:suppress(UnknownTask)": "the task was pruned while it "
    "waited: there is nothing left to cancel",
    "swarm/checkpoints.py:Checkpoints._resume_when_room:(IllegalTransition, UnknownTask)": "the paused task was "
    "cancelled while its approval waited for room: nothing resumes, as its canceller was told",
    "swarm/checkpoints.py:Checkpoints._resume_when_room:AtCapacity": "the approved task waits for room and says so "
    "in the progress reports; the capacity check is the design's, not a failure",
    "swarm/workers.py:handoff_tool.handle:ValidationError": _ANSWERED,
    "agent.py:AgentRunner._call:OSError": _TOOL_RESULT + " (it could not start: it did not run)",
    "agent.py:AgentRunner._call:UnrenderableArguments": _ANSWERED
    + " (arguments no card or record can hold: it did not run)",
    "agent.py:AgentRunner._call:InvalidArguments": _ANSWERED
    + " (arguments its tool refuses, before any card: it did not run; logged at INFO, the model's mistake)",
    "agent.py:AgentRunner._may_have_run:ValueError": "arguments nothing can hash are refused by the policy anyway",
    "swarm/checkpoints.py:Checkpoints._open_paused:_NotPaused": "cancelled meanwhile: nothing was opened, and the "
    "canceller ends the task and says so",
    "swarm/checkpoints.py:Checkpoints._open_paused:Exception": "no gate, no pause: _gate_failed logs and counts it, "
    "ends the task saying why and reports it",
    "swarm/checkpoints.py:Checkpoints._open_then_pause:Exception": "no gate, no pause: _gate_failed logs and counts "
    "it, ends the task saying why and reports it",
    "swarm/patterns.py:_with_handoffs:ModelError": "the handoff's target fails as a transient worker result with the "
    "error; the task's result says so",
    "swarm/service.py:SwarmService.submit:suppress(StoreUnavailable)": "the store already refused the start: the "
    "caller is told it was not started, and a row it left running is ended at the next start",
    "tools/registry.py:ToolRegistry.execute:(TypeError, ValueError)": "invalid arguments are answered to the model "
    "(and logged at INFO: the model's mistake, not Kazma's)",
    "tools/shell.py:_kill_group:suppress(ProcessLookupError, PermissionError)": "the process group is already gone",
    "tools/shell.py:ShellTool._stop:suppress(ProcessLookupError)": "the process is already gone",
    "tools/shell.py:ShellTool.run:PathRefused": _TOOL_RESULT,
    "tools/shell.py:ShellTool.run:suppress(OSError)": "cleaning up a temporary file the command may have removed",
    "tools/shell.py:ShellTool.run:OSError": _TOOL_RESULT,
    "tools/shell.py:ShellTool._signal_note:suppress(ValueError)": _PARSE,
    "tools/workspace.py:_workspace_root:FileNotFoundError": "a missing workspace is created",
    "tools/workspace.py:_open_parent:suppress(FileExistsError)": "the folder is there already",
    "tools/files.py:ReadFileTool._read:PathRefused": _TOOL_RESULT,
    "tools/files.py:ReadFileTool._read:FileNotFoundError": _TOOL_RESULT,
    "tools/files.py:ReadFileTool._read:UnicodeDecodeError": _TOOL_RESULT,
    "tools/files.py:WriteFileTool._write:PathRefused": _TOOL_RESULT,
    "tools/files.py:WriteFileTool._write:FileNotFoundError": _TOOL_RESULT,
    "tools/files.py:ReadFileTool._read:OSError": _TOOL_RESULT + " (a path it cannot open: a socket, a name too long)",
    "tools/files.py:WriteFileTool._write:OSError": _TOOL_RESULT + " (a path it cannot write: a name too long, no room)",
    "tools/files.py:WriteFileTool._write:suppress(OSError)": "removing the temporary file after a failed write, which "
    "the write's result reports",
    "tools/http_get.py:HttpGetTool.run:httpx.InvalidURL": _TOOL_RESULT,
    "tools/http_get.py:HttpGetTool.run:(TimeoutError, httpx.TimeoutException)": _TOOL_RESULT,
    "tools/http_get.py:HttpGetTool.run:(AddressRefused, _FetchFailed)": _TOOL_RESULT,
    "tools/http_get.py:HttpGetTool.run:httpx.HTTPError": _TOOL_RESULT,
    "tools/http_get.py:HttpGetTool._connect:httpx.ConnectError": "the next resolved address is tried; the last failure "
    "is the tool's result",
    "tools/http_get.py:HttpGetTool._result:LookupError": "an unknown charset is read as UTF-8 with replacements, "
    "marked",
    "transcript.py:TranscriptStore._tell:asyncio.QueueFull": "a stalled page loses live updates, not the record "
    "(the transcript is stored); it reloads",
}

_PEOPLE = "posted to people (for_humans turns fences into labels), never sent to a model"
_RECORD = "the task's stored result or error; check_swarm_task fences it wherever it reaches the lead"

UNFENCED_TEXT: Mapping[str, str] = {
    "agent.py:AgentRunner._call": "the model's own call (its name, its arguments' parse error) answered to the same "
    "model; a tool's output and error are fenced as one block before the reply",
    "conversation.py:Conversations._post_result": _PEOPLE,
    "conversation.py:Conversations._lead_says": _PEOPLE,
    "executor.py:PlanExecutor.describe": "/plan's view (a step's failure, or why a pending step runs again), to the "
    "person who asked for it in the chat or the console: " + _PEOPLE,
    "executor.py:PlanExecutor._record": "the notice that a step failed for a passing reason and runs again, "
    "with its error as the sub-agent's own failure line said it: " + _PEOPLE,
    "swarm/commands.py:_describe": _PEOPLE,
    "swarm/commands.py:call_line": _PEOPLE,
    "swarm/commands.py:_retry_risk": "the second ask before /swarm retry, to the person who typed it: " + _PEOPLE,
    "swarm/grammar.py:help_text": "the grammar's own usage summaries, written by Kazma",
    "swarm/patterns.py:_labelled": _RECORD,
    "swarm/patterns.py:_metadata": _RECORD,
    "swarm/patterns.py:_merged": _RECORD,
    "swarm/patterns.py:_handover": "the parts are fenced as one block on the next line, before the target sees them",
    "swarm/patterns.py:routed": _RECORD,
    "swarm/patterns.py:pipeline": _RECORD,
    "swarm/reliability.py:run_with_fallback": _RECORD,
    "swarm/calls.py:WorkerCalls._recorded": "a failed worker's error with Kazma's own list of the tools it started: "
    + _RECORD,
    "swarm/endings.py:Unsaved.over": "a task's error with Kazma's note that its ending is kept until the store "
    "answers: " + _RECORD,
    "swarm/checkpoints.py:Checkpoints.wait": _PEOPLE,
    "swarm/service.py:SwarmService._how_ended": "how the task's row says it was ended, for the progress lines of "
    "a run that finished after that; " + _PEOPLE,
}
