"""omnistage.media.fetch: the guards of remote media fetching, over loopback only.

How real fetching is tested without a bypass in production code: the injected resolver maps
test host names to public-looking addresses (which pass the address check like any real
answer), and the injected transport `ToLocal` receives the pinned request (URL host = that
address, Host header / SNI = the name), records it, and re-targets only the socket to a local
server on 127.0.0.1. The address check itself is exercised with resolvers that answer private
addresses, and with the default (getaddrinfo) resolver on "localhost".
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import time
from dataclasses import replace
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from omnistage.errors import InvalidRequestError
from omnistage.media.fetch import FetchedMedia, MediaFetchPolicy, address_refusal, fetch_media

PARAM = "messages[0].content[0].image_url.url"
PUBLIC_A = "93.184.216.34"          # public-looking answers; nothing ever connects to them
PUBLIC_B = "151.101.1.69"
PUBLIC_V6 = "2606:2800:220:1:248:1893:25c8:1946"
BODY = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40
POLICY = MediaFetchPolicy(allowed_domains=("media.example.com", "cdn.example.org"),
                          max_bytes=1 << 20, timeout_s=5.0)


class FakeResolver:
    """host -> answers (IP strings, or an exception to raise); records every lookup."""

    def __init__(self, answers: dict):
        self.answers, self.calls = answers, []

    async def __call__(self, host: str) -> list[str]:
        self.calls.append(host)
        if isinstance(self.answers[host], Exception):
            raise self.answers[host]
        return self.answers[host]


DNS = {"media.example.com": [PUBLIC_A], "cdn.example.org": [PUBLIC_B]}


class ToLocal(httpx.AsyncBaseTransport):
    """Records each request as fetch_media built it, then sends it to 127.0.0.1:port with
    the same headers and extensions (Host, SNI). Counts the body bytes it hands back."""

    def __init__(self, port: int, verify: ssl.SSLContext | bool = True):
        self.port, self.seen, self.body_bytes = port, [], 0
        self.inner = httpx.AsyncHTTPTransport(verify=verify, retries=0)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        url = request.url.copy_with(host="127.0.0.1", port=self.port)
        response = await self.inner.handle_async_request(
            httpx.Request("GET", url, headers=request.headers, extensions=request.extensions))
        response.stream = _Counted(response.stream, self)
        return response

    async def aclose(self):
        await self.inner.aclose()


class _Counted(httpx.AsyncByteStream):
    def __init__(self, stream: httpx.AsyncByteStream, owner: ToLocal):
        self.stream, self.owner = stream, owner

    async def __aiter__(self):
        async for chunk in self.stream:
            self.owner.body_bytes += len(chunk)
            yield chunk

    async def aclose(self):
        await self.stream.aclose()


def _head(status: int, headers: dict) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines + ["Connection: close", "", ""]).encode()


async def media_site(target: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
    """One request per connection. Paths: /cat.png, /hop/<n> (n redirects, then the file),
    /to?next=<url>, /huge-declared, /endless, /slow, /gzip; anything else is 404."""
    path, query = urlsplit(target)[2:4]
    if path in ("/cat.png", "/hop/0"):
        writer.write(_head(200, {"Content-Type": "image/png; q=1", "Content-Length": len(BODY)})
                     + BODY)
    elif path.startswith("/hop/") or path == "/to":
        location = parse_qs(query)["next"][0] if path == "/to" else f"/hop/{int(path[5:]) - 1}"
        writer.write(_head(302, {"Location": location, "Content-Length": 0}))
    elif path == "/huge-declared":          # announces 1 GB, then sends nothing until EOF
        writer.write(_head(200, {"Content-Length": 10**9}))
        await reader.read()
    elif path == "/endless":                # chunked, no Content-Length, never ends
        writer.write(_head(200, {"Transfer-Encoding": "chunked"}))
        while True:
            writer.write(b"10000\r\n" + b"z" * 65536 + b"\r\n")
            await writer.drain()
    elif path == "/slow":                   # one byte every 50 ms: no single read times out
        writer.write(_head(200, {"Content-Length": 1000}))
        for _ in range(1000):
            writer.write(b"s")
            await writer.drain()
            await asyncio.sleep(0.05)
    elif path == "/gzip":
        writer.write(_head(200, {"Content-Encoding": "gzip", "Content-Length": 3}) + b"abc")
    else:
        writer.write(_head(404, {"Content-Length": 0}))
    await writer.drain()


class LocalServer:
    """`media_site` on 127.0.0.1 (TLS when `ssl_context`); records (target, headers). Handlers
    still running at exit (the never-ending bodies) are cancelled."""

    def __init__(self, ssl_context: ssl.SSLContext | None):
        self.ssl_context, self.requests, self._tasks = ssl_context, [], set()

    async def __aenter__(self) -> "LocalServer":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0,
                                                  ssl=self.ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader, writer):
        self._tasks.add(asyncio.current_task())
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            self.requests.append((head[0].split(" ")[1], {
                k.lower(): v for k, v in (line.split(": ", 1) for line in head[1:] if line)}))
            await media_site(self.requests[-1][0], reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass                                # the client hung up: expected in the cap tests
        finally:
            self._tasks.discard(asyncio.current_task())
            writer.close()


async def fetch_local(url: str, policy: MediaFetchPolicy = POLICY, dns: dict = DNS, *,
                      ssl_context=None, verify=True, log: list | None = None, port=None):
    """fetch_media through `ToLocal` to a fresh `LocalServer` (or `port`) -> (media,
    transport, server); `log` also receives (transport, server), for expected refusals."""
    async with LocalServer(ssl_context) as server:
        transport = ToLocal(port or server.port, verify)
        if log is not None:
            log.append((transport, server))
        try:
            got = await fetch_media(url, policy, param=PARAM, resolver=FakeResolver(dns),
                                    transport=transport)
        finally:
            await transport.aclose()
    return got, transport, server


def fetch_offline(url: str, policy: MediaFetchPolicy, resolver=None):
    """A fetch that must be refused before connecting: the transport fails the test.
    resolver=None is the real one (getaddrinfo)."""
    return fetch_media(url, policy, param=PARAM, resolver=resolver,
                       transport=httpx.MockTransport(lambda r: pytest.fail(f"sent {r.url}")))


def refused(coro, match: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError, match=match) as info:
        asyncio.run(coro)
    assert info.value.param == PARAM
    return info.value


def test_policy_normalises_and_matches_exact_or_wildcard():
    policy = MediaFetchPolicy(allowed_domains=("Media.Example.COM.", "*.cdn.example.org",
                                               "bücher.de", "[2606:2800::1]"))
    assert policy.allowed_domains == ("media.example.com", "*.cdn.example.org",
                                      "xn--bcher-kva.de", "2606:2800::1")
    # An exact entry has no subdomains; a wildcard has every subdomain but not the apex.
    expect = {"media.example.com": True, "img.media.example.com": False,
              "evilmedia.example.com": False, "a.b.cdn.example.org": True,
              "cdn.example.org": False, "evilcdn.example.org": False,
              "xn--bcher-kva.de": True, "2606:2800::1": True}
    assert {host: policy.allows_host(host) for host in expect} == expect
    for bad in ("https://example.com", "example.com:443", "example.com/path", "u@example.com",
                "*.*.example.com", "a.*.com", "", "*.1.2.3.4"):
        with pytest.raises(ValueError, match="not a host name"):
            MediaFetchPolicy(allowed_domains=(bad,))
    for bad in ({"max_bytes": 0}, {"timeout_s": 0}, {"max_redirects": -1},
                {"allowed_domains": "example.com"}):
        with pytest.raises(ValueError):
            MediaFetchPolicy(**bad)
    assert not MediaFetchPolicy().enabled and policy.enabled


@pytest.mark.parametrize("address,reason", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"),
    ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("fd12::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"), ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("100.64.0.1", "carrier-grade NAT"), ("240.0.0.1", "reserved"), ("fec0::1", "site-local"),
    ("192.0.2.1", "private"), ("::ffff:127.0.0.1", "loopback address, embedded"),
    ("::ffff:10.0.0.1", "private address, embedded"),
    ("2002:a9fe:a9fe::", "link-local address, embedded"),
    ("64:ff9b::a00:1", "private address, embedded"), ("::127.0.0.1", "reserved"),
    (PUBLIC_A, None), (PUBLIC_V6, None), ("8.8.8.8", None), ("2002:808:808::", None),
])
def test_address_refusal(address, reason):
    got = address_refusal(ipaddress.ip_address(address))
    assert got is None if reason is None else reason in got


def test_fetching_is_off_by_default():
    resolver = FakeResolver(DNS)
    refused(fetch_offline("https://media.example.com/cat.png", MediaFetchPolicy(), resolver),
            "does not fetch media URLs.*--allowed-media-domains")
    assert resolver.calls == []


@pytest.mark.parametrize("url,match", [
    ("file:///etc/passwd", "only http and https.*'file'"), ("http:///cat.png", "no host"),
    ("ftp://media.example.com/cat.png", "only http and https.*'ftp'"),
    ("data:image/png;base64,AAAA", "only http and https.*'data'"),
    ("https://user:secret@media.example.com/cat.png", "credentials"),
    ("https://user@media.example.com/cat.png", "credentials"),
    ("https://media.example.com:99999/", "port 99999 is not a valid TCP port"),
    ("https://exa mple.com/", "not one of"), ("https://a.com/" + "a" * 9000, "longer than 8192"),
    *[(url, "not one of this server's allowed media domains") for url in (
        "https://evil.example.net/", "https://img.media.example.com/",
        "https://media.example.com.evil.net/", f"https://{PUBLIC_A}/")],
])
def test_bad_url_or_domain_is_refused_before_dns(url, match):
    resolver = FakeResolver(DNS)
    refused(fetch_offline(url, POLICY, resolver), match)
    assert resolver.calls == []                 # a refused name never reaches DNS


@pytest.mark.parametrize("answers,match", [
    (["127.0.0.1"], "127.0.0.1, a loopback"), (["10.0.0.7"], "private"),
    ([PUBLIC_A, "192.168.0.10"], "192.168.0.10, a private"),      # every address must pass
    (["169.254.169.254"], "link-local"), (["fe80::1%eth0"], "link-local"),
    (["::ffff:127.0.0.1"], "loopback address, embedded"), (["::1"], "loopback"),
    (["100.64.1.1"], "carrier-grade NAT"), (["fd00::5"], "private"), (["0.0.0.0"], "unspec"),
    ([], "did not resolve"), (["not-an-ip"], "did not resolve"),
    (OSError(-2, "Name or service not known"), "could not resolve host .*Name or service"),
])
def test_private_answers_are_refused(answers, match):
    refused(fetch_offline("https://media.example.com/cat.png", POLICY,
                          FakeResolver({"media.example.com": answers})), match)


def test_default_resolver_and_ip_literals_refuse_loopback():
    policy = MediaFetchPolicy(allowed_domains=("localhost", "127.0.0.1", "::ffff:10.0.0.1"),
                              max_bytes=1000, timeout_s=5.0)
    # The real getaddrinfo resolves localhost to loopback: refused before any connect.
    refused(fetch_offline("http://localhost:9/x.png", policy), "'localhost' resolves to .*loopb")
    refused(fetch_offline("http://127.0.0.1:9/x.png", policy), "'127.0.0.1' is a loopback")
    refused(fetch_offline("http://[::ffff:10.0.0.1]/", policy), "private address, embedded")


def test_connects_to_checked_address_even_if_dns_changes():
    """Rebinding: a second lookup would answer loopback. There is none; the request URL
    carries the address that was checked."""
    seen, calls = [], []

    def handler(request):
        seen.append(request)
        return httpx.Response(200, content=b"ok", headers={"Content-Type": "image/png"})

    async def rebinding(host):                  # every lookup after the first: loopback
        calls.append(host)
        return [PUBLIC_V6] if len(calls) == 1 else ["127.0.0.1"]
    got = asyncio.run(fetch_media("https://media.example.com:8443/a/cat.png?s=1#frag", POLICY,
                                  param=PARAM, resolver=rebinding,
                                  transport=httpx.MockTransport(handler)))
    assert calls == ["media.example.com"]
    [request] = seen
    assert (request.url.host, request.url.port, request.url.raw_path) == (PUBLIC_V6, 8443,
                                                                          b"/a/cat.png?s=1")
    assert request.headers["host"] == "media.example.com:8443"
    assert request.headers["accept-encoding"] == "identity"
    assert request.extensions["sni_hostname"] == "media.example.com"
    assert got == FetchedMedia(b"ok", "image/png", "https://media.example.com:8443/a/cat.png?s=1")


def test_fetch_over_loopback_socket():
    got, transport, server = asyncio.run(fetch_local("http://media.example.com/cat.png?v=2"))
    assert got.data == BODY and got.content_type == "image/png"
    assert got.url == "http://media.example.com/cat.png?v=2"
    [request] = transport.seen
    assert request.url.host == PUBLIC_A and "sni_hostname" not in request.extensions
    [(target, headers)] = server.requests
    assert target == "/cat.png?v=2" and headers["host"] == "media.example.com"


def _self_signed(tmp_path, name: str) -> tuple[str, str]:
    """A self-signed certificate (also its own CA) for `name` -> (cert file, key file)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, name)])
    now, day = datetime.datetime.now(datetime.timezone.utc), datetime.timedelta(days=1)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - day).not_valid_after(now + day)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(pem))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")


