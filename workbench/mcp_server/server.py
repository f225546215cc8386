"""The MCP layer: publish the Workbench tools on the official SDK's MCPServer, over stdio or streamable HTTP."""
from __future__ import annotations

import inspect
import logging
import sys
import threading
import typing
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceNotFoundError, ToolError, UnexpectedToolError
from pydantic import ValidationError

from workbench.errors import WorkbenchError, clip, shorten
from workbench.files import reads_within
from workbench.kernels import numerics
from workbench.mcp_server.state import Limits
from workbench.mcp_server.tools import TOOLS, Call, Workbench

INSTRUCTIONS = """\
Mechanistic interpretability on a local LLM. Start with model_info and list_hook_points; `run` a prompt with
record=[...] to keep activations in a server-side trace (ids like trace-1a2b3c4d), then read slices with
get_activation, look at attention_pattern / logit_lens, edit with ablate / steer / patch / run_with_interventions
(each returns baseline vs edited next-token distributions), and save_trace / replay_trace to keep results.
Objects live in this session only and are released when it ends."""

SESSION_HEADER = "mcp-session-id"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SWEEP_SECONDS = 60.0
MAX_ERROR_CHARS = 2000  # an error message never carries a request's bulk back

logger = logging.getLogger(__name__)


def session_key(ctx: Context) -> str:
    """Whose objects a request sees: the HTTP session id, or the one client of a stdio server."""
    headers = ctx.headers
    if headers is None:
        return "stdio"
    # requests without a session (stateless HTTP, 2026 envelopes) share one scope, reachable only by random ids
    return headers.get(SESSION_HEADER) or "stateless"


async def call_in_thread(bench: Workbench, key: str, method: Callable, arguments: dict[str, Any]) -> Any:
    """Run a tool on a worker thread under the model lock, in its session's numerics (for this call and thread only);
    a client's cancel stops it at the next step. The session is busy from the request's arrival to its answer, so the
    idle sweep never releases it under a call."""
    cancelled = threading.Event()

    with bench.sessions.using(key) as session:
        def work() -> Any:
            with numerics(session.numerics), bench.lock, reads_within(bench.artifacts.root):
                call = Call(session, cancelled)
                call.check()  # cancelled while waiting for the lock
                return method(call, **arguments)

        try:
            return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise
        except (WorkbenchError, ValueError) as err:  # the user's mistake: its message goes back as the tool error
            raise ToolError(clip(str(err), MAX_ERROR_CHARS)) from err
        except Exception as err:  # a bug, not the user's mistake: still one line with a reason, the traceback logged
            logger.exception("tool %s failed", getattr(method, "__name__", method))
            raise ToolError(f"internal error ({type(err).__name__}): {clip(str(err), 200)}") from err


