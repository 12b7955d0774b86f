"""One TLS context per process, for every HTTP client the framework makes.

Invariant: clients made with `verify=tls.context()` share one `ssl.SSLContext`, built once the way
httpx builds its own (its CA bundle, SSL_CERT_FILE and SSL_CERT_DIR honoured). httpx otherwise
builds a context per client and loads the CA bundle each time: 22 ms of CPU measured here, and our
clients are short-lived (one per health poll while a server starts, per weight reload, per
broadcast): the launcher spent most of its CPU there.
"""

from __future__ import annotations

import functools
import ssl


@functools.cache
def context() -> ssl.SSLContext:
    import httpx

    return httpx.create_ssl_context()
