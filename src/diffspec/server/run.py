"""Starting the server: `serve` (the CLI, in the foreground) and `ServerThread` (in the background).

`serve_command(args)` is what `diffspec serve` runs: load the engine once, bind the socket
(a port in use is a one-line error), print the URL, then hand the socket to uvicorn, which
stops gracefully on Ctrl-C (requests in flight finish first).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Optional

from ..errors import DiffspecError
from .app import ServerConfig, create_app


def _require_server_packages():
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise DiffspecError(f"diffspec serve needs fastapi and uvicorn ({e.name} is missing): "
                            f"pip install 'diffspec[serve]'") from None
    return uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 = any free port)."""
    if not 0 <= port <= 65535:
        raise DiffspecError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise DiffspecError(f"cannot resolve --host '{host}': {e}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise DiffspecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


def serve(engine, config: ServerConfig, log_level: str = "info", announce: Optional[str] = None,
          sock: Optional[socket.socket] = None) -> None:
    """Serve `engine` on config.host:config.port (or an already bound `sock`) until interrupted."""
    uvicorn = _require_server_packages()
    sock = sock or bind(config.host, config.port)
    app = create_app(engine, config)
    print(f"diffspec serve: {url_of(sock)}/v1 (model '{config.model_name}'; {announce or 'ready'}; "
          f"Ctrl-C stops)", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    server.run(sockets=[sock])


class ServerThread:
    """A live server on 127.0.0.1 in a background thread (tests, notebooks).

        with ServerThread(engine, ServerConfig("tiny")) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, engine, config: ServerConfig, port: int = 0, log_level: str = "warning"):
        uvicorn = _require_server_packages()
        self.app = create_app(engine, config)
        self._sock = bind("127.0.0.1", port)
        self.url = url_of(self._sock)
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="diffspec-serve", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_command(args) -> int:
    """`diffspec serve`: build the engine from the CLI arguments and serve it."""
    from ..api import load_engine

    _require_server_packages()
    if args.max_queue < 0:
        raise DiffspecError(f"--max-queue must be >= 0, got {args.max_queue}")
    from ..cli_options import check_drafter_spec, policy_options

    options = policy_options(args)  # a setting the policy would not read is refused before the model loads
    check_drafter_spec(args.drafter)
    sock = bind(args.host, args.port)  # a port in use fails now, not after the model loaded
    engine = load_engine(args.model, args.drafter, args.policy, dtype=args.dtype, max_context=args.max_context,
                         drafter_dtype=args.drafter_dtype, backend=args.backend, kernels=args.kernels,
                         compile=args.compile,
                         **options)
    config = ServerConfig(model_name=args.served_model_name or engine.target.name, api_key=args.api_key,
                          max_queue=args.max_queue, host=args.host, port=args.port)
    drafter = engine.drafter.describe() if engine.drafter else "none"
    serve(engine, config, log_level=args.log_level,
          announce=f"backend {engine.target.backend}, drafter {drafter}, policy {engine.policy.describe()}, max queue {args.max_queue}"
                   + (", API key required" if args.api_key else ""), sock=sock)
    return 0