class WorkbenchServer(MCPServer):
    """The SDK's server, with tools that refuse an argument they do not take (a misspelt ``positons`` would otherwise
    be dropped and its default used) and say in one line why an argument is bad."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arguments: dict[str, set[str]] = {}  # tool -> the arguments it takes

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        known = self.arguments.get(name)
        unknown = sorted(set(arguments or {}) - known) if known is not None else []
        if unknown:
            raise ToolError(f"Error executing tool {name}: no argument {shorten(unknown[0])}; it takes "
                            f"{', '.join(sorted(known)) or 'none'}")
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as err:
            if isinstance(err, UnexpectedToolError) or not isinstance(err.__cause__, ValidationError):
                raise
            raise ToolError(f"Error executing tool {name}: {_one_line(err.__cause__)}") from err.__cause__

    async def list_tools(self) -> list[Any]:
        tools = await super().list_tools()
        for listed in tools:
            if listed.name in self.arguments:
                listed.input_schema = {**listed.input_schema, "additionalProperties": False}
        return tools


def _one_line(error: ValidationError) -> str:
    """A validation error as 'field: reason' parts on one line (no input echoed, no documentation links)."""
    problems = error.errors(include_url=False, include_input=False)
    parts = [f"{'.'.join(str(part) for part in problem['loc']) or 'arguments'}: {clip(problem['msg'], 120)}"
             for problem in problems[:3]]
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(parts).replace("\n", " ") + more


def _publish(server: WorkbenchServer, bench: Workbench, name: str) -> None:
    """Add one Workbench method as a tool: its signature minus ``call`` is the input schema."""
    method = getattr(bench, name)
    hints = typing.get_type_hints(method, include_extras=True)
    params = [p.replace(annotation=hints[p.name]) for p in list(inspect.signature(method).parameters.values())[1:]]

    async def handler(ctx: Context, **arguments: Any) -> Any:
        return await call_in_thread(bench, session_key(ctx), method, arguments)

    ctx_param = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=Context)
    handler.__signature__ = inspect.Signature([*params, ctx_param], return_annotation=hints["return"])
    handler.__annotations__ = {**{p.name: p.annotation for p in params}, "ctx": Context, "return": hints["return"]}
    handler.__name__ = name
    server.add_tool(handler, name=name, description=inspect.getdoc(method))
    server.arguments[name] = {p.name for p in params}


def build_server(bench: Workbench) -> WorkbenchServer:
    """An MCPServer with every workbench tool and the session traces as resources."""

    @asynccontextmanager
    async def lifespan(_: MCPServer) -> AsyncIterator[dict]:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_expire_idle_sessions, bench)
            yield {}
            tasks.cancel_scope.cancel()

    server = WorkbenchServer("workbench", instructions=INSTRUCTIONS, lifespan=lifespan, log_level="WARNING")
    for name in TOOLS:
        _publish(server, bench, name)

    @server.resource("trace://{trace_id}", name="trace", mime_type="application/json",
                     description="A trace of this session: prompt, tokens, next-token top-5, interventions, "
                                 "recorded hooks")
    async def read_trace(trace_id: str, ctx: Context) -> str:
        key = session_key(ctx)

        def summary(call: Call) -> str:
            return bench.trace_summary(call, trace_id).model_dump_json()

        try:
            return await call_in_thread(bench, key, summary, {})
        except ToolError as err:
            raise ResourceNotFoundError(str(err)) from err

    return server


async def _expire_idle_sessions(bench: Workbench) -> None:
    while True:
        await anyio.sleep(min(SWEEP_SECONDS, bench.limits.idle_seconds))
        for key in bench.sessions.expire_idle():
            logger.info("released idle session %s", key)


def http_app(server: MCPServer, bench: Workbench, host: str = "127.0.0.1"):
    """The streamable HTTP ASGI app; a client's DELETE (session end) releases its objects at once."""
    app = server.streamable_http_app(host=host, session_idle_timeout=bench.limits.idle_seconds)

    async def releasing(scope, receive, send):
        await app(scope, receive, send)
        if scope["type"] == "http" and scope["method"] == "DELETE":
            session_id = dict(scope["headers"]).get(SESSION_HEADER.encode())
            if session_id and bench.sessions.release(session_id.decode()):
                logger.info("released session %s on disconnect", session_id.decode())

    return releasing


def serve(model: str | None = None, artifacts: str = "artifacts", http: bool = False, host: str = "127.0.0.1",
          port: int = 8000, device: str | None = None, dtype: str | None = None, limits: Limits = Limits(),
          quantize: str | None = None, devices: list[str] | None = None) -> None:
    """Load the model (quantized on load as ``quantize`` says; split over ``devices`` when given), then serve until the client goes away (stdio) or the
    process is stopped (HTTP)."""
    import workbench

    loaded = workbench.load(model, device=device, dtype=dtype, quantize=quantize, devices=devices)
    bench = Workbench(loaded, artifacts, limits, loader=lambda path, quantize: workbench.load(
        path, device=device, dtype=dtype, quantize=quantize, devices=devices))
    server = build_server(bench)
    print(f"workbench mcp: {loaded!r}, artifacts in {bench.artifacts.root}", file=sys.stderr)
    if not http:
        anyio.run(server.run_stdio_async)
        return
    import uvicorn

    print(f"workbench mcp: streamable HTTP on http://{host}:{port}/mcp", file=sys.stderr)
    if host not in LOOPBACK:
        print(f"workbench mcp: warning: {host} is not a loopback address; anyone who can reach it can run tools "
              "(there is no authentication)", file=sys.stderr)
    uvicorn.run(http_app(server, bench, host), host=host, port=port, log_level="warning")
