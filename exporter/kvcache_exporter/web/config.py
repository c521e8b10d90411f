"""The web-config file (Prometheus exporter-toolkit format), checked as `promtool check web-config` does.

One file serves Prometheus and this exporter alike: tls_server_config, basic_auth_users (bcrypt
hashes) and http_server_config. Every error is `file:key: message`.
"""

from __future__ import annotations

import os
import re
import ssl
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError

_TOP_KEYS = {"tls_server_config", "basic_auth_users", "http_server_config"}
_TLS_KEYS = {
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "cipher_suites",
    "curve_preferences",
    "min_version",
    "max_version",
    "prefer_server_cipher_suites",
}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# Go's names (crypto/tls) -> OpenSSL's, for TLS <= 1.2. Go does not let TLS 1.3 suites be chosen
# either: those names are accepted and change nothing.
_CIPHERS = {
    "TLS_RSA_WITH_3DES_EDE_CBC_SHA": "DES-CBC3-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256": "AES128-SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA": "ECDHE-RSA-DES-CBC3-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
}
_TLS13_CIPHERS = {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}
_CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}
# The headers exporter-toolkit lets a web-config set, with the values it allows (None: any).
_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
_BCRYPT = re.compile(rb"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")


@dataclass(frozen=True)
class WebConfig:
    ssl_context: ssl.SSLContext | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Mapping[str, str] = field(default_factory=dict)  # sent with every response


def load_web_config(path: str | None) -> WebConfig:
    if not path:
        return WebConfig()
    data = _mapping(_read(path), f"{path}: top level")
    _known(data, _TOP_KEYS, path, "")
    tls = _mapping(data.get("tls_server_config"), f"{path}:tls_server_config")
    _known(tls, _TLS_KEYS, path, "tls_server_config.")
    return WebConfig(
        _ssl_context(path, tls) if tls.get("cert_file") or tls.get("key_file") else None,
        _users(path, data.get("basic_auth_users")),
        _headers(path, _mapping(data.get("http_server_config"), f"{path}:http_server_config")),
    )


def _read(path: str) -> Any:
    import yaml  # here, not at the top: only --web.config.file needs it (~1 MiB of serve's RSS)

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except OSError as err:
        raise ConfigError(f"{path}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err


def _mapping(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a mapping, not {type(value).__name__} {str(value)[:40]!r}")
    return value


def _known(data: dict, allowed: set[str], path: str, section: str) -> None:
    unknown = sorted(str(k) for k in set(data) - allowed)
    if unknown:
        raise ConfigError(f"{path}:{section}{unknown[0]}: unknown key")


def _users(path: str, value: Any) -> dict[str, bytes]:
    users = {}
    for user, hashed in _mapping(value, f"{path}:basic_auth_users").items():
        match = _BCRYPT.fullmatch(str(hashed).encode())
        if not match or not 4 <= int(match.group(1)) <= 31:
            raise ConfigError(f"{path}:basic_auth_users.{user}: not a bcrypt hash (cost 4 to 31)")
        users[str(user)] = match.group(0)
    return users


def _headers(path: str, http: dict) -> dict[str, str]:
    _known(http, {"http2", "headers"}, path, "http_server_config.")
    if not isinstance(http.get("http2", True), bool):
        raise ConfigError(f"{path}:http_server_config.http2: must be true or false")
    headers = _mapping(http.get("headers"), f"{path}:http_server_config.headers")
    where = f"{path}:http_server_config.headers"
    for name, value in headers.items():
        if name not in _HEADERS:
            raise ConfigError(f'{where}: HTTP header "{name}" can not be configured')
        allowed = _HEADERS[name]
        if allowed is not None and value not in allowed:
            raise ConfigError(f"{where}.{name}: must be one of {', '.join(allowed)}")
    return {str(k): str(v) for k, v in headers.items()}


def _ssl_context(path: str, tls: dict) -> ssl.SSLContext:
    where = f"{path}:tls_server_config"
    for key in ("cert_file", "key_file"):
        if not tls.get(key):
            raise ConfigError(f"{where}.{key}: missing")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _versions(context, tls, where)
    _ciphers(context, tls, where)
    auth = tls.get("client_auth_type", "NoClientCert")
    if auth not in _CLIENT_AUTH:
        raise ConfigError(f"{where}.client_auth_type: {auth!r} is not one of {', '.join(_CLIENT_AUTH)}")
    context.verify_mode = _CLIENT_AUTH[auth]
    if not tls.get("prefer_server_cipher_suites", True):
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    here = os.path.dirname(path)  # relative paths are relative to the file, as in Prometheus
    try:
        context.load_cert_chain(os.path.join(here, tls["cert_file"]), os.path.join(here, tls["key_file"]))
        if tls.get("client_ca_file"):
            context.load_verify_locations(os.path.join(here, tls["client_ca_file"]))
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"{where}: {getattr(err, 'strerror', None) or err}") from err
    return context


def _versions(context: ssl.SSLContext, tls: dict, where: str) -> None:
    for key in ("min_version", "max_version"):
        if key in tls and tls[key] not in _VERSIONS:
            raise ConfigError(f"{where}.{key}: unknown TLS version {tls[key]!r} (TLS10 to TLS13)")
    low = _VERSIONS[tls.get("min_version", "TLS12")]
    high = _VERSIONS[tls.get("max_version", "TLS13")]
    if low > high:
        raise ConfigError(f"{where}.min_version: above max_version")
    with warnings.catch_warnings():  # TLS 1.0/1.1 are deprecated, and honoured when asked for
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version, context.maximum_version = low, high


def _ciphers(context: ssl.SSLContext, tls: dict, where: str) -> None:
    names = tls.get("cipher_suites") or []
    curves = tls.get("curve_preferences") or []
    for key, value in (("cipher_suites", names), ("curve_preferences", curves)):
        if not isinstance(value, list):
            raise ConfigError(f"{where}.{key}: must be a list")
    unknown = [n for n in names if n not in _CIPHERS and n not in _TLS13_CIPHERS]
    if unknown:
        raise ConfigError(f"{where}.cipher_suites: unknown cipher {unknown[0]}")
    openssl = [_CIPHERS[n] for n in names if n in _CIPHERS]
    # OpenSSL 3 refuses TLS 1.0/1.1 (SHA-1 signatures) above security level 0.
    level = ":@SECLEVEL=0" if context.minimum_version < ssl.TLSVersion.TLSv1_2 else ""
    try:
        if openssl or level:
            context.set_ciphers(":".join(openssl or ["DEFAULT"]) + level)
    except ssl.SSLError as err:
        raise ConfigError(f"{where}.cipher_suites: this OpenSSL offers none of them") from err
    bad = [c for c in curves if c not in _CURVES]
    if bad:
        raise ConfigError(f"{where}.curve_preferences: unknown curve {bad[0]}")
    if curves:  # Python's ssl takes one curve: the most preferred
        context.set_ecdh_curve(_CURVES[curves[0]])
