"""The fleet view on NATS with TLS, NKeys and pool-scoped permissions, against a real nats-server:
certificates made by `openssl` here, an NKey made by the `nkeys` package (nats-py's own), and the
users of deploy/nats/authorization.conf as shipped."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from kvcache_exporter.aggregator.fleet_residency import FleetResidency
from kvcache_exporter.aggregator.nats_intake import DeltaIntake, NatsIntake
from kvcache_exporter.fleet_publish import FleetPublisher, NatsOptions
from kvcache_exporter.sources.kv_events_decode import Batch, Event, KvEventDrain
from tests.aggregator.test_nats_intake import settled, spread, until
from tests.nats_server import NatsServer

AUTHORIZATION = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "authorization.conf"


def drain(n: int = 40) -> KvEventDrain:
    return KvEventDrain((Batch(0, 1.0, (Event("BlockStored", tuple(spread(n))),)),))


def certificates(where: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 it signed: (ca, cert, key)."""
    ca, ca_key = where / "ca.pem", where / "ca-key.pem"
    cert, key, csr = where / "server.pem", where / "server-key.pem", where / "server.csr"
    ext = where / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", ca_key, "-out", ca)  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", csr)
    openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1",
            "-extfile", ext, "-out", cert)  # fmt: skip
    return ca, cert, key


async def reaches_a_shard(
    options: NatsOptions,
    pool: str = "llama",
    shard_options: NatsOptions | None = None,
    replicas: int = 1,
    seconds: float = 20,
):
    """Publishes one drain with `options` and reads it with a shard (which creates the stream on
    `replicas` servers), each step within `seconds`: (publisher, shard intake)."""
    intake = NatsIntake(shard_options or options, DeltaIntake(FleetResidency(), pool), replicas=replicas)
    publisher = FleetPublisher(options, pool, "a")
    await intake.start()
    try:
        await until(lambda: intake.connected_once, seconds)
        publisher.start()
        publisher.offer(0, drain())
        await publisher.flush(seconds)
        await settled(intake, seconds)
        return publisher, intake.intake
    finally:
        await publisher.close()
        await intake.close()


@pytest.mark.timeout(120)
def test_tls_with_a_private_ca_publishes_and_without_the_ca_never_connects(tmp_path):
    ca, cert, key = certificates(tmp_path)
    config = f'tls {{ cert_file: "{cert}", key_file: "{key}" }}\n'
    server = NatsServer(tmp_path / "js", config=config).start()
    url = server.url.replace("nats://", "tls://")

    async def run():
        publisher, intake = await reaches_a_shard(NatsOptions(url, tls_ca_file=str(ca)))
        assert intake.fleet.replicas["a"].resident == 40 and publisher.dropped == {}
        unknown = FleetPublisher(NatsOptions(url), "llama", "b")  # the system CAs: not ours
        unknown.start()
        unknown.offer(0, drain())
        await asyncio.sleep(3)
        assert not unknown.connected and unknown.published == 0
        await unknown.close()

    try:
        asyncio.run(run())
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_an_nkey_user_publishes_and_a_stranger_seed_never_connects(tmp_path):
    nkeys = pytest.importorskip("nkeys", reason="nats-py's NKey support needs the nkeys package")

    def seed_file(name: str) -> tuple[Path, str]:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        path = tmp_path / f"{name}.nk"
        path.write_bytes(seed)
        return path, nkeys.from_seed(bytearray(seed)).public_key.decode()

    known, public = seed_file("known")
    stranger, _ = seed_file("stranger")
    server = NatsServer(
        tmp_path / "js", config=f"authorization {{ users = [ {{nkey: {public}}} ] }}\n"
    ).start()

    async def run():
        publisher, intake = await reaches_a_shard(NatsOptions(server.url, nkey_seed_file=str(known)))
        assert intake.fleet.replicas["a"].resident == 40 and publisher.dropped == {}
        other = FleetPublisher(NatsOptions(server.url, nkey_seed_file=str(stranger)), "llama", "b")
        other.start()
        other.offer(0, drain())
        await asyncio.sleep(3)
        assert not other.connected and other.published == 0
        await other.close()

    try:
        asyncio.run(run())
    finally:
        server.stop()


PASSWORDS = {
    "SIDECAR_LLAMA_PASSWORD": "s1",
    "AGGREGATOR_LLAMA_PASSWORD": "a1",
    "SIDECAR_MISTRAL_PASSWORD": "s2",
    "AGGREGATOR_MISTRAL_PASSWORD": "a2",
}


@pytest.mark.timeout(180)
def test_the_shipped_permissions_let_a_sidecar_publish_only_into_its_own_pool(tmp_path):
    (tmp_path / "authorization.conf").write_text(AUTHORIZATION.read_text())  # included beside the config
    server = NatsServer(tmp_path / "js", config='include "authorization.conf"\n', env=PASSWORDS).start()

    def options(user: str, password: str) -> NatsOptions:
        return NatsOptions(f"nats://{user}:{password}@127.0.0.1:{server.port}")

    async def run():
        llama, mistral = options("sidecar-llama", "s1"), options("aggregator-mistral", "a2")
        mistral_shard = NatsIntake(mistral, DeltaIntake(FleetResidency(), "mistral"))
        await mistral_shard.start()  # the pool's aggregator makes its stream
        try:
            await until(lambda: mistral_shard.connected_once, 20)
            intruder = FleetPublisher(llama, "mistral", "a")  # llama's sidecar, into mistral's pool
            intruder.start()
            intruder.offer(0, drain())
            await until(lambda: intruder.dropped["publish_error"] >= 3, 30)  # 2 s a refusal (no ack)
            assert intruder.published == 0
            await intruder.close()
            own = FleetPublisher(options("sidecar-mistral", "s2"), "mistral", "m")
            own.start()
            own.offer(0, drain())
            await own.flush(30)
            await own.close()
            await settled(mistral_shard, 20)
            assert set(mistral_shard.intake.fleet.replicas) == {"m"}  # nothing of the intruder's
        finally:
            await mistral_shard.close()
        publisher, intake = await reaches_a_shard(llama, "llama", options("aggregator-llama", "a1"))
        assert intake.fleet.replicas["a"].resident == 40 and publisher.dropped == {}

    try:
        asyncio.run(run())
    finally:
        server.stop()
