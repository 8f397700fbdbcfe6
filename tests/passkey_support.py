"""A passkey authenticator in software, and signing in over HTTP with it: what a browser and its authenticator
send, built from the WebAuthn specification, for tests that speak HTTP without a browser.

Nothing on Kazma's side is mocked: the answers carry real ECDSA P-256 signatures over real authenticator data
and client data, and the console verifies them with ``py_webauthn`` as it does a browser's (the browser
tests, tests/test_browser_people.py, use Chromium's own virtual authenticator instead).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import cbor2
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

_UP, _UV, _AT = 0x01, 0x04, 0x40  # authenticator data flags: user present, user verified, credential data


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def from_b64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass
class SoftCredential:
    id: bytes
    rp_id: str
    user_handle: bytes
    key: ec.EllipticCurvePrivateKey
    sign_count: int = 0


@dataclass
class SoftAuthenticator:
    """Holds resident credentials; ``user_verified=False`` models a device that only checks presence."""

    user_verified: bool = True
    credentials: list[SoftCredential] = field(default_factory=list)

    def _flags(self, *extra: int) -> int:
        flags = _UP | (_UV if self.user_verified else 0)
        for bit in extra:
            flags |= bit
        return flags

    def create(self, options: dict[str, Any], origin: str) -> dict[str, Any]:
        """``navigator.credentials.create``: a new key pair, attested with format ``none``."""
        rp_id = str(options["rp"]["id"])
        key = ec.generate_private_key(ec.SECP256R1())
        numbers = key.public_key().public_numbers()
        cose = cbor2.dumps({1: 2, 3: -7, -1: 1, -2: numbers.x.to_bytes(32, "big"), -3: numbers.y.to_bytes(32, "big")})
        credential = SoftCredential(secrets.token_bytes(32), rp_id, from_b64url(options["user"]["id"]), key)
        data = (
            hashlib.sha256(rp_id.encode()).digest()
            + bytes([self._flags(_AT)])
            + struct.pack(">I", 0)
            + bytes(16)  # AAGUID: none
            + struct.pack(">H", len(credential.id))
            + credential.id
            + cose
        )
        client = self._client_data("webauthn.create", options["challenge"], origin)
        self.credentials.append(credential)
        return {
            "id": b64url(credential.id),
            "rawId": b64url(credential.id),
            "type": "public-key",
            "response": {
                "clientDataJSON": b64url(client),
                "attestationObject": b64url(cbor2.dumps({"fmt": "none", "attStmt": {}, "authData": data})),
                "transports": ["internal"],
            },
            "clientExtensionResults": {},
            "authenticatorAttachment": "platform",
        }

    def get(self, options: dict[str, Any], origin: str, *, which: int = -1) -> dict[str, Any]:
        """``navigator.credentials.get``: an assertion by one of the credentials held for the relying party."""
        rp_id = str(options["rpId"])
        allowed = {from_b64url(c["id"]) for c in options.get("allowCredentials") or []}
        held = [c for c in self.credentials if c.rp_id == rp_id and (not allowed or c.id in allowed)]
        if not held:
            raise LookupError("no passkey for this site")
        credential = held[which]
        credential.sign_count += 1
        data = (
            hashlib.sha256(rp_id.encode()).digest() + bytes([self._flags()]) + struct.pack(">I", credential.sign_count)
        )
        client = self._client_data("webauthn.get", options["challenge"], origin)
        signature = credential.key.sign(data + hashlib.sha256(client).digest(), ec.ECDSA(hashes.SHA256()))
        return {
            "id": b64url(credential.id),
            "rawId": b64url(credential.id),
            "type": "public-key",
            "response": {
                "clientDataJSON": b64url(client),
                "authenticatorData": b64url(data),
                "signature": b64url(signature),
                "userHandle": b64url(credential.user_handle),
            },
            "clientExtensionResults": {},
            "authenticatorAttachment": "platform",
        }

    @staticmethod
    def _client_data(kind: str, challenge: str, origin: str) -> bytes:
        return json.dumps({"type": kind, "challenge": challenge, "origin": origin, "crossOrigin": False}).encode()


class CeremonyRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


async def _post(client: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    async with client.post(url, json=body or {}) as response:
        data: dict[str, Any] = await response.json(content_type=None)
        if response.status != 200:
            raise CeremonyRefused(response.status, str(data.get("error")))
        return data


async def enrol(
    client: aiohttp.ClientSession, base: str, link: str, authenticator: SoftAuthenticator, *, origin: str | None = None
) -> str:
    """Follow an enrolment link as a browser would (on ``origin``: the page's, by default ``base``); returns the
    signed-in session's CSRF token."""
    token = link.rstrip("/").rpartition("/")[2]
    origin = origin or base.rstrip("/")
    options = await _post(client, f"{base}/enrol/{token}/options")
    answer = authenticator.create(options["publicKey"], origin)
    await _post(client, f"{base}/enrol/{token}", answer)
    return await csrf_of(client, base)


async def sign_in(
    client: aiohttp.ClientSession, base: str, authenticator: SoftAuthenticator, *, which: int = -1
) -> str:
    """Sign in with a passkey as a browser would; returns the session's CSRF token."""
    options = await _post(client, f"{base}/login/passkey/options")
    answer = authenticator.get(options["publicKey"], base.rstrip("/"), which=which)
    await _post(client, f"{base}/login/passkey", answer)
    return await csrf_of(client, base)


async def csrf_of(client: aiohttp.ClientSession, base: str) -> str:
    async with client.get(f"{base}/", allow_redirects=False) as page:
        assert page.status == 200, page.status
        match = re.search(r'<meta name="kazma-csrf" content="([^"]+)">', await page.text())
    assert match is not None
    return match.group(1)