def test_https_sends_sni_and_verifies_the_name_not_the_ip(tmp_path):
    cert, key = _self_signed(tmp_path, "media.example.com")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    server_ctx.sni_callback = lambda sock, name, ctx: sni.append(name)
    sni, tls = [], {"ssl_context": server_ctx,        # the client trusts only this certificate
                    "verify": ssl.create_default_context(cafile=cert)}
    got, transport, _ = asyncio.run(fetch_local("https://media.example.com/cat.png", **tls))
    assert got.data == BODY and sni == ["media.example.com"]
    assert transport.seen[0].url.host == PUBLIC_A
    # The same server under another allowed name: its certificate does not match -> refused.
    refused(fetch_local("https://cdn.example.org/cat.png", **tls),
            "could not fetch.*(?i:certificate)")


def test_redirect_to_allowed_domain_is_followed_and_rechecked():
    got, transport, _ = asyncio.run(fetch_local(
        "http://media.example.com/to?next=http://cdn.example.org/hop/1"))
    assert got.data == BODY and got.url == "http://cdn.example.org/hop/0"
    assert [r.url.host for r in transport.seen] == [PUBLIC_A, PUBLIC_B, PUBLIC_B]
    assert [r.headers["host"] for r in transport.seen] == [
        "media.example.com", "cdn.example.org", "cdn.example.org"]


