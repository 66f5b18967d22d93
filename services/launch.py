"""Starts every process of a mesh config, waits until all are healthy, restarts one that dies or wedges, stops
them all on Ctrl-C.

    python -m services.launch --config configs/local.yaml [--demo]
"""

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.runtime.config import REPO_ROOT, MeshConfig, load_config, write_overridden
from services.runtime.probe import stage_serving
from services.runtime.shm import clean_stale_pools

log = logging.getLogger("launch")

RESTART_BACKOFF_S = 0.5  # the first restart of a dead stage: soon, as a crash is usually one bad moment
RESTART_BACKOFF_MAX_S = 16.0  # the backoff doubles per death up to this: a crash loop must not hog the host
MAX_RESTARTS = 5  # restarts within RESTART_WINDOW_S; one more death and the stage is broken, left down
RESTART_WINDOW_S = 600.0  # long enough to span a few GPU stage loads (minutes each)
UNHEALTHY_S = 60.0  # a served stage NOT_SERVING (or silent) this long is wedged: killed and started again
HEALTH_EVERY_S = 2.0  # how often a running stage's health is asked: cheap, yet not every loop
CLEANUP_GRACE_S = 3.0  # a dead stage's leftovers get SIGTERM first: its resource tracker unlinks semaphores meanwhile
SUPERVISE_EVERY_S = 0.5


