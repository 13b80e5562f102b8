"""Fetch a media URL (image/audio/video) from an allowed public host, or refuse it.

Remote fetching is off by default: a `MediaFetchPolicy` with no `allowed_domains` refuses every
URL, so only inline `data:` URLs (decoded elsewhere) work. When an operator lists domains, an
http(s) URL is fetched only if every hop (the URL and each redirect target) passes all checks:

- scheme http/https; no userinfo (`user:pass@`); host allowed by the policy (see
  `MediaFetchPolicy.allows_host` for the matching rule);
- the host is resolved once per hop and EVERY address it resolves to must be public
  (`address_refusal`); the connection then goes to the checked address itself: the request URL
  carries the IP, while the Host header and TLS SNI (and so certificate verification) carry the
  original name. A DNS answer that changes between check and connect (rebinding) cannot
  redirect the connection, because no second lookup happens;
- redirects are followed by hand (at most `max_redirects`), each target re-checked in full;
- the body is read with a cap: Content-Length is checked first (and a lie cannot help, because
  bytes are counted while reading), `Accept-Encoding: identity` is sent and an encoded reply is
  refused (so the cap counts the bytes we hand on, and no gzip bomb is ever inflated);
- everything (DNS, connects, every hop, the body) shares one `timeout_s` deadline.

Every refusal is an `InvalidRequestError(param=<caller's param>)` saying why.

The URL is parsed once, by httpx, and that parsed URL is what is checked and requested, so there
is no gap between a checker's parser and the client's. Requests go straight to an httpx
transport (no AsyncClient): no cookie jar, no proxy from the environment (a proxy would defeat
the pinning), no automatic redirects. Tests inject `resolver` and `transport`; production code
has no bypass: every address the resolver returns is checked whoever supplied it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx

from omnistage.errors import InvalidRequestError

DEFAULT_MAX_MEDIA_BYTES = 64 * 1024 * 1024
DEFAULT_FETCH_TIMEOUT_S = 20.0
MAX_URL_CHARS = 8192            # longer URLs are refused before parsing
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
OK_STATUSES = frozenset({200, 203})

# host name -> its IP addresses as strings (e.g. ["93.184.216.34", "2606:2800::1"]).
Resolver = Callable[[str], Awaitable[Sequence[str]]]
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Dot-separated labels of letters, digits, '-' and '_' (seen in real host names), IDNA-encoded.
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


@dataclass(frozen=True)
class MediaFetchPolicy:
    """Which media URLs may be fetched, and the limits on each fetch.

    `allowed_domains` entries (normalised to lower-case ASCII/IDNA, trailing dot dropped):
    "example.com" allows exactly the host example.com (not its subdomains); "*.example.com"
    allows every subdomain of example.com (but not example.com itself, list both for both);
    an IP literal allows that address (which must still be public). Exact matching is the
    default because the subdomains of a big domain often serve other people's content.
    """
    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_redirects: int = 3

    def __post_init__(self):
        # Server configuration errors: ValueError at start-up, not a request error.
        if isinstance(self.allowed_domains, str):
            raise ValueError("allowed_domains must be a sequence of domains, not one string")
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")
        domains = tuple(dict.fromkeys(_normalise_domain(d) for d in self.allowed_domains))
        object.__setattr__(self, "allowed_domains", domains)

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_domains)

    def allows_host(self, host: str) -> bool:
        """`host` is a normalised host (see `_url_host`)."""
        is_ip = _ip_or_none(host) is not None
        for entry in self.allowed_domains:
            if entry.startswith("*."):
                if is_ip:                           # "*.3.4" must not match 1.2.3.4
                    continue
                if host.endswith(entry[1:]):        # ".example.com": a proper subdomain
                    return True
            elif host == entry:
                return True
        return False


@dataclass(frozen=True)
class FetchedMedia:
    data: bytes
    content_type: str | None     # media type of the reply, lower-case, no parameters
    url: str                     # final URL, after redirects (with the host name, not the IP)


async def fetch_media(url: str, policy: MediaFetchPolicy, *, param: str,
                      resolver: Resolver | None = None,
                      transport: httpx.AsyncBaseTransport | None = None) -> FetchedMedia:
    """GET `url` under `policy`; every refusal is InvalidRequestError(param=param).

    `resolver` defaults to the event loop's getaddrinfo. `transport` defaults to a fresh
    `httpx.AsyncHTTPTransport` (closed afterwards); an injected transport is the caller's and
    is left open. Either way each request's URL names the checked IP (see the module doc).
    """
    if not policy.enabled:
        raise InvalidRequestError(
            f"{param}: this server does not fetch media URLs; send the media inline as a "
            "data: URL (or base64 input_audio), or ask the operator to start the server with "
            "--allowed-media-domains", param=param)
    own_transport = transport is None
    if own_transport:
        transport = httpx.AsyncHTTPTransport(retries=0)
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _fetch(url, policy, param, resolver or _getaddrinfo, transport)
    except TimeoutError:
        raise InvalidRequestError(
            f"{param}: fetching {_shorten(url)} took longer than {policy.timeout_s:g} s; use a "
            "faster host or send the media inline as a data: URL", param=param) from None
    finally:
        if own_transport:
            await transport.aclose()


def address_refusal(ip: IPAddress) -> str | None:
    """Why `ip` must not be connected to (e.g. "loopback"), or None when it is public."""
    if isinstance(ip, ipaddress.IPv6Address):
        # IPv4 addresses wrapped in IPv6 reach the IPv4 host: judge the inner address.
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in _NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None and (reason := address_refusal(inner)):
            return f"{reason}, embedded in an IPv6 address"
    checks = (
        (ip.is_unspecified, "unspecified address"),
        (ip.is_loopback, "loopback address"),
        (ip.is_link_local, "link-local address"),
        (ip.is_multicast, "multicast address"),
        (ip in _CGNAT if ip.version == 4 else False, "carrier-grade NAT address"),
        (getattr(ip, "is_site_local", False), "site-local address"),
        (ip.is_reserved, "reserved address"),
        (ip.is_private, "private address"),
        (not ip.is_global, "address that is not globally routable"),
    )
    return next((reason for refused, reason in checks if refused), None)


@dataclass(frozen=True)
class _Hop:
    """One checked request target: the URL as given and the address to connect to."""
    url: httpx.URL          # as the client wrote it (host name), fragment dropped
    host: str               # normalised host name, or the IP literal
    ip: IPAddress           # the checked address the connection is pinned to


async def _fetch(url: str, policy: MediaFetchPolicy, param: str, resolver: Resolver,
                 transport: httpx.AsyncBaseTransport) -> FetchedMedia:
    current = _parse(url, param, "")
    for hops_done in range(policy.max_redirects + 1):
        context = "" if hops_done == 0 else f"redirect to {_shorten(str(current))} refused: "
        hop = await _check(current, policy, param, resolver, context)
        result = await _request(hop, policy, param, transport)
        if isinstance(result, FetchedMedia):
            return result
        current = result
    raise InvalidRequestError(
        f"{param}: {_shorten(url)} redirected more than {policy.max_redirects} times; link the "
        "media's final URL", param=param)


async def _request(hop: _Hop, policy: MediaFetchPolicy, param: str,
                   transport: httpx.AsyncBaseTransport) -> FetchedMedia | httpx.URL:
    """One GET to the pinned address: the media, or the (parsed, not yet checked) redirect."""
    try:
        response = await transport.handle_async_request(_pinned_request(hop, policy))
        try:
            if response.status_code in REDIRECT_STATUSES:
                location = response.headers.get("location")
                if not location:
                    raise _bad_status(param, hop, response.status_code)
                return _parse(location, param, "redirect refused: ", base=hop.url)
            if response.status_code not in OK_STATUSES:
                raise _bad_status(param, hop, response.status_code)
            data = await _read_capped(response, policy.max_bytes, param, hop)
            return FetchedMedia(data=data, content_type=_media_type(response), url=str(hop.url))
        finally:
            await response.aclose()            # a redirect's body is never read
    except httpx.TimeoutException:
        raise TimeoutError from None            # reported as the overall timeout
    except httpx.HTTPError as e:
        raise InvalidRequestError(
            f"{param}: could not fetch {_shorten(str(hop.url))} ({type(e).__name__}: {e}); "
            "check the URL, or send the media inline as a data: URL", param=param) from None


def _parse(text: str, param: str, context: str, base: httpx.URL | None = None) -> httpx.URL:
    """Parse (and join onto `base`, for a redirect's Location) and check scheme and userinfo."""
    if len(text) > MAX_URL_CHARS:
        raise InvalidRequestError(f"{param}: {context}the URL is longer than {MAX_URL_CHARS} "
                                  "characters; use a shorter URL", param=param)
    try:
        url = base.join(text) if base is not None else httpx.URL(text)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise InvalidRequestError(f"{param}: {context}{_shorten(text)!r} is not a valid URL; "
                                  "send an https:// URL or a data: URL", param=param) from None
    if url.scheme not in ("http", "https"):
        raise InvalidRequestError(
            f"{param}: {context}only http and https URLs can be fetched, got scheme "
            f"{url.scheme!r}; send an https:// URL or the media inline as a data: URL",
            param=param)
    if url.userinfo:
        raise InvalidRequestError(f"{param}: {context}URLs with credentials (user:password@) "
                                  "are not fetched; remove them from the URL", param=param)
    if url.port is not None and not 0 < url.port < 65536:      # httpx admits any integer
        raise InvalidRequestError(f"{param}: {context}port {url.port} is not a valid TCP port; "
                                  "fix the URL", param=param)
    if not url.raw_host:
        raise InvalidRequestError(f"{param}: {context}the URL has no host; send an "
                                  "https://host/path URL", param=param)
    return url.copy_with(fragment=None)


async def _check(url: httpx.URL, policy: MediaFetchPolicy, param: str, resolver: Resolver,
                 context: str) -> _Hop:
    """Domain check, then resolve and require every address to be public; pin the first."""
    host = _url_host(url)
    if not policy.allows_host(host):
        # Checked before resolving, so a refused name never reaches DNS.
        raise InvalidRequestError(
            f"{param}: {context}host {host!r} is not one of this server's allowed media "
            "domains; send the media inline as a data: URL, or ask the operator to allow the "
            "host with --allowed-media-domains", param=param)
    literal = _ip_or_none(host)
    if literal is not None:
        addresses = [literal]
    else:
        try:
            answers = await resolver(host)
        except OSError as e:                    # socket.gaierror and friends
            raise InvalidRequestError(f"{param}: {context}could not resolve host {host!r} "
                                      f"({e}); check the URL's host name", param=param) from None
        addresses = [_ip_or_none(a) for a in answers]
        if not addresses or None in addresses:
            raise InvalidRequestError(f"{param}: {context}host {host!r} did not resolve to a "
                                      "usable address; check the URL's host name", param=param)
    for ip in addresses:
        if reason := address_refusal(ip):
            where = f"is a {reason}" if literal is not None else f"resolves to {ip}, a {reason}"
            raise InvalidRequestError(f"{param}: {context}host {host!r} {where}; media are only "
                                      "fetched from public internet hosts", param=param)
    return _Hop(url=url, host=host, ip=addresses[0])


def _pinned_request(hop: _Hop, policy: MediaFetchPolicy) -> httpx.Request:
    # Only the connection target changes: path, query and port stay; Host names the site.
    target = hop.url.copy_with(host=str(hop.ip))
    extensions: dict = {"timeout": dict.fromkeys(("connect", "read", "write", "pool"),
                                                 policy.timeout_s)}
    if hop.url.scheme == "https" and _ip_or_none(hop.host) is None:
        # SNI and certificate verification use the name, not the IP we connect to.
        extensions["sni_hostname"] = hop.host
    headers = {"Host": hop.url.netloc.decode("ascii"), "Accept": "*/*",
               "Accept-Encoding": "identity", "User-Agent": "omnistage-media-fetch"}
    return httpx.Request("GET", target, headers=headers, extensions=extensions)


async def _read_capped(response: httpx.Response, max_bytes: int, param: str, hop: _Hop) -> bytes:
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise InvalidRequestError(
            f"{param}: {_shorten(str(hop.url))} was sent {encoding!r}-encoded although the "
            "request asked for none; serve the media file without Content-Encoding",
            param=param)
    declared = response.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise _too_large(param, hop, max_bytes, f"it declares {int(declared)} bytes")
    body = bytearray()
    # aiter_bytes == the raw bytes here (identity only, checked above), and it also serves
    # replies a transport has already read. Chunks are at most ~64 KiB (httpcore reads).
    async for chunk in response.aiter_bytes():
        if len(body) + len(chunk) > max_bytes:
            raise _too_large(param, hop, max_bytes, "its body is longer")
        body += chunk
    return bytes(body)


async def _getaddrinfo(host: str) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))   # sockaddr[0]: the IP