@pytest.mark.parametrize("target,match", [
    ("http://evil.example.net/cat.png", "redirect to .*evil.example.net.* refused: host "
                                        "'evil.example.net' is not one of"),
    ("http://internal.example.org/cat.png", "redirect to .* refused: .*10.0.0.1, a private"),
    ("file:///etc/passwd", "redirect refused: only http and https"),
    ("http://u:p@cdn.example.org/cat.png", "redirect refused: URLs with credentials"),
])
def test_redirect_to_refused_target(target, match):
    policy = replace(POLICY, allowed_domains=("media.example.com", "internal.example.org"))
    dns = {**DNS, "internal.example.org": ["10.0.0.1"], "evil.example.net": [PUBLIC_B]}
    refused(fetch_local(f"http://media.example.com/to?next={target}", policy, dns), match)


def test_redirect_limit():
    got, transport, _ = asyncio.run(fetch_local("http://media.example.com/hop/3"))
    assert got.data == BODY and len(transport.seen) == 4          # 3 redirects: allowed
    refused(fetch_local("http://media.example.com/hop/4"), "redirected more than 3 times")
    refused(fetch_local("http://media.example.com/hop/1", replace(POLICY, max_redirects=0)),
            "redirected more than 0 times")


def test_declared_oversize_refused_from_header():
    start = time.monotonic()
    refused(fetch_local("http://media.example.com/huge-declared"),
            "larger than this server's 1048576-byte limit \\(it declares 1000000000 bytes")
    assert time.monotonic() - start < POLICY.timeout_s / 2        # did not wait for the body


def test_undeclared_oversize_refused_while_reading():
    """The body never ends, so finishing at all shows the reader stopped at the cap."""
    log = []
    refused(fetch_local("http://media.example.com/endless", log=log), "its body is longer")
    [(transport, _)] = log
    assert transport.body_bytes <= POLICY.max_bytes + 2 * 65536   # at most a read past the cap


def test_slow_server_hits_total_timeout():
    start = time.monotonic()
    refused(fetch_local("http://media.example.com/slow", replace(POLICY, timeout_s=0.5)),
            "longer than 0.5 s")
    assert time.monotonic() - start < 3.0


def test_http_errors_are_request_errors():
    refused(fetch_local("http://media.example.com/missing.png"), "HTTP status 404")
    refused(fetch_local("http://media.example.com/gzip"), "'gzip'-encoded")
    refused(fetch_local("http://media.example.com/cat.png", port=1),    # nothing listens there
            "could not fetch .*ConnectError")