def spawn(cmd: list[str], log: Path, env: dict[str, str], append: bool = False) -> subprocess.Popen:
    """`cmd` started in the repository, output into `log`, in a process group of its own (what it leaves behind
    when it dies can be ended with it). No preexec_fn, so Python uses vfork, which runs no fork handlers: grpcio's
    would restart its poller in the child, which can abort before exec."""
    with open(log, "ab" if append else "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, process_group=0)


def end_group(pgid: int, grace: float = CLEANUP_GRACE_S) -> None:
    """Ends what is left of a dead stage's process group (its worker processes): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def _reap(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """A killed process's exit code; -9 if it has not gone yet (stuck in the kernel), so no caller waits forever."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.error("pid %d has not exited %.0f s after SIGKILL", proc.pid, timeout)
        return -signal.SIGKILL


@dataclass
class Watch:
    """One process's supervision: its deaths, when to start it again, whether it has served since it started."""
    started: float = field(default_factory=time.monotonic)
    deaths: list[float] = field(default_factory=list)
    restart_at: float | None = None
    served: bool = False
    unhealthy_since: float | None = None
    probed: float = 0.0
    down: bool = False  # died past the bound: left down


class Mesh:
    """The processes of one config. A context manager: started on enter, stopped on exit."""

    def __init__(self, config_path: str | Path, log_dir: str | Path | None = None, stages: tuple[str, ...] = MeshConfig.STAGES,
                 env: dict[str, str] | None = None, supervise: bool = False, max_restarts: int = MAX_RESTARTS,
                 unhealthy_s: float = UNHEALTHY_S):
        """`supervise`: a thread restarts dead stages (else whoever runs the mesh calls `supervise()`)."""
        self.config_path = Path(config_path).resolve()
        self.cfg = load_config(self.config_path)
        self.log_dir = Path(log_dir or REPO_ROOT / ".cache" / "logs")
        self.stages = stages
        # gRPC fork support off: stages fork only to exec, where grpcio's handlers can abort the child.
        # OMNI_LAUNCHER_PID: each stage asks the kernel itself to end it with the launcher (die_with_launcher)
        self.env = {"GRPC_ENABLE_FORK_SUPPORT": "false", **os.environ, "PYTHONUNBUFFERED": "1", **(env or {}),
                    "OMNI_LAUNCHER_PID": str(os.getpid())}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), self.env.get("PYTHONPATH", "")]))
        self.procs: dict[str, subprocess.Popen] = {}
        self.watches: dict[str, Watch] = {}
        self.max_restarts, self.unhealthy_s, self.start_timeout = max_restarts, unhealthy_s, 600.0
        self._supervised = supervise
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def gateway_address(self) -> str:
        return self.cfg.gateway.replicas[0].address

    def processes(self) -> list[tuple[str, str, int]]:
        return [(f"{stage}-{i}", stage, i) for stage in self.stages for i in range(len(self.cfg.replicas(stage)))]

    def start(self, timeout: float = 600.0) -> "Mesh":
        clean_stale_pools()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout = timeout
        for name, stage, i in self.processes():
            self._spawn(name, stage, i)
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        for watch in self.watches.values():
            watch.served = True
        self._stopping.clear()
        if self._supervised:
            # A long-lived thread: a stage's PR_SET_PDEATHSIG fires when the thread that started it ends
            self._supervisor = threading.Thread(target=self._supervise_loop, name="mesh-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def _spawn(self, name: str, stage: str, i: int, append: bool = False) -> None:
        cmd = [sys.executable, "-m", f"services.{stage}", "--config", str(self.config_path), "--replica", str(i)]
        self.procs[name] = spawn(cmd, self.log_dir / f"{name}.log", self.env, append)
        watch = self.watches.setdefault(name, Watch())
        watch.started, watch.served, watch.unhealthy_since, watch.restart_at = time.monotonic(), False, None, None

    def _supervise_loop(self) -> None:
        while not self._stopping.wait(SUPERVISE_EVERY_S):
            try:
                self.supervise()
            except Exception:  # noqa: BLE001 - supervision goes on whatever one look met
                log.exception("supervision step failed")

    def supervise(self) -> None:
        """One look at every process: a dead one is cleaned up and started again after its backoff (or left down
        past the bound), one wedged for too long is killed. The others are never touched."""
        for name, stage, i in self.processes():
            if self._stopping.is_set():
                return
            watch, proc = self.watches[name], self.procs[name]
            if watch.down:
                continue
            if watch.restart_at is not None:
                if time.monotonic() >= watch.restart_at:
                    log.warning("%s: starting it again (restart %d)", name, len(watch.deaths))
                    self._spawn(name, stage, i, append=True)
            elif proc.poll() is not None:
                self._died(name, proc, f"exited with code {proc.returncode}")
            else:
                self._check_health(name, stage, i, watch, proc)

    def _died(self, name: str, proc: subprocess.Popen, why: str) -> None:
        watch, now = self.watches[name], time.monotonic()
        end_group(proc.pid)
        clean_stale_pools()
        watch.deaths = [t for t in watch.deaths if now - t < RESTART_WINDOW_S] + [now]
        if len(watch.deaths) > self.max_restarts:
            watch.down = True
            log.error("%s %s: %d deaths within %.0f s, so it is left down; the other stages keep serving:\n%s", name,
                      why, len(watch.deaths), RESTART_WINDOW_S, self.log_tail(name))
            return
        backoff = min(RESTART_BACKOFF_S * 2 ** (len(watch.deaths) - 1), RESTART_BACKOFF_MAX_S)
        watch.restart_at = now + backoff
        log.warning("%s %s: restarting it in %.1f s:\n%s", name, why, backoff, self.log_tail(name, 10))

    def _check_health(self, name: str, stage: str, i: int, watch: Watch, proc: subprocess.Popen) -> None:
        now = time.monotonic()
        if now - watch.probed < HEALTH_EVERY_S:
            return
        watch.probed = now
        serving = stage_serving(stage, self.cfg.replicas(stage)[i].address, timeout=1.0, security=self.cfg.security)
        if serving:
            if not watch.served:
                log.info("%s is serving again", name)
            watch.served, watch.unhealthy_since = True, None
        elif not watch.served:
            if now - watch.started > self.start_timeout:
                self._kill(name, proc, f"not serving {self.start_timeout:.0f} s after its start")
        elif stage not in MeshConfig.HTTP_STAGES:  # an HTTP stage's health is its gateway's: killing it mends nothing
            watch.unhealthy_since = watch.unhealthy_since or now
            if now - watch.unhealthy_since > self.unhealthy_s:
                self._kill(name, proc, f"not serving for {self.unhealthy_s:.0f} s (wedged)")

    def _kill(self, name: str, proc: subprocess.Popen, why: str) -> None:
        proc.kill()
        _reap(proc)
        self._died(name, proc, why)

    def down(self) -> list[str]:
        """The processes left down: they died past the bound."""
        return [name for name, w in self.watches.items() if w.down]

    def wait_healthy(self, timeout: float) -> None:
        pending = {name: (stage, self.cfg.replicas(stage)[i].address) for name, stage, i in self.processes()}
        deadline = time.monotonic() + timeout
        while pending:
            for name in list(pending):
                code = self.procs[name].poll()
                if code is not None:
                    raise RuntimeError(f"{name} exited with code {code} while starting:\n{self.log_tail(name)}")
                if stage_serving(*pending[name], timeout=1.0, security=self.cfg.security):
                    log.info("%s is serving on %s", name, pending[name][1])
                    del pending[name]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {sorted(pending)}")
            if pending:
                time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self, grace: float = 10.0) -> dict[str, int]:
        """Stops every process (SIGTERM, then SIGKILL after `grace`); returns their exit codes."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=grace)  # a look under way ends within its probes' timeouts
            self._supervisor = None
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = _reap(proc)
            end_group(proc.pid, grace=1.0)
        self.procs.clear()
        self.watches.clear()
        clean_stale_pools()
        return codes

    def __enter__(self) -> "Mesh":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local.yaml"))
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every stage to be healthy")
    parser.add_argument("--demo", action="store_true", help="send one demo request once healthy (speech to out/demo.wav)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value (YAML), e.g. --set thinker.engine=native; repeatable")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    # Ctrl-C stops the mesh even where SIGINT was inherited ignored (a script's background job), and only once:
    # a second one (`timeout -s INT` signals the whole group) would cut the stop short
    def interrupt(*_):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    config = write_overridden(args.config, args.set, REPO_ROOT / ".cache" / f"launch-{Path(args.config).stem}-{os.getpid()}.yaml")
    mesh = Mesh(config, args.log_dir)
    log.info("starting %d processes of %s (logs in %s)", len(mesh.processes()), mesh.config_path.name, mesh.log_dir)
    mesh.start(args.timeout)
    try:
        doors = [f"gateway on {mesh.gateway_address}"] + [f"HTTP API on http://{r.address}" for r in mesh.cfg.api.replicas]
        log.info("mesh ready: %s (Ctrl-C stops it)", ", ".join(doors))
        if args.demo:
            from services import client

            client.demo(mesh.gateway_address, REPO_ROOT / "out" / "demo.wav")
        while not stop:
            mesh.supervise()  # logs each restart, and each stage left down
            time.sleep(SUPERVISE_EVERY_S)
    except KeyboardInterrupt:
        pass
    finally:
        log.info("stopping")
        codes = mesh.stop()
        log.info("stopped: %s", ", ".join(f"{k}={v}" for k, v in codes.items()))
        if config != Path(args.config):
            config.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
