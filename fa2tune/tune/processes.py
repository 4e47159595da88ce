"""Where a tune's helper processes come from: forked from a server that imported torch, triton and fa2tune once.

A tune runs one worker process per GPU and a pool of compile processes per worker. Started with "spawn", each
of them would import torch itself, and on the 2×H200 host `import torch` takes ~5 s of CPU: a worker would wait for
its own import and then for its pool's (32 processes importing at once take 5-7 s each), 12-14 s before its first
trial. Here they are forked instead, at no import cost:

- The workers, and the compile pool of a tune in the main process, come from multiprocessing's fork server with
  fa2tune.tune.workers preloaded (so torch, triton, optuna and every module a worker runs). The server is a fresh
  interpreter that never touches CUDA, so its children may use CUDA; `start_early()`, called by `fa2tune tune`
  before this process imports torch, has it importing while this process does the same.
- A worker forks its own compile pool first thing, before it touches CUDA (`fork_context`): its children then
  start with everything imported and create only their CUDA contexts.

CUDA forbids a child forked after its parent initialized CUDA from using it, so fork is only for a process that
has not (a worker at its start); anything else uses the server. Platforms without fork use spawn.

A forked child has the environment of the process it was forked from, the server's being the one it started
with; a spawned child has its parent's at its start. So children `adopt` the environment their parent passes
them, and a server whose imports ran under another TRITON_INTERPRET (read when triton is imported) is not used.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

# What the fork server imports before its first fork: workers imports torch, triton, optuna, the templates'
# renderer and every fa2tune module a worker or a compile process runs.
PRELOAD = ["fa2tune.tune.workers"]
# Read when triton or fa2tune is imported: a child forked from a server started with another value is wrong.
_READ_AT_IMPORT = ("TRITON_INTERPRET",)
_server_environment: dict[str, str] | None = None  # os.environ when this module started the server


def _forking() -> bool:
    return sys.platform == "linux"


def context():
    """The multiprocessing context for a tune's workers and a CUDA-using process's compile pool: the fork server
    (started now with PRELOAD if it is not running), or spawn where there is no fork."""
    global _server_environment
    if not _forking():
        return mp.get_context("spawn")
    if _server_environment is not None and any(
        _server_environment.get(name) != os.environ.get(name) for name in _READ_AT_IMPORT
    ):
        return mp.get_context("spawn")  # the server imported triton in the other mode
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs: it was started with PRELOAD already
    if _server_environment is None:
        _server_environment = dict(os.environ)
    forkserver.ensure_running()
    return ctx


def start_early() -> None:
    """Starts the fork server and its imports now, in the background; call before importing torch, so the two
    imports overlap. Later context() calls find it running."""
    context()


def fork_context():
    """The context for a compile pool forked from this process, which must not have initialized CUDA (a tune's
    worker at its start); spawn where there is no fork."""
    return mp.get_context("fork" if _forking() else "spawn")


def adopt(environment: dict[str, str]) -> None:
    """Makes this (child) process's environment its parent's, as passed at its start (see the module's text)."""
    if environment != os.environ:
        os.environ.clear()
        os.environ.update(environment)
