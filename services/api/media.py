"""Media bytes from a request: base64 data, data URLs, and (where the deployment allows it) http(s) URLs."""

import base64
import binascii

import httpx

from services.api.errors import ApiError, bad


def b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{where}: not valid base64", where, "invalid_base64") from None


def data_url(url: str, where: str) -> bytes:
    """`data:[<type>][;params];base64,<data>` -> the bytes (only base64 data URLs carry binary media)."""
    head, sep, data = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise bad(f"{where}: a data URL must be base64 (data:<type>;base64,<data>)", where, "invalid_data_url")
    return b64(data, where)


class Fetcher:
    """GETs http(s) URLs for media, reading no more than `max_bytes` of any of them."""

    def __init__(self, max_bytes: int, timeout_s: float = 30.0):
        self.max_bytes = max_bytes
        self.client = httpx.AsyncClient(timeout=timeout_s, follow_redirects=True, max_redirects=5)

    async def get(self, url: str, where: str) -> bytes:
        try:
            async with self.client.stream("GET", url) as reply:
                if reply.status_code >= 400:
                    raise bad(f"{where}: fetching {url} gave HTTP {reply.status_code}", where, "url_fetch_failed")
                body = bytearray()
                async for piece in reply.aiter_bytes():
                    body += piece
                    if len(body) > self.max_bytes:
                        raise ApiError(413, f"{where}: {url} is over the request size limit of {self.max_bytes} bytes",
                                       param=where, code="request_too_large")
                return bytes(body)
        except httpx.HTTPError as e:
            raise bad(f"{where}: cannot fetch {url}: {type(e).__name__}: {e}", where, "url_fetch_failed") from None

    async def close(self) -> None:
        await self.client.aclose()


async def media(url: str, where: str, fetcher: Fetcher | None) -> bytes:
    if url.startswith("data:"):
        return data_url(url, where)
    if url.startswith(("http://", "https://")):
        if fetcher is None:
            raise bad(f"{where}: this server does not fetch URLs (api.allow_url_fetch is off); send the media as a "
                      "data URL (data:<type>;base64,<data>)", where, "url_fetch_disabled")
        return await fetcher.get(url, where)
    raise bad(f"{where}: expected a data URL (data:<type>;base64,<data>) or an http(s) URL", where, "invalid_url")