def _url_host(url: httpx.URL) -> str:
    """Lower-case ASCII (IDNA) host without a trailing dot; IP literals in canonical form."""
    host = url.raw_host.decode("ascii").lower().rstrip(".")
    ip = _ip_or_none(host)
    return str(ip) if ip is not None else host


def _normalise_domain(entry: str) -> str:
    text = entry.strip().lower()
    wildcard = text.startswith("*.")
    name = (text[2:] if wildcard else text).rstrip(".")
    ip = _ip_or_none(name.strip("[]"))
    if ip is not None and not wildcard:
        return str(ip)
    try:
        url = httpx.URL(f"http://{name}/")
        # Round trip: a port, path, query or userinfo in the entry would not survive it.
        host = url.raw_host.decode("ascii") if url.host == name else ""
    except (httpx.InvalidURL, ValueError):
        host = ""
    if ip is not None or not _HOSTNAME.fullmatch(host):
        raise ValueError(f"allowed media domain {entry!r} is not a host name; write e.g. "
                         "'example.com' (that host only) or '*.example.com' (its subdomains)")
    return f"*.{host}" if wildcard else host


def _ip_or_none(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _media_type(response: httpx.Response) -> str | None:
    value = response.headers.get("content-type", "").split(";")[0].strip().lower()
    return value or None


def _shorten(url: str, limit: int = 200) -> str:
    return url if len(url) <= limit else url[:limit] + "..."


def _too_large(param: str, hop: _Hop, max_bytes: int, detail: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{param}: the media at {_shorten(str(hop.url))} is larger than this server's "
        f"{max_bytes}-byte limit ({detail}); send a smaller file", param=param)


def _bad_status(param: str, hop: _Hop, status: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"{param}: fetching {_shorten(str(hop.url))} failed with HTTP status {status}; check "
        "that the URL is public and points at the media file", param=param)
