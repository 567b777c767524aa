"""Connection settings from the environment (credentials never from the repo).

    settings = Settings.from_env()
    settings.kafka_bootstrap   # "127.0.0.1:39092"
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional

from schemas.errors import ConfigError

DEFAULT_KAFKA_PORT = 39092
DEFAULT_MINIO_PORT = 39000


def cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """Where downloaded servers and local state live: outside the repository."""
    return Path(env.get("TRAJPIPE_CACHE_DIR") or Path.home() / ".cache" / "trajpipe")


def state_dir(env: Mapping[str, str] = os.environ) -> Path:
    """Where the local servers keep their data, pid files and logs (TRAJPIPE_STATE_DIR, else <cache>/local).

    Separate from the download cache, so a run (CI, a throwaway experiment) can start on empty servers while
    reusing the fetched jars and the built MinIO binary."""
    return Path(env.get("TRAJPIPE_STATE_DIR") or cache_dir(env) / "local")


def state_credentials(path: Path) -> dict[str, str]:
    """Credentials the local launcher generated (mode 0600 file in its state dir), if any."""
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def recorded_brokers(state: Path) -> int:
    """How many brokers the local Kafka in the state dir `state` was formatted with (0: none recorded)."""
    record = state / "kafka.brokers"
    return int(record.read_text().strip() or 1) if record.exists() else 0


def record_brokers(state: Path, brokers: int) -> None:
    (state / "kafka.brokers").write_text(f"{brokers}\n")


def local_kafka_bootstrap(env: Mapping[str, str] = os.environ) -> str:
    """Every node of the local platform (`python -m infra up [--brokers N]`): node i on the Kafka port + 2(i-1)."""
    port = int(env.get("TRAJPIPE_KAFKA_PORT") or DEFAULT_KAFKA_PORT)
    brokers = recorded_brokers(state_dir(env)) or 1
    return ",".join(f"127.0.0.1:{port + 2 * i}" for i in range(brokers))


@dataclass(frozen=True)
class Settings:
    kafka_bootstrap: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    s3_secure: bool = False
    bucket: str = "trajpipe"

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Settings":
        env = os.environ if env is None else env
        local = state_credentials(state_dir(env) / "minio.env")
        access = env.get("TRAJPIPE_S3_ACCESS_KEY") or env.get("MINIO_ROOT_USER") or local.get("MINIO_ROOT_USER")
        secret = env.get("TRAJPIPE_S3_SECRET_KEY") or env.get("MINIO_ROOT_PASSWORD") or local.get("MINIO_ROOT_PASSWORD")
        if not access or not secret:
            raise ConfigError(
                "no object-store credentials: set TRAJPIPE_S3_ACCESS_KEY and TRAJPIPE_S3_SECRET_KEY "
                "(or MINIO_ROOT_USER/MINIO_ROOT_PASSWORD), or run `python -m infra up` to start a local MinIO"
            )
        settings = cls(
            kafka_bootstrap=env.get("TRAJPIPE_KAFKA_BOOTSTRAP") or local_kafka_bootstrap(env),
            # the local MinIO where `infra up` started it (TRAJPIPE_MINIO_PORT moves it, as Kafka's port moves)
            s3_endpoint=env.get("TRAJPIPE_S3_ENDPOINT") or f"127.0.0.1:{env.get('TRAJPIPE_MINIO_PORT') or DEFAULT_MINIO_PORT}",
            s3_access_key=access,
            s3_secret_key=secret,
            s3_secure=env.get("TRAJPIPE_S3_SECURE", "0").lower() in ("1", "true", "yes"),
            bucket=env.get("TRAJPIPE_BUCKET", "trajpipe"),
        )
        settings.validate()
        return settings

    def validate(self) -> None:
        if "://" in self.s3_endpoint:
            raise ConfigError(
                f"TRAJPIPE_S3_ENDPOINT={self.s3_endpoint!r}: give host:port without a scheme; "
                "set TRAJPIPE_S3_SECURE=1 for https"
            )
        if not self.kafka_bootstrap or " " in self.kafka_bootstrap:
            raise ConfigError(f"TRAJPIPE_KAFKA_BOOTSTRAP={self.kafka_bootstrap!r}: give host:port[,host:port]")
        if not (3 <= len(self.bucket) <= 63) or not self.bucket.replace("-", "").isalnum() or not self.bucket.islower():
            raise ConfigError(f"TRAJPIPE_BUCKET={self.bucket!r}: 3-63 lowercase letters, digits or '-'")

    def with_bucket(self, bucket: str) -> "Settings":
        return replace(self, bucket=bucket)

    def as_env(self) -> dict[str, str]:
        """The environment a child service needs to reach the same servers."""
        return {
            "TRAJPIPE_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            "TRAJPIPE_S3_ENDPOINT": self.s3_endpoint,
            "TRAJPIPE_S3_ACCESS_KEY": self.s3_access_key,
            "TRAJPIPE_S3_SECRET_KEY": self.s3_secret_key,
            "TRAJPIPE_S3_SECURE": "1" if self.s3_secure else "0",
            "TRAJPIPE_BUCKET": self.bucket,
        }


NS_VAR = "TRAJPIPE_NS"


def parse_weights(text: str) -> dict[str, float]:
    """'code=1,math=2' -> {'code': 1.0, 'math': 2.0}."""
    out: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--weights {text!r}: write NAME=NUMBER[,NAME=NUMBER]") from None
    return out


def add_ns_argument(parser: Any, flag: str = "--ns", help: str = "run namespace (topics <ns>.*)",
                    env: Optional[Mapping[str, str]] = None) -> None:
    """`--ns` (or `flag`) defaulting to $TRAJPIPE_NS, and required when that is unset."""
    default = (os.environ if env is None else env).get(NS_VAR) or None
    parser.add_argument(flag, default=default, required=default is None,
                        help=f"{help} (default: ${NS_VAR}{'' if default is None else ', now ' + default})")
