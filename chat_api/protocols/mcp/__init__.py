"""MCP: a person's chatmem memory as tools for other clients (Claude Desktop, IDE agents, LibreChat).

server.py holds the tools and the HTTP transport at /mcp; `chatmem mcp` (chat_api/cli/mcp.py) serves the
same tools over stdio.
"""
