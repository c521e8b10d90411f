"""The web-config file judged as Prometheus's own `promtool check web-config` judges it, and the
TLS it configures checked by real handshakes."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import warnings

import bcrypt
import pytest

from kvcache_exporter.config import ConfigError
from kvcache_exporter.web.config import load_web_config

HASH = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
TLS = "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n"

# name -> file body; each verdict (accept or reject) must equal promtool's.
CASES = {
    "tls": TLS,
    "cipher_suites": TLS + "  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]\n",
    "tls13_cipher_suite": TLS + "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
    "unknown_cipher": TLS + "  cipher_suites: [TLS_FOO]\n",
    "rc4_cipher": TLS + "  cipher_suites: [TLS_RSA_WITH_RC4_128_SHA]\n",
    "min_tls10": TLS + "  min_version: TLS10\n",
    "max_tls12": TLS + "  max_version: TLS12\n",
    "unknown_version": TLS + "  min_version: TLS99\n",
    "empty_version": TLS + "  min_version: ''\n",
    "curves": TLS + "  curve_preferences: [X25519, CurveP256]\n",
    "unknown_curve": TLS + "  curve_preferences: [Foo]\n",
    "prefer_server_ciphers": TLS + "  prefer_server_cipher_suites: false\n",
    "client_auth": TLS + "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: cert.pem\n",
    "unknown_client_auth": TLS + "  client_auth_type: Foo\n",
    "missing_client_ca": TLS + "  client_ca_file: nope.pem\n",
    "unknown_tls_key": TLS + "  foo: 1\n",
    "inline_cert": "tls_server_config:\n  cert: x\n  key: y\n",
    "no_cert_file": "tls_server_config:\n  key_file: key.pem\n",
    "missing_cert": "tls_server_config:\n  cert_file: nope.pem\n  key_file: key.pem\n",
    "key_is_a_cert": "tls_server_config:\n  cert_file: cert.pem\n  key_file: cert.pem\n",
    "tls_scalar": "tls_server_config: yes-please\n",
    "tls_empty": "tls_server_config: {}\n",
    "good_hash": f"basic_auth_users:\n  alice: '{HASH}'\n",
    "invalid_hash": "basic_auth_users:\n  alice: notahash\n",
    "truncated_hash": "basic_auth_users:\n  alice: $2b$04$abcdefghijklmnopqrstuu\n",
    "cost_99_hash": f"basic_auth_users:\n  alice: '$2b$99${HASH[7:]}'\n",
    "empty_hash": "basic_auth_users:\n  alice:\n",
    "users_list": "basic_auth_users: [alice]\n",
    "users_scalar": "basic_auth_users: alice\n",
    "http2": "http_server_config:\n  http2: false\n",
    "http2_not_bool": "http_server_config:\n  http2: maybe\n",
    "header": "http_server_config:\n  headers:\n    X-Frame-Options: deny\n",
    "header_bad_value": "http_server_config:\n  headers:\n    X-Frame-Options: DENY\n",
    "header_not_allowed": "http_server_config:\n  headers:\n    Foo: bar\n",
    "unknown_top_key": "rate_limit:\n  interval: 1s\n",
    "top_scalar": "hello\n",
    "empty": "",
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", folder / "key.pem", "-out", folder / "cert.pem", "-days", "1",
                    "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)  # fmt: skip
    return folder


def ours(path) -> bool:
    try:
        load_web_config(str(path))
    except ConfigError as err:
        assert str(err).startswith(str(path)), err  # file:key: message
        return False
    return True


def promtool(path) -> bool:
    run = subprocess.run(["promtool", "check", "web-config", path.name], cwd=path.parent, capture_output=True)
    return run.returncode == 0


def test_verdicts_equal_promtools(certs):
    disagree = {}
    for name, body in CASES.items():
        path = certs / f"{name}.yaml"
        path.write_text(body)
        if ours(path) != promtool(path):
            disagree[name] = f"promtool {'accepts' if promtool(path) else 'rejects'}"
    assert disagree == {}
    assert ours(certs / "tls.yaml") and not ours(certs / "invalid_hash.yaml")  # the table judges both ways


def test_errors_name_the_key(certs):
    expected = {
        "tls_scalar": "tls_server_config: must be a mapping, not str 'yes-please'",
        "users_list": "basic_auth_users: must be a mapping",
        "invalid_hash": "basic_auth_users.alice: not a bcrypt hash",
        "unknown_cipher": "tls_server_config.cipher_suites: unknown cipher TLS_FOO",
        "unknown_tls_key": "tls_server_config.foo: unknown key",
    }
    for name, message in expected.items():
        path = certs / f"{name}.yaml"
        path.write_text(CASES[name])
        with pytest.raises(ConfigError, match=f"^{path}:{message}"):
            load_web_config(str(path))


def test_min_above_max_is_rejected_though_promtool_passes_it(certs):
    path = certs / "inverted.yaml"
    path.write_text(TLS + "  min_version: TLS13\n  max_version: TLS12\n")  # Go would fail every handshake
    with pytest.raises(ConfigError, match="min_version: above max_version"):
        load_web_config(str(path))


def handshake(server_context: ssl.SSLContext, client: ssl.SSLContext) -> tuple[str, str]:
    """(TLS version, cipher) a real handshake over loopback negotiates."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def accept():
            conn, _ = listener.accept()
            try:
                with server_context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        with socket.create_connection(("127.0.0.1", port)) as raw, client.wrap_socket(raw) as tls:
            version, cipher = tls.version(), tls.cipher()[0]
        thread.join(5)
    return version, cipher


def client(low=ssl.TLSVersion.TLSv1, high=ssl.TLSVersion.TLSv1_3, ciphers="DEFAULT:@SECLEVEL=0"):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_ciphers(ciphers)
    with warnings.catch_warnings():  # old versions on purpose
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version, context.maximum_version = low, high
    return context


@pytest.mark.parametrize(
    "extra,tls_client,version",
    [
        ("", client(), "TLSv1.3"),
        ("  max_version: TLS12\n", client(), "TLSv1.2"),
        ("  min_version: TLS10\n", client(high=ssl.TLSVersion.TLSv1), "TLSv1"),
        ("  min_version: TLS11\n", client(high=ssl.TLSVersion.TLSv1_1), "TLSv1.1"),
    ],
)
def test_negotiated_version(certs, extra, tls_client, version):
    path = certs / "handshake.yaml"
    path.write_text(TLS + extra)
    assert handshake(load_web_config(str(path)).ssl_context, tls_client)[0] == version


def test_default_minimum_refuses_tls11(certs):
    path = certs / "default.yaml"
    path.write_text(TLS)
    with pytest.raises((ssl.SSLError, OSError)):
        handshake(load_web_config(str(path)).ssl_context, client(high=ssl.TLSVersion.TLSv1_1))


def test_cipher_suites_choose_the_tls12_cipher(certs):
    path = certs / "ciphers.yaml"
    path.write_text(TLS + "  max_version: TLS12\n  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA]\n")
    context = load_web_config(str(path)).ssl_context
    assert handshake(context, client()) == ("TLSv1.2", "ECDHE-ECDSA-AES256-SHA")
