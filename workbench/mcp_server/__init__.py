"""The MCP server: every workbench operation as a tool for agents (``workbench mcp``, ``workbench mcp --http``)."""
from workbench.mcp_server.server import build_server, http_app, serve
from workbench.mcp_server.state import Limits
from workbench.mcp_server.tools import TOOLS, Workbench

__all__ = ["Workbench", "Limits", "TOOLS", "build_server", "http_app", "serve"]
