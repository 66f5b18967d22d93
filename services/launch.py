"""Starts every process of a mesh config, waits until all are healthy, stops them all on Ctrl-C.

    python -m services.launch --config configs/local.yaml [--demo]
"""

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.runtime.config import REPO_ROOT, MeshConfig, load_config, write_overridden
from services.runtime.probe import stage_serving
from services.runtime.transport import clean_stale_pools

log = logging.getLogger("launch")


def spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """`cmd` started in the repository, output into `log`. No preexec_fn, so Python uses vfork, which runs no fork
    handlers: grpcio's would restart its poller in the child, which can abort before exec."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)


class Mesh:
    """The processes of one config. A context manager: started on enter, stopped on exit."""

    def __init__(self, config_path: str | Path, log_dir: str | Path | None = None, stages: tuple[str, ...] = MeshConfig.STAGES,
                 env: dict[str, str] | None = None):
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

    @property
    def gateway_address(self) -> str:
        return self.cfg.gateway.replicas[0].address

    def processes(self) -> list[tuple[str, str, int]]:
        return [(f"{stage}-{i}", stage, i) for stage in self.stages for i in range(len(self.cfg.replicas(stage)))]

    def start(self, timeout: float = 600.0) -> "Mesh":
        clean_stale_pools()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name, stage, i in self.processes():
            cmd = [sys.executable, "-m", f"services.{stage}", "--config", str(self.config_path), "--replica", str(i)]
            self.procs[name] = spawn(cmd, self.log_dir / f"{name}.log", self.env)
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

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
                codes[name] = proc.wait()
        self.procs.clear()
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
            for name, proc in mesh.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{mesh.log_tail(name)}")
            time.sleep(0.5)
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
