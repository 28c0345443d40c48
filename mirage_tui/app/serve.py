"""``mirage-tui --attach SESSION --serve [HOST:]PORT``: the attached console in a browser (textual-serve).

Each browser connection starts its own attached console (``mirage-tui --attach
SESSION``) under textual-serve. Every request must carry the session's token:
the page as ``/?token=...`` (the URL printed at start), which sets an HttpOnly,
SameSite=Strict cookie that the page's websocket then presents; a request
without either gets 403. Only the session's owner can read the token (it lives
in the 0700 run directory), so only they can open the console. Loopback unless
a host is named; plain HTTP, so name a host only on a network you trust (or put
a TLS proxy in front).
"""

from __future__ import annotations

import hmac
import os
import shlex
import sys

from mirage_tui.config.topology import UsageError
from mirage_tui.session.registry import SessionEntry

COOKIE = "mirage_token"


def parse_address(text: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` (``[::1]:PORT`` too) -> (host, port); loopback when no host is named."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host = "127.0.0.1"
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--serve takes [HOST:]PORT with PORT 1-65535, e.g. 8000 or 0.0.0.0:8000; got {text!r}")
    return host, int(port)


def read_token(entry: SessionEntry) -> str:
    """The session's token (only its owner can read it); :class:`UsageError` once the session is over."""
    try:
        with open(os.path.join(entry.run_dir, "token"), encoding="ascii") as f:
            return f.read().strip()
    except OSError as e:
        raise UsageError(f"cannot read session {entry.session}'s token: {e.strerror} (has it ended?)") from None


def serve(entry: SessionEntry, address: str, theme: str) -> int:
    """Serve the attached console of ``entry`` on ``address`` until interrupted."""
    try:
        from aiohttp import web
        from textual_serve.server import Server
    except ImportError:
        raise UsageError("--serve needs textual-serve: pip install textual-serve") from None
    host, port = parse_address(address)
    token = read_token(entry)

    @web.middleware
    async def require_token(request, handler):
        given = request.query.get("token") or request.cookies.get(COOKIE) or ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            return web.Response(status=403, text="mirage: this console needs the session's token: open the URL "
                                                  "mirage-tui printed (…/?token=...)\n")
        response = await handler(request)
        if request.query.get("token"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        return response

    class TokenServer(Server):
        async def _make_app(self):
            app = await super()._make_app()
            app.middlewares.append(require_token)
            return app

    tui = os.path.join(os.path.dirname(sys.executable), "mirage-tui")  # this install's, found without PATH
    command = shlex.join([tui, "--attach", entry.run_dir, "--theme", theme])
    url_host = f"[{host}]" if ":" in host else host
    print(f"mirage-tui: serving session {entry.session} at http://{url_host}:{port}/?token={token} "
          f"(Ctrl-C stops serving; the run goes on)", file=sys.stderr, flush=True)
    TokenServer(command, host=host, port=port, title=f"mirage: session {entry.session}").serve()
    return 0
