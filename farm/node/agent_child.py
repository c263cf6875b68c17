"""The agent's forked child, set up to look like a fresh ``python SCRIPT``
(``farm.node.agent``'s docstring lists what it shares with the agent).

Split out of farm.node.agent; the bodies are as they were.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import signal
import sys
import threading
import traceback
import types
from dataclasses import dataclass
from typing import Any, NoReturn

# The warning filters as they were before the agent added its own (the child's).
FRESH_WARNING_FILTERS: list[Any] = []


@dataclass(frozen=True)
class Command:
    script: str | None  # the path as given, or None for -m and -c
    module: str | None
    args: list[str]
    unbuffered: bool
    code: str | None = None  # -c's program


def _streams(unbuffered: bool) -> None:
    # As the interpreter sets them up at start: stdout line-buffered on a tty,
    # stderr always; -u / PYTHONUNBUFFERED: write-through binary layers.
    def text(fd: int, mode: str, *, line: bool, errors: str = "strict") -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        buffered: Any = raw
        if not (unbuffered and mode == "wb"):
            buffered = io.BufferedReader(raw) if mode == "rb" else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding=sys.stdout.encoding, errors=errors,
                                line_buffering=line, write_through=unbuffered)

    sys.stdin = text(0, "rb", line=False)
    sys.stdout = text(1, "wb", line=os.isatty(1))
    sys.stderr = text(2, "wb", line=True, errors="backslashreplace")
    # The originals too (code that restores sys.stdout from them).
    for name in ("stdin", "stdout", "stderr"):
        setattr(sys, f"__{name}__", getattr(sys, name))


def reseed() -> None:
    # A forked child would draw the agent's numbers; a fresh process seeds
    # these from the OS. CUDA's generators are made at CUDA's init, in the child.
    import random

    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()


def fresh_farm() -> None:
    # The farm's process-wide caches, as a fresh process has them: empty (the
    # child's FARM_HOME, CLIENT_CACHE_DIR... are read again on first use).
    settings = sys.modules.get("farm.core.settings")
    if settings is not None:
        settings.get_settings.cache_clear()


def _fresh_warnings() -> None:
    import warnings

    if FRESH_WARNING_FILTERS:
        warnings.filters[:] = FRESH_WARNING_FILTERS  # type: ignore[index]
        warnings._filters_mutated()  # type: ignore[attr-defined]


def _fresh_logging() -> None:
    # `farm agent` ran logging.basicConfig (the CLI does); a fresh interpreter's
    # root logger has no handler and level WARNING. torch's own loggers are
    # as its import left them, in a fresh process too.
    import logging

    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)


def _signals() -> None:
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
    # The interpreter's own choices at start.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _sys_path(cmd: Command, env: dict[str, str], cwd: str, base_path: list[str]) -> list[str]:
    # As the interpreter puts it first: the script's directory, the working
    # directory for -m, and "" (the working directory, as looked up) for -c.
    if cmd.script is not None:
        first = os.path.dirname(os.path.realpath(os.path.join(cwd, cmd.script)))
    else:
        first = "" if cmd.code is not None else cwd
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *[os.path.join(cwd, p) for p in extra], *base_path]


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def child_main(cmd: Command, req: dict[str, Any], fds: list[int], close: list[int],
               base_path: list[str]) -> NoReturn:
    code = 1
    interrupted = False
    try:
        os.setsid()
        for fd in close:
            os.close(fd)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        _signals()
        env = dict(req["env"])
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(env)
        _streams(cmd.unbuffered)
        sys.path[:] = _sys_path(cmd, env, req["cwd"], base_path)
        reseed()
        _fresh_logging()
        _fresh_warnings()
        fresh_farm()
        if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
            import torch  # OpenMP read the variable when the agent loaded it

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        try:
            if cmd.module is not None:
                sys.argv = ["-m", *cmd.args]
                import runpy

                runpy._run_module_as_main(cmd.module, alter_argv=True)  # type: ignore[attr-defined]
            elif cmd.code is not None:
                sys.argv = ["-c", *cmd.args]
                _run_code(cmd.code)
            else:
                assert cmd.script is not None
                sys.argv = [cmd.script, *cmd.args]
                _run_script(cmd.script)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except KeyboardInterrupt:
            _print_exception(cmd.script)
            interrupted = True
            code = 128 + signal.SIGINT
        except BaseException:
            _print_exception(cmd.script)
            code = 1
        # The interpreter's exit: join non-daemon threads, then atexit.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                code = 120
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # the setup itself failed: say so on whatever stderr is
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(1)
    os._exit(code)


def _run_script(script: str) -> None:
    # As `python SCRIPT`: a __main__ module that stays in sys.modules (pickle,
    # atexit handlers and threads that outlive the script's last line see it).
    path = os.path.abspath(script)
    with io.open_code(path) as f:
        source = f.read()
    main = types.ModuleType("__main__")
    # Python 3.9+: the main script's __file__ and code filename are absolute.
    main.__dict__.update({"__file__": path, "__cached__": None, "__builtins__": __builtins__,
                          "__spec__": None, "__loader__": None, "__package__": None})
    sys.modules["__main__"] = main
    exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)


def _run_code(code: str) -> None:
    # As `python -c CODE`: a __main__ without __file__, code named "<string>".
    main = types.ModuleType("__main__")
    main.__dict__.update({"__builtins__": __builtins__, "__spec__": None, "__loader__": None,
                          "__package__": None})
    sys.modules["__main__"] = main
    exec(compile(code, "<string>", "exec", dont_inherit=True), main.__dict__)


def _print_exception(script: str | None) -> None:
    etype, value, tb = sys.exc_info()
    # Leave out the agent's own frames, as a fresh process's traceback would.
    skip = tb
    while skip is not None and skip.tb_frame.f_code.co_filename == __file__:
        skip = skip.tb_next
    if value is not None:
        value = value.with_traceback(skip or tb)
    sys.excepthook(etype, value, skip or tb)  # type: ignore[arg-type]
