"""The framework's HTTP clients share one TLS context (`prime_rl.runtime.tls`)."""

import ssl

import httpx

from prime_rl.engine.server import is_healthy
from prime_rl.runtime import tls
from prime_rl.runtime.net import free_port


def test_health_polls_build_no_tls_context_each(monkeypatch):
    # httpx builds a context per client and loads the CA bundle each time (22 ms of CPU): `rl`
    # polls its servers' health every half second while they start, and spent most of its CPU there.
    built = []
    create = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or create(*a, **k))
    tls.context.cache_clear()
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: a refused connection, as while vLLM starts
    assert not any(is_healthy(url) for _ in range(5))
    assert len(built) == 1


def test_the_shared_context_verifies_as_httpx_does():
    shared, own = tls.context(), httpx.create_ssl_context()
    assert shared.verify_mode == own.verify_mode == ssl.CERT_REQUIRED and shared.check_hostname
    assert shared.cert_store_stats()["x509_ca"] == own.cert_store_stats()["x509_ca"] > 0
